"""Merge or bypass, for one patch: a pure function of plain values (`route`), with the reason for its answer.

A patch is merged (ComfyUI's add_patches: W + ΔW baked into the weight) or bypassed (the change runs in the layer's
forward, bypass.py). The rule, by mode (README "apply_mode", CONTRIBUTING "Bypass mode, in detail"):

- `merge` bakes everything in, except where that would break the workflow's order on a layer an earlier file
  bypasses (below).
- `bypass` runs every Linear/Conv weight change in the forward (a whole weight, or rows of a fused one); biases are
  still merged (their change is exact in any float dtype) and so are norm layers and other parameters.
- `auto` bypasses only what a merge could not patch exactly: a weight stored as fp8 or in ComfyUI's quantized
  layouts or a tensor type we do not know (`WeightFormat.merge_exact`), a plain float weight ComfyUI would merge
  through a narrower copy (0.33's fp16 `lora_compute_dtype` under an fp32 weight), and the same two for a bias
  (fp8 bias, fp32 bias merged in fp16). GGUF weights are merged: the GGUF pack patches the decoded weight, exactly.

In every mode: a change that reads W (DoRA, OFT, GLoRA, (IA)³...) is merged where W cannot be read in the forward
(only ComfyUI's or the GGUF pack's own patching decodes it); a change that reads W on a layer an earlier file
bypasses is bypassed (merged, it would not see that file's change), and so is any change after an earlier bypassed
change that reads W (merged, it would be in the W that change reads: applied before it); a bias change after a bias
change an earlier file bypassed is bypassed too. Bypassed, they run after it in the forward, as chained merges
would order them.
"""

from dataclasses import dataclass
from enum import Enum

import torch

from .weight_format import WeightFormat

MODES = ("merge", "bypass", "auto")
MERGE, BYPASS = "merge", "bypass"


class Reason(Enum):
    """Why a patch is merged or bypassed (the value says it in words)."""

    NOT_OUTPUT_ROWS = "it changes a part of the parameter other than whole output rows, or a converted parameter"
    NOT_LINEAR_OR_CONV = "its layer is not a Linear or ConvNd layer (norm, embedding, circular padding...)"
    NOT_BYPASSABLE = "its change cannot run in the forward (not a weight or bias change of a bypassable kind)"
    UNREADABLE_WEIGHT = "its change reads the weight, which only ComfyUI's or the GGUF pack's own patching decodes"
    READS_BYPASSED = "its change reads the weight of a layer an earlier file bypasses, so it runs after that change"
    AFTER_BYPASSED_READER = "an earlier file's bypassed change reads this weight, so this one runs after it"
    MODE_MERGE = "apply_mode merge"
    MODE_BYPASS = "apply_mode bypass"
    MERGE_NOT_EXACT = "auto: a merge would round it into the stored format (fp8, quantized, unknown tensor type)"
    MERGED_NARROWER = "auto: ComfyUI would merge it through a copy in a narrower compute dtype"
    MERGE_EXACT = "auto: a merge patches it exactly"
    NO_BIAS_PATH = "a bias change on a layer without a bias, or one ComfyUI runs without its forward"
    BIAS_AFTER_BYPASSED = "an earlier file bypasses this layer's bias change, so this one runs after it"
    BIAS_MERGE_ROUNDS = "a merge would round the bias change into the stored bias (fp8)"
    BIAS_MERGED_NARROWER = "ComfyUI would merge the bias through a copy in a narrower compute dtype"
    BIAS_MERGE_EXACT = "a merge patches the bias exactly"


@dataclass(frozen=True)
class Route:
    how: str  # MERGE or BYPASS
    reason: Reason

    @property
    def bypassed(self) -> bool:
        return self.how == BYPASS


@dataclass(frozen=True)
class PatchFacts:
    """What the route reads of one patch: its key and its adapter's plan."""

    param: str | None  # "weight" or "bias" when the key names one, else None
    output_rows_only: bool  # PatchKey.output_rows_only
    bypassable: bool  # lycoris_core.bypass.is_bypassable(plan)
    reads_weight: bool  # lycoris_core.bypass.reads_weight(plan)
    changes_bias: bool  # lycoris_core.bypass.changes_bias(plan)


@dataclass(frozen=True)
class LayerFacts:
    """What the route reads of the patched layer (None for a layer it cannot look up: merged)."""

    linear_or_conv: bool  # weight_format.layer_op(layer) is not None
    skips_forward: bool  # ComfyUI uses it without its forward: only weight changes run there
    weight: WeightFormat | None
    bias: WeightFormat | None  # None: the layer has no bias


@dataclass(frozen=True)
class Earlier:
    """What our bypass injections already on the patcher do to this parameter."""

    bypassed: bool = False  # some earlier file bypasses a change of it
    read_by_bypassed: bool = False  # and one of those changes reads the weight


NOTHING_EARLIER = Earlier()


def route(mode: str, patch: PatchFacts, layer: LayerFacts | None, earlier: Earlier = NOTHING_EARLIER,
          compute_dtype: torch.dtype | None = None) -> Route:
    """Merge or bypass this patch in `mode` (MODES); `compute_dtype`: the dtype ComfyUI merges in
    (weight_format.merge_dtype, None where it merges in an fp32 copy)."""
    if not patch.output_rows_only:
        return Route(MERGE, Reason.NOT_OUTPUT_ROWS)
    if layer is None or not layer.linear_or_conv:
        return Route(MERGE, Reason.NOT_LINEAR_OR_CONV)
    if patch.changes_bias and patch.param == "bias":
        return _bias_route(mode, layer, earlier, compute_dtype)
    if not patch.bypassable or patch.param != "weight":
        return Route(MERGE, Reason.NOT_BYPASSABLE)
    if patch.reads_weight:
        if not layer.weight.readable:
            return Route(MERGE, Reason.UNREADABLE_WEIGHT)
        if earlier.bypassed:
            return Route(BYPASS, Reason.READS_BYPASSED)
    if earlier.read_by_bypassed:
        return Route(BYPASS, Reason.AFTER_BYPASSED_READER)
    if mode == "bypass":
        return Route(BYPASS, Reason.MODE_BYPASS)
    if mode != "auto":
        return Route(MERGE, Reason.MODE_MERGE)
    if not layer.weight.merge_exact:
        return Route(BYPASS, Reason.MERGE_NOT_EXACT)
    if layer.weight.merged_narrower(compute_dtype):
        return Route(BYPASS, Reason.MERGED_NARROWER)
    return Route(MERGE, Reason.MERGE_EXACT)


def _bias_route(mode: str, layer: LayerFacts, earlier: Earlier, compute_dtype: torch.dtype | None) -> Route:
    """A bias change runs in the forward (added to the output) in bypass and auto where a merge would round it
    into the stored bias, as the weight changes there do; else it is merged, exactly."""
    if layer.skips_forward or layer.bias is None:
        return Route(MERGE, Reason.NO_BIAS_PATH)
    if earlier.bypassed:
        return Route(BYPASS, Reason.BIAS_AFTER_BYPASSED)
    if mode == "merge":
        return Route(MERGE, Reason.MODE_MERGE)
    if layer.bias.merge_rounds:
        return Route(BYPASS, Reason.BIAS_MERGE_ROUNDS)
    if layer.bias.merged_narrower(compute_dtype):
        return Route(BYPASS, Reason.BIAS_MERGED_NARROWER)
    return Route(MERGE, Reason.BIAS_MERGE_EXACT)
