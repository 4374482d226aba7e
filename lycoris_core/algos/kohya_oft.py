"""kohya sd-scripts' own OFT (`networks.oft`): a rotation of the weight's output rows, block by block.

    Q = B − Bᵀ per block;  Q ← Q · (min(‖Q‖_F, C) + ε) / (‖Q‖_F + ε)     (norm over all blocks, C = alpha · out, ε = 1e-8)
    R = (I + Q)(I − Q)⁻¹                                                 (Cayley, fp32 or wider)
    W'_k = R_kᵀ W_k,   W_k = W[k·b:(k+1)·b]                              (Linear and Conv2d alike: rows only)

Multiplier: sd-scripts' own R ← I + m(R − I) (strength_mode "lycoris"), or linear W + m·(W'(1) − W), which is the
same: W + m(RᵀW − W) = (I + m(R − I))ᵀW, kohya's OFT having no rescale.
Where it differs from LyCORIS' diag-OFT (oft.py), which has the same layout: alpha = 0 clamps Q to 0 here (no change)
but means "unconstrained" there; ε sits on both sides of the ratio; there is no `rescale`; and alpha is required
(sd-scripts cannot load a file without it either). sd-scripts writes `oft_unet_….oft_blocks`; keys.py reads those
blocks under BLOCKS, so that the file's own definition is the one applied.

Bypass: the output-channel map of oft.py (`oft.row_rotation`), from this file's own Cayley transform.
"""

import torch

from ..casting import cast
from .base import Algorithm, FormSite, Layout, ShapeError, Tensors, expect, require
from .oft import ChannelMap, OFTLayout, merge_blocks, row_blocks, row_rotation

BLOCKS = "kohya_oft_blocks"
EPSILON = 1e-8


def layout(t: Tensors, alpha: float | None) -> Layout:
    (blocks,) = require(t, BLOCKS)
    n, b = blocks.shape[0], blocks.shape[1]
    expect(blocks.ndim == 3 and blocks.shape[2] == b, f"oft_blocks must be (n, b, b), got {list(blocks.shape)}", BLOCKS)
    if alpha is None:
        raise ShapeError("kohya OFT needs alpha, its constraint", "alpha")
    return OFTLayout(None, 1.0, n * b, blocks=n, block_size=b, constraint=alpha * n * b)


def cayley(blocks: torch.Tensor, constraint: float) -> torch.Tensor:
    """R = (I+Q)(I−Q)⁻¹ for Q = B − Bᵀ with ‖Q‖_F clamped to C as sd-scripts does it (a tensor op: no host read)."""
    q = blocks - blocks.transpose(-1, -2)
    norm = torch.linalg.vector_norm(q)
    q = q * ((torch.clamp(norm, max=constraint) + EPSILON) / (norm + EPSILON))
    eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


def merge_into(t: Tensors, lay: OFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    merge_blocks(row_blocks(cayley(t[BLOCKS], lay.constraint), t, m, reference), weight)


def bypass(t: Tensors, lay: OFTLayout, at: FormSite) -> ChannelMap | None:
    return row_rotation(cayley(cast(t[BLOCKS], at.device, torch.float32), lay.constraint), t, at)


ALGORITHM = Algorithm(
    name="kohya-oft", label="OFT (kohya)", markers=(BLOCKS,), marker_ndim=3, keys=(BLOCKS,),
    layout=layout, merge_into=merge_into, bypass=bypass, reads_param=True,
    no_peft_form="kohya's OFT has no PEFT form with the same maths (PEFT's OFT uses its own Cayley-Neumann rotation)",
)
