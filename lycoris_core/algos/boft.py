"""BOFT: butterfly orthogonal fine-tuning, M = log2(n)+1 stages of block rotations with butterfly permutations.

    R_{i,k} = Cayley(B_{i,k}) with the OFT clamp (norm over all M·n blocks, C = alpha · out)
    x ← W; for each stage i (k = 2^i · b/2):
        permute rows into butterfly order, x_k ← R_{i,k} x_k per block of b rows, permute back
    W' = ρ ⊙ x

Multiplier: linear (W + m·(W'(1) − W)) or LyCORIS' reference, which interpolates every stage,
R_{i} ← m·R_{i} + (1 − m)·I (not linear in m); rescale is not interpolated.
Every stage mixes rows only, so W is merged in place a piece of columns at a time (oft.merge_columns).
"""

from dataclasses import dataclass

import torch

from .base import Algorithm, Layout, Tensors, expect, require
from .oft import RESCALE, _check_rescale, cayley, interpolate, merge_columns

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


def butterfly(rotations: torch.Tensor, weight: torch.Tensor, block_size: int) -> torch.Tensor:
    x = weight
    for i, rotation in enumerate(rotations):
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


ALGORITHM = Algorithm(
    name="boft", label="BOFT", markers=(BLOCKS,), marker_ndim=4, keys=(BLOCKS, RESCALE),
    layout=layout, merge_into=merge_into,
)
