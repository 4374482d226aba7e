"""GLoRA: a low-rank change that also acts on the current weight.

    New layout (LyCORIS ≥ 3.0): a1 (in, r), a2 (r, in), b1 (out, r), b2 (r, in·∏k)   [conv: trailing 1s / kernel]
        ΔW = s · ( W ×_in (A₁A₂) + (B₁B₂).reshape(W.shape) ),  W ×_in M = einsum("oi…,ij->oj…", W, M)
    Old layout (LyCORIS 1.x–2.x, Linear and 1×1 conv): a1 (r, in), a2 (in, r), b1 (r, in), b2 (out, r)
        ΔW = s · ( W A₂A₁ + B₂B₁ )
    s = alpha / r.

Added into W factor by factor (never the in×in product A₁A₂): P = W ×_in A₁ (out × r·∏k, small) is formed first,
so every read of W is done before W is written. Linear and 1×1 conv: W₂ += s·m·[P | B₁] @ [A₂ ; B₂], one addmm_ and
no temporary. Conv with k > 1: the same a piece of output rows at a time (`casting.pieces`; a row of ΔW reads only
that row of W).

The layouts are told apart by shape. Both can fit a square weight, so the choice is made against the target weight
(`resolve`); only r == in == out stays ambiguous, and then the current (new) layout is assumed. ΔW depends on W as it
stands when the patch is computed, so stacked patches apply in order.
"""

import math
from dataclasses import dataclass

import torch

from ..casting import pieces
from .base import Algorithm, Layout, ShapeError, Tensors, expect, require, rows_2d, scale_from_alpha

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


def add_into(t: Tensors, lay: GLoRALayout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    a1, a2, b1, b2 = (_flat(t[k], k) for k in (A1, A2, B1, B2))
    first, second, low_left, low_right = (a2, a1, b2, b1) if lay.old else (a1, a2, b1, b2)
    alpha = lay.scale * m
    if all(d == 1 for d in weight.shape[2:]):
        w = weight.reshape(weight.shape[0], weight.shape[1])
        left = torch.cat([w @ first, low_left], dim=1)  # reads W; out is written only below
        rows_2d(out).addmm_(left, torch.cat([second, low_right]), alpha=alpha)
        return
    kernel = weight.reshape(weight.shape[0], weight.shape[1], -1)  # (out, in, prod(k))
    target = out.view(kernel.shape)
    for start, length in pieces(kernel.shape[0], kernel[0].numel() * kernel.element_size()):
        part = slice(start, start + length)
        # these rows of W ×_in A₁A₂ read only these rows of W; batched matmuls keep W's layout (no permuted copy)
        delta = torch.matmul(second.transpose(0, 1), torch.matmul(first.transpose(0, 1), kernel[part]))
        rows_2d(delta).addmm_(low_left[part], low_right)
        target[part].add_(delta, alpha=alpha)

ALGORITHM = Algorithm(
    name="glora", label="GLoRA", markers=(A1,), keys=(A1, A2, B1, B2),
    layout=layout, add_into=add_into,
)
