"""LoRA / LoCon (also DyLoRA files, which are plain LoRA files).

    ΔW = s · (U₂ D₂).reshape(W.shape),       U₂ = up.reshape(out, r), D₂ = down.reshape(r, -1), s = alpha / r
    Tucker (lora_mid, conv with k > 1):
    ΔW[o, n, …] = s · Σᵢⱼ mid[i, j, …] U₂[o, i] D₂[j, n]

Patched as W₂ += s·m·U₂D₂ by one addmm_ into W (no temporary); with Tucker, mid is folded into the down factor first
(einsum("ij…,jn->in…", mid, D₂), r × in·∏k), so it is the same addmm_.

Bypass: F₀(x; s·m·U₂D₂) = s·m · up(down(x)), factor by factor; the down factor carries the layer's geometry (kernel,
stride, padding), up is a pointwise mix (Tucker: down pointwise, mid with the geometry, up pointwise). Two thin matmuls
instead of a weight-sized change: r·(in·∏k + out) per output position instead of in·∏k·out.

`down` keeps in/groups channels, so grouped convolutions need nothing special when merged (in bypass they have no
factored form: down(x) would need the groups). LyCORIS' DyLoRA stores a conv `up`
as 2-D (out, r); any up whose trailing dims are 1 reads the same way.
"""

import math

import torch

from .base import (
    Additive,
    Algorithm,
    FormSite,
    LayerOp,
    Layout,
    RowAdder,
    Tensors,
    expect,
    narrowed_rows,
    require,
    rows_2d,
    scale_from_alpha,
    trailing_ones,
    tucker_factors,
)

UP, DOWN, MID = "lora_up.weight", "lora_down.weight", "lora_mid.weight"


def layout(t: Tensors, alpha: float | None) -> Layout:
    up, down = require(t, UP, DOWN)
    expect(up.ndim >= 2 and down.ndim >= 2, "lora_up/lora_down must have at least 2 dims", UP)
    rank = down.shape[0]
    expect(rank > 0 and up.shape[1] == rank and trailing_ones(up, 2),
           f"lora_up {list(up.shape)} does not match lora_down {list(down.shape)} (rank {rank})", UP)
    mid = t.get(MID)
    if mid is None:
        shape = (up.shape[0], *down.shape[1:]) if down.ndim > 2 else None
        return Layout(rank, scale_from_alpha(alpha, rank), up.shape[0], math.prod(down.shape[1:]), shape)
    expect(mid.ndim >= 3 and mid.shape[:2] == (rank, rank) and trailing_ones(down, 2),
           f"lora_mid {list(mid.shape)} does not match rank {rank} with lora_down {list(down.shape)}", MID)
    shape = (up.shape[0], down.shape[1], *mid.shape[2:])
    return Layout(rank, scale_from_alpha(alpha, rank), up.shape[0], math.prod(shape[1:]), shape)


def factors(t: Tensors, lay: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with ΔW₂ = s · A @ B: A (out, r), B (r, in·∏k)."""
    up = t[UP].reshape(lay.out, lay.rank)
    down = t[DOWN].reshape(lay.rank, -1)
    if MID in t:
        return tucker_factors(t[MID], up.transpose(0, 1), down)
    return up, down


def factored(t: Tensors, lay: Layout, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ΔW₂ = (s·A) @ B at full strength (Tucker folded into B)."""
    up, down = factors(t, lay)
    return up * lay.scale, down


def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    up, down = factors(t, lay)
    rows_2d(out).addmm_(up, down, alpha=lay.scale * m)


class Factored(Additive):
    """ΔW·x = s·m · up(mid(down(x))), the factors cast once to the site's work dtype and device."""

    def __init__(self, t: Tensors, lay: Layout, at: FormSite):
        op, scale, dtype = at.op, lay.scale * at.strength, at.work_dtype
        self.op = op
        self.up = at.cast(t[UP], dtype).reshape(lay.out, lay.rank) * scale  # the scale folded into the smallest factor
        down = at.cast(t[DOWN], dtype)
        if MID in t:
            self.down = down.reshape(lay.rank, at.shape[1])  # pointwise
            self.mid = LayerOp(op.conv_dims, op.stride, op.padding, op.dilation), at.cast(t[MID], dtype)
        else:
            self.down = down.reshape(lay.rank, *at.shape[1:])
            self.mid = None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        work = x.to(self.up.dtype)
        if self.mid is not None:
            mid_op, mid = self.mid
            inner = mid_op(self.op.pointwise(work, self.down), mid)
        else:
            inner = self.op(work, self.down)
        return self.op.pointwise(inner, self.up).to(x.dtype)


def bypass(t: Tensors, lay: Layout, at: FormSite) -> Factored | None:
    return Factored(t, lay, at) if at.op.groups == 1 else None


def rows(t: Tensors, lay: Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of ΔW = s·U₂D₂(·mid): up's rows (the only factor indexed by output rows)."""
    return narrowed_rows(t, lay, start, count, UP)


def row_adder(t: Tensors, lay: Layout, m: float) -> RowAdder:
    """add(out, first): rows [first, first + n) of s·m·U₂D₂ are s·m·U₂[first:first + n]·D₂."""
    up, down = factors(t, lay)

    def add(out: torch.Tensor, first: int) -> None:
        rows_2d(out).addmm_(up.narrow(0, first, out.shape[0]), down, alpha=lay.scale * m)

    return add


ALGORITHM = Algorithm(
    name="locon", label="LoCon", pointwise_label="LoRA", markers=(UP,), keys=(UP, DOWN, MID),
    layout=layout, add_into=add_into, supports_dora=True, bypass=bypass, factored=factored, rows=rows,
    scale_from_peft_config=True, row_adder=row_adder,
)
