"""The diffusers and PEFT names ComfyUI's own LoRA key maps lack, derived from ComfyUI's own name converters.

ComfyUI maps a UNet's diffusers names only in the old attention-processor form (`unet.….attn1.processor.to_q`),
and a DiT's under the one prefix its diffusers loader writes (`transformer.…`). PEFT and diffusers write the plain
module paths under more prefixes: bare (`get_peft_model_state_dict`), `unet.` / `transformer.` / `text_encoder.`
(`save_lora_weights`), `base_model.model.` (PEFT's `save_pretrained`), and a pipeline prefix with PEFT's wrapper
(`text_encoder.base_model.model.`). Every name here comes from a converter ComfyUI already uses for this model
(`comfy.utils.unet_to_diffusers`, and the `*_to_diffusers` maps behind its `transformer.` entries) or from the
text-encoder entries of `model_lora_keys_clip`, never from a table of our own. For the DiTs ComfyUI has no
converter for (Wan, HunyuanVideo, LTX-Video, ...), the names come from diffusers' own single-file converters, run
on ComfyUI's model by scripts/derive_diffusers_names.py into diffusers_names.json beside this file.

A name two of our sources give different weights is left out, and ComfyUI's own entry always wins: a name that
does not map is reported, a name mapped to the wrong weight would be applied silently.
"""

import dataclasses
import functools
import json
import re
import weakref
from collections.abc import Callable
from pathlib import Path

import comfy.lora
import comfy.utils
import torch

from . import gguf
from .patch_key import Offset, PatchKey

# ComfyUI's own key-map builders, as they were when the pack was imported: everywhere.py wraps the module's
# attributes later, and its wrappers call into this module (through lora_key_map, at the end of this module) for the extra names.
COMFY_BUILDERS = {False: comfy.lora.model_lora_keys_unet, True: comfy.lora.model_lora_keys_clip}

UNET_PREFIXES = ("", "unet.", "base_model.model.", "unet.base_model.model.")
# `diffusion_model.` before a diffusers path: SimpleTuner's comfyui format (bghira/SimpleTuner
# simpletuner/helpers/training/lora_format.py convert_diffusers_to_comfyui: `transformer.` -> `diffusion_model.`).
DIT_PREFIXES = ("", "transformer.", "base_model.model.", "diffusion_model.")
# diffusers paths with dots as underscores after a prefix: the LyCORIS wrapper's `lycoris_` (SimpleTuner's
# lora_type=lycoris, as ComfyUI's own map writes it for Flux/SD3) and OneTrainer's legacy `lora_transformer_`.
DIT_UNDERSCORED_PREFIXES = ("lycoris_", "lora_transformer_")
# musubi-tuner names a module `lora_unet_` + its path in musubi's own port of the model, dots as underscores
# (kohya-ss/musubi-tuner src/musubi_tuner/networks/lora.py LoRANetwork, lora_zimage.py): HunyuanVideo's ports keep
# Tencent's names and Z-Image's split q/k/v, which are the paths ComfyUI's own map lists under `transformer.`
# (its diffusion-pipe and z_image_to_diffusers entries); ComfyUI's `lora_unet_` entries use its own paths.
MUSUBI = "lora_unet_"
# musubi-tuner's HunyuanVideo 1.5 port splits each fused attention projection (Tencent's `img_attn_qkv`) into
# `img_attn_q`, `_k`, `_v` (src/musubi_tuner/hunyuan_video_1_5/hunyuan_video_1_5_modules.py MMDoubleStreamBlock),
# which its own converter to ComfyUI (networks/convert_hunyuan_video_1_5_lora_to_comfy.py) concatenates in that
# order, in equal thirds, into the fused weight.
MUSUBI_FUSED_QKV, MUSUBI_SPLIT_QKV = "_attn_qkv", ("_attn_q", "_attn_k", "_attn_v")
DIFFUSION_MODEL = "diffusion_model."
# Modules ComfyUI's model holds that diffusers keeps in another pipeline component, under the path diffusers' own
# conversion gives them: LTX-2's text connectors (diffusers' LTX2TextConnectors, which SimpleTuner hangs on the
# transformer as `connectors`: helpers/models/ltxvideo2/model.py; renamed as its checkpoint_loader.py
# LTX_2_0_CONNECTORS_KEYS_RENAME_DICT renames the original's; diffusers' single-file converter drops them).
COMPONENT_RENAMES = {"ltxav": (
    ("audio_embeddings_connector.transformer_1d_blocks.", "connectors.audio_connector.transformer_blocks."),
    ("video_embeddings_connector.transformer_1d_blocks.", "connectors.video_connector.transformer_blocks."))}
# Trainers whose model port keeps the original module paths (ComfyUI's, without `diffusion_model.`) and name them
# under a prefix of their own, per architecture (unet_config's image_model): (prefix, dots as underscores).
# Ideogram 4: SimpleTuner trains its own port of the original (bghira/SimpleTuner at bc8e6ab7,
# simpletuner/helpers/models/ideogram/transformer.py: attention.qkv/.o, feed_forward.w1-3) and saves it through its
# Ideogram4Pipeline.save_lora_weights (`transformer.`) or the LyCORIS wrapper (`lycoris_`, save_hooks._save_lycoris).
# Anima: OneTrainer's ORIGINAL format nests the DiT under the original checkpoint's `net.` (Nerogar/OneTrainer at
# 23df3832, modules/model/AnimaModel.py diffusers_to_original: add_prefix("net"); LoRASaverMixin._save_original).
# HiDream-O1: newer ComfyUIs list `model.` + ComfyUI's path (Comfy-Org/ComfyUI comfy/lora.py model_lora_keys_unet
# at 17358c8, `isinstance(model, comfy.model_base.HiDreamO1)`), the original checkpoint's wrapper; musubi-tuner trains
# that checkpoint's Qwen3VLForConditionalGeneration (kohya-ss/musubi-tuner at 30c658c4, hidream_o1/hidream_o1_utils.py;
# networks/lora_hidream_o1.py), so its names are `lora_unet_model_` + ComfyUI's path, dots as underscores.
ORIGINAL_PATH_PREFIXES = {
    "ideogram4": (("transformer.", False), ("lycoris_", True)),
    "hidream_o1": (("model.", False), ("lora_unet_model_", True)),
    "anima": (("net.", False),),
}
# kohya-style names (`lora_unet_` + a path, dots as underscores) a trainer's own port of a model writes, per
# architecture (image_model) and block list: (the port's fragment, ComfyUI's). HunyuanImage 2.1 (and its refiner) in
# sd-scripts keeps Tencent's names, which its own converter renames to ComfyUI's (kohya-ss/sd-scripts at 48d368fa,
# networks/convert_hunyuan_image_lora_to_comfy.py: double_blocks_mappings, single_blocks_mappings); ComfyUI lists
# Tencent's names only for HunyuanVideo's model class (its diffusion-pipe entries), which these give again.
KOHYA_FRAGMENTS = {"hunyuan_video": {
    "double_blocks_": (("img_mlp_fc1", "img_mlp_0"), ("img_mlp_fc2", "img_mlp_2"), ("img_mod_linear", "img_mod_lin"),
                       ("txt_mlp_fc1", "txt_mlp_0"), ("txt_mlp_fc2", "txt_mlp_2"), ("txt_mod_linear", "txt_mod_lin")),
    "single_blocks_": (("modulation_linear", "modulation_lin"),)}}
# The prefixes under which ComfyUI itself lists a DiT's diffusers names; their paths are the modules we re-prefix.
DIT_SOURCES = ("transformer.", "base_model.model.", "unet.base_model.model.")
TEXT_ENCODER_PIPE_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoder_3.")
PEFT_WRAPPER = "base_model.model."
# transformers 5 drops CLIPTextModel's `text_model.` wrapper (its conversion mapping's PrefixChange), so a text
# encoder trained there is named `text_encoder.encoder.layers.…` where transformers 4 wrote `…text_model.encoder.…`.
CLIP_TEXT_WRAPPER = "text_model."
WEIGHT = ".weight"
# kohya's names for the Nth text encoder of a pipeline, as ComfyUI's map writes them (`lora_te2_…`, also for T5).
KOHYA_ENCODER = re.compile(r"lora_te(\d+)_(.+)")


def _merged(candidates: list[tuple[str, object]]) -> dict:
    """name -> target, without the names our sources disagree on."""
    merged, conflicting = {}, set()
    for name, target in candidates:
        if merged.setdefault(name, target) != target:
            conflicting.add(name)
    for name in conflicting:
        del merged[name]
    return merged


def unet_module_paths(model) -> dict[str, str]:
    """diffusers module path -> ComfyUI weight key, from ComfyUI's unet_to_diffusers ({} for a non-UNet)."""
    config = getattr(getattr(model, "model_config", None), "unet_config", None)
    if config is None:
        return {}
    return {name[: -len(WEIGHT)]: f"diffusion_model.{key}"
            for name, key in comfy.utils.unet_to_diffusers(config).items() if name.endswith(WEIGHT)}


DIFFUSERS_NAMES = Path(__file__).with_name("diffusers_names.json")
BLOCK_INDEX = re.compile(r"\\\{(\d+)\\\}")  # `{0}` as re.escape writes it
MODEL_KINDS = ("image_model", "audio_model")  # the unet_config key naming the architecture (ACE-Step: audio_model)


def _model_kind(config: dict) -> str | None:
    """The architecture's name in a unet config or a diffusers_names.json entry."""
    return next((config[k] for k in MODEL_KINDS if k in config), None)


def architecture(model) -> str | None:
    """The architecture's name of a ComfyUI model (its unet config's image_model or audio_model), None for a UNet."""
    return _model_kind(getattr(getattr(model, "model_config", None), "unet_config", None) or {})


@dataclasses.dataclass(frozen=True)
class RowPieces:
    """A weight a file stores with its rows in another order than ComfyUI's: the file's rows are, in order, the runs
    (start, count) of ComfyUI's rows (diffusers' value-first SwiGLU input of MiniMax H3 and Mochi, the swapped
    scale/shift halves of a final modulation). As a key-map entry's converter function it takes a change in the
    file's order to ComfyUI's, so ComfyUI's own loader applies such an entry right too; the pack applies each run
    as a module of its own (apply.find_target), which is exact for the algorithms that read the weight as well."""
    runs: tuple[tuple[int, int], ...]

    def __call__(self, change: torch.Tensor) -> torch.Tensor:
        starts = [start for start, _ in self.runs]
        pieces = change.split([count for _, count in self.runs])
        return torch.cat([piece for _, piece in sorted(zip(starts, pieces), key=lambda pair: pair[0])])


def row_runs(patch_key: PatchKey, rows: int) -> tuple[tuple[int, int], ...] | None:
    """The runs of ComfyUI's rows a key-map entry's rows are, in the file's order, when its converter function
    only reorders whole rows: ours (RowPieces) or ComfyUI's swap_scale_shift (a final modulation's [scale; shift]
    in diffusers' order, [shift; scale] in ComfyUI's: comfy/utils.py, flux_to_diffusers and its kin); else None."""
    function = patch_key.convert
    if function is None or patch_key.offset is not None:
        return None
    if isinstance(function, RowPieces):
        return function.runs
    if function is comfy.utils.swap_scale_shift and rows % 2 == 0:
        return ((rows // 2, rows // 2), (0, rows // 2))
    return None


@dataclasses.dataclass(frozen=True)
class ConverterRule:
    """One rule of diffusers_names.json: ComfyUI's weight path (a pattern over block indices), the converted
    module path it is (a template), and which of its rows: a block (start, count, of), or all of them in the
    converter's order (pieces, each (start, count, of)), or None for the whole weight in order."""
    pattern: re.Pattern
    template: str
    rows: tuple[int, int, int] | None
    pieces: tuple[tuple[int, int, int], ...] | None

    def target(self, key: str, total: int):
        """The key-map entry for this rule on a weight of `total` rows; None when the rows do not divide as the
        converter splits them (not this layout)."""
        parts = (self.rows,) if self.rows else self.pieces or ()
        if any(total % whole for _, _, whole in parts):
            return None
        if self.rows:
            start, count, whole = self.rows
            return PatchKey(key, Offset(0, start * total // whole, count * total // whole)).as_comfy()
        if self.pieces:
            runs = RowPieces(tuple((s * total // w, c * total // w) for s, c, w in self.pieces))
            return PatchKey(key, convert=runs).as_comfy()
        return key


@functools.cache
def _converter_rules() -> dict[tuple[str, str], list[ConverterRule]]:
    """(image_model or audio_model, how files name the modules) -> its rules. A rule for one block's exact path
    (Mochi's last block) comes first and stands for that block alone."""
    table = json.loads(DIFFUSERS_NAMES.read_text(encoding="utf-8"))["architectures"]
    rules: dict[tuple[str, str], list] = {}
    for arch in table.values():
        for rule in arch["rules"]:
            pattern = re.compile(BLOCK_INDEX.sub(r"(\\d+)", re.escape(rule["comfy"] + WEIGHT)))
            pieces = tuple(tuple(p) for p in rule["pieces"]) if rule.get("pieces") else None
            rules.setdefault((_model_kind(arch), arch["names"]), []).append(
                ConverterRule(pattern, rule["diffusers"], tuple(rule["rows"]) if rule["rows"] else None, pieces))
    return {key: sorted(found, key=lambda rule: rule.pattern.groups > 0) for key, found in rules.items()}


def converted_module_paths(model, names: str = "diffusers") -> list[tuple[str, object]]:
    """Converted module path -> ComfyUI weight key (or (key, rows) for a part of a fused weight), by the rules
    the converters give for this architecture ([] for one they were not run on): diffusers' paths, or with
    names="bare" the paths DiffSynth-Studio's own models use."""
    rules = _converter_rules().get((architecture(model), names), ())
    if not rules:
        return []
    paths = []
    for key, tensor in model.state_dict().items():
        if not (key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)):
            continue
        exact = False
        for rule in rules:
            match = rule.pattern.fullmatch(key, len(DIFFUSION_MODEL))
            if match is None or (exact and rule.pattern.groups):
                continue
            exact = exact or not rule.pattern.groups
            shape = gguf.logical_shape(tensor) if gguf.is_gguf_tensor(tensor) else tensor.shape
            target = rule.target(key, shape[0] if len(shape) else 1)
            if target is not None:
                paths.append((rule.template.format(*match.groups()), target))
    return paths


def dit_module_paths(comfy_map: dict) -> list[tuple[str, object]]:
    """diffusers module paths of a DiT as ComfyUI's own map lists them under a diffusers prefix, or under
    `diffusion_model.` where the entry is a converter's, not ComfyUI's own path (0.3.75 lists Z-Image's diffusers
    names only there)."""
    paths = []
    for name, target in comfy_map.items():
        if not isinstance(name, str):
            continue
        for source in DIT_SOURCES:
            if name.startswith(source):
                paths.append((name[len(source):], target))
                break
        else:
            if name.startswith(DIFFUSION_MODEL) and target != name + WEIGHT:
                paths.append((name[len(DIFFUSION_MODEL):], target))
    return paths


def component_module_paths(model) -> list[tuple[str, str]]:
    """diffusers' paths of the modules ComfyUI's model holds from another diffusers component (COMPONENT_RENAMES)."""
    renames = COMPONENT_RENAMES.get(architecture(model), ())
    paths = []
    for key in model.state_dict() if renames else ():
        path = key[len(DIFFUSION_MODEL): -len(WEIGHT)]
        if key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT):
            paths += [(theirs + path[len(ours):], key) for ours, theirs in renames if path.startswith(ours)]
    return paths


# Weights ComfyUI fuses at load that trainers keep as separate modules, per architecture (image_model): the fused
# module's last path segments -> the modules the trainers name, in row order, each an equal share of the rows.
# Qwen-Image 2.1 (ComfyUI 0.37+: image_model "qwen_image21", comfy/model_detection.py at 0b61ce5b; a
# model_base.QwenImage subclass at 094c74c1) fuses each block's SwiGLU gate and up projections into
# `img_mlp.gate_up` = [gate_layer; proj] (comfy/ldm/qwen_image21/model.py SwiGLUFeedForward at 08f68f09); diffusers,
# musubi-tuner, SimpleTuner and ai-toolkit train them as two Linears. ComfyUI 0.38's own map gives the same two halves
# (comfy/lora.py model_lora_keys_unet at 17358c8f, its `.img_mlp.gate_up` rule); 0.37's gives none.
FUSED_WEIGHT_PARTS = {"qwen_image21": {"img_mlp.gate_up": ("img_mlp.gate_layer", "img_mlp.proj")}}


def equal_row_parts(key: str, rows: int, names: list[str]) -> list[tuple[str, tuple]]:
    """name i -> (key, (0, i·rows/n, rows/n)): n parts of equal height of a fused weight, in row order; none when
    its rows do not divide in n."""
    if rows % len(names):
        return []
    height = rows // len(names)
    return [(name, PatchKey(key, Offset(0, i * height, height)).as_comfy()) for i, name in enumerate(names)]


def fused_weight_part_paths(model) -> list[tuple[str, tuple]]:
    """Each part's module path (FUSED_WEIGHT_PARTS) -> (the fused weight's key, (0, i·rows/n, rows/n)) for the i-th
    of its n parts, from the model's own weights; a weight whose rows do not divide in n gets none."""
    table = FUSED_WEIGHT_PARTS.get(architecture(model), {})
    paths = []
    for key, shape in model_shapes(model).items() if table else ():
        path = key[len(DIFFUSION_MODEL): -len(WEIGHT)]
        if not (key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)):
            continue
        for fused, parts in table.items():
            if ("." + path).endswith("." + fused):
                paths += equal_row_parts(key, shape[0], [path[: -len(fused)] + part for part in parts])
    return paths


def musubi_split_qkv_names(listed: list[tuple[str, object]], shapes: dict) -> list[tuple[str, object]]:
    """musubi's `lora_unet_…_attn_q/_k/_v` -> the thirds of the rows of the fused `…_attn_qkv` ComfyUI lists under
    its Tencent name (MUSUBI_SPLIT_QKV); a fused weight whose rows do not divide in three gets none."""
    names = []
    for path, target in listed:
        if path.endswith(MUSUBI_FUSED_QKV) and PatchKey.from_comfy(target).is_whole:
            stem = MUSUBI + path[: -len(MUSUBI_FUSED_QKV)].replace(".", "_")
            names += equal_row_parts(target, shapes[target][0], [stem + part for part in MUSUBI_SPLIT_QKV])
    return names


def _row_slices(comfy_map: dict) -> dict[str, set[Offset]]:
    """fused weight key -> the output-row slices ComfyUI's map gives parts of it (Flux's to_q/to_k/to_v in qkv)."""
    slices: dict[str, set] = {}
    for target in map(PatchKey.from_comfy, comfy_map.values()):
        if target.offset is not None and target.output_rows_only:
            slices.setdefault(target.weight, set()).add(target.offset)
    return slices


def fused_part_names(comfy_map: dict) -> list[tuple[str, object]]:
    """`<fused weight's module>.<i>` -> its i-th part, as OneTrainer's OMI format names the parts of a fused weight
    (`double_blocks.0.img_attn.qkv.0` is to_q). The parts are the finest tiling of the rows by ComfyUI's own slices:
    from row 0, each part is the shortest slice starting where the previous one ended (so linear1's q, k, v, mlp,
    not its q+k+v slice)."""
    names = []
    for key, slices in _row_slices(comfy_map).items():
        start, index = 0, 0
        while parts := [s for s in slices if s.start == start]:
            part = min(parts, key=lambda s: s.length)
            names.append((f"{key[: -len(WEIGHT)]}.{index}", PatchKey(key, part).as_comfy()))
            start, index = part.end, index + 1
    return names


def kohya_fragment_names(model) -> list[tuple[str, str]]:
    """`lora_unet_` names with the port's fragments of KOHYA_FRAGMENTS in place of ComfyUI's (reversed as the
    trainer's converter reverses them)."""
    stacks = KOHYA_FRAGMENTS.get(architecture(model), {})
    names = []
    for key in model.state_dict() if stacks else ():
        path = key[len(DIFFUSION_MODEL): -len(WEIGHT)].replace(".", "_")
        for stack, fragments in stacks.items():
            if key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT) and path.startswith(stack):
                renamed = path
                for theirs, ours in fragments:
                    renamed = renamed.replace(ours, theirs)
                if renamed != path:
                    names.append((MUSUBI + renamed, key))
    return names


def original_path_names(model) -> list[tuple[str, str]]:
    """ComfyUI's own module paths under the prefixes ORIGINAL_PATH_PREFIXES lists for this architecture."""
    prefixes = ORIGINAL_PATH_PREFIXES.get(architecture(model), ())
    paths = [(key[len(DIFFUSION_MODEL): -len(WEIGHT)], key) for key in model.state_dict()
             if prefixes and key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)]
    return [(prefix + (path.replace(".", "_") if underscored else path), key)
            for prefix, underscored in prefixes for path, key in paths]


def diffusion_model_names(model, comfy_map: dict) -> dict:
    """Every prefixed diffusers/PEFT name of this diffusion model that ComfyUI's map lacks, and the indexed names
    of the parts of its fused weights."""
    unet = unet_module_paths(model)
    candidates = [(prefix + path, key) for path, key in unet.items() for prefix in UNET_PREFIXES]
    if not unet:
        listed, parts = dit_module_paths(comfy_map), fused_weight_part_paths(model)
        paths = listed + parts + converted_module_paths(model) + component_module_paths(model)
        candidates += [(prefix + path, target) for path, target in paths for prefix in DIT_PREFIXES]
        candidates += [(prefix + path.replace(".", "_"), target) for path, target in paths
                       for prefix in DIT_UNDERSCORED_PREFIXES]
        candidates += [(MUSUBI + path.replace(".", "_"), target) for path, target in listed + parts]
        candidates += musubi_split_qkv_names(listed, model_shapes(model))
        # DiffSynth-Studio saves PEFT's state dict of its own model with no prefix: its paths are the original
        # model's (Wan: `blocks.0.self_attn.q`, ComfyUI's paths without `diffusion_model.`) or its own (Flux).
        candidates += [(key[len(DIFFUSION_MODEL): -len(WEIGHT)], key) for key in model.state_dict()
                       if key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)]
        candidates += converted_module_paths(model, names="bare")
        candidates += original_path_names(model)
        candidates += kohya_fragment_names(model)
    candidates += fused_part_names(comfy_map)
    return _merged(candidates)


def _kohya_root(name: str, target: str) -> tuple[str, str] | None:
    """(pipeline prefix, root) of a `lora_teN_<path>` entry: the root is the start of the target whose rest, dots
    written as underscores, is <path>. kohya's Nth text encoder is the pipeline's `text_encoder_N` (N = 1:
    `text_encoder`), as ComfyUI's own map pairs them (SDXL: `lora_te2_…` and `text_encoder_2.…` on CLIP-G); this is
    how T5, for which ComfyUI writes only kohya names, gets its pipeline prefix (Flux: 2, SD3: 3)."""
    match = KOHYA_ENCODER.fullmatch(name)
    if match is None or not target.endswith(WEIGHT):
        return None
    index, path = int(match.group(1)), match.group(2)
    stem = target[: -len(WEIGHT)]
    if len(stem) <= len(path) or stem[-len(path) - 1] != "." or stem[-len(path):].replace(".", "_") != path:
        return None
    pipe = "text_encoder." if index == 1 else f"text_encoder_{index}."
    return (pipe, stem[: -len(path)]) if pipe in TEXT_ENCODER_PIPE_PREFIXES else None


def _encoder_roots(comfy_map: dict, weight_keys) -> dict[str, str]:
    """`text_encoder.` -> `clip_l.transformer.` etc.: where ComfyUI's own diffusers entries for each pipeline
    text encoder point, and its kohya `lora_teN_` entries. A pipeline prefix whose entries point into two roots is
    left out."""
    roots: dict[str, set[str]] = {}
    for name, target in comfy_map.items():
        if not isinstance(name, str) or not PatchKey.from_comfy(target).is_whole or target not in weight_keys:
            continue
        for pipe in TEXT_ENCODER_PIPE_PREFIXES:
            path = name[len(pipe):] if name.startswith(pipe) else None
            if path and target.endswith(path + WEIGHT):
                roots.setdefault(pipe, set()).add(target[: -len(path + WEIGHT)])
        kohya = _kohya_root(name, target)
        if kohya is not None:
            roots.setdefault(kohya[0], set()).add(kohya[1])
    return {pipe: found.pop() for pipe, found in roots.items() if len(found) == 1}


def text_encoder_names(clip_model, comfy_map: dict) -> dict:
    """Every weight of each text encoder ComfyUI's map names a diffusers pipeline prefix for, under that prefix
    (also with PEFT's wrapper after it), with and without CLIPTextModel's `text_model.` wrapper. PEFT's
    `save_pretrained` names (`base_model.model.` alone) do not say which encoder they are for: they map only when
    there is one. The language-model encoders' names (ordered_encoder_names) come after these."""
    weight_keys = [k for k in clip_model.state_dict() if k.endswith(WEIGHT)]
    roots = _encoder_roots(comfy_map, set(weight_keys))
    prefixes = {pipe: (pipe, pipe + PEFT_WRAPPER) + ((PEFT_WRAPPER,) if len(set(roots.values())) == 1 else ())
                for pipe in roots}
    candidates = []
    for pipe, root in roots.items():
        for key in weight_keys:
            if key.startswith(root):
                path = key[len(root): -len(WEIGHT)]
                candidates += [(prefix + form, key) for form in {path, path.removeprefix(CLIP_TEXT_WRAPPER)}
                               for prefix in prefixes[pipe]]
    return {**ordered_encoder_names(weight_keys), **_merged(candidates)}


# A language-model text encoder as ComfyUI ports it: `<name>.transformer.model.layers.N…` (its Llama2_ is `.model`).
LM_ROOT = re.compile(r"([^.]+\.transformer\.)model\.layers\.\d+\.")
LM_MODEL = "model."
# The wrappers transformers saves that language model under, in place of ComfyUI's `model.`: none for a base model
# (LlamaModel, Qwen3Model, Gemma2Model: `layers.N…`); `model.` for a causal LM (Qwen3ForCausalLM, ComfyUI's own);
# transformers 5's vision-language models, `model.language_model.` (Qwen2_5_VL / Qwen3VL / Gemma3 / Mistral3
# ForConditionalGeneration) or `language_model.` (their base models Qwen3VLModel, Mistral3Model); and transformers
# 4's Gemma3 / Mistral3 `language_model.model.` (what conversion_mapping.py's "llava" renames into
# `model.language_model.`).
LM_WRAPPERS = ("", "model.", "model.language_model.", "language_model.", "language_model.model.")
# transformers 5 moves Qwen2.5-VL's vision tower under `model.` as well: `model.visual.blocks.N…`.
VISION, VISION_WRAPPER = "visual.", "model."
# diffusers' order of a pipeline's text encoders (text_encoder, text_encoder_2, … as kohya's lora_te1_, lora_te2_, …),
# by ComfyUI's names for them, where an LLM is among them and ComfyUI's map gives it no place: HunyuanVideoPipeline
# (text_encoder = LlamaModel, text_encoder_2 = CLIPTextModel) and HiDreamImagePipeline (CLIP-L, CLIP-G, T5, Llama);
# OneTrainer declares the same (Nerogar/OneTrainer modules/model/{HunyuanVideo,HiDream}Model.py lora_text_encoders).
PIPELINE_ORDERS = (("llama", "clip_l"), ("clip_l", "clip_g", "t5xxl", "llama"))
PIPE_WRAPPER = "text_encoders."  # ComfyUI's generic prefix: `text_encoders.` + its own key (OneTrainer's COMFY format)
KOHYA_SOLO = "lora_te_"  # kohya's one text encoder (sd-scripts' Anima / Lumina networks)


def _forms(path: str, language_model: bool) -> set[str]:
    """The module paths trainers write for ComfyUI's `path` (relative to `<name>.transformer.`)."""
    if language_model and path.startswith(LM_MODEL):
        return {wrapper + path[len(LM_MODEL):] for wrapper in LM_WRAPPERS}
    if path.startswith(VISION):
        return {path, VISION_WRAPPER + path}
    return {path, path.removeprefix(CLIP_TEXT_WRAPPER)}


def _encoder_places(weight_keys) -> tuple[dict[str, int], set[str]]:
    """(root -> its pipeline index, the language-model roots): by PIPELINE_ORDERS where the model's encoders are one
    of those, else 1 for a language model that is the model's only encoder; roots without a place are left out."""
    roots = {key[: key.index(".transformer.") + len(".transformer.")] for key in weight_keys
             if ".transformer." in key and "." not in key[: key.index(".transformer.")]}
    models = {match.group(1) for key in weight_keys if (match := LM_ROOT.match(key))}
    names = {root.split(".")[0]: root for root in roots}
    for order in PIPELINE_ORDERS:
        if set(order) == set(names):
            return {names[name]: index for index, name in enumerate(order, 1)}, models
    return ({root: 1 for root in models} if len(roots) == 1 else {}), models


def ordered_encoder_names(weight_keys: list[str]) -> dict:
    """The names trainers give the text encoders ComfyUI's map has no pipeline place for (the language models, and
    HunyuanVideo's CLIP-L as its second encoder): `text_encoder[_N].` (also with PEFT's wrapper), kohya's
    `lora_te[N]_`, PEFT's `base_model.model.` for an only encoder, and `text_encoders.<ComfyUI's root>` with the
    language model under each of transformers' wrappers (LM_WRAPPERS)."""
    places, models = _encoder_places(weight_keys)
    candidates = []
    for key in weight_keys:
        root = next((r for r in places.keys() | models if key.startswith(r)), None)
        if root is None:
            continue
        forms = _forms(key[len(root): -len(WEIGHT)], root in models)
        if root in models:
            candidates += [(PIPE_WRAPPER + root + form, key) for form in forms]
        if root in places:
            index = places[root]
            pipe = "text_encoder." if index == 1 else f"text_encoder_{index}."
            prefixes = [pipe, pipe + PEFT_WRAPPER] + ([PEFT_WRAPPER] if len(places) == 1 else [])
            candidates += [(prefix + form, key) for form in forms for prefix in prefixes]
            kohya = [f"lora_te{index}_"] + ([KOHYA_SOLO] if len(places) == 1 else [])
            candidates += [(prefix + form.replace(".", "_"), key) for form in forms for prefix in kohya]
    return _merged(candidates)


# diffusers' fused projections and the projections they concatenate, in row order (diffusers 0.42's
# AttentionModuleMixin.fuse_projections and Attention.fuse_projections, called by `fuse_qkv_projections`: `to_qkv` =
# cat(to_q, to_k, to_v), `to_kv` for cross-attention, `to_added_qkv` = cat(add_q_proj, add_k_proj, add_v_proj);
# WanAttention.fuse_projections also `to_added_kv` = cat(add_k_proj, add_v_proj)). SimpleTuner trains adapters there
# with `--fuse_qkv_projections`. diffusers keeps the unfused modules beside the fused one.
FUSED_PROJECTIONS = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "to_added_kv": ("add_k_proj", "add_v_proj"),
}


def fused_parts(name: str, key_map: dict) -> tuple[str, ...] | None:
    """The names of the projections a fused module name (`…attn.to_qkv`, `lycoris_…_attn_to_qkv`) concatenates by
    rows, when the map has every one of them and not the fused name itself (ComfyUI's own entries win); else None."""
    if name in key_map:
        return None
    for fused, parts in FUSED_PROJECTIONS.items():
        for separator in (".", "_"):
            if name.endswith(separator + fused):
                names = tuple(name[: -len(fused)] + part for part in parts)
                return names if all(n in key_map for n in names) else None
    return None


# Weights whose rows the writer's model may read in another order than ComfyUI's, under the same names and shapes,
# told apart only by how the writer saves its keys (Module.adapter_named). DiffSynth-Studio keeps PEFT's `.default.`
# (keys.ADAPTER_NAMED) and trains MiniMax H3 LoRAs on two models (diffsynth/configs/model_configs.py,
# "minimax_h3_dit"): MiniMaxH3DiT for the original MiniMax/MiniMax-H3 checkpoint (and its own NF4), whose
# MiniMaxH3Attention.forward reads qkv_proj's rows per head, view(total, heads, 3, head_dim)
# (diffsynth/models/minimax_h3_dit.py), and MiniMaxH3DiTComfy(Pruned) for Comfy-Org/MiniMax-H3's checkpoints, whose
# _comfy_attention_forward reads [q; k; v], view(total, 3, heads, head_dim) (diffsynth/models/minimax_h3_dit_comfy.py)
# as ComfyUI's Attention.forward does (comfy/ldm/minimax/model.py: split by heads·head_dim); its lora/*.sh examples
# train on both, with the same targets (attn.qkv_proj, attn.out_proj, mlp.fc1, mlp.fc2). Its saver
# (diffsynth/diffusion/logger.py ModelLogger.save_model) writes no metadata and no alpha: nothing in the file says
# which, so the module is refused unless the user says which checkpoint it was trained on (LyCORIS Convert's
# trained_on). (diffusers 0.42.1's _convert_non_diffusers_minimax_h3_lora_to_diffusers reads every such file per
# head.) Bare or `diffusion_model.` names without `.default.` (the turbo LoRAs, ai-toolkit) are ComfyUI's own rows.
TRAINED_ON_UNKNOWN = "not known (refuse what depends on it)"
TRAINED_ON_COMFY = "Comfy-Org's checkpoint (ComfyUI's rows)"
TRAINED_ON_ORIGINAL = "the original checkpoint (rows per head)"
TRAINED_ON = (TRAINED_ON_UNKNOWN, TRAINED_ON_COMFY, TRAINED_ON_ORIGINAL)
QKV_PROJ, Q_NORM = "qkv_proj.weight", "q_norm.weight"


def _per_head_runs(key: str, shapes: dict) -> tuple[tuple[int, int], ...] | None:
    """ComfyUI's rows of a [q; k; v] weight in the order a per-head reader holds them (q, k, v of head 0, then of
    head 1, ...): runs of head_dim rows, head_dim read off the layer's q_norm; None when the shapes do not fit."""
    head_dim = shapes.get(key[: -len(QKV_PROJ)] + Q_NORM, (0,))[0]
    rows = shapes[key][0]
    if not head_dim or rows % (3 * head_dim):
        return None
    inner = rows // 3
    return tuple((part * inner + head * head_dim, head_dim) for head in range(inner // head_dim) for part in range(3))


@dataclasses.dataclass(frozen=True)
class RowOrderQuestion:
    """Why such a module is refused while the checkpoint is not known, and the runs of ComfyUI's rows the original
    checkpoint's order is (a function of the weight key and the model's shapes)."""
    reason: str
    original_runs: Callable[[str, dict], tuple[tuple[int, int], ...] | None]


ROW_ORDER_UNKNOWN = {
    re.compile(r"diffusion_model\.(?:token_refiner\.)?blocks\.\d+\.attn\.qkv_proj\.weight"): RowOrderQuestion(
        "row order unknown: DiffSynth-Studio (PEFT's `.default.` in the keys) trains MiniMax H3 on the original "
        "checkpoint, whose qkv_proj rows go per head (q, k, v of each head together: "
        "diffsynth/models/minimax_h3_dit.py), and on Comfy-Org's, whose rows are ComfyUI's (all q, then all k, then "
        "all v: minimax_h3_dit_comfy.py), and the file does not say which (LyCORIS Convert's trained_on writes it "
        "out in ComfyUI's rows once you say)", _per_head_runs),
}


def row_order_target(patch_key: PatchKey, adapter_named: bool, trained_on: str, shapes: dict
                     ) -> tuple[PatchKey, str | None]:
    """(the key-map target of a module written this way, as the checkpoint it was trained on reads the rows, or why
    it cannot be placed): ROW_ORDER_UNKNOWN's modules go as they are for ComfyUI's rows, as a RowPieces entry for rows
    per head, and nowhere when that is not known. Only a whole weight: a row slice is one projection of diffusers'
    names (lightx2v's `to_q`), in ComfyUI's order."""
    if not adapter_named or not patch_key.is_whole:
        return patch_key, None
    key = patch_key.weight
    question = next((q for pattern, q in ROW_ORDER_UNKNOWN.items() if pattern.fullmatch(key)), None)
    if question is None or trained_on == TRAINED_ON_COMFY:
        return patch_key, None
    runs = question.original_runs(key, shapes) if trained_on == TRAINED_ON_ORIGINAL else None
    if runs is None:
        return patch_key, question.reason
    return PatchKey(key, convert=RowPieces(runs)), None


def extend(module, comfy_map: dict, is_clip: bool) -> dict:
    """ComfyUI's map plus the diffusers/PEFT names it lacks; ComfyUI's own entries are kept as they are."""
    extra = text_encoder_names(module, comfy_map) if is_clip else diffusion_model_names(module, comfy_map)
    return {**extra, **comfy_map}


# Per model object: its LoRA key map and weight shapes. Building them walks the whole state dict and, for UNets,
# ComfyUI's diffusers name table (~10 ms on SDXL, most of a bypass strength change). A loaded model never changes
# its layers, and clones share the model object, so a weak cache by identity is exact and dies with the model.
_key_maps: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_shapes: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def model_shapes(module) -> dict[str, tuple[int, ...]]:
    """Every state-dict key's shape as the model uses it: a GGUF layer's state_dict() gives meta tensors of its
    packed storage shape, so its weights' logical shapes are read off the weights themselves."""
    if module not in _shapes:
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        shapes.update({k: gguf.logical_shape(v) for k, v in module.named_parameters() if gguf.is_gguf_tensor(v)})
        _shapes[module] = shapes
    return _shapes[module]


def lora_key_map(module, is_clip: bool) -> dict:
    """ComfyUI's own map from file prefixes to this model's weight keys (model_lora_keys_unet / _clip), plus the
    diffusers/PEFT names it lacks (derived from ComfyUI's own converters, above)."""
    if module not in _key_maps:
        _key_maps[module] = extend(module, COMFY_BUILDERS[is_clip](module, {}), is_clip)
    return _key_maps[module]
