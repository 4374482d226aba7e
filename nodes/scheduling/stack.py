"""Stacks: several files in one node, as the de-facto LORA_STACK type other packs pass around (glue/lora_stack.py).

Files apply in stack order, which matters for GLoRA (its change depends on the weight as it stands).
"""

import folder_paths
from comfy_api.latest import io

from ...lycoris_core import LycorisError
from ...lycoris_core.block_weights import parse
from ..glue.apply import apply_file, is_off
from ..glue.cache import load_cached
from ..glue.inputs import (
    CATEGORY,
    DEFAULT_APPLY_MODE,
    apply_mode_input,
    clip_input,
    file_stamp,
    fingerprint_by_links,
    lycoris_path,
    mode_input,
    model_clip_outputs,
    model_input,
    node_key,
    remember_linked,
)
from ..glue.lora_stack import LoraStack, StackRow, read_item

STACK_TOOLTIP = (
    "One file per line: 'name | strength_model | strength_clip | block weights'. Strengths default to 1 (clip to the "
    "model strength); block weights are optional (see LyCORIS Loader (Block Weights)). A line starting with '#' is "
    "off. Files apply top to bottom."
)


def _float(text: str, default: float, line: str) -> float:
    try:
        return float(text) if text.strip() else default
    except ValueError:
        raise LycorisError(f"'{text.strip()}' is not a strength in stack line '{line}'") from None


def parse_rows(text: str) -> list[StackRow]:
    rows = []
    known = set(folder_paths.get_filename_list("loras"))
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        name, *rest = (part.strip() for part in line.split("|"))
        if name not in known:
            raise LycorisError(f"'{name}' is not a file in the loras folders (stack line '{line}')")
        strength_model = _float(rest[0], 1.0, line) if rest else 1.0
        strength_clip = _float(rest[1], strength_model, line) if len(rest) > 1 else strength_model
        block_weights = rest[2] if len(rest) > 2 else ""
        parse(block_weights)  # refuse bad block weights now, not when the stack is applied
        rows.append(StackRow(name, strength_model, strength_clip, block_weights))
    return rows


def fingerprint_by_stack(cls, stack="", **_inputs) -> str:
    """`fingerprint_by_file` for every file the stack names (see loaders.py)."""
    return "\n".join(file_stamp(line.split("|")[0].strip()) for line in str(stack).splitlines() if line.strip())


class LycorisStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisStack",
            display_name="LyCORIS Stack",
            category=CATEGORY,
            description="Several LyCORIS/LoRA files, each with its strengths and optional block weights, as a "
                        "LORA_STACK that LyCORIS Apply Stack (or other packs' stack appliers) apply in order.",
            inputs=[
                io.String.Input("stack", multiline=True, default="", tooltip=STACK_TOOLTIP),
                LoraStack.Input("lora_stack", optional=True,
                                tooltip="A stack to extend; its files come first."),
            ],
            outputs=[LoraStack.Output(display_name="LORA_STACK", tooltip="The stack: incoming rows, then these.")],
        )

    fingerprint_inputs = classmethod(fingerprint_by_stack)

    @classmethod
    def execute(cls, stack, lora_stack=None):
        return io.NodeOutput([*(lora_stack or []), *parse_rows(stack)])


class LycorisApplyStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisApplyStack",
            display_name="LyCORIS Apply Stack",
            category=CATEGORY,
            description="Applies a LORA_STACK to the model and clip, in stack order, exactly as chained LyCORIS "
                        "Loaders would.",
            inputs=[
                model_input(),
                clip_input(optional=True),
                LoraStack.Input("lora_stack", tooltip="Rows of (file, strength_model, strength_clip)."),
                mode_input(),
                apply_mode_input(),
            ],
            outputs=model_clip_outputs(),
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_by_links)

    @classmethod
    def execute(cls, model, lora_stack, clip=None, strength_mode="linear", apply_mode=DEFAULT_APPLY_MODE):
        reference = strength_mode == "lycoris"
        node = node_key(cls)
        lines = []
        rows = [read_item(row, i) for i, row in enumerate(lora_stack, start=1)]  # all checked before any applies
        remember_linked(row[0] for row in rows)
        for i, (name, strength_model, strength_clip) in enumerate(rows):
            if is_off(strength_model, reference) and is_off(strength_clip, reference):
                continue
            weights = parse(rows[i].block_weights)
            model, clip, report = apply_file(load_cached(lycoris_path(name)), model, clip, strength_model,
                                             strength_clip, reference, weights, apply_mode,
                                             None if node is None else f"{node}:{i}")
            lines.append(report.line())
        return io.NodeOutput(model, clip, ui={"text": lines})


NODES: list[type[io.ComfyNode]] = [LycorisStack, LycorisApplyStack]
