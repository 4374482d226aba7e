"""BOFT: butterfly orthogonal fine-tuning, M = log2(n)+1 stages of block rotations with butterfly permutations.

    R_{i,k} = Cayley(B_{i,k}) with the OFT clamp (norm over all M·n blocks, C = alpha · out)
    x ← W; for each stage i (k = 2^i · b/2):
        permute rows into butterfly order, x_k ← R_{i,k} x_k per block of b rows, permute back
    W' = ρ ⊙ x

Multiplier: linear (W + m·(W'(1) − W)) or LyCORIS' reference, which interpolates every stage,
R_{i} ← m·R_{i} + (1 − m)·I (not linear in m); rescale is not interpolated.
Every stage mixes rows only, so W is merged in place a piece of columns at a time (oft.merge_columns).

Bypass: W' = P·W with P = ρ ⊙ (butterfly) (reference) or (1 − m)·I + m·ρ ⊙ (butterfly) (linear), so
W'x + b = P(y − b) + b on the layer's output y = Wx + b (`oft.ChannelMap`). Stage i mixes the rows whose index
r = G·b/2 + o (o < b/2) differ in bit i of G only; a run of g consecutive stages i₀…i₁ is therefore one
block-diagonal map of blocks of 2^g·b/2 rows, in the order that puts bits i₀…i₁ of G (then o) last (`_group`).
The stages are grouped into runs of blocks ≤ GROUP_ROWS rows and each run's blocks formed once per injection
(by running those stages on a tiled identity): per output position, a channel gather and one batched block product
per run (about (M / g)·2^g·b/2 multiply-adds per channel) instead of a weight rebuild. Grouped convs: only when
the one block map stays within groups (oft.within_groups), else the dense path.
"""

from dataclasses import dataclass

import torch

from ..casting import cast
from .base import Algorithm, FormSite, Layout, Tensors, expect, require
from .oft import RESCALE, ChannelMap, Stage, _check_rescale, cayley, interpolate, merge_columns, within_groups

BLOCKS = "oft_blocks"


@dataclass(frozen=True)
class BOFTLayout(Layout):
    stages: int = 0
    block_size: int = 0
    constraint: float = 0.0


def layout(t: Tensors, alpha: float | None) -> Layout:
    (blocks,) = require(t, BLOCKS)
    stages, n, b = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    expect(blocks.ndim == 4 and blocks.shape[3] == b and b % 2 == 0 and n & (n - 1) == 0 and n > 0,
           f"oft_blocks must be (M, n, b, b) with n a power of two and b even, got {list(blocks.shape)}", BLOCKS)
    _check_rescale(t, n * b)
    return BOFTLayout(None, 1.0, n * b, stages=stages, block_size=b, constraint=(alpha or 0.0) * n * b)


def butterfly(rotations: torch.Tensor, weight: torch.Tensor, block_size: int, first: int = 0) -> torch.Tensor:
    """The stages first, first + 1, … (one per rotation given) applied to the rows of `weight`."""
    x = weight
    for i, rotation in enumerate(rotations, start=first):
        k = 2**i * block_size // 2
        x = x.unflatten(0, (-1, 2, k)).transpose(1, 2).flatten(0, 2).unflatten(0, (-1, block_size))
        x = torch.einsum("bij,bj...->bi...", rotation, x)
        x = x.flatten(0, 1).unflatten(0, (-1, k, 2)).transpose(1, 2).flatten(0, 2)
    return x


def merge_into(t: Tensors, lay: BOFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    rotations = cayley(t[BLOCKS], lay.constraint)
    if reference:
        rotations = interpolate(rotations, m)
    merge_columns(t, weight, m, reference, lambda columns: butterfly(rotations, columns, lay.block_size))


GROUP_ROWS = 128  # block rows of one run of stages in bypass: larger blocks do more maths, smaller ones more passes


def _group(rotations: torch.Tensor, first: int, block_size: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, blocks) of stages first…first+g−1: row σ[p] of W goes to position p, and those stages map the
    reordered rows by blockdiag(blocks) (out_i = Σ_j blocks[c, i, j] in_j), blocks of 2^g·b/2 rows."""
    g, half, device = rotations.shape[0], block_size // 2, rotations.device
    size = 2**g * half
    # new position p = ((hi·2^first + low)·2^g + mid)·half + o  ↔  row r = ((hi·2^g + mid)·2^first + low)·half + o
    hi = torch.arange(out // (2**(first + g) * half), device=device).view(-1, 1, 1, 1)
    low = torch.arange(2**first, device=device).view(1, -1, 1, 1)
    mid = torch.arange(2**g, device=device).view(1, 1, -1, 1)
    o = torch.arange(half, device=device).view(1, 1, 1, -1)
    order = (((hi * 2**g + mid) * 2**first + low) * half + o).reshape(-1)
    probe = torch.zeros(out, size, device=device, dtype=rotations.dtype)
    probe[order, torch.arange(out, device=device) % size] = 1  # the identity of each block, in W's row order
    mapped = butterfly(rotations, probe, block_size, first)
    return order, mapped[order].view(out // size, size, size)


def stages(rotations: torch.Tensor, block_size: int, out: int, row_scale: torch.Tensor | None
           ) -> tuple[list[Stage], torch.Tensor | None]:
    """The butterfly followed by `row_scale` ⊙ as mix_channels' stages (runs of stages, each a gather and one
    block-diagonal product; the gathers between runs composed) and the final gather, or None for the identity."""
    count = rotations.shape[0]
    per_run = max(1, (GROUP_ROWS // (block_size // 2)).bit_length() - 1)  # 2^g * b/2 <= GROUP_ROWS
    runs, inverse = [], None
    for first in range(0, count, per_run):
        order, blocks = _group(rotations[first:first + per_run], first, block_size, out)
        identity = first == 0  # no lower bits to move below the run's: rows keep their order
        gather = None if identity and inverse is None else (order if inverse is None else inverse[order])
        runs.append([gather, blocks, order])
        inverse = None if identity else torch.argsort(order)
    if row_scale is not None:
        _, blocks, order = runs[-1]
        runs[-1][1] = blocks * row_scale.reshape(-1)[order].view(blocks.shape[0], -1, 1)
    return [(gather, blocks) for gather, blocks, _ in runs], inverse


def bypass(t: Tensors, lay: BOFTLayout, at: FormSite) -> ChannelMap | None:
    rotations = cayley(cast(t[BLOCKS], at.device, torch.float32), lay.constraint)
    m = at.strength
    if at.reference:
        rotations = interpolate(rotations, m)
    scale = cast(t[RESCALE], at.device, torch.float32).reshape(-1) if RESCALE in t else None
    if not at.reference:
        scale = torch.full((lay.out,), m, device=rotations.device) if scale is None else scale * m
    runs, last = stages(rotations, lay.block_size, lay.out, scale)
    keep = 0.0 if at.reference else 1.0 - m
    if len(runs) == 1 and runs[0][0] is None and last is None and keep:  # one block map: fold (1 - m) I into it
        blocks = runs[0][1]
        runs, keep = [(None, blocks + keep * torch.eye(blocks.shape[-1], device=blocks.device))], 0.0
    return ChannelMap(runs, last, keep, at) if within_groups(runs, last, at) else None


ALGORITHM = Algorithm(
    name="boft", label="BOFT", markers=(BLOCKS,), marker_ndim=4, keys=(BLOCKS, RESCALE),
    layout=layout, merge_into=merge_into, bypass=bypass, reads_param=True,
    no_peft_form="LyCORIS' BOFT has no PEFT form with the same maths (PEFT's BOFT differs in its butterfly "
                 "permutations)",
)
