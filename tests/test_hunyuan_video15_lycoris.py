"""The LyCORIS wrapper's files on HunyuanVideo 1.5 (SimpleTuner's lora_type=lycoris), written by lycoris-lora 4.1.3
on diffusers' own HunyuanVideo15Transformer3DModel and checked value for value through our loader node, as
tests/test_video_dit_peft.py checks the other video DiTs (whose helpers this reuses).

SimpleTuner trains HunyuanVideo 1.5 as diffusers' model (bghira/SimpleTuner at bc8e6ab7,
simpletuner/helpers/models/hunyuanvideo/model.py: MODEL_CLASS, its copy of HunyuanVideo15Transformer3DModel, loaded
from the hunyuanvideo-community Diffusers checkpoints) and saves the LyCORIS wrapper in save_hooks.py _save_lycoris
(LycorisNetwork.save_weights: `lycoris_` + the module path, dots as underscores, the config as `lycoris_config`),
with the preset of its config/lycoris_config.json.example (every Linear of the Attention and FeedForward modules).

diffusers 0.42.1 has neither a single-file converter for 1.5 nor a LoRA saver for its pipeline. ComfyUI's
HunyuanVideo15 is HunyuanVideo's model with 1.5's config, and 1.0's converter
(`convert_hunyuan_video_transformer_to_diffusers`) turns what the two share (the double blocks, the token refiner,
the patch embedding, the output layers) into parameters of 1.5's diffusers model, name for name and shape for shape:
the twin's transformer blocks and token refiner, where every target of the preset lies, hold ComfyUI's weights
through it. 1.5's own embedders (byT5, vision, timestep, condition type) are left out on both sides: ComfyUI's stay
as they are, the twin's random and never adapted. Both ComfyUIs (0.3.75 and 0.33) have the model.
"""

import comfy.model_management
import comfy.model_patcher
import diffusers
import peft  # noqa: F401  (an oracle of this module: its import error is a failure, not a skip)
import pytest
import test_nodes
from diffusers.loaders import single_file_utils
from test_video_dit_peft import (
    CPU,
    LYCORIS,
    Arch,
    Models,
    check_file,
    comfy_model,
    lycoris_file,
    read_keys,
    tencent_names,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths
loras = test_nodes.loras

# ComfyUI's detection of 1.5 (no pooled vector, no single blocks, byT5 and vision inputs, 1-frame patches) at a tiny
# width; diffusers' twin of the same sizes
HV15 = Arch("HunyuanVideo15",
            {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 1, 1], "out_channels": 16,
             "vec_in_dim": None, "axes_dim": [4, 6, 6], "meanflow": False, "context_in_dim": 40, "hidden_size": 32,
             "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 0, "theta": 256, "qkv_bias": True,
             "byt5": True, "guidance_embed": False, "use_cond_type_embedding": True, "vision_in_dim": 24,
             "meanflow_sum": True},
            "convert_hunyuan_video_transformer_to_diffusers", "HunyuanVideo15Transformer3DModel",
            {"in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16,
             "num_layers": 2, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1,
             "text_embed_dim": 40, "image_embed_dim": 24, "rope_axes_dim": (4, 6, 6)},
            "", (), params="comfy.ldm.hunyuan_video.model.HunyuanVideoParams", tencent_names=True)
# 1.5's own embedders: ComfyUI's modules 1.0's converter has no rule for, and the twin's it gives no weight
COMFY_ONLY = ("byt5_in.", "vision_in.", "time_in.", "cond_type_embedding.")
TWIN_ONLY = ("context_embedder_2.", "image_embedder.", "time_embed.", "cond_type_embed.")
# bghira/SimpleTuner config/lycoris_config.json.example's apply_preset
SIMPLETUNER_PRESET = {"target_module": ["Attention", "FeedForward"],
                      "module_algo_map": {"Attention": {"factor": 16}, "FeedForward": {"factor": 8}}}


@pytest.fixture(scope="module")
def hv15():
    model = comfy_model(HV15)
    twin = getattr(diffusers, HV15.diffusers_model)(**HV15.diffusers_config).float().eval()
    shared = {k: v for k, v in model.diffusion_model.state_dict().items() if not k.startswith(COMFY_ONLY)}
    converter = getattr(single_file_utils, HV15.converter)
    originals = tencent_names(model, converter, set(twin.state_dict()), shared)
    models = Models(HV15, comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU), originals)
    models.base = models.to_diffusers(shared)
    missing, unexpected = twin.load_state_dict(models.base, strict=False)  # a wrong shape raises
    assert unexpected == [] and missing and all(key.startswith(TWIN_ONLY) for key in missing), (missing, unexpected)
    models.twin = twin.requires_grad_(False)
    yield models
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("algo", list(LYCORIS))
def test_simpletuner_lycoris_file_applies_fully_and_equal_to_its_forward(algo, hv15, loras, tmp_path):
    written, merged = lycoris_file(hv15, algo, tmp_path, preset=SIMPLETUNER_PRESET)
    names = read_keys(written)
    assert all(name.startswith("lycoris_") for name in names)
    # the preset reaches the double blocks' attention (q/k/v rows of img_attn.qkv and txt_attn.qkv) and both
    # feed-forwards, and the token refiner's attention and feed-forward
    modules = {name.rsplit(".", 1)[0] for name in merged}
    assert {"transformer_blocks.1.attn.add_v_proj", "transformer_blocks.1.ff_context.net.2",
            "context_embedder.token_refiner.refiner_blocks.1.attn.to_k",
            "context_embedder.token_refiner.refiner_blocks.0.ff.net.0.proj"} <= modules
    assert len(modules) == 2 * 12 + 2 * 6  # per block: 8 attention, 4 feed-forward; per refiner block: 4 and 2
    check_file(hv15, loras, written, merged)
