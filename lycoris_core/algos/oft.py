"""Diag-OFT: an orthogonal rotation of the weight's output rows, block by block.

    Q = B − Bᵀ per block;  if C > 0: Q ← Q · min(1, C / (‖Q‖_F + 1e-8))   (norm over all blocks, C = alpha · out)
    R = (I + Q)(I − Q)⁻¹                                                   (Cayley, fp32 or wider)
    W'_k = ρ_k ⊙ (R_kᵀ W_k),   W_k = W[k·b:(k+1)·b]                        (ρ = optional `rescale`)

Multiplier: linear (W + m·(W'(1) − W)) or LyCORIS' reference R ← I + m(R − I), rescale not interpolated.
Old LyCORIS 2.0 files store R itself as `oft_diag` (rescale already folded in); they use the same rotation.
Both multipliers make W'(m) = P·W with P block-diagonal over the output rows (the blocks P_k below), so W is merged
in place a piece of whole blocks of rows at a time (contiguous rows, one batched product each, `merge_blocks`): no
weight-sized temporary, and one pass over W.
The clamp is a tensor op, not a Python branch, so computing a patch never reads a value back to the host.

Bypass: W' = P·W with P block-diagonal over the output rows, so W'x + b = P(y − b) + b = P·y + c for y = Wx + b,
c = b − P·b (`ChannelMap`, P and c formed once per injection in fp32):

    linear:     P_k = (1 − m)·I + m·diag(ρ_k)·R_kᵀ        reference:  P_k = diag(ρ_k)·(I + m(R_k − I))ᵀ

b·b multiply-adds per output channel and position instead of a weight rebuild (convs: a grouped 1×1 conv on the
output, whatever the layer's kernel, stride or padding, since P acts on output channels only). A grouped conv has
the form only when no block spans two groups (`within_groups`): row o of W' = P·W meets only the inputs of o's group.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..casting import cast, pieces
from .base import CONV, Algorithm, Form, FormSite, Layout, Tensors, expect, require, rows_2d

BLOCKS, RESCALE, OLD_R = "oft_blocks", "rescale", "oft_diag"


@dataclass(frozen=True)
class OFTLayout(Layout):
    blocks: int = 0
    block_size: int = 0
    constraint: float = 0.0  # C = alpha · out; 0 means unconstrained


def _check_rescale(t: Tensors, out: int) -> None:
    if RESCALE in t:
        expect(t[RESCALE].numel() == out, f"rescale has {t[RESCALE].numel()} values for {out} output rows", RESCALE)


def layout(t: Tensors, alpha: float | None) -> Layout:
    (blocks,) = require(t, BLOCKS)
    expect(blocks.ndim == 3 and blocks.shape[2] == blocks.shape[1], f"oft_blocks must be (n, b, b), got "
           f"{list(blocks.shape)}", BLOCKS)
    n, b = blocks.shape[0], blocks.shape[1]
    _check_rescale(t, n * b)
    return OFTLayout(None, 1.0, n * b, blocks=n, block_size=b, constraint=(alpha or 0.0) * n * b)


def layout_old(t: Tensors, alpha: float | None) -> Layout:
    (rotation,) = require(t, OLD_R)
    expect(rotation.ndim == 3 and rotation.shape[2] == rotation.shape[1],
           f"oft_diag must be (n, b, b), got {list(rotation.shape)}", OLD_R)
    n, b = rotation.shape[0], rotation.shape[1]
    return OFTLayout(None, 1.0, n * b, blocks=n, block_size=b)


def cayley(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """R = (I+Q)(I−Q)⁻¹ for Q = B − Bᵀ, optionally clamped to ‖Q‖_F ≤ C; works for (…, b, b) stacks."""
    q = blocks - blocks.transpose(-1, -2)
    if constraint > 0:
        q = q * torch.clamp(constraint / (torch.linalg.vector_norm(q) + 1e-8), max=1.0)
    eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


def interpolate(rotation: torch.Tensor, multiplier: float) -> torch.Tensor:
    """I + m(R − I): LyCORIS' reference multiplier for orthogonal factors."""
    eye = torch.eye(rotation.shape[-1], device=rotation.device, dtype=rotation.dtype)
    return eye + multiplier * (rotation - eye)


def merge_columns(t: Tensors, weight: torch.Tensor, m: float, reference: bool,
                  rotate: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """W ← ρ ⊙ rotate(W) (reference: the rotations are already interpolated) or W + m·(ρ ⊙ rotate(W) − W)
    (linear), in place, for `rotate` acting on the rows of an (out, n) piece of W₂ and returning a new tensor."""
    rows = rows_2d(weight)
    rescale = t[RESCALE].reshape(-1, 1) if RESCALE in t else None
    for start, length in pieces(rows.shape[1], rows.shape[0] * rows.element_size()):
        columns = rows[:, start:start + length]
        rotated = rotate(columns)
        if rescale is not None:
            rotated.mul_(rescale)
        if reference:
            columns.copy_(rotated)
        else:
            columns.lerp_(rotated, m)


def _merge_into(rotation: torch.Tensor, t: Tensors, weight: torch.Tensor, m: float, reference: bool) -> None:
    merge_blocks(row_blocks(rotation.to(weight.dtype), t, m, reference), weight)


def merge_into(t: Tensors, lay: OFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    _merge_into(cayley(t[BLOCKS], lay.constraint), t, weight, m, reference)


def merge_into_old(t: Tensors, lay: OFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    _merge_into(t[OLD_R], t, weight, m, reference)


# --- bypass: a map of the layer's output channels -------------------------------------------------------------------

Stage = tuple[torch.Tensor | None, torch.Tensor]  # (gather: channel order before the blocks, or None; blocks (n, S, S))


def mix_channels(h: torch.Tensor, stages: list[Stage], last: torch.Tensor | None, conv_dims: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """P·h along the channels (last dim for Linear, dim 1 for convs), P = Π_last · B_G Π_G ⋯ B_1 Π_1 given as
    stages (Π: a channel gather, None for the identity; B = blockdiag(blocks), out_i = Σ_j blocks[k, i, j] h_j
    within block k), plus `bias` (added by the last block op when there is no final gather)."""
    dim = 1 if conv_dims else h.ndim - 1
    for i, (order, blocks) in enumerate(stages):
        if order is not None:
            h = h.index_select(dim, order)
        add = bias if i == len(stages) - 1 and last is None else None
        n, size = blocks.shape[0], blocks.shape[1]
        if conv_dims:
            h = CONV[conv_dims](h, blocks.reshape(n * size, size, *(1,) * conv_dims), add, groups=n)
        elif n == 1:
            h = F.linear(h, blocks[0], add)
        else:
            h = torch.einsum("...kj,kij->...ki", h.unflatten(-1, (n, size)), blocks).flatten(-2)
            h = h if add is None else h + add
    if last is not None:
        h = h.index_select(dim, last)
        if bias is not None:
            h = h + (bias if not conv_dims else bias.reshape(-1, *(1,) * conv_dims))
    return h


class ChannelMap(Form):
    """W' = (P + keep·I)·W for P given as `stages` (mix_channels), computed in fp32 and cast once:

        output-side: W'x + b = P·y + keep·y + c,   c = b − (P + keep·I)·b     (y = Wx + b: the bias is kept)
        input-side (`input_side`): W'x = W·(P + keep·I)·x, the layer's op then sees the mapped input."""

    def __init__(self, stages: list[Stage], last: torch.Tensor | None, keep: float, at: FormSite,
                 input_side: bool = False):
        self.conv_dims, self.keep, self.input_side = at.op.conv_dims, keep, input_side
        self.dtype = at.work_dtype
        stages = [(None if order is None else order.to(at.device), cast(blocks, at.device, torch.float32))
                  for order, blocks in stages]
        self.last = None if last is None else last.to(at.device)
        self.stages = [(order, cast(blocks, at.device, self.dtype)) for order, blocks in stages]
        self.bias = None
        if not input_side and at.bias is not None:
            b = at.bias.reshape(1, -1)
            self.bias = cast(b - mix_channels(b, stages, self.last, 0) - keep * b, at.device, self.dtype).reshape(-1)

    def _map(self, h: torch.Tensor) -> torch.Tensor:
        work = h.to(self.dtype)
        out = mix_channels(work, self.stages, self.last, self.conv_dims, self.bias)
        if self.keep:
            out = out.add_(work, alpha=self.keep)
        return out.to(h.dtype)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return self._map(x)

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if self.input_side else self._map(y)


def row_blocks(rotation: torch.Tensor, t: Tensors, m: float, reference: bool) -> torch.Tensor:
    """The blocks P_k of W'(m) = blockdiag(P)·W (module docstring), in rotation's dtype."""
    eye = torch.eye(rotation.shape[-1], device=rotation.device, dtype=rotation.dtype)
    rescale = None
    if RESCALE in t:
        rescale = cast(t[RESCALE], rotation.device, rotation.dtype).reshape(rotation.shape[0], -1, 1)
    if reference:
        blocks = interpolate(rotation, m).transpose(-1, -2)
        return blocks if rescale is None else blocks * rescale
    blocks = rotation.transpose(-1, -2) if rescale is None else rotation.transpose(-1, -2) * rescale
    return torch.lerp(eye.expand_as(blocks), blocks, m)


def merge_blocks(blocks: torch.Tensor, weight: torch.Tensor) -> None:
    """W_k ← P_k·W_k in place for each block k of b rows: a piece of whole blocks (contiguous rows) at a time, one
    batched product into a piece-sized temporary, copied back."""
    n, b = blocks.shape[0], blocks.shape[1]
    rows = rows_2d(weight)
    columns = rows.shape[1]
    for start, count in pieces(n, b * columns * rows.element_size()):
        part = rows[start * b:(start + count) * b].view(count, b, columns)
        part.copy_(torch.bmm(blocks[start:start + count], part))


def within_groups(stages: list[Stage], last: torch.Tensor | None, at: FormSite) -> bool:
    """Whether P·(W x) is W'x for W' = P·W: a grouped conv applies row o of W' to the inputs of o's group, so P may
    mix only rows of one group (one block map whose blocks each lie within a group)."""
    groups = at.op.groups
    if groups == 1:
        return True
    size = stages[0][1].shape[1]
    return len(stages) == 1 and stages[0][0] is None and last is None and (at.shape[0] // groups) % size == 0


def row_rotation(rotation: torch.Tensor, t: Tensors, at: FormSite) -> ChannelMap | None:
    stages = [(None, row_blocks(cast(rotation, at.device, torch.float32), t, at.strength, at.reference))]
    return ChannelMap(stages, None, 0.0, at) if within_groups(stages, None, at) else None


def bypass(t: Tensors, lay: OFTLayout, at: FormSite) -> ChannelMap | None:
    return row_rotation(cayley(cast(t[BLOCKS], at.device, torch.float32), lay.constraint), t, at)


def bypass_old(t: Tensors, lay: OFTLayout, at: FormSite) -> ChannelMap | None:
    return row_rotation(t[OLD_R], t, at)


ALGORITHM = Algorithm(
    name="diag-oft", label="Diag-OFT", markers=(BLOCKS,), marker_ndim=3, keys=(BLOCKS, RESCALE),
    layout=layout, merge_into=merge_into, bypass=bypass, reads_param=True,
    no_peft_form="LyCORIS' diag-OFT has no PEFT form with the same maths (PEFT's OFT rotates by its own "
                 "Cayley-Neumann series and block layout)",
)
OLD_ALGORITHM = Algorithm(
    name="oft-diag-v2", label="Diag-OFT (LyCORIS 2.0)", markers=(OLD_R,), keys=(OLD_R,),
    layout=layout_old, merge_into=merge_into_old, uses_alpha=False, bypass=bypass_old, reads_param=True,
    no_peft_form="LyCORIS 2.0's OFT has no PEFT form with the same maths",
)
