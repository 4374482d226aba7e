"""PEFT files on Ideogram 4, end to end: diffusers' names onto ComfyUI's fused qkv, against PEFT's own merge().

Ideogram 4 exists in ComfyUI 0.33 only (skipped on 0.3.75). ComfyUI's model (`supported_models.Ideogram4`, whose
widths come from its unet_extra_config, narrowed here before the model is built) is tiny, fp32, on the CPU, in a
ModelPatcher. Its twin is diffusers' own `Ideogram4Transformer2DModel` with the same weights: diffusers splits
ComfyUI's `attention.qkv` into `to_q`/`to_k`/`to_v` in row thirds and names `attention.o` `to_out.0`
(diffusers' `_convert_non_diffusers_ideogram4_lora_to_diffusers`, and OneTrainer's IdeogramModel fusion_groups and
diffusers_to_original); every other weight has the same name in both. The twin is loaded strictly both ways, so the
two hold exactly the same weights.

Adapters on the twin over every Linear OneTrainer trains (the attention, feed-forward and modulation of each block,
the input, text and timestep projections and the final layer), saved by `Ideogram4Pipeline.save_lora_weights`
(OneTrainer's DIFFUSERS format is this file with alpha folded in; with the PEFT config as metadata, and without) and
PEFT's `save_pretrained`. Truth: PEFT's `merge()` in float64. Each file goes through our loader node at strengths 1
and 0.5; every module must apply, every adapted weight be within 1e-4 of its largest change of the truth (the fused
qkv compared third by third), and every other weight stay as it was.
"""

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import diffusers
import peft
import pytest
import test_nodes
import torch
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from test_nodes import run_node, weights_after_full_load
from test_peft_dit import adapted, assert_weights_match, merged_parameters, put

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not hasattr(comfy.supported_models, "Ideogram4"),
                                 reason="this ComfyUI has no supported_models.Ideogram4")]
loras = test_nodes.loras

CPU = torch.device("cpu")
PREFIX = "diffusion_model."
SEED = 4
STRENGTHS = (1.0, 0.5)
# ComfyUI's unet config keys and diffusers' config keys are the same names
TINY = {"in_channels": 8, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "intermediate_size": 48,
        "adaln_dim": 16, "llm_features_dim": 24}
QKV = ("to_q", "to_k", "to_v")
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3", "adaln_modulation", "adaln_proj", "input_proj",
           "llm_cond_proj", "mlp_in", "mlp_out", "final_layer.linear"]


def comfy_name(name: str) -> str:
    """A diffusers weight's ComfyUI key, or the fused qkv's for a third of it."""
    for part in QKV:
        name = name.replace(f".attention.{part}.", ".attention.qkv.")
    return PREFIX + name.replace(".attention.to_out.0.", ".attention.o.")


def to_comfy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if f".attention.{QKV[0]}." in name:
            out[comfy_name(name)] = torch.cat([state[name.replace(QKV[0], part)] for part in QKV])
        elif not any(f".attention.{part}." in name for part in QKV[1:]):
            out[comfy_name(name)] = value
    return out


def to_diffusers(comfy_state: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        value = comfy_state[comfy_name(name)]
        part = next((i for i, p in enumerate(QKV) if f".attention.{p}." in name), None)
        out[name] = value if part is None else value.chunk(3)[part]
    return out


@pytest.fixture(scope="module")
def ideogram():
    torch.manual_seed(SEED)
    twin = diffusers.Ideogram4Transformer2DModel(**TINY).float().eval().requires_grad_(False)
    with torch.no_grad():
        for param in twin.parameters():
            param.copy_(torch.randn(param.shape) * (param[0].numel() if param.ndim > 1 else 4) ** -0.5)
    config = comfy.supported_models.Ideogram4({"image_model": "ideogram4"})
    config.unet_config.update(TINY)  # its unet_extra_config fixed the released widths
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "", device=CPU)
    model.diffusion_model.load_state_dict({k[len(PREFIX):]: v for k, v in to_comfy(twin.state_dict()).items()},
                                          strict=True)
    back = to_diffusers({PREFIX + k: v for k, v in model.diffusion_model.state_dict().items()}, twin.state_dict())
    twin.load_state_dict(back, strict=True)  # every diffusers weight is one ComfyUI weight or a third of one
    yield twin, comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)
    comfy.model_management.unload_all_models()


def _file(twin, kind: str, save_format: str, folder):
    options = {"use_dora": True} if kind == "dora" else {}
    alpha = 4 if save_format == "save_lora_weights" else 8  # without the config in the file: trained at alpha = rank
    config = peft.LoraConfig(r=4, lora_alpha=alpha, init_lora_weights=False, target_modules=TARGETS, **options)
    model = adapted(twin, config, save_format, seed=SEED + len(kind + save_format))
    if save_format == "save_pretrained":
        model.save_pretrained(str(folder / kind))
        written = [f"{kind}/adapter_model.safetensors", f"{kind}/adapter_config.json"]
    else:
        written = [f"{kind}-{save_format}.safetensors"]
        metadata = config.to_dict() if save_format.endswith("+metadata") else None
        diffusers.Ideogram4Pipeline.save_lora_weights(
            str(folder), transformer_lora_layers=peft.get_peft_model_state_dict(model), weight_name=written[0],
            transformer_lora_adapter_metadata=metadata)
    return {name: (folder / name).read_bytes() for name in written}, merged_parameters(model)


@pytest.mark.parametrize("kind,save_format,warnings", [
    ("lora", "save_lora_weights", 1),  # no alpha anywhere: alpha = rank, as diffusers loads it, with a warning
    ("lora", "save_lora_weights+metadata", 0),
    ("dora", "save_lora_weights+metadata", 0),
    ("lora", "save_pretrained", 0),
])
def test_peft_file_on_ideogram4_applies_fully_and_equal_to_peft_merge(kind, save_format, warnings, ideogram, loras,
                                                                      tmp_path):
    twin, patcher = ideogram
    written, merged = _file(twin, kind, save_format, tmp_path)
    adapted_modules = {name.rsplit(".", 1)[0] for name in merged}
    assert {"layers.0.attention.to_k", "layers.1.attention.to_out.0", "adaln_proj", "input_proj",
            "final_layer.adaln_modulation"} <= adapted_modules
    name = put(loras, written)
    _, report = map_file(read(loras / name), patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    assert len(report.applied) == report.total == len(merged)
    assert len(report.warnings) == warnings, report.warnings
    base = twin.state_dict()
    keys = sorted({comfy_name(n) for n in base})
    for strength in STRENGTHS:
        patched = run_node(LycorisLoaderModelOnly, model=patcher, lycoris_name=name, strength_model=strength)[0]
        comfy.model_management.unload_all_models()
        assert_weights_match(to_diffusers(weights_after_full_load(patched, keys), base), base, merged, strength)
    comfy.model_management.unload_all_models()


def test_the_twin_is_comfyuis_model_weight_for_weight(ideogram):
    """Both strict loads passed (fixture); the split is diffusers' own LoRA converter's (thirds of qkv's rows)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers
    twin, patcher = ideogram
    qkv = patcher.model.diffusion_model.state_dict()["layers.0.attention.qkv.weight"]
    lora = {"diffusion_model.layers.0.attention.qkv.lora_A.weight": torch.eye(qkv.shape[1]),
            "diffusion_model.layers.0.attention.qkv.lora_B.weight": qkv.clone()}
    split = _convert_non_diffusers_ideogram4_lora_to_diffusers(lora)
    for part in QKV:
        assert torch.equal(split[f"transformer.layers.0.attention.{part}.lora_B.weight"],
                           twin.state_dict()[f"layers.0.attention.{part}.weight"])
