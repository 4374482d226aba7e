"""DoRA (weight decomposition) on top of an additive algorithm's ΔW (LoCon, LoHa, LoKr).

    V = W + ΔW                  (ΔW at full strength, scale applied)
    n = ‖V‖ along the axis of dora_scale:  out-axis (out, 1…) per output row; in-axis (1, in, 1…) per input channel
    g = dora_scale / (n + ε),   ε = finfo(compute dtype).eps
    linear:     W' = W + m·(V·g − W)
    reference:  W' = V · (m·(g − 1) + 1)     (LyCORIS; at m = 0 it keeps W + ΔW)

The norm is that of W + ΔW, not of W (ComfyUI's out-axis branch uses W). A 1-D dora_scale is per output row. PEFT's
magnitude vector (`lora_magnitude_vector`) is per output row in every layout, including conv's (1, out, 1, 1), which on
a square conv has the shape of LyCORIS' per-input dora_scale: the module says which it holds (`per_output`).

Computed in place: V is formed where W was (the algorithm's add_into), then scaled; linear semantics, which need W
and V at once, read W from the weight as given, so V's buffer is the one weight-sized temporary.
"""

from collections.abc import Callable

import torch

from .algos.base import Layout, ShapeError, Tensors
from .casting import add_scaled, pieces

OUT, IN = "out", "in"


def axis_for(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...], per_output: bool = False) -> str:
    """Which axis a dora_scale of this shape normalises for this weight; ShapeError when it fits neither.
    `per_output`: the file's writer defines it per output row (PEFT), so only the out-axis can fit."""
    ndim = len(weight_shape)
    if per_output:
        return _peft_axis(scale_shape, weight_shape)
    if len(scale_shape) == 1 and scale_shape[0] == weight_shape[0]:
        return OUT
    if len(scale_shape) == ndim and scale_shape[0] == weight_shape[0] and all(d == 1 for d in scale_shape[1:]):
        return OUT
    if (ndim >= 2 and len(scale_shape) == ndim and scale_shape[0] == 1 and scale_shape[1] == weight_shape[1]
            and all(d == 1 for d in scale_shape[2:])):
        return IN
    raise ShapeError(f"dora_scale {list(scale_shape)} fits neither axis of a weight of shape {list(weight_shape)}",
                     "dora_scale")


def _peft_axis(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> str:
    """PEFT's magnitude: (out,) or (1, out, 1…) (a conv norm taken with keepdim, then transposed)."""
    out = weight_shape[0]
    if scale_shape == (out,):
        return OUT
    if len(scale_shape) == len(weight_shape) and scale_shape[:2] == (1, out) and all(d == 1 for d in scale_shape[2:]):
        return OUT
    raise ShapeError(f"PEFT's DoRA magnitude {list(scale_shape)} is not one value per output channel of a weight of "
                     f"shape {list(weight_shape)}", "dora_scale")


def _norm(v: torch.Tensor, axis: str) -> torch.Tensor:
    """‖V‖ over every dim but the axis', shaped to broadcast against V. Squares are summed a piece of rows at a time
    (`casting.pieces`): torch's sum stays accurate to about an ulp where a long fp32 norm reduction drifts."""
    keep = 0 if axis == OUT else 1
    dims = [d for d in range(v.ndim) if d != keep]
    squares = torch.zeros(v.shape[keep], dtype=v.dtype, device=v.device)
    for start, length in pieces(v.shape[0], v[0].numel() * v.element_size()):
        rows = v.narrow(0, start, length)
        if keep == 0:
            squares[start:start + length] = rows.square().sum(dim=dims)
        else:
            squares += rows.square().sum(dim=dims)
    shape = [1] * v.ndim
    shape[keep] = v.shape[keep]
    return squares.sqrt_().reshape(shape)


def merge_into(add_into: Callable[[Tensors, Layout, torch.Tensor, float, torch.Tensor], None], t: Tensors,
               layout: Layout, v: torch.Tensor, weight: torch.Tensor, dora_scale: torch.Tensor, axis: str, m: float,
               reference: bool) -> None:
    """v ← W'(m) in place. `v` holds W in the compute dtype on entry; `weight` is W as given (any dtype), read by the
    linear semantics only, which therefore need `v` to be a buffer of its own."""
    add_into(t, layout, v, 1.0, v)  # v = V = W + dW
    norm = _norm(v, axis)
    gain = dora_scale.reshape(norm.shape) / (norm + torch.finfo(v.dtype).eps)
    if reference:
        v.mul_(m * (gain - 1) + 1)
        return
    v.mul_(m * gain)  # W + m*(V*g - W) = m*g*V + (1 - m)*W
    if m != 1:
        add_scaled(v, weight, 1 - m)
