"""Key names: which suffixes we know, the aliases other trainers use for them, and how keys group into modules.

A key is `<module prefix><separator><suffix>`. LyCORIS/kohya prefixes have no dots (`lora_unet_…_to_q.lora_up.weight`),
diffusers/PEFT ones do (`transformer.blocks.0.attn.to_q.lora_B.weight`), so a key is split at the longest known
suffix rather than at a dot.
"""

from collections.abc import Callable

from .algos import BIAS_ALGORITHMS, WEIGHT_ALGORITHMS
from .algos.kohya_oft import BLOCKS as KOHYA_OFT_BLOCKS

ALPHA, DORA_SCALE = "alpha", "dora_scale"
# PEFT's DoRA magnitude is kept under its own name until the module is built: it is per output channel in every layout
# ((out,) for Linear, (1, out, 1, 1) for conv), where LyCORIS' dora_scale of shape (1, in, 1, 1) is per input channel.
PEFT_MAGNITUDE = "lora_magnitude_vector"

# Other writers' names for LoRA factors and DoRA magnitudes -> our canonical suffix.
ALIASES: dict[str, str] = {
    "lora_B.weight": "lora_up.weight",
    "lora_A.weight": "lora_down.weight",
    "lora.up.weight": "lora_up.weight",
    "lora.down.weight": "lora_down.weight",
    "lora_linear_layer.up.weight": "lora_up.weight",
    "lora_linear_layer.down.weight": "lora_down.weight",
    "lora_B.default.weight": "lora_up.weight",
    "lora_A.default.weight": "lora_down.weight",
    "lora_B": "lora_up.weight",
    "lora_A": "lora_down.weight",
    # ai-toolkit's DoRAModule (toolkit/models/DoRA.py): the row norms of W + ΔW, per output as PEFT's magnitude
    "magnitude": PEFT_MAGNITUDE,
}
# PEFT's adapter name kept in a key (`<module>.lora_A.default.weight`): a PeftModel's own state dict, as
# DiffSynth-Studio saves it (diffsynth/diffusion/training_module.py `mapping_lora_state_dict`), where PEFT's
# get_peft_model_state_dict drops the name. Recorded per module (Module.adapter_named): it tells some writers apart.
ADAPTER_NAMED: tuple[str, ...] = tuple("." + alias for alias in ALIASES if ".default." in alias)
# canonical suffix -> its name with PEFT's adapter name: how a tool rewriting such a module keeps the mark
WITH_ADAPTER_NAME: dict[str, str] = {canonical: alias for alias, canonical in ALIASES.items() if ".default." in alias}
# diffusers' attention-processor LoRA joins the suffix with "_" instead of ".": `to_q_lora.up.weight`.
UNDERSCORE_ALIASES: dict[str, str] = {
    "lora.up.weight": "lora_up.weight",
    "lora.down.weight": "lora_down.weight",
}


def _canonical_suffixes() -> set[str]:
    names = {ALPHA, DORA_SCALE, PEFT_MAGNITUDE}
    for algorithm in WEIGHT_ALGORITHMS + BIAS_ALGORITHMS:
        names.update(algorithm.keys)
        names.update(algorithm.markers)
    return names


# (separator + suffix as written, canonical suffix), longest first so `lora_up.weight` wins over `weight`.
_SPLITS: tuple[tuple[str, str], ...] = tuple(sorted(
    [("." + s, s) for s in _canonical_suffixes()]
    + [("." + alias, canonical) for alias, canonical in ALIASES.items()]
    + [("_" + alias, canonical) for alias, canonical in UNDERSCORE_ALIASES.items()],
    key=lambda pair: -len(pair[0]),
))


# kohya sd-scripts' OFT (networks/oft.py) names its U-Net modules `oft_unet_…` where its LoRA writes `lora_unet_…`, and
# defines its blocks its own way: the prefix is read as the LoRA one (which ComfyUI's key maps know), the blocks as
# kohya's (algos/kohya_oft.py) rather than LyCORIS' diag-OFT.
PREFIX_RENAMES: dict[str, tuple[str, dict[str, str]]] = {
    "oft_unet_": ("lora_unet_", {"oft_blocks": KOHYA_OFT_BLOCKS}),
}

# OneTrainer's OMI format (`enable_omi_format`; Nerogar/OneTrainer modules/util/convert/lora/convert_*_lora.py key sets,
# applied by convert_to_omi) names each module by its path in the original checkpoint (the paths ComfyUI's models
# use) under one prefix per component. Those paths are what ComfyUI's own generic key-map entries list, under
# `diffusion_model.` and `text_encoders.<encoder>.transformer.`, so the prefix is all that needs reading differently.
# `unet.` and `transformer.` are diffusers' prefixes too: the original layout's top-level modules tell OMI names apart.
OMI_DIFFUSION_MODEL_TOPS = {
    "unet.": ("input_blocks.", "middle_block.", "output_blocks.", "time_embed.", "label_emb.", "out."),  # SD1.5/SDXL
    "transformer.": ("double_blocks.", "single_blocks.", "img_in", "txt_in", "time_in.", "vector_in.",  # Flux
                     "guidance_in.", "final_layer."),
}
OMI_TEXT_ENCODERS = {  # OMI component -> ComfyUI's encoder, and the encoder's top-level modules as OMI writes them
    "clip_l.": ("clip_l", ("text_model.", "text_projection")),
    "clip_g.": ("clip_g", ("text_model.", "text_projection")),
    "t5.": ("t5xxl", ("encoder.",)),
}
OMI_PREFIXES: tuple[str, ...] = (
    tuple(component + top for component, tops in OMI_DIFFUSION_MODEL_TOPS.items() for top in tops)
    + tuple(component + top for component, (_encoder, tops) in OMI_TEXT_ENCODERS.items() for top in tops))
PREFIX_RENAMES.update({component + top: ("diffusion_model." + top, {})
                       for component, tops in OMI_DIFFUSION_MODEL_TOPS.items() for top in tops})
PREFIX_RENAMES.update({component + top: (f"text_encoders.{encoder}.transformer.{top}", {})
                       for component, (encoder, tops) in OMI_TEXT_ENCODERS.items() for top in tops})


def _renamed(prefix: str, suffix: str) -> tuple[str, str]:
    for written, (read_as, suffixes) in PREFIX_RENAMES.items():
        if prefix.startswith(written):
            return read_as + prefix[len(written):], suffixes.get(suffix, suffix)
    return prefix, suffix


def split_key(key: str, renamed: bool = True) -> tuple[str, str] | None:
    """(module prefix, canonical suffix), or None when the key ends in no suffix we know. `renamed=False` keeps the
    prefix as written (a diffusers file whose `transformer.` holds a module named like an OMI top, below)."""
    for written, canonical in _SPLITS:
        if key.endswith(written) and len(key) > len(written):
            prefix = key[: -len(written)]
            return _renamed(prefix, canonical) if renamed else (prefix, canonical)
    return None


def read_as_written(keys) -> Callable[[str], bool]:
    """Whether a key of this file keeps its prefix as written: it is under an OMI diffusion-model component
    (`unet.`, `transformer.`) that the file does not use as OMI does, with every key under it starting with one of
    the original layout's top-level modules. Ideogram 4's diffusers names have a `transformer.final_layer` beside
    `transformer.layers.…`: read as OMI, the module would lose the name its PEFT config (alpha) is keyed by."""
    keys = list(keys)
    plain = tuple(component for component, tops in OMI_DIFFUSION_MODEL_TOPS.items()
                  if not all(key[len(component):].startswith(tops) for key in keys if key.startswith(component)))
    return lambda key: key.startswith(plain)
