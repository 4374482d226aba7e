"""LoHa: the Hadamard product of two low-rank products.

    ΔW = s · ((w1a w1b) ⊙ (w2a w2b)).reshape(W.shape),        s = alpha / r, r = w1b.shape[0]
    Tucker (hada_t1/t2, conv with k > 1), with the a-factors stored transposed (r, out):
    Rᵢ = einsum("ij…,jr,ip->pr…", tᵢ, wᵢb, wᵢa),  ΔW = s · (R₁ ⊙ R₂)

Both products are low-rank, A @ B (the Tucker form folded by `tucker_factors`), so ΔW is formed a piece of output rows
at a time and added into W (`casting.pieces`): only two pieces exist at once, never a weight-sized temporary.

s is applied once, as in the reference's forward pass (its get_diff_weight/merge_to apply it twice; see the spec).
"""

import math

import torch

from ..casting import pieces
from .base import Algorithm, Layout, Tensors, expect, require, rows_2d, scale_from_alpha, tucker_factors

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


def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    (a1, b1), (a2, b2) = _factors(t, W1A, W1B, T1), _factors(t, W2A, W2B, T2)
    rows = rows_2d(out)
    for start, length in pieces(rows.shape[0], rows.shape[1] * rows.element_size()):
        part = slice(start, start + length)
        rows[part].addcmul_(a1[part] @ b1, a2[part] @ b2, value=lay.scale * m)


ALGORITHM = Algorithm(
    name="loha", label="LoHa", markers=(W1A,), keys=(W1A, W1B, W2A, W2B, T1, T2),
    layout=layout, add_into=add_into, supports_dora=True,
)
