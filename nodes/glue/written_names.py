"""The names a written file gives each weight of the model, read off the model's LoRA key map (apply.lora_key_map:
every name a loader accepts -> the weight, or the rows of a fused weight, it changes).

kohya/LyCORIS (`file_names`): what every LoRA tool and ComfyUI's core loader read. diffusers (`diffusers_names`,
`part_names`): what diffusers' save_lora_weights writes, including the separate layers diffusers keeps for the row
parts of a weight ComfyUI fuses. Save, Extract and Convert write these names; they are ComfyUI's key maps read
through PatchKey, so they live here and not in lycoris_core.
"""

from collections.abc import Mapping
from typing import NamedTuple

from ...lycoris_core.tools.convert import component_path
from .keymap import PEFT_WRAPPER
from .patch_key import PatchKey

# The name styles a written module may take, most widely read first: kohya's (every LoRA tool and ComfyUI's core
# loader), then ComfyUI's generic names (every weight of every model, any loader built on ComfyUI's key maps).
# SD1.x's single text encoder is `lora_te_` for kohya's scripts and A1111 (`lora_te1_` is SDXL's first encoder; SDXL's
# key map has no `lora_te_` names, so it keeps te1/te2).
NAME_PREFERENCE = ("lora_unet_", "lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_prior_unet_",
                   "diffusion_model.", "text_encoders.")

# ComfyUI's Flux name table (comfy.utils.flux_to_diffusers) lists, from 0.33 on, Flux 2's single-block names
# beside Flux 1's for the same weights (marked "# Flux 2" there): linear1 whole as `attn.to_qkv_mlp_proj` (Flux 1:
# to_q/to_k/to_v/proj_mlp row parts), linear2 as `attn.to_out` (Flux 1: `proj_out`). Which ones diffusers' model
# has depends on the model, so the names of the other generation are left out.
FLUX2_SINGLE_BLOCK = (".attn.to_qkv_mlp_proj", ".attn.to_out")


class RowPart(NamedTuple):
    """Rows start..start+length of a fused weight, written as the diffusers layer `name`."""

    start: int
    length: int
    name: str


def file_names(key_map: Mapping) -> dict[str, str]:
    """ComfyUI weight key -> the kohya-style module name a file written for it uses. Only names that map a whole
    weight (no offset into a fused one) qualify; among those, NAME_PREFERENCE decides, then the shortest name."""
    def rank(name: str) -> tuple[int, int]:
        style = next((i for i, p in enumerate(NAME_PREFERENCE) if name.startswith(p)), len(NAME_PREFERENCE))
        return style, len(name)

    names: dict[str, str] = {}
    for name, target in key_map.items():
        key = PatchKey.from_comfy(target)
        if not isinstance(name, str) or not key.is_whole:
            continue
        current = names.get(key.weight)
        if current is None or rank(name) < rank(current):
            names[key.weight] = name
    return names


def _diffusers_rank(name: str) -> int:
    # CLIP's `text_model.` form first: what transformers 4 wrote, and diffusers reads it with transformers 5 too
    # (lora_base._load_lora_into_text_encoder strips it when the model has no `text_model`). Otherwise the first
    # name the key map lists wins: ComfyUI's tables give a layer's diffusers name first and other trainers'
    # aliases for it after (Flux's `ff.net.0.proj`, then `ff.linear_in`).
    return 0 if ".text_model." in name else 1


def _plain_diffusers_name(name) -> bool:
    """A component's plain module path: no PEFT wrapper, not ComfyUI's old `.processor.` attention names."""
    if not isinstance(name, str) or ".processor." in name:
        return False
    found = component_path(name)
    return found is not None and not found[1].startswith(PEFT_WRAPPER)


def diffusers_names(key_map: Mapping) -> dict[str, str]:
    """ComfyUI weight key -> the name diffusers' save_lora_weights writes for it (`unet.…`, `transformer.…`,
    `text_encoder[_N].…`): among the plain diffusers names the key map gives the whole weight, the first listed."""
    names: dict[str, str] = {}
    for name, target in key_map.items():
        key = PatchKey.from_comfy(target)
        if not _plain_diffusers_name(name) or not key.is_whole:
            continue
        current = names.get(key.weight)
        if current is None or _diffusers_rank(name) < _diffusers_rank(current):
            names[key.weight] = name
    return names


def for_flux_generation(key_map: Mapping, flux2: bool) -> dict:
    """The key map without the single-block names of the other Flux generation (a no-op for other models)."""
    def keep(name) -> bool:
        if not isinstance(name, str) or "single_transformer_blocks." not in name:
            return True
        return name.endswith(FLUX2_SINGLE_BLOCK) == flux2
    return {name: target for name, target in key_map.items() if keep(name)}


def part_names(key_map: Mapping) -> dict[str, list[RowPart]]:
    """Fused ComfyUI weight key -> the RowParts tiling its rows, for weights diffusers keeps as separate layers
    (Flux's qkv as to_q/to_k/to_v, linear1 as those and proj_mlp): from row 0, each part is the shortest named slice
    starting where the previous one ended (the caller checks they reach the last row)."""
    slices: dict[str, dict[tuple[int, int], str]] = {}
    for name, target in key_map.items():
        if not _plain_diffusers_name(name):
            continue
        key = PatchKey.from_comfy(target)
        if key.offset is None or key.offset.dim != 0 or key.is_converted:
            continue
        span = (key.offset.start, key.offset.length)
        current = slices.setdefault(key.weight, {}).get(span)
        if current is None or _diffusers_rank(name) < _diffusers_rank(current):
            slices[key.weight][span] = name
    tilings = {}
    for weight, named in slices.items():
        start, parts = 0, []
        while candidates := [span for span in named if span[0] == start]:
            span = min(candidates, key=lambda s: s[1])
            parts.append(RowPart(span[0], span[1], named[span]))
            start += span[1]
        tilings[weight] = parts
    return {weight: parts for weight, parts in tilings.items() if parts}
