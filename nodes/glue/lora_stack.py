"""LORA_STACK, the de-facto type other packs pass files around in (Efficiency, Comfyroll, LoRA Manager): a list of
(name, strength_model, strength_clip) tuples. Our rows are tuples of the same three items, so those packs read them
unchanged; block weights ride along as an attribute."""

import math

from comfy_api.latest import io

from ...lycoris_core import LycorisError

LoraStack = io.Custom("LORA_STACK")


class StackRow(tuple):
    """(name, strength_model, strength_clip), plus our optional block weights text."""

    block_weights: str = ""

    def __new__(cls, name: str, strength_model: float, strength_clip: float, block_weights: str = ""):
        row = super().__new__(cls, (name, strength_model, strength_clip))
        row.block_weights = block_weights
        return row


def read_item(item, number: int) -> StackRow:
    """A LORA_STACK item as a StackRow, checked: other packs' stacks come from code we do not control, and an item
    that is not (file, strength_model, strength_clip) or has a non-finite strength is refused naming it (from 1)."""
    try:
        name, strength_model, strength_clip = str(item[0]), float(item[1]), float(item[2])
    except (TypeError, ValueError, IndexError, KeyError):
        raise LycorisError(f"lora_stack item {number} is {str(item)[:80]}, not (file, strength_model, "
                           "strength_clip)") from None
    if not (math.isfinite(strength_model) and math.isfinite(strength_clip)):
        raise LycorisError(f"lora_stack item {number} ({name}): its strengths must be finite numbers")
    return StackRow(name, strength_model, strength_clip, getattr(item, "block_weights", "") or "")
