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

Row window (`row_offset`): ComfyUI's converter (0.38) splits a fused to_qkv LoKr into q/k/v modules, and where W₂'s
b rows do not divide the q/k/v sizes it repeats W₁ whole and writes `row_offset` = the projection's first row. The
change of such a module is rows [o, o + R) of the fused ΔW, R being the target's rows. Row r of kron(W₁, W₂) is
W₁[r // b] ⊗ W₂[r % b], so the window is at most three runs of rows (a partial block of W₂'s rows, whole blocks,
a partial block), each one broadcast addcmul_ as above.

Bypass: with x's input channels read as (c, d) (X[j, q] = x[j·d + q]) and the output's as (a, b),

    ΔW·x = s·m · W₁ · X · W₂ᵀ        linear, per token: (a, c)·(c, d)·(d, b), reshaped to a·b outputs
    ΔW·x = s·m · W₁ ·_c conv(X, W₂)  conv: W₂ (b, d, *k) is a conv over each of the c channel groups (batched as
                                     N·c images of d channels, with the layer's stride, padding and dilation), then
                                     the c groups are mixed by W₁ at every output position

W₁ may equally go first (mix the c groups of the input, then W₂ on a groups): whichever order costs fewer
multiplications per token (linear: b·c·(d + a) against a·d·(c + b)). W₁ and W₂ are formed once at prepare (a
decomposed or Tucker W₂ is 1/(a·c) of the weight), with s·m folded into W₁. A row window keeps its rows of the
fused output. Grouped convolutions (input channels split by the layer's groups) take the dense path. An fp16 input
on the CPU is computed in fp32 (`FormSite.work_dtype`), as are LoHa's.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..casting import cast
from .base import (
    Additive,
    Algorithm,
    FormSite,
    Layout,
    ShapeError,
    Tensors,
    expect,
    require,
    rows_2d,
    scale_from_alpha,
    tucker_factors,
)

W1, W1A, W1B = "lokr_w1", "lokr_w1_a", "lokr_w1_b"
W2, W2A, W2B, T2 = "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"
ROW_OFFSET = "row_offset"


@dataclass(frozen=True)
class RowWindowLayout(Layout):
    """The LoKr of a fused weight (`out` rows, `flat_in`/`shape` its input side), of which the target weight is
    the rows from `row_offset` on: it fits a target of the same input size whose rows end inside the fused ones."""

    row_offset: int = 0

    def resolve(self, weight_shape: tuple[int, ...]) -> Layout:
        in_shape = tuple(weight_shape[1:])
        same_in = in_shape == self.shape[1:] if self.shape is not None else math.prod(in_shape) == self.flat_in
        if len(weight_shape) < 2 or not same_in:
            fused = list(self.shape or (self.out, self.flat_in))
            raise ShapeError(f"module is for rows of a fused weight of shape {fused}, the model's is "
                             f"{list(weight_shape)}: the input sizes differ")
        expect(self.row_offset + weight_shape[0] <= self.out,
               f"row_offset {self.row_offset} + the model weight's {weight_shape[0]} rows run past the {self.out} "
               "rows of the fused LoKr change", ROW_OFFSET)
        return self


def _row_offset(t: Tensors) -> int | None:
    """The row_offset scalar as an int (checked: one whole number ≥ 0), None when the module has none."""
    if ROW_OFFSET not in t:
        return None
    value = t[ROW_OFFSET]
    expect(value.numel() == 1 and value.ndim <= 1, f"row_offset must be one number, got shape {list(value.shape)}",
           ROW_OFFSET)
    number = value.reshape(-1)[0].item()
    expect(not isinstance(number, (bool, complex)) and float(number).is_integer() and number >= 0,
           f"row_offset must be a whole number >= 0, got {number}", ROW_OFFSET)
    return int(number)


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
        rank = t2.shape[0] if t2.ndim else -1
        expect(t2.ndim >= 3 and w2a.ndim == 2 and w2b.ndim == 2 and t2.shape[1] == rank and w2a.shape[0] == rank
               and w2b.shape[0] == rank,
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
    offset = _row_offset(t)
    if offset is None:
        return Layout(rank, scale, out, flat_in, shape)
    expect(offset < out, f"row_offset {offset} is past the {out} rows of the fused LoKr change", ROW_OFFSET)
    return RowWindowLayout(rank, scale, out, flat_in, shape, row_offset=offset)


def _w1(t: Tensors) -> torch.Tensor:
    return t[W1] if W1 in t else t[W1A] @ t[W1B]


def _w2_factors(t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with W₂ = A @ B flattened to (b, d·∏k), for a decomposed W₂."""
    return tucker_factors(t[T2], t[W2A], t[W2B]) if T2 in t else (t[W2A], t[W2B])


def _row_runs(first: int, rows: int, b: int) -> list[tuple[int, int, int, int]]:
    """Rows [first, first + rows) of kron(W₁, W₂), W₂ having b rows, as runs (i, n_i, j, n_j): W₁'s rows
    [i, i + n_i) ⊗ W₂'s rows [j, j + n_j), in order. A partial block at either end, whole blocks between."""
    end = first + rows
    head_end = min(end, -(-first // b) * b)  # up to the next block boundary
    tail_start = max(head_end, end // b * b)
    runs = []
    if first < head_end:
        runs.append((first // b, 1, first % b, head_end - first))
    if head_end < tail_start:
        runs.append((head_end // b, (tail_start - head_end) // b, 0, b))
    if tail_start < end:
        runs.append((tail_start // b, 1, 0, end - tail_start))
    return runs


def add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    w1 = _w1(t)
    (a, c), alpha = w1.shape, lay.scale * m
    first = lay.row_offset if isinstance(lay, RowWindowLayout) else 0  # out holds rows [first, first + len(out))
    if W2 in t:
        w2 = t[W2].reshape(t[W2].shape[0], -1)
    elif a * c > 1:
        left, right = _w2_factors(t)
        w2 = left @ right  # 1/(a·c) of W
    else:  # W1 is 1x1: dW = W1*A @ B, plain low rank
        left, right = _w2_factors(t)
        rows_2d(out).addmm_(w1 * left.narrow(0, first, out.shape[0]), right, alpha=alpha)
        return
    done = 0
    for i, n_i, j, n_j in _row_runs(first, out.shape[0], w2.shape[0]):
        rows = out.narrow(0, done, n_i * n_j).view(n_i, n_j, c, -1)
        rows.addcmul_(w1[i:i + n_i, None, :, None], w2[None, j:j + n_j, None, :], value=alpha)
        done += n_i * n_j


def row_adder(t: Tensors, lay: Layout, m: float) -> Callable[[torch.Tensor, int], None]:
    """add(out, first): out += m·ΔW[first:first + len(out)], a window of the change's rows (of the target's, which
    may itself be a row window of a fused change), as `add_into` adds a row window; W₁ and a decomposed W₂ (unless
    W₁ is 1×1) are formed once for all windows."""
    offset = lay.row_offset if isinstance(lay, RowWindowLayout) else 0
    formed = dict(t)
    if W2 not in t and math.prod(_w1(t).shape) > 1:
        left, right = _w2_factors(t)
        formed = {W1: _w1(t), W2: left @ right}

    def add(out: torch.Tensor, first: int) -> None:
        window = RowWindowLayout(lay.rank, lay.scale, lay.out, lay.flat_in, lay.shape, row_offset=offset + first)
        add_into(formed, window, out, m, out)

    return add


def _thin(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A full matrix as (P, Q) with P @ Q = w and the smaller inner size: (w, I) or (I, w)."""
    rows, cols = w.shape
    if cols <= rows:
        return w, torch.eye(cols, dtype=w.dtype, device=w.device)
    return torch.eye(rows, dtype=w.dtype, device=w.device), w


def factored(t: Tensors, lay: Layout, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ΔW₂ = s·kron(W₁, W₂) = (s·kron(P₁, P₂)) @ kron(Q₁, Q₂) exactly (the mixed-product rule), Wₖ = Pₖ @ Qₖ:

        W₁ = w1_a @ w1_b, or w1 as (w1, I) / (I, w1), whichever inner size is smaller
        W₂ = w2_a @ w2_b, Tucker folded (`tucker_factors`), or w2 (flat, b × d·∏k) likewise

    kron over (out, in·∏k) is ΔW.reshape(out, −1): row i·b + j, column l·(d·∏k) + q holds W₁[i, l]·W₂[j, q], the
    kernel being W₂'s (module docstring). Rank R₁R₂ ≤ min(out, in·∏k). A row window (`row_offset`) is not known
    without the target's rows: `changes.is_factored` sends those to the dense path."""
    p1, q1 = (t[W1A], t[W1B]) if W1 not in t else _thin(t[W1])
    p2, q2 = _w2_factors(t) if W2 not in t else _thin(t[W2].reshape(t[W2].shape[0], -1))
    return _kron(p1, p2) * lay.scale, _kron(q1, q2)


def _kron(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """kron(x, y) of two matrices by broadcasting (torch.kron views its inputs, which fails on some strided ones,
    e.g. the transposed factors of a Tucker product)."""
    return (x[:, None, :, None] * y[None, :, None, :]).reshape(x.shape[0] * y.shape[0], x.shape[1] * y.shape[1])


class Kronecker(Additive):
    """ΔW·x = W₁ · X · W₂ᵀ (conv: W₂ applied as a batched conv over the c input-channel groups), s·m in W₁."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, at: FormSite, rows: tuple[int, int] | None):
        self.op, self.w1, self.w2, self.rows = at.op, w1, w2, rows
        (a, c), b, d = w1.shape, w2.shape[0], w2.shape[1]
        kernel = math.prod(w2.shape[2:])
        self.w2_first = b * c * (d * kernel + a) <= a * d * (c + b * kernel)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.w1.dtype:  # fp16 input on the CPU: computed in fp32 (FormSite.work_dtype)
            return self._delta(x.to(self.w1.dtype)).to(x.dtype)
        return self._delta(x)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        (a, c), b, d = self.w1.shape, self.w2.shape[0], self.w2.shape[1]
        if not self.op.conv_dims:
            groups = x.reshape(*x.shape[:-1], c, d)
            if self.w2_first:  # (..., c, d) -> (..., c, b) -> (..., a, b)
                y = torch.matmul(self.w1, torch.matmul(groups, self.w2.transpose(0, 1)))
            else:  # (..., c, d) -> (..., a, d) -> (..., a, b)
                y = torch.matmul(torch.matmul(self.w1, groups), self.w2.transpose(0, 1))
            return self._window(y.reshape(*x.shape[:-1], a * b), -1)
        unbatched = x.ndim == self.op.conv_dims + 1
        if unbatched:
            x = x.unsqueeze(0)
        n, space = x.shape[0], x.shape[2:]
        if self.w2_first:  # N*c images of d channels -> (N, c, b*S') -> mixed to (N, a, b*S')
            z = self.op(x.reshape(n * c, d, *space), self.w2)
            y = torch.matmul(self.w1, z.reshape(n, c, -1))
        else:  # (N, c, d*S) mixed to (N, a, d*S) -> N*a images of d channels -> (N*a, b, S')
            mixed = torch.matmul(self.w1, x.reshape(n, c, -1))
            y = self.op(mixed.reshape(n * a, d, *space), self.w2)
        out_space = y.shape[2:] if not self.w2_first else z.shape[2:]
        y = self._window(y.reshape(n, a * b, *out_space), 1)
        return y.squeeze(0) if unbatched else y

    def _window(self, y: torch.Tensor, dim: int) -> torch.Tensor:
        return y if self.rows is None else y.narrow(dim, *self.rows)


def bypass(t: Tensors, lay: Layout, at: FormSite) -> Kronecker | None:
    if at.op.groups != 1:
        return None
    f32 = {name: cast(v, at.device, torch.float32) for name, v in t.items() if name != ROW_OFFSET}
    w1 = _w1(f32) * (lay.scale * at.strength)
    (a, c), in_shape = w1.shape, at.shape[1:]
    if in_shape[0] % c:
        return None
    if W2 in f32:
        w2 = f32[W2]
    else:
        left, right = _w2_factors(f32)
        w2 = left @ right
    b, d = w2.shape[0], in_shape[0] // c
    if w2.numel() != b * d * math.prod(in_shape[1:]):
        return None
    w2 = w2.reshape(b, d, *in_shape[1:])  # the kernel (if any) stays W2's, as in W's rows
    rows = (lay.row_offset, at.shape[0]) if isinstance(lay, RowWindowLayout) else None
    if rows is None and a * b != at.shape[0]:
        return None
    work = at.work_dtype
    return Kronecker(cast(w1, at.device, work), cast(w2, at.device, work), at, rows)


def rows(t: Tensors, lay: Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of kron(W₁, W₂): a row window (module docstring), inside any window the module already has."""
    offset = lay.row_offset if isinstance(lay, RowWindowLayout) else 0
    return t, RowWindowLayout(lay.rank, lay.scale, lay.out, lay.flat_in, lay.shape, row_offset=offset + start)


ALGORITHM = Algorithm(
    name="lokr", label="LoKr", markers=(W1, W1A), keys=(W1, W1A, W1B, W2, W2A, W2B, T2, ROW_OFFSET),
    layout=layout, add_into=add_into, supports_dora=True, bypass=bypass, factored=factored, rows=rows,
    scale_from_peft_config=True, row_adder=row_adder, patch_16bit_by_rows=True,
)
