"""Block weights: the loader with a per-block multiplier written by name (the blocks a file touches: LyCORIS Block
Info, inspection/block_info.py)."""

from comfy_api.latest import io

from ...lycoris_core.block_weights import parse
from ..glue.inputs import (
    CATEGORY,
    DEFAULT_APPLY_MODE,
    apply_mode_input,
    block_weights_input,
    clip_input,
    fingerprint_by_file,
    lycoris_input,
    mode_input,
    model_clip_outputs,
    model_input,
    node_key,
    strength_input,
)
from ..glue.lora_files import validate_name
from .loaders import load_and_apply
from .presets import CUSTOM, block_weight_text, preset_names


def preset_input() -> io.Combo.Input:
    return io.Combo.Input("preset", options=preset_names(), default=CUSTOM, optional=True,
                          tooltip="A named set of block weights; block_weights rules are applied after it (so they "
                                  "refine it). 'custom' uses block_weights alone.")


class LycorisBlockWeights(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisBlockWeights",
            display_name="LyCORIS Loader (Block Weights)",
            category=CATEGORY,
            description=(
                "The LyCORIS Loader with a strength multiplier per block of the model, written by block name (any "
                "architecture) or as an A1111/Inspire LBW vector. Applied per weight through ComfyUI's patch "
                "strengths, so it is exact for every algorithm."
            ),
            inputs=[
                model_input(),
                clip_input(),
                lycoris_input(),
                strength_input("strength_model", "diffusion model"),
                strength_input("strength_clip", "text encoder"),
                block_weights_input(),
                preset_input(),
                mode_input(),
                apply_mode_input(),
            ],
            outputs=model_clip_outputs(),
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, model, clip, lycoris_name, strength_model, strength_clip, block_weights, preset=CUSTOM,
                strength_mode="linear", apply_mode=DEFAULT_APPLY_MODE):
        weights = parse(block_weight_text(preset, block_weights))
        new_model, new_clip, ui = load_and_apply(model, clip, lycoris_name, strength_model, strength_clip,
                                                 strength_mode, weights, apply_mode, node_key(cls))
        return io.NodeOutput(new_model, new_clip, ui=ui)


NODES: list[type[io.ComfyNode]] = [LycorisBlockWeights]
