"""What a file did to this model, for the UI: per-block relative change and the JSON payload the panel draws."""

import math
from collections import defaultdict

import torch

from ..lycoris_core import LycorisError, change_norms
from ..lycoris_core.block_weights import BlockWeights
from ..lycoris_core.blocks import block_of
from ..lycoris_core.summary import summarize
from .apply import Applied, ApplyReport, model_shapes
from .patched import base_weight, unpatched_weight

# Measuring the change costs about one patch pass over the touched weights; above this many weight elements the
# loaders leave it to the LyCORIS Info node so a strength change stays quick.
LOADER_MEASURE_BUDGET = 150_000_000


def _weight_fp32(patcher, applied: Applied) -> torch.Tensor:
    """The unpatched target weight as ComfyUI would patch it (patched.base_weight, on the weight's own device),
    narrowed to the module's slice."""
    key = applied.target.key
    temp = base_weight(patcher, key, unpatched_weight(patcher, key).device)
    if applied.target.offset is not None:
        temp = temp.narrow(*applied.target.offset)
    return temp


def is_dynamic(patcher) -> bool:
    """ComfyUI's dynamic VRAM loading (0.33+): the weights stay on the offload device or in the file's mmap."""
    dynamic = getattr(patcher, "is_dynamic", None)  # 0.3.75 has no dynamic loading
    return dynamic is not None and dynamic()


def touched_elements(report: ApplyReport) -> int:
    return sum(math.prod(a.target.shape) for a in report.targets.values())


def block_changes(report: ApplyReport, patchers: dict, strengths: dict[str, float],
                  weights: BlockWeights | None = None) -> list[dict]:
    """[{name, change = ‖ΔW‖/‖W‖ over the block at its side's strength × block weight, modules}], in model order.
    W is the unpatched weight; `patchers` are the sides' ModelPatchers (see `patchers_of`)."""
    weights = weights or BlockWeights()
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for applied in report.targets.values():
        side = applied.target.side
        if side not in patchers:
            continue
        strength = strengths[side] * weights.weight_for(applied.target.key)
        with torch.no_grad():
            change2, weight2 = change_norms(applied.plan, applied.module.tensors,
                                            _weight_fp32(patchers[side], applied), strength)
        entry = sums[block_of(applied.target.key)]
        entry[0] += change2
        entry[1] += weight2
        entry[2] += 1
    order = _model_order(patchers)
    first_key: dict[str, int] = {}
    for applied in report.targets.values():
        name, position = block_of(applied.target.key), order.get(applied.target.key, len(order))
        first_key[name] = min(first_key.get(name, position), position)
    return [{"name": name, "change": math.sqrt(c / w) if w else 0.0, "modules": n}
            for name, (c, w, n) in sorted(sums.items(), key=lambda item: first_key[item[0]])]


def _model_order(patchers: dict) -> dict[str, int]:
    """Position of each weight in the model (diffusion model first, then text encoder), to list blocks in order."""
    keys = [key for side in ("model", "clip") if side in patchers for key in model_shapes(patchers[side].model)]
    return {key: i for i, key in enumerate(keys)}


def patchers_of(model, clip) -> dict:
    """The ModelPatcher of each connected side: it knows the unpatched weights (the nn.Module alone does not)."""
    patchers = {}
    if model is not None:
        patchers["model"] = model
    if clip is not None:
        patchers["clip"] = clip.patcher
    return patchers


def payload(path, report: ApplyReport, blocks: list[dict] | None) -> dict:
    data = report.to_json()
    data["blocks"] = blocks
    try:
        data["summary"] = summarize(path).to_json()
    except LycorisError as e:
        # The file was applied from its checked snapshot; the summary reads the file again, which may have changed
        # (or be one it cannot describe) since. The patch stands: say why the description is missing.
        data["summary"] = None
        data["warnings"] = [*data.get("warnings", []), f"no summary: {e}"]
    return data
