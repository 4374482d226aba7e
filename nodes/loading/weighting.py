"""Block weights: the loader with a per-block multiplier written by name, and the list of blocks a file touches."""

from comfy_api.latest import io

from ...lycoris_core.block_weights import parse
from ..glue.apply import map_file
from ..glue.cache import load_cached
from ..glue.inputs import (
    BLOCK_WEIGHTS_TOOLTIP,
    CATEGORY,
    DEFAULT_APPLY_MODE,
    apply_mode_input,
    block_weights_input,
    clip_input,
    fingerprint_by_file,
    lycoris_input,
    lycoris_path,
    mode_input,
    model_clip_outputs,
    model_input,
    node_key,
    strength_input,
)
from ..glue.lora_files import validate_name
from ..glue.report import block_changes, patchers_of, payload
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


class LycorisBlockInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisBlockInfo",
            display_name="LyCORIS Block Info",
            category=CATEGORY,
            description="Lists the blocks of this model that a file touches, with module counts and the relative "
                        "change |dW|/|W| of each at the given strength and block weights: the names to use in "
                        "block weights.",
            is_output_node=True,
            inputs=[
                lycoris_input(),
                io.Model.Input("model", tooltip="The diffusion model whose blocks are listed."),
                io.Clip.Input("clip", optional=True, tooltip="The text encoder whose layers are listed too."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01, optional=True,
                               tooltip="The strength at which the change is measured."),
                io.String.Input("block_weights", multiline=True, default="default=1", optional=True,
                                tooltip=BLOCK_WEIGHTS_TOOLTIP),
            ],
            outputs=[io.String.Output(display_name="blocks",
                                      tooltip="One line per block: name, modules, change at this strength.")],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, lycoris_name, model, clip=None, strength=1.0, block_weights="default=1"):
        path = lycoris_path(lycoris_name)
        _patches, report = map_file(load_cached(path), model, clip, reference=False)
        blocks = block_changes(report, patchers_of(model, clip), {"model": strength, "clip": strength},
                               parse(block_weights))
        lines = [f"{b['name']}: {b['modules']} modules, change {b['change']:.4f}" for b in blocks]
        return io.NodeOutput("\n".join(lines), ui={"lycoris": [payload(path, report, blocks)]})


NODES: list[type[io.ComfyNode]] = [LycorisBlockWeights, LycorisBlockInfo]
