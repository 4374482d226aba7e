"""The algorithm registry, in the reference's detection order (lycoris.modules.get_module): first match wins.

A module's weight is patched by the first algorithm in WEIGHT_ALGORITHMS whose marker key it has; its bias by every
algorithm in BIAS_ALGORITHMS whose marker it has (PEFT's (IA)³ has both: `ia3_l` also scales a normal layer's bias;
LightX2V's `diff_m` patches a Wan block's `modulation` the same way).
PEFT's own OFT, BOFT and (IA)³ come last: their markers (`oft_R`, `boft_R`, `ia3_l`) are PEFT's names, which no
LyCORIS file uses; then PEFT's LoRA and OFT on an nn.Embedding (`lora_embedding_A/B`, `oft_embedding_R`), names of
their own.
"""

import re
from typing import Any

import torch

from . import (
    boft,
    comfy_oft,
    full,
    glora,
    ia3,
    kohya_oft,
    locon,
    loha,
    lokr,
    oft,
    peft_boft,
    peft_embedding,
    peft_ia3,
    peft_lora_bias,
    peft_oft,
)
from .base import Algorithm, Layout, ShapeError, Tensors

WEIGHT_ALGORITHMS: tuple[Algorithm, ...] = (
    locon.ALGORITHM,
    loha.ALGORITHM,
    ia3.ALGORITHM,
    lokr.ALGORITHM,
    full.FULL,
    full.NORM,
    kohya_oft.ALGORITHM,  # its own marker (keys.py), before LyCORIS' diag-OFT all the same
    comfy_oft.ALGORITHM,  # diag-OFT's keys under ComfyUI's `diffusion_model.` names: ComfyUI's constraint
    oft.ALGORITHM,
    boft.ALGORITHM,
    glora.ALGORITHM,
    oft.OLD_ALGORITHM,
    peft_oft.ALGORITHM,
    peft_oft.OLD_ALGORITHM,  # refused with its reason when the file is loaded
    peft_boft.ALGORITHM,
    peft_ia3.ALGORITHM,
    peft_embedding.LORA,  # PEFT's adapters on an nn.Embedding: their own key names
    peft_embedding.OFT,
)
# Parts that patch another parameter than the weight (`param`): the bias, LightX2V's Wan `modulation`
BIAS_ALGORITHMS: tuple[Algorithm, ...] = (full.FULL_BIAS, full.NORM_BIAS, peft_lora_bias.ALGORITHM,
                                          peft_ia3.BIAS_ALGORITHM, full.MODULATION)
BY_NAME: dict[str, Algorithm] = {a.name: a for a in WEIGHT_ALGORITHMS + BIAS_ALGORITHMS}
# Keys an algorithm reads into its layout and never again: the patch does not need them.
LAYOUT_ONLY_KEYS: frozenset[str] = frozenset({lokr.ROW_OFFSET, *peft_oft.OPTION_KEYS, *peft_ia3.OPTION_KEYS})


def is_peft_feedforward(feedforward_modules: Any, module_name: str) -> bool:
    """PEFT's IA3 rule: a string is a regular expression the whole name must match; a list, name endings."""
    if isinstance(feedforward_modules, str):
        return re.fullmatch(feedforward_modules, module_name) is not None
    return any(module_name.endswith(ending) for ending in feedforward_modules or ())


def written_before_0_18(peft_version: Any) -> bool:
    """PEFT's own test (OFTConfig.check_kwargs): a config without `peft_version` (stored since 0.18), or an older
    one, was written by PEFT < 0.18. "0.18.0.dev0"-style builds count as 0.18."""
    numbers = re.findall(r"\d+", str(peft_version or "0").partition("@")[0])[:2]
    return tuple(int(n) for n in numbers) < (0, 18)


def option_entries(algorithm: Algorithm, options: dict[str, Any], module_name: str) -> Tensors:
    """The `peft_option.<name>` scalar entries an algorithm reads, from a module's raw PEFT options
    (peft_config.module_options) and its name in the model PEFT wrapped (for IA3's `feedforward_modules`). Added to
    the module's key group before build_modules; options the config does not give are left out (the algorithm then
    takes PEFT's default and lists it in its layout's `assumed`)."""
    values = dict(options)
    if algorithm is peft_ia3.ALGORITHM and "feedforward_modules" in options:
        values[peft_ia3.FEEDFORWARD] = is_peft_feedforward(options["feedforward_modules"], module_name)
    if peft_oft.OPTION_PREFIX + peft_oft.SERIES_BEFORE_0_18 in algorithm.keys and options:  # PEFT's OFTs
        values[peft_oft.SERIES_BEFORE_0_18] = written_before_0_18(options.get("peft_version"))
    entries = {}
    for key in algorithm.keys:
        name = key.removeprefix(peft_oft.OPTION_PREFIX)
        if key.startswith(peft_oft.OPTION_PREFIX) and values.get(name) is not None:
            entries[key] = torch.tensor(float(values[name]), dtype=torch.float64)
    return entries

__all__ = ["BIAS_ALGORITHMS", "BY_NAME", "LAYOUT_ONLY_KEYS", "WEIGHT_ALGORITHMS", "Algorithm", "Layout", "ShapeError",
           "Tensors", "option_entries"]
