"""LORA_STACK, the de-facto type other packs pass files around in (Efficiency, Comfyroll, LoRA Manager): a list of
(name, strength_model, strength_clip) tuples. Our rows are tuples of the same three items, so those packs read them
unchanged; block weights ride along as an attribute."""

from comfy_api.latest import io

LoraStack = io.Custom("LORA_STACK")


class StackRow(tuple):
    """(name, strength_model, strength_clip), plus our optional block weights text."""

    block_weights: str = ""

    def __new__(cls, name: str, strength_model: float, strength_clip: float, block_weights: str = ""):
        row = super().__new__(cls, (name, strength_model, strength_clip))
        row.block_weights = block_weights
        return row
