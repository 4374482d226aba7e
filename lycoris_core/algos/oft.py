"""Diag-OFT: an orthogonal rotation of the weight's output rows, block by block.

    Q = B − Bᵀ per block;  if C > 0: Q ← Q · min(1, C / (‖Q‖_F + 1e-8))   (norm over all blocks, C = alpha · out)
    R = (I + Q)(I − Q)⁻¹                                                   (Cayley, fp32 or wider)
    W'_k = ρ_k ⊙ (R_kᵀ W_k),   W_k = W[k·b:(k+1)·b]                        (ρ = optional `rescale`)

Multiplier: linear (W + m·(W'(1) − W)) or LyCORIS' reference R ← I + m(R − I), rescale not interpolated.
Old LyCORIS 2.0 files store R itself as `oft_diag` (rescale already folded in); they use the same rotation.
The rotations mix rows only, so W is merged in place a piece of columns at a time (`merge_columns`): no
weight-sized temporary.
The clamp is a tensor op, not a Python branch, so computing a patch never reads a value back to the host.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..casting import pieces
from .base import Algorithm, Layout, Tensors, expect, require, rows_2d

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


def rotate_rows(rotation: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """W'_k = R_kᵀ W_k for each block k of output rows."""
    n, b = rotation.shape[0], rotation.shape[1]
    rows = weight.reshape(n, b, *weight.shape[1:])
    return torch.einsum("knm,kn...->km...", rotation, rows).reshape(weight.shape)


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
    if reference:
        rotation = interpolate(rotation, m)
    merge_columns(t, weight, m, reference, lambda columns: rotate_rows(rotation, columns))


def merge_into(t: Tensors, lay: OFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    _merge_into(cayley(t[BLOCKS], lay.constraint), t, weight, m, reference)


def merge_into_old(t: Tensors, lay: OFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    _merge_into(t[OLD_R], t, weight, m, reference)


ALGORITHM = Algorithm(
    name="diag-oft", label="Diag-OFT", markers=(BLOCKS,), marker_ndim=3, keys=(BLOCKS, RESCALE),
    layout=layout, merge_into=merge_into,
)
OLD_ALGORITHM = Algorithm(
    name="oft-diag-v2", label="Diag-OFT (LyCORIS 2.0)", markers=(OLD_R,), keys=(OLD_R,),
    layout=layout_old, merge_into=merge_into_old, uses_alpha=False,
)
