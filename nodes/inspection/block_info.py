"""LyCORIS Block Info: the blocks of a model a file touches, with the change of each: the names block weights use."""

from comfy_api.latest import io

from ...lycoris_core.block_weights import parse
from ..glue.apply import map_file
from ..glue.cache import load_cached
from ..glue.inputs import BLOCK_WEIGHTS_TOOLTIP, CATEGORY, fingerprint_by_file, lycoris_input, lycoris_path
from ..glue.lora_files import validate_name
from ..glue.report import block_changes, patchers_of, payload


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
