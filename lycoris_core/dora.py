"""DoRA (weight decomposition) on top of an additive algorithm's ΔW (LoCon, LoHa, LoKr).

    V = W + ΔW                  (ΔW at full strength, scale applied)
    n = ‖V‖ along the axis of dora_scale:  out-axis (out, 1…) per output row; in-axis (1, in, 1…) per input channel
    g = dora_scale / (n + ε),   ε = finfo(compute dtype).eps
    linear:     W' = W + m·(V·g − W)
    reference:  W' = V · (m·(g − 1) + 1)     (LyCORIS; at m = 0 it keeps W + ΔW)

The norm is that of W + ΔW, not of W (ComfyUI's out-axis branch uses W). A 1-D dora_scale is per output row. PEFT's
magnitude vector (`lora_magnitude_vector`) is per output row in every layout, including conv's (1, out, 1, 1), which on
a square conv has the shape of LyCORIS' per-input dora_scale: the module says which it holds (`per_output`).

Computed in place: V is formed where W was (the algorithm's add_into), then scaled; linear semantics at m ≠ 1, which
need W and V at once, read W from the weight as given, so V's buffer is the one weight-sized temporary (at m = 1 W' =
g·V reads no W: V is formed in W itself).

Bypass (`bypass`): g depends on W and the factors only, so it is computed once at prepare, exactly as the merge does
(V formed densely once, the same norm and ε); each forward then runs the algorithm's own additive form (ΔW·x from
factors, built at strength 1) and never forms W'. With α = (1 − m) + m·g and β = m·g (linear) or β = α (reference,
whose h = m·(g − 1) + 1 is α itself):

    out-axis:  W'(m) = α ⊙ W + β ⊙ ΔW (per output row)    W'x + b = α ⊙ (y − b) + b + β ⊙ ΔWx,   y = Wx + b
    in-axis:   W'(m) = W·diag(α) + ΔW·diag(β)               W'x + b = W(α ⊙ x) + b + ΔW(β ⊙ x)

so the out-axis form rescales the layer's output channels (keeping the bias) and the in-axis form is input-side: the
layer runs on α ⊙ x (its input channels scaled; zero padding stays zero) and ΔW on β ⊙ x. (Linear: W + m(V·g − W) =
(1 − m)W + m·g·(W + ΔW); reference: V·h = h·W + h·ΔW.) PEFT's magnitude is per output row: the out-axis form.
"""

from collections.abc import Callable
from dataclasses import replace

import torch

from .algos.base import Additive, Algorithm, Form, FormSite, Layout, RowAdder, ShapeError, Tensors
from .casting import add_scaled, cast_all, pieces
from .keys import DORA_SCALE

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


# Rows of V squared at a time on the CPU: one buffer this size, reused, stays in cache (L3; a fresh piece per step
# would be new memory, page-faulted in every time: 10x the cost of the reduction itself).
CPU_PIECE_BYTES = 4 * 2**20


def piece_rows(rows: int, row_bytes: int) -> int:
    """Rows per piece: CPU_PIECE_BYTES, and at most a quarter of the whole (a buffer is never weight-sized)."""
    return max(1, min(CPU_PIECE_BYTES // max(1, row_bytes), -(-rows // 4)))


@torch.no_grad()  # a weight that requires grad cannot be written through out=
def _norm(v: torch.Tensor, axis: str) -> torch.Tensor:
    """‖V‖ over every dim but the axis', shaped to broadcast against V. Squares are summed a piece of rows at a time
    (`casting.pieces` on a GPU, CPU_PIECE_BYTES on the CPU) into one reused buffer: torch's sum stays accurate to
    about an ulp where a long fp32 norm reduction drifts."""
    keep = 0 if axis == OUT else 1
    dims = [d for d in range(v.ndim) if d != keep]
    squares = torch.zeros(v.shape[keep], dtype=v.dtype, device=v.device)
    row_bytes = v[0].numel() * v.element_size()
    if v.device.type == "cpu":
        size = piece_rows(v.shape[0], row_bytes)
        spans = [(start, min(size, v.shape[0] - start)) for start in range(0, v.shape[0], size)]
    else:
        spans = pieces(v.shape[0], row_bytes)
    buffer = torch.empty((max(length for _, length in spans), *v.shape[1:]), dtype=v.dtype, device=v.device)
    for start, length in spans:
        rows = v.narrow(0, start, length)
        square = torch.mul(rows, rows, out=buffer.narrow(0, 0, length))
        if keep == 0:
            torch.sum(square, dim=dims, out=squares.narrow(0, start, length))
        else:
            squares += square.sum(dim=dims)
    shape = [1] * v.ndim
    shape[keep] = v.shape[keep]
    return squares.sqrt_().reshape(shape)


def merge_into(add_into: Callable[[Tensors, Layout, torch.Tensor, float, torch.Tensor], None], t: Tensors,
               layout: Layout, v: torch.Tensor, weight: torch.Tensor, dora_scale: torch.Tensor, axis: str, m: float,
               reference: bool, add_rows: RowAdder | None = None) -> None:
    """v ← W'(m) in place. `v` holds W in the compute dtype on entry; `weight` is W as given (any dtype), read by the
    linear semantics at m ≠ 1 only, which therefore need `v` to be a buffer of its own, unless the out-axis is
    fused (`add_rows` given: see `_merge_rows`)."""
    if add_rows is not None and axis == OUT:
        _merge_rows(add_rows, v, dora_scale, m, reference)
        return
    add_into(t, layout, v, 1.0, v)  # v = V = W + dW
    gain = _gain(v, dora_scale, axis)
    if reference:
        v.mul_(m * (gain - 1) + 1)
        return
    v.mul_(m * gain)  # W + m*(V*g - W) = m*g*V + (1 - m)*W
    if m != 1:
        add_scaled(v, weight, 1 - m)


@torch.no_grad()  # a weight that requires grad cannot be written through out=
def _merge_rows(add_rows: RowAdder, v: torch.Tensor, dora_scale: torch.Tensor, m: float, reference: bool) -> None:
    """Out-axis DoRA a piece of rows at a time: a row's gain needs only that row of V, so each piece (CPU_PIECE_BYTES,
    in cache) gets its rows of ΔW, their norms and the gain before the next is read: W is read and written once
    instead of three times (add, norm, scale). The same operations per row as the unfused path. Linear semantics at
    m ≠ 1 keep the piece's W in a buffer of that size, so `v` needs no copy of its own."""
    rows = v.shape[0]
    size = piece_rows(rows, v[0].numel() * v.element_size())
    dims = list(range(1, v.ndim))
    scale = dora_scale.reshape(rows, *[1] * (v.ndim - 1))
    squares = torch.empty((size, *v.shape[1:]), dtype=v.dtype, device=v.device)
    keep = None if reference or m == 1 else torch.empty_like(squares)
    for start in range(0, rows, size):
        length = min(size, rows - start)
        piece = v.narrow(0, start, length)
        if keep is not None:
            keep.narrow(0, 0, length).copy_(piece)
        add_rows(piece, start)  # V's rows
        square = torch.mul(piece, piece, out=squares.narrow(0, 0, length))
        norm = square.sum(dim=dims, keepdim=True).sqrt_()
        gain = scale.narrow(0, start, length) / (norm + torch.finfo(v.dtype).eps)
        if reference:
            piece.mul_(m * (gain - 1) + 1)
            continue
        piece.mul_(m * gain)
        if keep is not None:
            piece.add_(keep.narrow(0, 0, length), alpha=1 - m)


def _gain(v: torch.Tensor, dora_scale: torch.Tensor, axis: str) -> torch.Tensor:
    """g = dora_scale / (‖V‖ + ε), ε = finfo(V's dtype).eps, shaped to broadcast against V."""
    norm = _norm(v, axis)
    return dora_scale.reshape(norm.shape) / (norm + torch.finfo(v.dtype).eps)


class OutputGain(Form):
    """Out-axis DoRA: W'x + b = α ⊙ (y − b) + b + β ⊙ ΔWx (module docstring), α, β per output channel."""

    def __init__(self, inner: Additive, alpha: torch.Tensor, beta: torch.Tensor, bias: torch.Tensor | None,
                 at: FormSite):
        self.inner = inner
        channels = (-1, *at.op.point)  # shaped to broadcast over the output's channels
        self.alpha, self.beta = at.cast(alpha.reshape(channels)), at.cast(beta.reshape(channels))
        self.bias_term = None if bias is None else at.cast(((1 - alpha) * bias).reshape(channels))  # (1 - alpha) * b

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = y * self.alpha if self.bias_term is None else torch.addcmul(self.bias_term, y, self.alpha)
        return out.addcmul_(self.inner.delta(x), self.beta)


class InputGain(Form):
    """In-axis DoRA: W'x + b = W(α ⊙ x) + b + ΔW(β ⊙ x) (module docstring), α, β per input channel."""

    input_side = True

    def __init__(self, inner: Additive, alpha: torch.Tensor, beta: torch.Tensor, at: FormSite):
        self.inner, self.op = inner, at.op
        self.alpha, self.beta = at.cast(alpha), at.cast(beta)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return self.op.scale_channels(x, self.alpha)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + self.inner.delta(self.op.scale_channels(x, self.beta))


def bypass(algorithm: Algorithm, t: Tensors, layout: Layout, axis: str, at: FormSite) -> Form | None:
    """The DoRA form of `algorithm`'s change at this site, or None (dense path) when the algorithm has no additive
    form here or the site gives no weight. g is computed from V = W + ΔW formed once, as `merge_into` does."""
    inner = algorithm.bypass(t, layout, replace(at, strength=1.0, weight=None, bias=None)) \
        if algorithm.bypass is not None else None
    if not isinstance(inner, Additive) or inner.input_side or at.weight is None:
        return None
    weight = at.weight
    f32 = cast_all(t, weight.device, weight.dtype, keep=algorithm.dense)
    v = weight.clone(memory_format=torch.contiguous_format)
    algorithm.add_into(f32, layout, weight, 1.0, v)
    gain = _gain(v, f32[DORA_SCALE], axis).reshape(-1)
    del v
    m = at.strength
    alpha = (1 - m) + m * gain
    beta = alpha if at.reference else m * gain
    if axis == OUT:
        return OutputGain(inner, alpha, beta, at.bias, at)
    return InputGain(inner, alpha, beta, at)
