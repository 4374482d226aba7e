"""DoRA (weight decomposition) on top of an additive algorithm's ΔW (LoCon, LoHa, LoKr).

    V = W + ΔW                  (ΔW at full strength, scale applied)
    n = ‖V‖ along the axis of dora_scale:  out-axis (out, 1…) per output row; in-axis (1, in, 1…) per input channel
    g = dora_scale / (n + ε),   ε = finfo(compute dtype).eps
    linear:     W' = W + m·(V·g − W)
    reference:  W' = V · (m·(g − 1) + 1)     (LyCORIS; at m = 0 it keeps W + ΔW)

The norm is that of W + ΔW, not of W (ComfyUI's out-axis branch uses W). A 1-D dora_scale (PEFT's magnitude vector)
is per output row.
"""

import torch

from .algos.base import ShapeError

OUT, IN = "out", "in"


def axis_for(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> str:
    """Which axis a dora_scale of this shape normalises for this weight; ShapeError when it fits neither."""
    ndim = len(weight_shape)
    if len(scale_shape) == 1 and scale_shape[0] == weight_shape[0]:
        return OUT
    if len(scale_shape) == ndim and scale_shape[0] == weight_shape[0] and all(d == 1 for d in scale_shape[1:]):
        return OUT
    if (ndim >= 2 and len(scale_shape) == ndim and scale_shape[0] == 1 and scale_shape[1] == weight_shape[1]
            and all(d == 1 for d in scale_shape[2:])):
        return IN
    raise ShapeError(f"dora_scale {list(scale_shape)} fits neither axis of a weight of shape {list(weight_shape)}",
                     "dora_scale")


def _norm(v: torch.Tensor, axis: str) -> torch.Tensor:
    if axis == OUT:
        return v.reshape(v.shape[0], -1).norm(dim=1).reshape(v.shape[0], *([1] * (v.ndim - 1)))
    per_in = v.transpose(0, 1).reshape(v.shape[1], -1).norm(dim=1)
    return per_in.reshape(1, v.shape[1], *([1] * (v.ndim - 2)))


def change(weight: torch.Tensor, delta: torch.Tensor, dora_scale: torch.Tensor, axis: str, m: float,
           reference: bool) -> torch.Tensor:
    """W'(m) − W for DoRA."""
    v = weight + delta
    norm = _norm(v, axis)
    gain = dora_scale.reshape(norm.shape) / (norm + torch.finfo(v.dtype).eps)
    if reference:
        return v * (m * (gain - 1) + 1) - weight
    return m * (v * gain - weight)
