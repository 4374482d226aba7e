"""GLoRA: a low-rank change that also acts on the current weight.

    New layout (LyCORIS ≥ 3.0): a1 (in, r), a2 (r, in), b1 (out, r), b2 (r, in·∏k)   [conv: trailing 1s / kernel]
        ΔW = s · ( W ×_in (A₁A₂) + (B₁B₂).reshape(W.shape) ),  W ×_in M = einsum("oi…,ij->oj…", W, M)
    Old layout (LyCORIS 1.x–2.x, Linear and 1×1 conv): a1 (r, in), a2 (in, r), b1 (r, in), b2 (out, r)
        ΔW = s · ( W A₂A₁ + B₂B₁ )
    s = alpha / r.

Added into W factor by factor (never the in×in product A₁A₂): P = W ×_in A₁ (out × r·∏k, small) is formed first,
so every read of W is done before W is written. Linear and 1×1 conv: W₂ += s·m·[P | B₁] @ [A₂ ; B₂], one addmm_ and
no temporary. Conv with k > 1: a piece of output rows at a time (`casting.pieces`; a row of ΔW reads only that row of
W), the piece laid out inputs first (in, rows·∏k) so that A₁ᵀ and A₂ᵀ are two plain matmuls on it, then
W += s·m·B₁B₂ (addmm_) and the piece's W ×_in A₁A₂ added back in W's layout.

The layouts are told apart by shape. Both can fit a square weight, so the choice is made against the target weight
(`resolve`); only r == in == out stays ambiguous, and then the current (new) layout is assumed. ΔW depends on W as it
stands when the patch is computed, so stacked patches apply in order.

Bypass (`Factored`): with A₁ (in, r), A₂ (r, in) the first and second input factors of either layout,

    W'x = Wx + s·m·(W ×_in A₁)(A₂ x) + s·m·B₁(B₂ x)

(W ×_in A₁A₂ applied by a conv is the conv of W on the input mapped by A₁A₂ per position: zero padding commutes with a
channel map). P = W ×_in A₁ (out × r·∏k) is formed once per injection from the weight before this adapter; then
Linear and 1×1 convs run [P | B₁]·([A₂ ; B₂]·x), two thin matmuls, and convs with k > 1 run P with the layer's
geometry on A₂x (r channels) plus B₁ on B₂ with the geometry: no extra product with W in the forward.
Grouped convs have no form (A₂ would act per group).
"""

import math
from dataclasses import dataclass, replace

import torch

from ..casting import cast, pieces
from .base import (
    Additive,
    Algorithm,
    FormSite,
    Layout,
    ShapeError,
    Tensors,
    expect,
    narrowed_rows,
    require,
    rows_2d,
    scale_from_alpha,
)

A1, A2, B1, B2 = "a1.weight", "a2.weight", "b1.weight", "b2.weight"


@dataclass(frozen=True)
class GLoRALayout(Layout):
    old: bool = False
    in_channels: int = 0
    candidates: tuple["GLoRALayout", ...] = ()  # unresolved: the layouts the shapes allow, new first

    def resolve(self, weight_shape: tuple[int, ...]) -> Layout:
        reasons = []
        for candidate in self.candidates or (self,):
            try:
                Layout.resolve(candidate, weight_shape)
            except ShapeError as e:
                reasons.append(e.reason)
                continue
            if len(weight_shape) > 1 and weight_shape[1] == candidate.in_channels:
                return candidate
            reasons.append(f"a1 is for {candidate.in_channels} input channels, the weight has {weight_shape[1]}")
        raise ShapeError("; ".join(reasons), A1)


def _flat(t: torch.Tensor, key: str) -> torch.Tensor:
    expect(t.ndim >= 2, f"{key} must have at least 2 dims, got {list(t.shape)}", key)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))  # not -1: a zero-size factor has no inferable width


def layout(t: Tensors, alpha: float | None) -> Layout:
    a1, a2, b1, b2 = (_flat(x, key) for x, key in zip(require(t, A1, A2, B1, B2), (A1, A2, B1, B2)))
    candidates = []
    if a2.shape[0] == b2.shape[0] == a1.shape[1] == b1.shape[1] and a1.shape[0] == a2.shape[1]:
        rank = a2.shape[0]
        candidates.append(GLoRALayout(rank, scale_from_alpha(alpha, rank), b1.shape[0], b2.shape[1],
                                      old=False, in_channels=a1.shape[0]))
    pointwise = all(d == 1 for k in (A1, A2, B1, B2) for d in t[k].shape[2:])  # the old layout: Linear or 1×1 conv
    if (a1.shape[0] == b1.shape[0] == a2.shape[1] == b2.shape[1] and a2.shape[0] == a1.shape[1] == b1.shape[1]
            and pointwise):
        rank = a1.shape[0]
        candidates.append(GLoRALayout(rank, scale_from_alpha(alpha, rank), b2.shape[0], b1.shape[1],
                                      old=True, in_channels=a2.shape[0]))
    if not candidates:
        raise ShapeError(f"GLoRA factors disagree: a1 {list(t[A1].shape)}, a2 {list(t[A2].shape)}, "
                         f"b1 {list(t[B1].shape)}, b2 {list(t[B2].shape)}", A1)
    if len(candidates) == 1:
        return candidates[0]
    first = candidates[0]
    return GLoRALayout(first.rank, first.scale, first.out, first.flat_in, candidates=tuple(candidates))


def _factors(t: Tensors, lay: GLoRALayout) -> tuple[torch.Tensor, ...]:
    """(A₁ (in, r), A₂ (r, in), B₁ (out, r), B₂ (r, in·∏k)) of ΔW = s·(W ×_in A₁A₂ + B₁B₂), whichever the layout."""
    a1, a2, b1, b2 = (_flat(t[k], k) for k in (A1, A2, B1, B2))
    return (a2, a1, b2, b1) if lay.old else (a1, a2, b1, b2)


def add_into(t: Tensors, lay: GLoRALayout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    first, second, low_left, low_right = _factors(t, lay)
    alpha = lay.scale * m
    if all(d == 1 for d in weight.shape[2:]):
        w = weight.reshape(weight.shape[0], weight.shape[1])
        left = torch.cat([w @ first, low_left], dim=1)  # reads W; out is written only below
        rows_2d(out).addmm_(left, torch.cat([second, low_right]), alpha=alpha)
        return
    kernel = weight.reshape(weight.shape[0], weight.shape[1], -1)  # (out, in, prod(k))
    target, inputs, taps = out.view(kernel.shape), kernel.shape[1], kernel.shape[2]
    for start, length in pieces(kernel.shape[0], kernel[0].numel() * kernel.element_size()):
        part = slice(start, start + length)
        # these rows of W ×_in A₁A₂ read only these rows of W. Inputs first, (in, rows·∏k), both products are plain
        # GEMMs (batched per row they are ~3× slower); the piece is read before its rows are written
        rows = kernel[part].transpose(0, 1).reshape(inputs, length * taps)
        term = second.transpose(0, 1) @ (first.transpose(0, 1) @ rows)
        rows_2d(target[part]).addmm_(low_left[part], low_right, alpha=alpha)
        target[part].add_(term.view(inputs, length, taps).transpose(0, 1), alpha=alpha)


def factored(t: Tensors, lay: GLoRALayout, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ΔW₂ = s·(W ×_in A₁A₂ + B₁B₂) as one product. With P = W ×_in A₁ (out, r, ∏k) and K = ∏k:

        (W ×_in A₁A₂)₂[o, (j, k)] = Σᵣ P[o, r, k]·A₂[r, j] = (P₂ @ kron(A₂, I_K))[o, (j, k)],  P₂ = P (out, r·K)

    so ΔW₂ = [s·P₂ | s·B₁] @ [kron(A₂, I_K) ; B₂], rank r·(K + 1) (2r for Linear and 1×1 convs). Reads W (the
    weight before this module, fp32)."""
    if weight is None:
        raise ShapeError("GLoRA's change reads the base weight, which was not given", A1)
    first, second, low_left, low_right = _factors(t, lay)
    w = weight.reshape(weight.shape[0], weight.shape[1], -1)  # (out, in, K)
    taps = w.shape[2]
    p = torch.einsum("oik,ir->ork", w, first).reshape(w.shape[0], -1)
    spread = torch.kron(second, torch.eye(taps, dtype=second.dtype, device=second.device))
    return torch.cat([p, low_left], dim=1) * lay.scale, torch.cat([spread, low_right])


class Factored(Additive):
    """ΔW·x = s·m·(P (A₂x) + B₁(B₂x)) with P = W ×_in A₁ (module docstring), all cast once."""

    def __init__(self, t: Tensors, lay: GLoRALayout, at: FormSite):
        first, second, low_left, low_right = (cast(f, at.device, torch.float32) for f in _factors(t, lay))
        self.op, scale = at.op, lay.scale * at.strength
        self.dtype = at.work_dtype
        at = replace(at, dtype=self.dtype)
        w = at.weight.reshape(at.shape[0], at.shape[1], -1)  # (out, in, prod(k))
        p = torch.einsum("oik,ir->ork", w, first) * scale  # the scale on the small factor
        self.pointwise = all(d == 1 for d in at.shape[2:])
        rank = second.shape[0]
        if self.pointwise:  # one pair of thin factors: [P | B1] @ [A2 ; B2]
            self.up = at.cast(torch.cat([p.reshape(at.shape[0], rank), low_left * scale], dim=1))
            self.down = at.cast(torch.cat([second, low_right])).reshape(2 * rank, *at.shape[1:])
        else:
            self.p = at.cast(p).reshape(at.shape[0], rank, *at.shape[2:])
            self.second, self.up = at.cast(second), at.cast(low_left * scale)
            self.down = at.cast(low_right).reshape(rank, *at.shape[1:])

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.dtype)
        if self.pointwise:
            out = self.op.pointwise(self.op(h, self.down), self.up)
        else:
            out = self.op(self.op.pointwise(h, self.second), self.p) + self.op.pointwise(self.op(h, self.down), self.up)
        return out.to(x.dtype)


def bypass(t: Tensors, lay: GLoRALayout, at: FormSite) -> Factored | None:
    return Factored(t, lay, at) if at.op.groups == 1 and at.weight is not None else None


def rows(t: Tensors, lay: GLoRALayout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of ΔW = s·(W ×_in A₁A₂ + B₁B₂): row o reads only row o of W, so the rows' change is the same A on the
    target's own rows plus B's output factor's rows (b1 in the current layout, b2 in the old). `lay` resolved."""
    return narrowed_rows(t, lay, start, count, B2 if lay.old else B1)


ALGORITHM = Algorithm(
    name="glora", label="GLoRA", markers=(A1,), keys=(A1, A2, B1, B2),
    layout=layout, add_into=add_into, bypass=bypass, factored=factored, rows=rows, reads_param=True,
)
