"""Computing one patch: W ← W'(m), in place, with every tensor cast once by casting.py.

The weight may be fp32/fp16/bf16/fp8, on any device, and may be a view (ComfyUI narrows fused weights with
offsets and keeps only the view's changes), so the result is always written into it. When the caller's
intermediate dtype is wider than W's, the result is also returned unrounded, in that dtype, for the caller to round
once: ComfyUI 0.33 hands adapters an fp16 copy of W with an fp32 intermediate and rounds what they return into the
storage dtype, so W' read back from the fp16 copy would be rounded twice and be inf above 65504.

Memory: the algorithms write into W itself (`add_into`, `merge_into`), so a patch makes at most one weight-sized
temporary: the fp32 copy of W when W is in another dtype or not contiguous, or V's buffer for linear DoRA at m ≠ 1, or ΔW
when a `function` must see the change. A returned result is that same fp32 copy, so it adds none. Adapter tensors
as large as W (Full) are never cast whole.
"""

from collections.abc import Callable

import torch

from . import dora
from .algos import BY_NAME
from .casting import cast, cast_all, compute_dtype, widens, working_copy
from .keys import DORA_SCALE
from .module import Plan

_IDENTITY = (lambda a: a).__code__


def _real_function(function: Callable[[torch.Tensor], torch.Tensor] | None
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """None for no function and for an identity: ComfyUI hands every adapter `lambda a: a` when a patch has none."""
    code = getattr(function, "__code__", None)
    if code is not None and code.co_code == _IDENTITY.co_code and code.co_argcount == 1:
        return None
    return function


def merge(plan: Plan, t: dict[str, torch.Tensor], w: torch.Tensor, weight: torch.Tensor, m: float) -> None:
    """w ← W'(m) in place. `w` is contiguous, in the compute dtype, and holds W; `weight` is W as given (the same
    tensor, or the original of the copy `w`, which linear DoRA needs)."""
    algorithm = BY_NAME[plan.algorithm]
    if algorithm.merge_into is not None:
        algorithm.merge_into(t, plan.layout, w, m, plan.reference)
    elif plan.dora_axis is not None:
        adder = algorithm.row_adder
        dora.merge_into(algorithm.add_into, t, plan.layout, w, weight, t[DORA_SCALE], plan.dora_axis, m,
                        plan.reference, None if adder is None else adder(t, plan.layout, 1.0))
    else:
        algorithm.add_into(t, plan.layout, w, m, w)


def change(plan: Plan, t: dict[str, torch.Tensor], weight: torch.Tensor, m: float) -> torch.Tensor:
    """W'(m) − W as a new tensor, in the dtype of `weight` and on the device of `weight` and `t` (already cast).

    For algorithms whose change does not read W, `weight` may be a meta tensor that only lends its shape."""
    algorithm = BY_NAME[plan.algorithm]
    if algorithm.add_into is not None and plan.dora_axis is None:
        device = weight.device if weight.device.type != "meta" else next(iter(t.values())).device
        delta = torch.zeros(weight.shape, dtype=weight.dtype, device=device)
        algorithm.add_into(t, plan.layout, weight, m, delta)
        return delta
    merged = working_copy(weight, weight.dtype, private=True)
    merge(plan, t, merged, weight, m)
    return merged.sub_(weight)


def is_noop(plan: Plan, strength: float) -> bool:
    """Linear strength 0 changes nothing. LyCORIS' own semantics need not: at m = 0 DoRA keeps W + ΔW and a
    rescaled OFT/BOFT keeps ρ ⊙ W."""
    return strength == 0 and not plan.reference


def apply(plan: Plan, tensors: dict[str, torch.Tensor], weight: torch.Tensor, strength: float,
          function: Callable[[torch.Tensor], torch.Tensor] | None = None,
          intermediate_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Patch `weight` in place to W + function(W'(strength) − W) and return it, or, when `intermediate_dtype` is
    wider than weight's dtype (`casting.widens`), return the result unrounded in `intermediate_dtype`.

    The maths runs in fp32 (or `intermediate_dtype` when wider) on weight's device; what is written into `weight`
    is the result rounded to weight's dtype once.
    """
    if is_noop(plan, strength):
        return weight
    function = _real_function(function)
    dtype = compute_dtype(intermediate_dtype)
    algorithm = BY_NAME[plan.algorithm]
    t = cast_all(tensors, weight.device, dtype, keep=algorithm.dense)
    row_adder = algorithm.row_adder if algorithm.patch_16bit_by_rows else None
    if (row_adder is not None and function is None and plan.dora_axis is None and weight.ndim >= 1
            and weight.dtype in _PIECEWISE_DTYPES and dtype == torch.float32
            and not widens(weight.dtype, intermediate_dtype)):
        _add_in_pieces(row_adder(t, plan.layout, strength), weight)
        return weight
    if function is None:
        # linear DoRA at m != 1 reads W after V = W + ΔW is formed: V gets a buffer of its own (at m = 1, W' = g·V;
        # the fused out-axis merge keeps W's rows itself)
        fused = plan.dora_axis == dora.OUT and algorithm.row_adder is not None
        w = working_copy(weight, dtype, private=plan.dora_axis is not None and not plan.reference and strength != 1
                         and not fused)
        merge(plan, t, w, weight, strength)
    else:
        w = working_copy(weight, dtype)
        w.add_(function(change(plan, t, w, strength)))
    if w is weight:
        return weight
    # w is our private copy, in the compute dtype: round it into weight once, and hand it over whole to a caller
    # that computes in it (a caller that reads weight instead, as ComfyUI does for offsets, gets the rounded W')
    weight.copy_(w)
    return w if widens(weight.dtype, intermediate_dtype) else weight


_PIECEWISE_DTYPES = (torch.float16, torch.bfloat16)


@torch.no_grad()  # a weight that requires grad is patched in place all the same
def _add_in_pieces(add_rows: Callable[[torch.Tensor, int], None], weight: torch.Tensor) -> None:
    """weight += m·ΔW for a 16-bit weight, a piece of rows at a time through one reused fp32 buffer (in cache): each
    piece is widened into it, ΔW's rows are added there, and it is rounded back once. The same values as the fp32
    working copy (the same elementwise operations on the same rows; a 1×1 LoKr W₁'s rank-r product may round by an
    ulp of fp32 differently), but W is read and written once, in its own dtype, instead of widened whole, added to
    and copied back (LowVramPatch does this at every forward of an offloaded layer). No weight-sized temporary."""
    rows = weight.shape[0]
    row_elements = weight[0].numel() if weight.ndim > 1 else 1
    size = dora.piece_rows(rows, 4 * row_elements)
    buffer = torch.empty((size, *weight.shape[1:]), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, size):
        length = min(size, rows - start)
        piece, rows_of_w = buffer.narrow(0, 0, length), weight.narrow(0, start, length)
        piece.copy_(rows_of_w)
        add_rows(piece, start)
        rows_of_w.copy_(piece)


def change_norms(plan: Plan, tensors: dict[str, torch.Tensor], weight: torch.Tensor, strength: float
                 ) -> tuple[float, float]:
    """(‖W'(strength) − W‖², ‖W‖²), computed like a patch but without touching `weight`. For reports."""
    dtype = compute_dtype(None)
    w = cast(weight, weight.device, dtype)
    delta = change(plan, cast_all(tensors, weight.device, dtype, keep=BY_NAME[plan.algorithm].dense), w, strength)
    return float(delta.square().sum()), float(w.square().sum())
