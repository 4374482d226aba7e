"""PEFT, diffusers and LyCORIS-wrapper files on the video DiTs ComfyUI has no diffusers names for: Wan 2.1 (T2V and
I2V), HunyuanVideo 1.0, LTX-Video, LTX-2, Cosmos Predict2 and MiniMax H3, end to end through nodes/glue/keymap.py's
`converted_module_paths`; and Kandinsky 5, whose diffusers names are ComfyUI's own (no converter: the twin loads
ComfyUI's state dict as it is).

Each architecture is ComfyUI's own model (`comfy.supported_models` WAN21_T2V / WAN21_I2V / HunyuanVideo / LTXV /
LTXAV / CosmosT2IPredict2) at a tiny width on the CPU with random fp32 weights, in a ModelPatcher. Its state dict goes
through diffusers' own single-file converter (`convert_wan_transformer_to_diffusers`,
`convert_hunyuan_video_transformer_to_diffusers`, `convert_ltx_transformer_checkpoint_to_diffusers`,
`convert_ltx2_transformer_to_diffusers`, `convert_cosmos_transformer_checkpoint_to_diffusers`; the last two are
renames with no size of their own) and is loaded strictly into diffusers' model of the same config (the twin): a
strict load proves the twin has exactly these weights under diffusers' names. LTX-2 and MiniMax H3 exist in ComfyUI
0.33 only (0.3.75 has no supported_models.LTXAV, MiniMaxH3): their cases are skipped there. MiniMax H3's converter
(`convert_minimax_h3_transformer_checkpoint_to_diffusers`, stacked [q; k; v] as ComfyUI's model reads qkv_proj)
splits qkv_proj into thirds; its names in diffusers_names.json come from diffusers' LoRA converter for it, so this
checks the two converters agree, value for value. Its text connectors are no part of diffusers'
transformer (the converter drops them; diffusers keeps them in a pipeline component of their own).

HunyuanVideo: ComfyUI renames some of Tencent's names when it loads a checkpoint (`process_unet_state_dict`), and the
converter reads Tencent's. The Tencent-named state dict starts from ComfyUI's own key-map entries
`transformer.<Tencent path>` (as scripts/derive_diffusers_names.py's `original_names()` does); where ComfyUI keeps no
Tencent name (norm scales, `time_in` / `guidance_in`'s `mlp.0` / `mlp.2`), from ComfyUI's renames reversed. Every
name is checked both ways: ComfyUI's loader renames it back to its key, and the converter turns it into parameters
of the twin. The model has no single blocks: diffusers' converter hard-codes hidden_size 3072 for the split of a
single block's linear1 into to_q/to_k/to_v/proj_mlp, so it cannot convert a tiny one; those row parts are checked
at full width against the converter's own output by tests/test_diffusers_names.py (the table test). The double
blocks' and the token refiner's fused qkv rows are checked here.

Adapters, on the twin, with the targets trainers use (diffusers' training scripts and SimpleTuner: to_q, to_k, to_v,
to_out.0; Wan I2V's image cross-attention add_k_proj/add_v_proj; HunyuanVideo's add_q_proj/add_k_proj/add_v_proj/
to_add_out; the feed-forward layers; LTX-2's audio feed-forward, its to_q etc. matching the audio and the
audio-video cross attentions too):

- PEFT LoRA, DoRA, LoHa, LoKr with random weights, saved by the pipeline's `save_lora_weights`
  (WanPipeline / HunyuanVideoPipeline / LTXPipeline / LTX2Pipeline / Cosmos2_5_PredictBasePipeline; with and without
  `transformer_lora_adapter_metadata`) or by PEFT's `save_pretrained` (`base_model.model.` names and
  adapter_config.json). Cosmos Predict2's own pipelines have no LoRA loader: Predict 2.5's, whose
  CosmosLoraLoaderMixin loads into the same CosmosTransformer3DModel, writes its file. Truth: PEFT's own `merge()`
  of each layer in float64.
- lycoris-lora 4.1.3's `create_lycoris(transformer, ...)` (lora, loha, lokr) over the same modules, saved as
  SimpleTuner's `_save_lycoris` does (`LycorisNetwork.save_weights`, `lycoris_` + diffusers path with dots as
  underscores, `lycoris_config` metadata). Truth: the network's forward (the wrapped layer's output on the identity,
  float64), never its merge_to / get_diff_weight, which scale LoHa/LoKr twice (spec §4.1).

Each file goes through our loader node at strengths 1 and 0.5; the patched ComfyUI state dict (after a full load)
goes through the same diffusers converter, so a diffusers weight that is rows of a fused ComfyUI weight is compared
through the converter's own split. Every module of the file must apply (no problems, no unused keys), every adapted
diffusers weight must be within 1e-4 of its largest change (fp32) of the truth, and every other weight untouched.

Beyond the trainers' targets, a LoRA on every Linear and Conv3d of each twin, embedders included. HunyuanVideo's
norm_out.linear (final_layer.adaLN_modulation.1 with the halves swapped) and MiniMax H3's ff.net.0.proj (fc1, value
half first) hold all of a ComfyUI weight's rows in another order: each run of rows is applied as a module of its own.
"""

import copy
import dataclasses
import functools
import importlib
import json
import re

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.supported_models
import diffusers
import peft
import pytest
import test_nodes
import torch
from derive_names import derive
from diffusers.loaders import single_file_utils
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.glue.keymap import model_shapes
from lycoris_nodes.nodes.glue.patch_key import Offset
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from reference.lycoris_factory import SEED, Lazy, _class_presets_restored, _randomise
from test_nodes import run_node, weights_after_full_load
from test_peft_dit import adapted, assert_weights_match, merged_parameters, put

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths
loras = test_nodes.loras

CPU = torch.device("cpu")
PREFIX = "diffusion_model."
RANK = 4
STRENGTHS = (1.0, 0.5)
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


@dataclasses.dataclass(frozen=True)
class Arch:
    supported: str  # comfy.supported_models class
    config: dict  # ComfyUI's unet config
    converter: str  # diffusers.loaders.single_file_utils function ("": diffusers' names are ComfyUI's own)
    diffusers_model: str
    diffusers_config: dict
    pipeline: str  # whose save_lora_weights writes the file
    targets: tuple[str, ...]  # the module names a trainer adapts (PEFT target_modules: suffixes of module paths)
    params: str | None = None  # the ComfyUI dataclass that takes the config (older ComfyUIs take fewer fields)
    tencent_names: bool = False  # ComfyUI renames the original names on load; the converter reads the originals
    converter_kwargs: tuple = ()  # (name, value) pairs the converter also takes (MiniMax H3's needs the config)


def _wan(**extra) -> dict:
    return {"image_model": "wan2.1", "model_type": "t2v", "dim": 32, "ffn_dim": 64, "freq_dim": 16, "text_dim": 24,
            "num_heads": 2, "num_layers": 2, "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2),
            "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, **extra}


def _wan_diffusers(**extra) -> dict:
    return {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
            "out_channels": 16, "text_dim": 24, "freq_dim": 16, "ffn_dim": 64, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, **extra}


MINIMAX_DIFFUSERS = {"num_attention_heads": 2, "attention_head_dim": 16, "hidden_size": 32, "num_layers": 2,
                     "num_refiner_layers": 1, "ffn_dim": 64, "in_channels": 4, "audio_in_channels": 8, "text_dim": 24,
                     "time_embed_hidden_dim": 32, "time_embed_dim": 16, "rope_freq_dim": 2}

ARCHS = {
    "wan21-t2v": Arch("WAN21_T2V", _wan(), "convert_wan_transformer_to_diffusers", "WanTransformer3DModel",
                      _wan_diffusers(), "WanPipeline", (*ATTENTION, "ffn.net.0.proj", "ffn.net.2")),
    # image cross-attention: k_img / v_img are diffusers' add_k_proj / add_v_proj; ComfyUI's image projection takes
    # 1280-wide CLIP features whatever the width
    "wan21-i2v": Arch("WAN21_I2V", _wan(model_type="i2v", in_dim=36), "convert_wan_transformer_to_diffusers",
                      "WanTransformer3DModel", _wan_diffusers(in_channels=36, image_dim=1280, added_kv_proj_dim=32),
                      "WanPipeline", (*ATTENTION, "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2")),
    # to_q/to_k/to_v and add_q/k_proj are row thirds of ComfyUI's img_attn.qkv / txt_attn.qkv; to_q etc. and
    # ff.net.* also match the token refiner's attention (rows of its self_attn.qkv) and feed-forward
    "hunyuan-video": Arch("HunyuanVideo",
                          {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2],
                           "out_channels": 16, "vec_in_dim": 24, "axes_dim": [4, 6, 6], "meanflow": False,
                           "context_in_dim": 40, "hidden_size": 32, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
                           "depth_single_blocks": 0, "theta": 256, "qkv_bias": True, "byt5": False,
                           "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
                           "meanflow_sum": False},
                          "convert_hunyuan_video_transformer_to_diffusers", "HunyuanVideoTransformer3DModel",
                          {"in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16,
                           "num_layers": 2, "num_single_layers": 0, "num_refiner_layers": 2, "mlp_ratio": 4.0,
                           "patch_size": 2, "patch_size_t": 1, "guidance_embeds": True, "text_embed_dim": 40,
                           "pooled_projection_dim": 24, "rope_axes_dim": (4, 6, 6)},
                          "HunyuanVideoPipeline",
                          (*ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.0.proj",
                           "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
                          params="comfy.ldm.hunyuan_video.model.HunyuanVideoParams", tencent_names=True),
    "ltx-video": Arch("LTXV", {"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 8,
                               "cross_attention_dim": 32, "num_attention_heads": 4, "in_channels": 16,
                               "out_channels": 16, "caption_channels": 24},
                      "convert_ltx_transformer_checkpoint_to_diffusers", "LTXVideoTransformer3DModel",
                      {"in_channels": 16, "out_channels": 16, "num_attention_heads": 4, "attention_head_dim": 8,
                       "cross_attention_dim": 32, "num_layers": 2, "caption_channels": 24},
                      "LTXPipeline", (*ATTENTION, "ff.net.0.proj", "ff.net.2")),
    # LTX-Video's widths plus the audio stream's and its text connectors' (which ComfyUI's model holds and the
    # converter drops: at their default width of 3840 they would be most of the model)
    "ltx2": Arch("LTXAV", {"image_model": "ltxav", "num_layers": 2, "attention_head_dim": 8, "cross_attention_dim": 32,
                           "num_attention_heads": 4, "in_channels": 16, "caption_channels": 24,
                           "audio_in_channels": 8, "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
                           "audio_cross_attention_dim": 16, "connector_num_attention_heads": 2,
                           "connector_attention_head_dim": 8, "connector_num_layers": 1},
                 "convert_ltx2_transformer_to_diffusers", "LTX2VideoTransformer3DModel",
                 {"in_channels": 16, "out_channels": 16, "num_attention_heads": 4, "attention_head_dim": 8,
                  "cross_attention_dim": 32, "num_layers": 2, "caption_channels": 24, "audio_in_channels": 8,
                  "audio_out_channels": 8, "audio_num_attention_heads": 2, "audio_attention_head_dim": 8,
                  "audio_cross_attention_dim": 16},
                 "LTX2Pipeline",
                 (*ATTENTION, "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")),
    # ComfyUI's detection of Predict2 2B (model_detection.py) at a tiny width; no bias anywhere
    "cosmos-predict2": Arch("CosmosT2IPredict2",
                            {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
                             "in_channels": 16, "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1,
                             "model_channels": 32, "concat_padding_mask": True, "crossattn_emb_channels": 24,
                             "pos_emb_cls": "rope3d", "pos_emb_learnable": True, "pos_emb_interpolation": "crop",
                             "min_fps": 1, "max_fps": 30, "use_adaln_lora": True, "adaln_lora_dim": 8,
                             "num_blocks": 2, "num_heads": 2, "extra_per_block_abs_pos_emb": False,
                             "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0,
                             "rope_t_extrapolation_ratio": 1.0},
                            "convert_cosmos_transformer_checkpoint_to_diffusers", "CosmosTransformer3DModel",
                            {"in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16,
                             "num_layers": 2, "mlp_ratio": 4.0, "text_embed_dim": 24, "adaln_lora_dim": 8,
                             "max_size": (128, 240, 240), "patch_size": (1, 2, 2), "rope_scale": (1.0, 4.0, 4.0),
                             "concat_padding_mask": True, "extra_pos_embed_type": None},
                            "Cosmos2_5_PredictBasePipeline", (*ATTENTION, "ff.net.0.proj", "ff.net.2")),
    # MiniMax H3 (0.33 only) at a tiny width: q/k/v are row thirds of ComfyUI's qkv_proj (the token refiner's too);
    # saved by MiniMaxH3LoraLoaderMixin (diffusers.loaders). ff.net.0.proj is fc1 with its halves swapped (value
    # first), so each half goes to the other half of fc1's rows
    "minimax-h3": Arch("MiniMaxH3",
                       {"image_model": "minimax_h3", "hidden_size": 32, "num_layers": 2, "token_refiner_num_layers": 1,
                        "num_attention_heads": 2, "attention_head_dim": 16, "ffn_hidden_size": 64, "latents_dim": 4,
                        "audio_latents_dim": 8, "text_dim": 24, "time_embed_hidden_size": 32, "time_embed_dim": 16,
                        "rope_inv_freq_len": 2},
                       "convert_minimax_h3_transformer_checkpoint_to_diffusers", "MiniMaxH3Transformer3DModel",
                       MINIMAX_DIFFUSERS,
                       "MiniMaxH3LoraLoaderMixin", (*ATTENTION, "ff.net.0.proj", "ff.net.2"),
                       converter_kwargs=(("config", MINIMAX_DIFFUSERS),)),
    # Kandinsky 5 (0.33 only): diffusers' Kandinsky5Transformer3DModel has ComfyUI's (and Kandinsky's own) names, no
    # converter; the targets of musubi-tuner's and the official trainer's defaults (lora_kandinsky.py)
    "kandinsky5": Arch("Kandinsky5",
                       {"image_model": "kandinsky5", "model_dim": 32, "ff_dim": 64, "time_dim": 16, "in_text_dim": 24,
                        "in_text_dim2": 20, "visual_embed_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2,
                        "axes_dims": (4, 6, 6)},
                       "", "Kandinsky5Transformer3DModel",
                       {"in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 24, "in_text_dim2": 20,
                        "time_dim": 16, "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2,
                        "axes_dims": (4, 6, 6)},
                       "Kandinsky5T2VPipeline",
                       ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer",
                        "feed_forward.in_layer", "feed_forward.out_layer")),
}
# the architectures this ComfyUI has (0.3.75 has no LTX-2; `available` reads the supported_models class only); the
# others' cases are skipped, saying why
HERE = [arch_id for arch_id, arch in ARCHS.items() if derive.available(arch)]

# Tencent name -> ComfyUI's, as HunyuanVideo's process_unet_state_dict renames on load (0.3.75 keeps the q/k norms
# as `.scale`, 0.33 as `.weight`); read backwards for the names ComfyUI's key map has no Tencent entry for. Every
# name found this way is checked with ComfyUI's own renaming.
HUNYUAN_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"), ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.weight"), ("_attn_k_norm.weight", "_attn.norm.key_norm.weight"),
    ("_attn_proj.", "_attn.proj."), ("_in.mlp.0.", "_in.in_layer."), ("_in.mlp.2.", "_in.out_layer."),
)


# --- ComfyUI's model and its diffusers twin ----------------------------------------------------------------------------

@dataclasses.dataclass
class Models:
    arch: Arch
    patcher: comfy.model_patcher.ModelPatcher
    originals: dict[str, str]  # ComfyUI key (no diffusion_model.) -> the name the converter reads
    twin: torch.nn.Module | None = None  # diffusers' model holding the same weights
    base: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the weights under diffusers' names

    def to_diffusers(self, comfy_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """ComfyUI's diffusion-model state dict (with or without `diffusion_model.`) under diffusers' names, by
        diffusers' converter (which splits the fused weights)."""
        checkpoint = {self.originals[k.removeprefix(PREFIX)]: v.detach().clone() for k, v in comfy_state.items()
                      if k.removeprefix(PREFIX) in self.originals}
        if not self.arch.converter:
            return checkpoint
        return dict(getattr(single_file_utils, self.arch.converter)(checkpoint, **dict(self.arch.converter_kwargs)))

    @functools.cached_property
    def keys(self) -> list[str]:
        return [PREFIX + k for k in self.originals]


def comfy_model(arch: Arch):
    config = dict(arch.config)
    if arch.params:  # fields this ComfyUI's dataclass lacks are left out (0.3.75's HunyuanVideo has no meanflow_sum)
        module, name = arch.params.rsplit(".", 1)
        accepted = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
        config = {k: v for k, v in config.items() if k in accepted or k == "image_model"}
    model_config = getattr(comfy.supported_models, arch.supported)(config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "", device=CPU)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # ComfyUI's layers are not initialised: random weights, about unit gain
        for param in model.diffusion_model.parameters():
            fan = param[0].numel() if param.ndim > 1 else 4
            param.copy_(torch.randn(param.shape, generator=gen) * fan ** -0.5)
    return model


def tencent_names(model, converter, twin_keys: set[str], state: dict | None = None) -> dict[str, str]:
    """HunyuanVideo: ComfyUI key -> Tencent's name, from ComfyUI's key map (`transformer.<Tencent path>`) or its
    renames read backwards; the one ComfyUI's loader renames back to the key and the converter turns into
    parameters of the twin. For every weight, or those of `state` (part of the model's state dict)."""
    from_map = {}
    for name, target in comfy.lora.model_lora_keys_unet(model, {}).items():
        if isinstance(name, str) and isinstance(target, str) and name.startswith("transformer."):
            from_map.setdefault(target.removeprefix(PREFIX).removesuffix(".weight"), name.removeprefix("transformer."))
    originals = {}
    for key, value in (model.diffusion_model.state_dict() if state is None else state).items():
        module, param = key.rsplit(".", 1)
        candidates = [f"{from_map[module]}.{param}"] if module in from_map else []
        candidates += [key.replace(comfy_name, tencent, 1) for tencent, comfy_name in HUNYUAN_RENAMES
                       if comfy_name in key]
        found = [c for c in dict.fromkeys(candidates + [key])
                 if list(model.model_config.process_unet_state_dict({c: None})) == [key]
                 and set(converter({c: value})) <= twin_keys]
        assert found, f"no Tencent name for {key} among {candidates}"
        originals[key] = found[0]
    return originals


def build(arch_id: str) -> Models:
    arch = ARCHS[arch_id]
    model = comfy_model(arch)
    with torch.device("meta"):
        twin_keys = set(getattr(diffusers, arch.diffusers_model)(**arch.diffusers_config).state_dict())
    converter = getattr(single_file_utils, arch.converter) if arch.converter else None
    state = model.diffusion_model.state_dict()
    originals = (tencent_names(model, converter, twin_keys) if arch.tencent_names else {k: k for k in state})
    models = Models(arch, comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU), originals)
    models.base = models.to_diffusers(state)
    twin = getattr(diffusers, arch.diffusers_model)(**arch.diffusers_config).float().eval()
    twin.load_state_dict(models.base, strict=True)  # the twin is ComfyUI's model, weight for weight
    models.twin = twin.requires_grad_(False)
    return models


@pytest.fixture(scope="module")
def archs():
    yield Lazy(build)
    comfy.model_management.unload_all_models()


def test_the_twins_hold_the_same_weights(archs):
    """A strict load took every converted weight (build); the twin's names are also every weight the converter
    wrote, and the fused ComfyUI weights are split (HunyuanVideo's qkv rows) or renamed (the others)."""
    for arch_id in HERE:
        models = archs[arch_id]
        assert set(models.twin.state_dict()) == set(models.base)
    hunyuan = archs["hunyuan-video"].base
    assert {"transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.add_v_proj.weight",
            "context_embedder.token_refiner.refiner_blocks.1.attn.to_k.weight"} <= set(hunyuan)


# --- files ---------------------------------------------------------------------------------------------------------

def _lora(targets, **options):
    return peft.LoraConfig(**{"r": RANK, "lora_alpha": RANK, "init_lora_weights": False,
                              "target_modules": list(targets), **options})


PEFT_ADAPTERS = {
    "lora": lambda targets: _lora(targets),
    "lora-alpha": lambda targets: _lora(targets, lora_alpha=8, rank_pattern={"to_v": 2}),
    "dora": lambda targets: _lora(targets, lora_alpha=8, use_dora=True),
    "loha": lambda targets: peft.LoHaConfig(r=RANK, alpha=8, init_weights=False, target_modules=list(targets)),
    "lokr": lambda targets: peft.LoKrConfig(r=RANK, alpha=8, init_weights=False, decompose_both=True,
                                            target_modules=list(targets)),
}
# (kind, how it is saved): diffusers' saver without the config (alpha = rank, which the loader assumes, with a
# warning) and with it, PEFT's save_pretrained for the rest (LoHa/LoKr have no diffusers saver)
PEFT_CASES = [("lora", "save_lora_weights"), ("lora-alpha", "save_lora_weights+metadata"),
              ("dora", "save_lora_weights+metadata"), ("lora", "save_pretrained"), ("loha", "save_pretrained"),
              ("lokr", "save_pretrained")]
WITHOUT_ALPHA = {("lora", "save_lora_weights")}
# create_lycoris settings per algorithm; lokr is SimpleTuner's default (linear_dim 10000, i.e. full factors, factor 16)
LYCORIS = {
    "lora": {"linear_dim": RANK, "linear_alpha": 2.0},
    "loha": {"linear_dim": RANK, "linear_alpha": 2.0},
    "lokr": {"linear_dim": 10000, "linear_alpha": 1.0, "factor": 16},
}


def save_peft(models: Models, model, config, kind: str, save_format: str, folder) -> dict[str, bytes]:
    if save_format == "save_pretrained":  # a folder: adapter_model.safetensors and its adapter_config.json
        model.save_pretrained(str(folder / kind))
        written = [f"{kind}/adapter_model.safetensors", f"{kind}/adapter_config.json"]
    else:
        written = [f"{kind}-{save_format}.safetensors"]
        metadata = config.to_dict() if save_format.endswith("+metadata") else None
        saver = getattr(diffusers, models.arch.pipeline, None) or getattr(diffusers.loaders, models.arch.pipeline)
        saver.save_lora_weights(
            str(folder), transformer_lora_layers=peft.get_peft_model_state_dict(model), weight_name=written[0],
            transformer_lora_adapter_metadata=metadata)
    return {name: (folder / name).read_bytes() for name in written}


def peft_file(models: Models, kind: str, save_format: str, folder, targets=None):
    """({path: bytes}, {diffusers weight: (before, PEFT's merge)}) for a seeded adapter on the twin."""
    config = PEFT_ADAPTERS[kind](targets or models.arch.targets)
    model = adapted(models.twin, config, save_format, seed=SEED + sum(map(ord, kind + save_format)))
    written = save_peft(models, model, config, kind, save_format, folder)
    merged = merged_parameters(model)
    assert all(name.endswith(".weight") for name in merged)  # no lora_bias: PEFT's merge leaves biases alone
    return written, merged


def _target_pattern(target: str) -> str:
    """A PEFT target (a suffix of module paths) as a LyCORIS preset name pattern (re.match on the module path)."""
    return rf"(.*\.)?{re.escape(target)}$"


def lycoris_network(twin, config: dict, seed: int):
    """create_lycoris over `twin` as SimpleTuner calls it from its lycoris_config (apply_preset, multiplier, the
    rest as options), every factor seeded in float64 (`_randomise`)."""
    with _class_presets_restored():
        LycorisNetwork.apply_preset(config["apply_preset"])
        options = {k: v for k, v in config.items() if k not in ("multiplier", "apply_preset")}
        net = create_lycoris(twin, config["multiplier"], warn_on_unmatched=False, **options)
    for lora in net.loras:
        lora.to(torch.float64)
    _randomise(net, torch.Generator().manual_seed(seed))
    return net


def preset_layers(twin, preset: dict) -> dict:
    """The layers a LyCORIS preset selects, read independently of LyCORIS: those a `target_name` pattern matches,
    and every Linear inside a module whose class is a `target_module`."""
    by_class = {f"{owner}.{name}": layer for owner, module in twin.named_modules()
                if type(module).__name__ in preset["target_module"]
                for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)}
    by_name = {name: module for name, module in twin.named_modules()
               if any(re.match(pattern, name) for pattern in preset.get("target_name", ()))}
    return {**by_class, **by_name}


@torch.no_grad()
def lycoris_file(models: Models, algo: str, folder, preset: dict | None = None):
    """The twin wrapped by create_lycoris over the trainer's targets (or a `preset` as a lycoris_config gives it),
    saved as SimpleTuner saves it; the truth is each wrapped layer's forward on the identity (float64)."""
    twin = copy.deepcopy(models.twin).double()
    preset = preset or {"target_module": [], "target_name": [_target_pattern(t) for t in models.arch.targets]}
    config = {"algo": algo, "multiplier": 1.0, **LYCORIS[algo], "apply_preset": preset}
    net = lycoris_network(twin, config, SEED + sum(map(ord, algo)))
    layers = preset_layers(twin, preset)
    before = {name: layer.weight.detach().clone() for name, layer in layers.items()}
    assert sorted(lora.lora_name for lora in net.loras) == sorted("lycoris_" + n.replace(".", "_") for n in layers)
    net.apply_to()
    path = folder / f"lycoris-{algo}.safetensors"
    # SimpleTuner's _save_lycoris: save_weights (in its training dtype) with the config as `lycoris_config`; the
    # values are float32-exact (_randomise), so the float32 file holds what the float64 truth computes with
    net.save_weights(str(path), torch.float32, {"lycoris_config": json.dumps(config)})
    merged = {}
    for name, layer in layers.items():
        eye = torch.eye(layer.in_features, dtype=torch.float64)
        bias = 0 if layer.bias is None else layer.bias
        merged[f"{name}.weight"] = (before[name], (layer(eye) - bias).T.contiguous())  # the output on I is W'ᵀ + b
    return {path.name: path.read_bytes()}, merged


@pytest.fixture(scope="module")
def files(archs, tmp_path_factory):
    """(arch, source, kind, format) -> ({path in the loras folder: bytes}, {diffusers weight: (before, after)})."""
    folder = tmp_path_factory.mktemp("video_dit_files")

    def make(case):
        arch_id, source, kind, save_format = case
        sub = folder / "-".join(case)
        sub.mkdir()
        if source == "peft":
            return peft_file(archs[arch_id], kind, save_format, sub)
        return lycoris_file(archs[arch_id], kind, sub)

    return Lazy(make)


# --- the checks ----------------------------------------------------------------------------------------------------

def check_file(models: Models, folder, written: dict[str, bytes], merged: dict, warnings: int = 0) -> None:
    """Every module of the file applies; our loader node's weights, through the converter, are the truth at each
    strength, and every weight no adapter touches is as it was."""
    base = models.base
    assert merged and set(merged) <= set(base), sorted(set(merged) - set(base))
    name = put(folder, written)
    _, report = map_file(read(folder / name), models.patcher, None, reference=False)
    assert report.problems == [] and report.unused_keys == []
    assert len(report.applied) == report.total > 0
    assert len(report.warnings) == warnings, report.warnings
    for strength in STRENGTHS:
        patched = run_node(LycorisLoaderModelOnly, model=models.patcher, lycoris_name=name,
                           strength_model=strength)[0]
        comfy.model_management.unload_all_models()
        got = models.to_diffusers(weights_after_full_load(patched, models.keys))
        assert set(got) == set(base)
        assert_weights_match(got, base, merged, strength)
    comfy.model_management.unload_all_models()


def _param(arch_id, *case):
    """One case on one architecture, skipped where this ComfyUI lacks the model (as tests/test_diffusers_names.py)."""
    supported = ARCHS[arch_id].supported
    skip = [] if arch_id in HERE else [pytest.mark.skip(reason=f"this ComfyUI has no supported_models.{supported}")]
    return pytest.param(arch_id, *case, id="-".join((arch_id, *case)), marks=skip)


def _cases(sources):
    return [_param(arch_id, *case) for arch_id in ARCHS for case in sources]


@pytest.mark.parametrize("arch_id,kind,save_format", _cases(PEFT_CASES))
def test_peft_file_applies_fully_and_equal_to_peft_merge(arch_id, kind, save_format, archs, files, loras):
    models = archs[arch_id]
    written, merged = files[arch_id, "peft", kind, save_format]
    adapted_modules = {name.rsplit(".", 1)[0] for name in merged}
    # every target of the architecture occurs (Wan I2V's image keys, HunyuanVideo's qkv rows, ...)
    assert {t for t in models.arch.targets if any(m.endswith("." + t) for m in adapted_modules)} == set(
        models.arch.targets)
    check_file(models, loras, written, merged, warnings=int((kind, save_format) in WITHOUT_ALPHA))


@pytest.mark.parametrize("arch_id,algo", _cases([(algo,) for algo in LYCORIS]))
def test_lycoris_wrapper_file_applies_fully_and_equal_to_its_forward(arch_id, algo, archs, files, loras):
    models = archs[arch_id]
    written, merged = files[arch_id, "lycoris", algo, "save_weights"]
    assert all(name.startswith("lycoris_") for name in read_keys(written))
    check_file(models, loras, written, merged)


def read_keys(written: dict[str, bytes]) -> list[str]:
    from safetensors.torch import load

    return list(load(next(iter(written.values()))))


# --- every layer PEFT can adapt -------------------------------------------------------------------------------------

def every_layer(models: Models) -> list[str]:
    """Every Linear and Conv3d of the twin (full module paths)."""
    return [name for name, module in models.twin.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d))]


@pytest.mark.parametrize("arch_id", _cases([()]))
def test_lora_on_every_layer_applies_fully(arch_id, archs, loras, tmp_path):
    """A LoRA on every Linear and Conv3d of the diffusers model (PEFT's save_pretrained): embedders, modulation,
    the patch embedding and the output projection as well as the blocks."""
    models = archs[arch_id]
    targets = every_layer(models)
    written, merged = peft_file(models, "lora", "save_pretrained", tmp_path, targets=targets)
    assert {name.removesuffix(".weight") for name in merged} == set(targets)
    check_file(models, loras, written, merged)


# diffusers' weights that are all of a ComfyUI weight's rows in another order (the converter swaps its halves):
# (architecture, diffusers module, ComfyUI's weight)
SWAPPED_HALVES = [("hunyuan-video", "norm_out.linear", "final_layer.adaLN_modulation.1"),
                  ("minimax-h3", "transformer_blocks.0.ff.net.0.proj", "blocks.0.mlp.fc1"),
                  ("minimax-h3", "token_refiner.refiner_blocks.0.ff.net.0.proj", "token_refiner.blocks.0.mlp.fc1")]


@pytest.mark.parametrize("arch_id,module,weight", [_param(*case) for case in SWAPPED_HALVES])
def test_swapped_halves_apply_to_the_other_halves(arch_id, module, weight, archs, loras, tmp_path):
    """A module whose rows are a ComfyUI weight's halves swapped (scale/shift of a final modulation, a value-first
    SwiGLU input) is applied as two modules: its first half onto the weight's second half, its second onto the
    first. DoRA there is exact too (its magnitude is per output row): the values, through the converter, are the
    truth (check_file)."""
    models = archs[arch_id]
    written, merged = peft_file(models, "dora", "save_lora_weights+metadata", tmp_path, targets=[module])
    _, report = map_file(read(loras / put(loras, written)), models.patcher, None, reference=False)
    key = f"{PREFIX}{weight}.weight"
    half = model_shapes(models.patcher.model)[key][0] // 2
    assert report.problems == []
    (module_key,) = [name for name, applied in report.applied.items() if applied == key]
    assert [applied.target.offset for name, applied in report.targets.items()
            if name.startswith(module_key + "[")] == [Offset(0, half, half), Offset(0, 0, half)]
    check_file(models, loras, written, merged)
