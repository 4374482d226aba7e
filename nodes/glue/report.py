"""What a file did to this model, for the UI: per-block relative change (and the chart a loader's panel keeps per
model), and the JSON payload the panel draws."""

import math
import weakref
from collections import OrderedDict, defaultdict

import torch

from ...lycoris_core import LycorisError, change_norms
from ...lycoris_core.block_weights import BlockWeights
from ...lycoris_core.blocks import block_of
from ...lycoris_core.summary import summarize
from .cache import file_identity
from .coverage import Applied, ApplyReport
from .keymap import model_shapes
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
        temp = temp.narrow(*applied.target.offset.as_comfy())
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


# The panel's chart at strength 1, per model object (clones share it; the chart reads the weights as loaded, not a
# clone's patches), then per (file identity, side, block weights). In linear strength mode every change is linear in
# the strength, W'(m) − W = m·(W'(1) − W), so each block's ‖ΔW‖/‖W‖ at strength s is |s| times its value at 1: a
# strength change rescales the cached chart instead of another patch pass over every touched weight (0.25 s on one
# SDXL transformer block, six times the re-patching itself; bench/README.md). Numbers only: no tensor is kept.
# At most CHARTS_PER_MODEL charts per model, least recently used dropped first: a checkpoint stays loaded for the
# whole session, and every new block-weight text or rewritten file is a new key (issue #23: a sweep of block weights
# grew the table by one chart per run, for as long as ComfyUI ran).
CHARTS_PER_MODEL = 64
_charts: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()


def _chart(model: torch.nn.Module, key: tuple, measure) -> list[dict]:
    """The chart kept for (model, key), measured by `measure()` when missing."""
    charts = _charts.setdefault(model, OrderedDict())
    if key in charts:
        charts.move_to_end(key)
    else:
        charts[key] = measure()
        while len(charts) > CHARTS_PER_MODEL:
            charts.popitem(last=False)
    return charts[key]


def measured_blocks(path: str, report, patchers: dict, strengths: dict[str, float], weights=None) -> list[dict]:
    """block_changes at these strengths, measured once per model, file, side and block weights and rescaled."""
    if any(applied.plan.reference for applied in report.targets.values()):
        return block_changes(report, patchers, strengths, weights)  # LyCORIS semantics: DoRA, OFT not linear in m
    identity = file_identity(path)
    blocks = []
    for side, patcher in patchers.items():  # model, then clip: block_changes' model order (no block spans both)
        chart = _chart(patcher.model, (identity, side, weights),
                       lambda side=side, patcher=patcher: block_changes(report, {side: patcher}, {side: 1.0}, weights))
        blocks += [{**block, "change": abs(strengths[side]) * block["change"]} for block in chart]
    return blocks


def panel_ui(path: str, report, model, clip, strength_model: float, strength_clip: float, weights=None) -> dict:
    """The panel's payload: coverage, per-block change (when cheap enough on every run) and the file summary.
    Not measured (blocks None, the reason in `not_measured`) for a large file, or when dynamic VRAM loading keeps
    the weights offloaded: reading them would pull them through RAM on every run just for a chart."""
    patchers = patchers_of(model, clip)
    blocks, not_measured = None, None
    if touched_elements(report) > LOADER_MEASURE_BUDGET:
        not_measured = "large file"
    elif any(is_dynamic(patcher) for patcher in patchers.values()):
        not_measured = "weights offloaded by dynamic VRAM loading"
    else:
        blocks = measured_blocks(path, report, patchers, {"model": strength_model, "clip": strength_clip}, weights)
    data = payload(path, report, blocks)
    if not_measured:
        data["not_measured"] = not_measured
    return {"lycoris": [data]}
