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

import functools
import json
import re
import weakref
from pathlib import Path

import comfy.lora
import comfy.utils
import torch

from . import gguf

# ComfyUI's own key-map builders, as they were when the pack was imported: everywhere.py wraps the module's
# attributes later, and its wrappers call into this module (through lora_key_map, at the end of this module) for the extra names.
COMFY_BUILDERS = {False: comfy.lora.model_lora_keys_unet, True: comfy.lora.model_lora_keys_clip}

UNET_PREFIXES = ("", "unet.", "base_model.model.", "unet.base_model.model.")
DIT_PREFIXES = ("", "transformer.", "base_model.model.")
# diffusers paths with dots as underscores after a prefix: the LyCORIS wrapper's `lycoris_` (SimpleTuner's
# lora_type=lycoris, as ComfyUI's own map writes it for Flux/SD3) and OneTrainer's legacy `lora_transformer_`.
DIT_UNDERSCORED_PREFIXES = ("lycoris_", "lora_transformer_")
# musubi-tuner names a module `lora_unet_` + its path in musubi's own port of the model, dots as underscores
# (kohya-ss/musubi-tuner src/musubi_tuner/networks/lora.py LoRANetwork, lora_zimage.py): HunyuanVideo's ports keep
# Tencent's names and Z-Image's split q/k/v, which are the paths ComfyUI's own map lists under `transformer.`
# (its diffusion-pipe and z_image_to_diffusers entries); ComfyUI's `lora_unet_` entries use its own paths.
MUSUBI = "lora_unet_"
DIFFUSION_MODEL = "diffusion_model."
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


@functools.cache
def _converter_rules() -> dict[tuple[str, str], list[tuple[re.Pattern, str, tuple | None]]]:
    """(image_model, how files name the modules) -> (ComfyUI path pattern, converted path template, rows as (start,
    count, of) or None). A rule for one block's exact path (Mochi's last block) comes first and stands for that
    block alone."""
    table = json.loads(DIFFUSERS_NAMES.read_text(encoding="utf-8"))["architectures"]
    rules: dict[tuple[str, str], list] = {}
    for arch in table.values():
        for rule in arch["rules"]:
            pattern = re.compile(BLOCK_INDEX.sub(r"(\\d+)", re.escape(rule["comfy"] + WEIGHT)))
            rows = tuple(rule["rows"]) if rule["rows"] else None
            rules.setdefault((arch["image_model"], arch["names"]), []).append((pattern, rule["diffusers"], rows))
    return {key: sorted(found, key=lambda rule: rule[0].groups > 0) for key, found in rules.items()}


def converted_module_paths(model, names: str = "diffusers") -> list[tuple[str, object]]:
    """Converted module path -> ComfyUI weight key (or (key, rows) for a part of a fused weight), by the rules
    the converters give for this architecture ([] for one they were not run on): diffusers' paths, or with
    names="bare" the paths DiffSynth-Studio's own models use."""
    config = getattr(getattr(model, "model_config", None), "unet_config", None) or {}
    rules = _converter_rules().get((config.get("image_model"), names), ())
    if not rules:
        return []
    paths = []
    for key, tensor in model.state_dict().items():
        if not (key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)):
            continue
        exact = False
        for pattern, template, rows in rules:
            match = pattern.fullmatch(key, len(DIFFUSION_MODEL))
            if match is None or (exact and pattern.groups):
                continue
            exact = exact or not pattern.groups
            target = key
            if rows is not None:
                start, count, whole = rows
                total = (gguf.logical_shape(tensor) if gguf.is_gguf_tensor(tensor) else tensor.shape)[0]
                if total % whole:
                    continue  # rows that do not divide as the converter splits them: not this layout
                target = (key, (0, start * total // whole, count * total // whole))
            paths.append((template.format(*match.groups()), target))
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


def _row_slices(comfy_map: dict) -> dict[str, set[tuple[int, int, int]]]:
    """fused weight key -> the output-row slices ComfyUI's map gives parts of it (Flux's to_q/to_k/to_v in qkv)."""
    slices: dict[str, set] = {}
    for target in comfy_map.values():
        if isinstance(target, tuple) and len(target) == 2 and target[1] is not None and target[1][0] == 0:
            slices.setdefault(target[0], set()).add(tuple(target[1]))
    return slices


def fused_part_names(comfy_map: dict) -> list[tuple[str, object]]:
    """`<fused weight's module>.<i>` -> its i-th part, as OneTrainer's OMI format names the parts of a fused weight
    (`double_blocks.0.img_attn.qkv.0` is to_q). The parts are the finest tiling of the rows by ComfyUI's own slices:
    from row 0, each part is the shortest slice starting where the previous one ended (so linear1's q, k, v, mlp,
    not its q+k+v slice)."""
    names = []
    for key, slices in _row_slices(comfy_map).items():
        start, index = 0, 0
        while parts := [s for s in slices if s[1] == start]:
            part = min(parts, key=lambda s: s[2])
            names.append((f"{key[: -len(WEIGHT)]}.{index}", (key, part)))
            start, index = start + part[2], index + 1
    return names


def diffusion_model_names(model, comfy_map: dict) -> dict:
    """Every prefixed diffusers/PEFT name of this diffusion model that ComfyUI's map lacks, and the indexed names
    of the parts of its fused weights."""
    unet = unet_module_paths(model)
    candidates = [(prefix + path, key) for path, key in unet.items() for prefix in UNET_PREFIXES]
    if not unet:
        listed = dit_module_paths(comfy_map)
        paths = listed + converted_module_paths(model)
        candidates += [(prefix + path, target) for path, target in paths for prefix in DIT_PREFIXES]
        candidates += [(prefix + path.replace(".", "_"), target) for path, target in paths
                       for prefix in DIT_UNDERSCORED_PREFIXES]
        candidates += [(MUSUBI + path.replace(".", "_"), target) for path, target in listed]
        # DiffSynth-Studio saves PEFT's state dict of its own model with no prefix: its paths are the original
        # model's (Wan: `blocks.0.self_attn.q`, ComfyUI's paths without `diffusion_model.`) or its own (Flux).
        candidates += [(key[len(DIFFUSION_MODEL): -len(WEIGHT)], key) for key in model.state_dict()
                       if key.startswith(DIFFUSION_MODEL) and key.endswith(WEIGHT)]
        candidates += converted_module_paths(model, names="bare")
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
        if not isinstance(name, str) or not isinstance(target, str) or target not in weight_keys:
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
    there is one."""
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
    return _merged(candidates)


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
