"""LoHa: the Hadamard product of two low-rank products.

    ΔW = s · ((w1a w1b) ⊙ (w2a w2b)).reshape(W.shape),        s = alpha / r, r = w1b.shape[0]
    Tucker (hada_t1/t2, conv with k > 1), with the a-factors stored transposed (r, out):
    Rᵢ = einsum("ij…,jr,ip->pr…", tᵢ, wᵢb, wᵢa),  ΔW = s · (R₁ ⊙ R₂)

Both products are low-rank, A @ B (the Tucker form folded by `tucker_factors`), so ΔW is formed a piece of output rows
at a time and added into W (`casting.pieces`): only two pieces exist at once, never a weight-sized temporary.

s is applied once, as in the reference's forward pass (its get_diff_weight/merge_to apply it twice; see the spec).

Bypass: a Hadamard product of two products is one product of rank r₁·r₂,

    (A₁B₁ ⊙ A₂B₂)[o, n] = Σᵢⱼ A₁[o, i]·A₂[o, j] · B₁[i, n]·B₂[j, n] = (U V)[o, n],
    U[o, (i, j)] = A₁[o, i]·A₂[o, j]   (out, r₁r₂),     V[(i, j), n] = B₁[i, n]·B₂[j, n]   (r₁r₂, in·∏k)

so ΔW·x = s·m · up(down(x)) as for LoCon, with down = V (the layer's geometry) and up = U (pointwise), both formed once
at prepare. Tucker likewise: with Rₖ[o, n, …] = Σ tₖ[p, q, …]·aₖ[p, o]·bₖ[q, n], the product R₁ ⊙ R₂ is a Tucker
product of rank r₁r₂ with core T[(p, p'), (q, q'), …] = t₁[p, q, …]·t₂[p', q', …], left a₁ ⊙ a₂ and right b₁ ⊙ b₂
(row-wise Kronecker products): down pointwise, T with the geometry, up pointwise.

It is used where it costs fewer multiplications per output position than the layer itself (the dense path rebuilds
ΔW and adds one more op of the layer's size):

    r₁r₂·(in·∏k + out) < in·∏k·out          Tucker: r₁r₂·(in + r₁r₂·∏k + out) < in·∏k·out

(e.g. r = 16 on a 1280×1280 Linear: 2.6 times fewer; r = 32 there would not be). Otherwise, and on grouped convs,
the dense path.
"""

import math
from collections.abc import Callable

import torch

from ..casting import cast, pieces
from .base import (
    Additive,
    Algorithm,
    FormSite,
    LayerOp,
    Layout,
    Tensors,
    expect,
    narrowed_rows,
    require,
    rows_2d,
    scale_from_alpha,
    tucker_factors,
)

W1A, W1B, W2A, W2B, T1, T2 = "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"


def layout(t: Tensors, alpha: float | None) -> Layout:
    w1a, w1b, w2a, w2b = require(t, W1A, W1B, W2A, W2B)
    expect(all(w.ndim == 2 for w in (w1a, w1b, w2a, w2b)), "hada_w* factors must be 2-D", W1A)
    rank = w1b.shape[0]
    if T1 in t or T2 in t:
        t1, t2 = require(t, T1, T2)
        kernel = tuple(t1.shape[2:])
        expect(t1.ndim >= 3 and t2.shape == t1.shape and t1.shape[:2] == (rank, rank)
               and w1a.shape[0] == rank and w2a.shape == w1a.shape and w2b.shape == w1b.shape,
               f"tucker LoHa factors disagree: t1 {list(t1.shape)}, w1_a {list(w1a.shape)}, w1_b {list(w1b.shape)}", T1)
        shape = (w1a.shape[1], w1b.shape[1], *kernel)
        return Layout(rank, scale_from_alpha(alpha, rank), shape[0], math.prod(shape[1:]), shape)
    expect(w1a.shape[1] == rank and w2a.shape[1] == w2b.shape[0] and w1a.shape[0] == w2a.shape[0]
           and w1b.shape[1] == w2b.shape[1],
           f"LoHa factors disagree: w1 {list(w1a.shape)}@{list(w1b.shape)}, w2 {list(w2a.shape)}@{list(w2b.shape)}", W1A)
    return Layout(rank, scale_from_alpha(alpha, rank), w1a.shape[0], w1b.shape[1])


def _factors(t: Tensors, wa: str, wb: str, core: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with the product Rᵢ = A @ B flattened to (out, in·∏k)."""
    if core in t:
        return tucker_factors(t[core], t[wa], t[wb])
    return t[wa], t[wb]


def row_adder(t: Tensors, lay: Layout, m: float) -> Callable[[torch.Tensor, int], None]:
    """add(out, first): out += m·ΔW[first:first + len(out)], from the same row pieces of both products."""
    (a1, b1), (a2, b2) = _factors(t, W1A, W1B, T1), _factors(t, W2A, W2B, T2)

    def add(out: torch.Tensor, first: int) -> None:
        part = slice(first, first + out.shape[0])
        rows_2d(out).addcmul_(a1[part] @ b1, a2[part] @ b2, value=lay.scale * m)

    return add


def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    (a1, b1), (a2, b2) = _factors(t, W1A, W1B, T1), _factors(t, W2A, W2B, T2)
    rows = rows_2d(out)
    for start, length in pieces(rows.shape[0], rows.shape[1] * rows.element_size()):
        part = slice(start, start + length)
        rows[part].addcmul_(a1[part] @ b1, a2[part] @ b2, value=lay.scale * m)


def _rowwise_kron(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(r₁, n), (r₂, n) → (r₁r₂, n): row (i, j) is p[i] ⊙ q[j]."""
    return (p[:, None] * q[None]).reshape(p.shape[0] * q.shape[0], *p.shape[1:])


class Hadamard(Additive):
    """ΔW·x = up(mid(down(x))) with the rank-r₁r₂ factors of the Hadamard product, s·m in up."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, mid: torch.Tensor | None, op: LayerOp):
        self.op, self.up, self.down, self.mid = op, up, down, mid
        self.mid_op = LayerOp(op.conv_dims, op.stride, op.padding, op.dilation)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.up.dtype:  # fp16 input on the CPU: computed in fp32 (FormSite.work_dtype)
            return self._delta(x.to(self.up.dtype)).to(x.dtype)
        return self._delta(x)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.mid is not None:
            inner = self.mid_op(self.op.pointwise(x, self.down), self.mid)
        else:
            inner = self.op(x, self.down)
        return self.op.pointwise(inner, self.up)


def factored(t: Tensors, lay: Layout, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ΔW₂ = U @ V exactly, rank r₁r₂ (the Hadamard product of two products, module docstring), s in U:

        U[o, (i, j)] = s·A₁[o, i]·A₂[o, j],     V[(i, j), n] = B₁[i, n]·B₂[j, n]

    with Tucker products folded to (Aₖ, Bₖ) first (`tucker_factors`: the kernel in Bₖ)."""
    (a1, b1), (a2, b2) = _factors(t, W1A, W1B, T1), _factors(t, W2A, W2B, T2)
    up = _rowwise_kron(a1.transpose(0, 1), a2.transpose(0, 1)).transpose(0, 1)
    return up * lay.scale, _rowwise_kron(b1, b2)


def bypass(t: Tensors, lay: Layout, at: FormSite) -> Hadamard | None:
    if at.op.groups != 1:
        return None
    f = {name: cast(v, at.device, torch.float32) for name, v in t.items()}
    out, channels, kernel = at.shape[0], at.shape[1], math.prod(at.shape[2:])
    scale = lay.scale * at.strength
    if T1 in f:  # a-factors (r, out), b-factors (r, in): rank r1*r2 Tucker
        rank = f[T1].shape[0] * f[T2].shape[0]
        if rank * (channels + rank * kernel + out) >= channels * kernel * out:
            return None
        up = _rowwise_kron(f[W1A], f[W2A]).transpose(0, 1) * scale
        down = _rowwise_kron(f[W1B], f[W2B])
        t1, t2 = f[T1], f[T2]
        core = (t1[:, None, :, None] * t2[None, :, None, :]).reshape(rank, rank, *t1.shape[2:])
        work = at.work_dtype
        return Hadamard(cast(up, at.device, work), cast(down, at.device, work), cast(core, at.device, work), at.op)
    rank = f[W1B].shape[0] * f[W2B].shape[0]
    if rank * (channels * kernel + out) >= channels * kernel * out:
        return None
    up = _rowwise_kron(f[W1A].transpose(0, 1), f[W2A].transpose(0, 1)).transpose(0, 1) * scale
    down = _rowwise_kron(f[W1B], f[W2B]).reshape(rank, *at.shape[1:])
    work = at.work_dtype
    return Hadamard(cast(up, at.device, work), cast(down, at.device, work), None, at.op)


def rows(t: Tensors, lay: Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of ΔW = s·(R₁ ⊙ R₂): the a-factors' rows of both products (Tucker stores them transposed, (r, out))."""
    return narrowed_rows(t, lay, start, count, W1A, W2A, dim=1 if T1 in t else 0)


ALGORITHM = Algorithm(
    name="loha", label="LoHa", markers=(W1A,), keys=(W1A, W1B, W2A, W2B, T1, T2),
    layout=layout, add_into=add_into, supports_dora=True, bypass=bypass, factored=factored, rows=rows,
    scale_from_peft_config=True, row_adder=row_adder,
)
