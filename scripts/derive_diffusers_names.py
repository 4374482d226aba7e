"""Derive nodes/glue/diffusers_names.json: which diffusers module is which ComfyUI weight (or rows of one), per architecture.

ComfyUI has name converters for SD, SD3, Flux, AuraFlow, PixArt and Z-Image, but none for Wan, HunyuanVideo,
LTX-Video, Mochi and the other video models, whose adapters diffusers, PEFT and SimpleTuner name by the diffusers
module path (`transformer.blocks.0.attn1.to_q`). diffusers' own single-file converters
(`diffusers.loaders.single_file_utils.convert_*_to_diffusers`) turn an original checkpoint into diffusers names. This
script runs them, never a table of our own: it builds ComfyUI's model on the meta device, hands the converter one
small tensor per weight whose values tag (weight, row), and reads back where every row went. A diffusers weight
that is a whole ComfyUI weight, or one contiguous block of its rows (diffusers splits HunyuanVideo's fused qkv), is
recorded; so is one whose rows are all of one weight's in another order (swapped scale/shift halves, MiniMax H3's
and Mochi's value-first SwiGLU): as the runs of ComfyUI's rows it holds, in order ("pieces"). Anything else is
recorded as converted and left unmapped.

Block indices are generalised: the model is built with a few blocks per stack, and a number in a path that takes
every value from 0 up across keys that are otherwise alike is a block index (`{0}` in the rule); the others
(`ffn.0`, `to_out.0`) stay literal. Row parts are fractions of the fused weight's rows, so they hold at any width.

    COMFY=0.33 .venv-0.33/bin/python scripts/derive_diffusers_names.py          # rewrite the table
    COMFY=0.33 .venv-0.33/bin/python scripts/derive_diffusers_names.py --check  # exit 1 if it is not current

tests/test_diffusers_names.py runs the check, and applies the rules to models of other depths and widths than the
ones traced here, against the converter's own output.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
TABLE = ROOT / "nodes" / "glue" / "diffusers_names.json"
WEIGHT = ".weight"
LORA = "lora:"  # Arch.converter names a LoRA converter
TRANSFORMER = "transformer."  # under which diffusers' LoRA converters name the transformer's modules
LORA_B = ".lora_B.weight"
MODEL_KINDS = ("image_model", "audio_model")  # the unet_config key that names the architecture
ROW_TAG = 1 << 20  # tag = (weight number) * ROW_TAG + row; float64 holds it exactly


@dataclass
class Arch:
    """One architecture: ComfyUI's model for it (supported_models class and config) and diffusers' converter."""
    name: str
    supported: str  # comfy.supported_models class
    config: dict
    converter: str  # diffusers.loaders.single_file_utils function, or "diffsynth:<module>.<function>"
    # ComfyUI renames some original checkpoint names when it loads them (its process_unet_state_dict); the
    # converter reads the original names, so the trace starts from them: ComfyUI's own `transformer.<original>`
    # key-map entries (HunyuanVideo's diffusion-pipe names), and the reverse of the renames below (ComfyUI's
    # fragment, the original's), each kept only where ComfyUI's own renaming gives the ComfyUI name back.
    original_from_comfy_map: bool = False
    original_renames: tuple[tuple[str, str], ...] = ()
    # The dataclass that takes the config, where older ComfyUIs take fewer fields (0.3.75's HunyuanVideo has no
    # meanflow_sum): fields it lacks are left out.
    params: str | None = None
    # diffusers' model for this architecture (class in diffusers, config overrides): a traced name that is no
    # module of it is dropped (ComfyUI's HunyuanVideo keeps no original name for a few embedders, so what the trace
    # starts from there is ComfyUI's own name, which the converter passes through unrenamed).
    diffusers_model: tuple[str, dict] = ("", {})
    # how files name these modules: "diffusers" (under the pipeline's prefixes, and the LyCORIS wrapper's and
    # OneTrainer's underscored forms) or "bare" (DiffSynth-Studio: PEFT's state dict of its own model, no prefix)
    names: str = "diffusers"
    # For a LoRA converter ("lora:<function>" in diffusers.loaders.lora_conversion_utils, where diffusers has no
    # single-file one): the prefix it reads before the original path, and the ComfyUI submodule the original paths
    # are relative to (ACE-Step 1.5's adapters name the decoder's modules only)
    lora_prefix: str = "diffusion_model."
    lora_root: str = ""
    # where ComfyUI's model is built: ACE-Step 1.5 computes its quantizer's codebook at construction, which the
    # meta device cannot, so it is built tiny on the CPU
    device: str = "meta"


def _wan(**extra) -> dict:
    return {"image_model": "wan2.1", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 32,
            "num_heads": 4, "num_layers": 3, "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2),
            "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, **extra}


def _hunyuan_video(**extra) -> dict:
    # hidden_size 3072 as in the released model: diffusers' converter splits single blocks' linear1 at 3072 rows
    return {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16,
            "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 4096,
            "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 3, "depth_single_blocks": 3,
            "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": True,
            "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False, **extra}


def _ltxv(**extra) -> dict:
    return {"image_model": "ltxv", "num_layers": 3, "attention_head_dim": 8, "cross_attention_dim": 64,
            "num_attention_heads": 4, "in_channels": 16, "out_channels": 16, "caption_channels": 32, **extra}


def _ltx2(**extra) -> dict:
    return {**_ltxv(), "image_model": "ltxav", **extra}


def _mochi(**extra) -> dict:
    # ComfyUI's detection of Mochi (model_detection.py, all fixed); diffusers' converter assumes its 48 blocks
    return {"image_model": "mochi_preview", "depth": 48, "patch_size": 2, "num_heads": 24, "hidden_size_x": 3072,
            "hidden_size_y": 1536, "mlp_ratio_x": 4.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
            "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
            "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
            "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 4096, "t5_token_length": 256,
            "rope_theta": 10000.0, **extra}


def _acestep15(**extra) -> dict:
    # ComfyUI's AceStepConditionGenerationModel at tiny widths (supported_models.ACEStep15 sets only audio_model)
    return {"audio_model": "ace1.5", "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
            "intermediate_size": 128, "num_dit_layers": 3, "num_lyric_layers": 1, "num_timbre_layers": 1,
            "num_tokenizer_layers": 1, "fsq_dim": 64, "text_hidden_dim": 64, "encoder_hidden_size": 64,
            "encoder_intermediate_size": 128, "encoder_num_heads": 2, **extra}


def _flux(**extra) -> dict:
    return {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
            "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 4, "depth": 3, "depth_single_blocks": 3,
            "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
            "txt_ids_dims": [], **extra}


def _flux2(**extra) -> dict:
    # ComfyUI's detection of Flux.2 (model_detection.py), dev widths
    return {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "mlp_ratio": 3.0, "theta": 2000,
            "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False, "ops_bias": False,
            "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3], "patch_size": 1,
            "in_channels": 128, "vec_in_dim": None, "depth": 3, "depth_single_blocks": 3, "yak_mlp": False,
            "txt_norm": False, "hidden_size": 6144, "num_heads": 48, "context_in_dim": 15360, "guidance_embed": True,
            **extra}


def _chroma(**extra) -> dict:
    return {"image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
            "out_channels": 64, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 64, "hidden_size": 3072,
            "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": None, "depth": 3, "depth_single_blocks": 3,
            "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120, "n_layers": 5, **extra}


def _cosmos_predict2(**extra) -> dict:
    # ComfyUI's detection of Cosmos Predict2 2B (model_detection.py)
    return {"image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128,
            "in_channels": 16, "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 2048,
            "concat_padding_mask": True, "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d",
            "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
            "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": 3, "num_heads": 16,
            "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0,
            "rope_t_extrapolation_ratio": 1.0, **extra}


# ComfyUI's Flux family loads BFL's `.scale` norms as `.weight` (supported_models.Flux.process_unet_state_dict)
FLUX_NORMS = ((".key_norm.weight", ".key_norm.scale"), (".query_norm.weight", ".query_norm.scale"))


ARCHS: list[Arch] = [
    Arch("wan", "WAN21_T2V", _wan(), "convert_wan_transformer_to_diffusers",
         diffusers_model=("WanTransformer3DModel", {"num_layers": 3})),
    Arch("wan-i2v", "WAN21_I2V", _wan(model_type="i2v", in_dim=36), "convert_wan_transformer_to_diffusers",
         diffusers_model=("WanTransformer3DModel", {"num_layers": 3, "image_dim": 1280, "added_kv_proj_dim": 5120})),
    Arch("wan-vace", "WAN21_Vace", _wan(model_type="vace", vace_layers=2, vace_in_dim=96),
         "convert_wan_transformer_to_diffusers",
         diffusers_model=("WanVACETransformer3DModel", {"num_layers": 3, "vace_layers": [0, 2]})),
    Arch("hunyuan-video", "HunyuanVideo", _hunyuan_video(), "convert_hunyuan_video_transformer_to_diffusers",
         original_from_comfy_map=True, params="comfy.ldm.hunyuan_video.model.HunyuanVideoParams",
         # supported_models.HunyuanVideo.process_unet_state_dict's renames of the embedders, which its key map
         # lists only under ComfyUI's own names
         original_renames=(("time_in.in_layer.", "time_in.mlp.0."), ("time_in.out_layer.", "time_in.mlp.2."),
                           ("guidance_in.in_layer.", "guidance_in.mlp.0."),
                           ("guidance_in.out_layer.", "guidance_in.mlp.2."),
                           ("txt_in.t_embedder.in_layer.", "txt_in.t_embedder.mlp.0."),
                           ("txt_in.t_embedder.out_layer.", "txt_in.t_embedder.mlp.2."),
                           ("txt_in.c_embedder.in_layer.", "txt_in.c_embedder.linear_1."),
                           ("txt_in.c_embedder.out_layer.", "txt_in.c_embedder.linear_2.")),
         diffusers_model=("HunyuanVideoTransformer3DModel", {"num_layers": 3, "num_single_layers": 3})),
    Arch("ltxv", "LTXV", _ltxv(), "convert_ltx_transformer_checkpoint_to_diffusers",
         diffusers_model=("LTXVideoTransformer3DModel", {"num_layers": 3})),
    Arch("ltx2", "LTXAV", _ltx2(), "convert_ltx2_transformer_to_diffusers",
         diffusers_model=("LTX2VideoTransformer3DModel", {"num_layers": 3})),
    # DiffSynth-Studio's own Flux (diffsynth/models/flux_dit.py), whose names its LoRAs keep unless trained with
    # --align_to_opensource_format; its converter from the original (BFL) names is a plain rename. No diffusers model
    # to check against: every name it gives is its model's.
    Arch("diffsynth-flux", "Flux", _flux(), "diffsynth:flux_dit.FluxDiTStateDictConverter",
         params="comfy.ldm.flux.model.FluxParams", names="bare",
         original_renames=FLUX_NORMS),
    # Flux.2, Chroma: ComfyUI's own map lists Flux.1's diffusers names for them; these fill in what it lacks
    # (Flux.2's global modulation and time/guidance embedders, Chroma's distilled guidance layer)
    Arch("flux2", "Flux2", _flux2(), "convert_flux2_transformer_checkpoint_to_diffusers",
         params="comfy.ldm.flux.model.FluxParams", original_renames=FLUX_NORMS,
         diffusers_model=("Flux2Transformer2DModel", {"num_layers": 3, "num_single_layers": 3})),
    Arch("chroma", "Chroma", _chroma(), "convert_chroma_transformer_checkpoint_to_diffusers",
         params="comfy.ldm.chroma.model.ChromaParams",
         original_renames=FLUX_NORMS + tuple((f"norms.{i}.weight", f"norms.{i}.scale") for i in range(5))
         + ((".norm.weight", ".norm.scale"),),
         diffusers_model=("ChromaTransformer2DModel", {"num_layers": 3, "num_single_layers": 3})),
    Arch("cosmos-predict2", "CosmosT2IPredict2", _cosmos_predict2(),
         "convert_cosmos_transformer_checkpoint_to_diffusers",
         diffusers_model=("CosmosTransformer3DModel", {
             "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
             "num_layers": 3, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
             "max_size": (128, 240, 240), "patch_size": (1, 2, 2), "rope_scale": (1.0, 4.0, 4.0),
             "concat_padding_mask": True, "extra_pos_embed_type": None})),
    Arch("mochi", "GenmoMochi", _mochi(), "convert_mochi_transformer_checkpoint_to_diffusers",
         diffusers_model=("MochiTransformer3DModel", {"num_layers": 48})),
    # Anima (Cosmos Predict2's DiT with an LLM adapter): diffusers loads its files into CosmosTransformer3DModel
    # through the LoRA converter of AnimaLoraLoaderMixin (the adapter goes to another component, text_conditioner)
    Arch("anima", "Anima", _cosmos_predict2(image_model="anima"), "lora:_convert_non_diffusers_anima_lora_to_diffusers",
         diffusers_model=("CosmosTransformer3DModel", {
             "in_channels": 16, "out_channels": 16, "num_attention_heads": 16, "attention_head_dim": 128,
             "num_layers": 3, "mlp_ratio": 4.0, "text_embed_dim": 1024, "adaln_lora_dim": 256,
             "max_size": (128, 240, 240), "patch_size": (1, 2, 2), "rope_scale": (1.0, 4.0, 4.0),
             "concat_padding_mask": True, "extra_pos_embed_type": None})),
    # Ideogram 4: diffusers has no single-file converter for it, only the LoRA converter its loader runs on files
    # with ComfyUI's names (Ideogram4LoraLoaderMixin.lora_state_dict), which splits the fused qkv into thirds
    Arch("ideogram4", "Ideogram4", {"image_model": "ideogram4", "in_channels": 128, "num_layers": 3},
         "lora:_convert_non_diffusers_ideogram4_lora_to_diffusers",
         diffusers_model=("Ideogram4Transformer2DModel", {"num_layers": 3})),
    # MiniMax H3 (released widths, on the meta device): the LoRA converter diffusers runs on files with the original
    # (ComfyUI's) names splits the fused qkv_proj into thirds and swaps fc1's halves (gate-first to diffusers'
    # value-first SwiGLU: recorded as the two halves' pieces)
    Arch("minimax-h3", "MiniMaxH3", {"image_model": "minimax_h3", "num_layers": 3, "token_refiner_num_layers": 3},
         "lora:_convert_non_diffusers_minimax_h3_lora_to_diffusers",
         diffusers_model=("MiniMaxH3Transformer3DModel", {"num_layers": 3, "num_refiner_layers": 3})),
    # ACE-Step 1.5 (audio): the LoRA converter AceStepLoraLoaderMixin.lora_state_dict runs on the official
    # trainer's files (PEFT's save_pretrained over the decoder: `base_model.model.` + the decoder's paths) renames
    # q/k/v/o_proj to_q/k/v/to_out.0; the decoder's other paths are diffusers' too
    Arch("acestep15", "ACEStep15", _acestep15(), "lora:_convert_non_diffusers_ace_step_lora_to_diffusers",
         diffusers_model=("AceStepTransformer1DModel", {"num_hidden_layers": 3}),
         lora_prefix="base_model.model.", lora_root="decoder.", device="cpu"),
]


def _comfy():
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.lora
    import comfy.supported_models
    return comfy


def meta_model(arch: Arch, config: dict | None = None):
    comfy = _comfy()
    cls = getattr(comfy.supported_models, arch.supported)
    config = dict(config or arch.config)
    if arch.params:
        module, name = arch.params.rsplit(".", 1)
        accepted = {f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
        config = {k: v for k, v in config.items() if k in accepted or k == "image_model"}
    return cls(config).get_model({}, "", device=arch.device)


def comfy_params(model) -> dict[str, tuple[int, ...]]:
    """ComfyUI's diffusion-model parameter keys (without `diffusion_model.`) and shapes; some converters need the
    biases beside the weights (Mochi's)."""
    prefix = "diffusion_model."
    return {k[len(prefix):]: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(prefix)}


def original_names(arch: Arch, model, params) -> dict[str, str]:
    """ComfyUI path -> the original checkpoint's name the converter reads (see Arch.original_renames)."""
    config = model.model_config
    candidates: dict[str, list[str]] = {path: [] for path in params}
    if arch.original_from_comfy_map:
        for name, target in _comfy().lora.model_lora_keys_unet(model, {}).items():
            if isinstance(name, str) and isinstance(target, str) and name.startswith("transformer."):
                path = target[len("diffusion_model."):]
                if path in candidates:
                    candidates[path].append(name[len("transformer."):] + WEIGHT)
    for path in params:
        candidates[path] += [path.replace(ours, theirs) for ours, theirs in arch.original_renames if ours in path]
    originals = {}
    for path, found in candidates.items():
        if not arch.original_from_comfy_map:
            found.append(path)  # a name ComfyUI loads as it is, unless a rename above gives it
        loaded_as_path = [c for c in found if list(config.process_unet_state_dict({c: None})) == [path]]
        if loaded_as_path:
            originals[path] = min(loaded_as_path, key=lambda c: c == path)  # a renamed original first
    return originals


def converter(arch: Arch):
    """The converter function: diffusers', or DiffSynth-Studio's file loaded on its own (its package imports
    training dependencies the converter does not need; it is installed without them)."""
    if not arch.converter.startswith("diffsynth:"):
        from diffusers.loaders import single_file_utils
        return getattr(single_file_utils, arch.converter)
    module, function = arch.converter[len("diffsynth:"):].rsplit(".", 1)
    package = Path(importlib.util.find_spec("diffsynth").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location(f"diffsynth_{module}", package / "utils" / "state_dict_converters"
                                                  / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, function)


def trace(arch: Arch, config: dict | None = None) -> dict[str, object]:
    """diffusers weight name -> where its rows are in ComfyUI's model (Rows), or "converted"."""
    import torch

    model = meta_model(arch, config)
    params = comfy_params(model)
    if arch.converter.startswith(LORA):
        return trace_lora(arch, params, config)
    originals = original_names(arch, model, params)
    ids = {path: i + 1 for i, path in enumerate(sorted(originals))}
    checkpoint = {}
    for path, orig in originals.items():
        shape = params[path]
        tags = ids[path] * ROW_TAG + torch.arange(shape[0] if shape else 1, dtype=torch.float64)
        checkpoint[orig] = tags.reshape(shape[0], *([1] * (len(shape) - 1))) if shape else tags[0]
    by_id = {i: path for path, i in ids.items()}
    converted = converter(arch)(checkpoint)
    found: dict[str, object] = {}
    for name, tensor in converted.items():
        if not name.endswith(WEIGHT) or not isinstance(tensor, torch.Tensor) or tensor.ndim == 0:
            continue
        rows = _read_rows(tensor, by_id, params)
        if rows is None:
            found[name] = "converted"
            continue
        if rows.path.endswith(WEIGHT):  # 0.3.75 keeps Flux's norms as `.scale`: no weight a `.weight` change goes to
            found[name] = rows
    return found


@dataclass(frozen=True)
class Rows:
    """Where a converted tensor's rows come from: ComfyUI weight `path` (of `total` rows), as runs (start, count) of
    its rows in the converted tensor's order; one run for a whole weight or a block of its rows."""
    path: str
    runs: tuple[tuple[int, int], ...]
    total: int


def _runs(rows: list[int]) -> tuple[tuple[int, int], ...]:
    """[4, 5, 0, 1] -> ((4, 2), (0, 2))."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, 1])
    return tuple((start, count) for start, count in runs)


def _read_rows(tensor, by_id: dict[int, str], params: dict) -> Rows | None:
    """Where the tagged rows of a converted tensor come from, or None when they are not one contiguous block of
    one weight's rows, nor all of its rows in another order."""
    import torch
    flat = tensor.reshape(tensor.shape[0], -1)
    if flat.shape[1] != 1 or flat.min() < ROW_TAG:
        return None
    tags = flat[:, 0].to(torch.int64)
    weight, path = int(tags[0]) // ROW_TAG, by_id.get(int(tags[0]) // ROW_TAG)
    if path is None or not torch.equal(tags // ROW_TAG, torch.full_like(tags, weight)):
        return None
    rows, total = (tags % ROW_TAG).tolist(), params[path][0]
    runs = _runs(rows)
    if len(runs) > 1 and sorted(rows) != list(range(total)):
        return None  # rows of one weight reordered but not all of them: no such layout is known
    return Rows(path, runs, total)


def trace_lora(arch: Arch, params: dict, config: dict | None) -> dict[str, object]:
    """trace() through a LoRA converter, one module at a time: a rank-1 LoRA on each ComfyUI weight, its lora_B's
    rows tagged (weight, row); where the converter puts those rows (under which diffusers module, which rows of it)
    says which diffusers module the weight is. A module the converter refuses (ValueError: Ideogram 4's converts the
    blocks only) is diffusers' module of the same path where diffusers' model has that weight at the same shape:
    the converter renames nothing there, as the trainers' own maps say (OneTrainer's IdeogramModel
    .diffusers_to_original: everything but the attention "keeps its diffusers name")."""
    import torch

    function = getattr(importlib.import_module("diffusers.loaders.lora_conversion_utils"), arch.converter[len(LORA):])
    overrides = {k: v for k, v in (config or {}).items() if k in arch.diffusers_model[1]}
    same_path = diffusers_shapes(arch, overrides) if arch.diffusers_model[0] else {}
    weights = sorted(p for p in params if p.endswith(WEIGHT) and len(params[p]) >= 2 and p.startswith(arch.lora_root))
    found: dict[str, object] = {}
    for number, path in enumerate(weights, 1):
        shape, stem = params[path], path[len(arch.lora_root): -len(WEIGHT)]
        up = number * ROW_TAG + torch.arange(shape[0], dtype=torch.float64)
        lora = {f"{arch.lora_prefix}{stem}.lora_A.weight": torch.ones(1, *shape[1:], dtype=torch.float64),
                f"{arch.lora_prefix}{stem}.lora_B.weight": up.reshape(shape[0], 1, *([1] * (len(shape) - 2)))}
        try:
            converted = function(lora)
        except ValueError:  # a module this converter does not convert
            name = path[len(arch.lora_root):]
            if same_path.get(name) == shape:
                found[name] = Rows(path, ((0, shape[0]),), shape[0])
            continue
        for key, tensor in converted.items():
            if not (key.startswith(TRANSFORMER) and key.endswith(LORA_B)):
                continue  # lora_A, or a module of another pipeline component (Anima's text conditioner)
            name = key[len(TRANSFORMER): -len(LORA_B)] + WEIGHT
            rows = _read_rows(tensor, {number: path}, params)
            found[name] = "converted" if rows is None else rows
    return found


def block_stacks(model) -> set[str]:
    """Paths of the model's block lists (nn.ModuleList): the number after one is a block index."""
    import torch
    prefix = "diffusion_model."
    return {name[len(prefix):] for name, module in model.named_modules()
            if isinstance(module, torch.nn.ModuleList) and name.startswith(prefix)}


def _indexed(path: str, stacks: set[str]) -> tuple[str, list[str]]:
    """`blocks.3.ffn.0` -> (`blocks.{0}.ffn.0`, ["3"])."""
    parts, values = path.split("."), []
    for i in range(1, len(parts)):
        if parts[i].isdigit() and ".".join(parts[:i]) in stacks:
            values.append(parts[i])
            parts[i] = f"{{{len(values) - 1}}}"
    return ".".join(parts), values


def _candidates(name: str, values: list[str]) -> list[str]:
    """Every way of writing the numbers `values` of the diffusers name as {0}, {1}, ... in order."""
    parts = name.split(".")
    def place(start: int, n: int) -> list[list[str]]:
        if n == len(values):
            return [parts[start:]]
        return [parts[start:i] + [f"{{{n}}}"] + rest for i in range(start, len(parts)) if parts[i] == values[n]
                for rest in place(i + 1, n + 1)]
    return [".".join(c) for c in place(0, 0)]


def _fractions(rows: Rows) -> tuple[tuple[int, int, int], ...] | None:
    """The runs as fractions of the weight's rows (start, count, of), which hold at any width; None for the whole
    weight in order."""
    if rows.runs == ((0, rows.total),):
        return None
    g = math.gcd(rows.total, *(n for run in rows.runs for n in run))
    return tuple((start // g, count // g, rows.total // g) for start, count in rows.runs)


def _rule(comfy: str, diffusers: str, fractions) -> dict:
    """A table rule: `rows` for one block of the weight's rows, `pieces` for all of them in another order."""
    if fractions is None or len(fractions) == 1:
        return {"comfy": comfy, "diffusers": diffusers, "rows": list(fractions[0]) if fractions else None}
    return {"comfy": comfy, "diffusers": diffusers, "rows": None, "pieces": [list(f) for f in fractions]}


def generalise(found: dict[str, object], stacks: set[str]) -> tuple[list[dict], list[str]]:
    """Rules {comfy, diffusers, rows} with block indices as {0}, {1}, and the names the converter reorders. A rule
    is kept only when writing it out for every block gives exactly the traced names."""
    groups: dict[tuple, list[tuple[list[str], str]]] = {}
    converted = set()
    for name, value in found.items():
        if value == "converted":
            converted.add(re.sub(r"(?<=\.)\d+(?=\.)", "#", name[: -len(WEIGHT)]))
            continue
        comfy_template, values = _indexed(value.path[: -len(WEIGHT)], stacks)
        groups.setdefault((comfy_template, _fractions(value)), []).append((values, name[: -len(WEIGHT)]))
    rules = []
    for (comfy_template, fractions), members in groups.items():
        fits = {t: [m for m in members if t.format(*m[0]) == m[1]] for values, name in members
                for t in _candidates(name, values)}
        # the template most blocks follow; a block that differs (Mochi's last, which has no text branch to update)
        # gets a rule of its own, for exactly its path
        best = max(fits, key=lambda t: (len(fits[t]), t))
        rules.append(_rule(comfy_template, best, fractions))
        rules += [_rule(comfy_template.format(*values), name, fractions)
                  for values, name in members if (values, name) not in fits[best]]
    return sorted(rules, key=lambda r: (r["diffusers"], r["comfy"])), sorted(converted)


def diffusers_shapes(arch: Arch, overrides: dict | None = None) -> dict[str, tuple[int, ...]]:
    """The weights of diffusers' own model for this architecture, as deep as the traced one, and their shapes."""
    import diffusers
    import torch
    name, config = arch.diffusers_model[0], {**arch.diffusers_model[1], **(overrides or {})}
    with torch.device("meta"):
        model = getattr(diffusers, name)(**config)
    return {key: tuple(value.shape) for key, value in model.state_dict().items() if key.endswith(WEIGHT)}


def diffusers_weights(arch: Arch, overrides: dict | None = None) -> set[str]:
    """The weight names of diffusers' own model for this architecture, as deep as the traced one."""
    return set(diffusers_shapes(arch, overrides))


def available(arch: Arch) -> bool:
    """Whether this ComfyUI has the architecture (0.3.75 has no LTX-2)."""
    return hasattr(_comfy().supported_models, arch.supported)


def derive(archs: list[Arch] | None = None) -> dict:
    table = {}
    for arch in archs or ARCHS:
        found = trace(arch)
        known = diffusers_weights(arch) if arch.diffusers_model[0] else set(found)
        missing = sorted(name[: -len(WEIGHT)] for name in found if name not in known)
        rules, converted = generalise({k: v for k, v in found.items() if k in known},
                                      block_stacks(meta_model(arch)))
        source = arch.converter if ":" in arch.converter else f"diffusers.loaders.single_file_utils.{arch.converter}"
        kind = next(k for k in MODEL_KINDS if k in arch.config)
        table[arch.name] = {kind: arch.config[kind], "supported_model": arch.supported,
                            "converter": source, "names": arch.names,
                            "rules": rules, "converted": converted}
        if missing:  # depends on which of ComfyUI's names the trace starts from, so it is said, not stored
            print(f"{arch.name}: not modules of diffusers' {arch.diffusers_model[0]}, left out: {', '.join(missing)}",
                  file=sys.stderr)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the table is not what the converters give")
    args = parser.parse_args()
    import diffusers
    missing = [arch.name for arch in ARCHS if not available(arch)]
    if missing:
        print(f"this ComfyUI lacks {', '.join(missing)}: run with the newest ComfyUI (COMFY=0.33)")
        return 1
    table = {"diffusers": diffusers.__version__, "architectures": derive()}
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if args.check:
        current = TABLE.read_text(encoding="utf-8") if TABLE.exists() else ""
        if current != text:
            print(f"{TABLE} is not what diffusers {diffusers.__version__}'s converters give: run this script")
            return 1
        return 0
    TABLE.write_text(text, encoding="utf-8")
    print(f"wrote {TABLE}: " + ", ".join(f"{k} {len(v['rules'])}" for k, v in table["architectures"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
