"""Computing one patch: W ← W'(m), in place, with every tensor cast once by casting.py.

The weight may be fp32/fp16/bf16/fp8, on any device, and may be a view (ComfyUI narrows fused weights with
offsets and keeps only the view's changes), so the result is written into it rather than returned as a new tensor.
"""

from collections.abc import Callable

import torch

from . import dora
from .algos import BY_NAME
from .casting import cast, cast_all, compute_dtype
from .keys import DORA_SCALE
from .module import Plan


def change(plan: Plan, t: dict[str, torch.Tensor], weight: torch.Tensor, m: float) -> torch.Tensor:
    """W'(m) − W, in the dtype and on the device of `weight` and `t` (already cast)."""
    algorithm = BY_NAME[plan.algorithm]
    if algorithm.diff_weight is None:
        return algorithm.merged(t, plan.layout, weight, m, plan.reference) - weight
    delta = algorithm.diff_weight(t, plan.layout, weight)
    if plan.dora_axis is not None:
        return dora.change(weight, delta, t[DORA_SCALE], plan.dora_axis, m, plan.reference)
    return m * delta


def is_noop(plan: Plan, strength: float) -> bool:
    """Linear strength 0 changes nothing. LyCORIS' own semantics need not: at m = 0 DoRA keeps W + ΔW and a
    rescaled OFT/BOFT keeps ρ ⊙ W."""
    return strength == 0 and not plan.reference


def apply(plan: Plan, tensors: dict[str, torch.Tensor], weight: torch.Tensor, strength: float,
          function: Callable[[torch.Tensor], torch.Tensor] | None = None,
          intermediate_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Patch `weight` in place to W + function(W'(strength) − W) and return it.

    The maths runs in fp32 (or `intermediate_dtype` when wider) on weight's device; the result is rounded to
    weight's dtype once.
    """
    if is_noop(plan, strength):
        return weight
    dtype = compute_dtype(intermediate_dtype)
    w = cast(weight, weight.device, dtype)
    delta = change(plan, cast_all(tensors, weight.device, dtype), w, strength)
    if function is not None:
        delta = function(delta)
    # w is either weight itself (already in the compute dtype) or our private copy: add in place, round once.
    w.add_(delta)
    if w is not weight:
        weight.copy_(w)
    return weight


def change_norms(plan: Plan, tensors: dict[str, torch.Tensor], weight: torch.Tensor, strength: float
                 ) -> tuple[float, float]:
    """(‖W'(strength) − W‖², ‖W‖²), computed like a patch but without touching `weight`. For reports."""
    dtype = compute_dtype(None)
    w = cast(weight, weight.device, dtype)
    delta = change(plan, cast_all(tensors, weight.device, dtype), w, strength)
    return float(delta.square().sum()), float(w.square().sum())
