"""LoKr: a Kronecker product of two (possibly low-rank) factors.

    W₁ = w1            or  w1_a @ w1_b                                  (a, c)
    W₂ = w2            or  w2_a @ w2_b (flat for conv)                  (b, d[·∏k])
         or tucker:        einsum("ij…,ip,jr->pr…", t2, w2_a, w2_b)      with w2_a (r, b), w2_b (r, d)
    ΔW = s · kron(W₁, W₂).reshape(W.shape),   out = a·b, in = c·d

Added into W without forming the Kronecker product: with W viewed as (a, b, c, d·∏k),
    W[i, j, l, q] += s·m · W₁[i, l] · W₂[j, q]          (one broadcast addcmul_, no temporary)
where a decomposed W₂ = A @ B (Tucker folded by `tucker_factors`) is formed first: 1/(a·c) of W's size. When W₁
is 1×1 that would be all of W, so then W₂ += s·m·(W₁A) @ B is one addmm_ instead.

s = 1 when both factors are full matrices (the trainer forces alpha = dim there); otherwise alpha / r with
r = w1_b.shape[0] if w1 is decomposed, else w2_b.shape[0]. An N-D W₂ (b, d, *k) is read flat, (b, d·∏k), which is
how its kernel sits in W's rows, so Conv1d/2d/3d all work.
"""

import math

import torch

from .base import Algorithm, Layout, Tensors, expect, require, rows_2d, scale_from_alpha, tucker_factors

W1, W1A, W1B = "lokr_w1", "lokr_w1_a", "lokr_w1_b"
W2, W2A, W2B, T2 = "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"


def _w1_shape(t: Tensors) -> tuple[tuple[int, int], int | None]:
    if W1 in t:
        w1 = t[W1]
        expect(w1.ndim == 2, f"lokr_w1 must be 2-D, got {list(w1.shape)}", W1)
        return tuple(w1.shape), None
    w1a, w1b = require(t, W1A, W1B)
    expect(w1a.ndim == 2 and w1b.ndim == 2 and w1a.shape[1] == w1b.shape[0],
           f"lokr_w1_a {list(w1a.shape)} does not match lokr_w1_b {list(w1b.shape)}", W1A)
    return (w1a.shape[0], w1b.shape[1]), w1b.shape[0]


def _w2_shape(t: Tensors) -> tuple[tuple[int, ...], int | None]:
    """(b, d, *k) when known in full, else (b, d·∏k); and the rank if decomposed."""
    if W2 in t:
        w2 = t[W2]
        expect(w2.ndim >= 2, f"lokr_w2 must have at least 2 dims, got {list(w2.shape)}", W2)
        return tuple(w2.shape), None
    w2a, w2b = require(t, W2A, W2B)
    if T2 in t:
        t2 = t[T2]
        rank = t2.shape[0]
        expect(t2.ndim >= 3 and t2.shape[1] == rank and w2a.shape[0] == rank and w2b.shape[0] == rank
               and w2a.ndim == 2 and w2b.ndim == 2,
               f"tucker LoKr factors disagree: t2 {list(t2.shape)}, w2_a {list(w2a.shape)}, w2_b {list(w2b.shape)}", T2)
        return (w2a.shape[1], w2b.shape[1], *t2.shape[2:]), rank
    expect(w2a.ndim == 2 and w2b.ndim == 2 and w2a.shape[1] == w2b.shape[0],
           f"lokr_w2_a {list(w2a.shape)} does not match lokr_w2_b {list(w2b.shape)}", W2A)
    return (w2a.shape[0], w2b.shape[1]), w2b.shape[0]


def layout(t: Tensors, alpha: float | None) -> Layout:
    (a, c), rank1 = _w1_shape(t)
    w2_shape, rank2 = _w2_shape(t)
    rank = rank1 if rank1 is not None else rank2
    scale = 1.0 if rank is None else scale_from_alpha(alpha, rank)
    out, flat_in = a * w2_shape[0], c * math.prod(w2_shape[1:])
    shape = (out, c * w2_shape[1], *w2_shape[2:]) if len(w2_shape) > 2 else None
    return Layout(rank, scale, out, flat_in, shape)


def _w1(t: Tensors) -> torch.Tensor:
    return t[W1] if W1 in t else t[W1A] @ t[W1B]


def _w2_factors(t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with W₂ = A @ B flattened to (b, d·∏k), for a decomposed W₂."""
    return tucker_factors(t[T2], t[W2A], t[W2B]) if T2 in t else (t[W2A], t[W2B])


def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    w1 = _w1(t)
    (a, c), alpha = w1.shape, lay.scale * m
    if W2 in t:
        w2 = t[W2].reshape(t[W2].shape[0], -1)
    elif a * c > 1:
        left, right = _w2_factors(t)
        w2 = left @ right  # 1/(a·c) of W
    else:  # W₁ is 1×1: ΔW = W₁·A @ B, plain low rank
        left, right = _w2_factors(t)
        rows_2d(out).addmm_(w1 * left, right, alpha=alpha)
        return
    out.view(a, w2.shape[0], c, -1).addcmul_(w1[:, None, :, None], w2[None, :, None, :], value=alpha)

ALGORITHM = Algorithm(
    name="lokr", label="LoKr", markers=(W1, W1A), keys=(W1, W1A, W1B, W2, W2A, W2B, T2),
    layout=layout, add_into=add_into, supports_dora=True,
)
