"""PEFT's adapters on an nn.Embedding (a text encoder's `token_embedding`), whose weight is (num_embeddings, dim).

LoRA (`lora_embedding_A` (r, num_embeddings), `lora_embedding_B` (dim, r), stored without `.weight`):

    W' = W + s · (B A)ᵀ = W + s · Aᵀ Bᵀ,   s = alpha / r (alpha / √r with rsLoRA)     (lora/layer.py Embedding)

Additive, at strength m: one addmm_ of the two small factors into W. Its scale is a PEFT LoRA's: an alpha in the file
(rank read from A), else the module's PEFT config (module.build_modules, as for every PEFT LoRA: patterns, rsLoRA),
else alpha = r (s = 1), as diffusers assumes. PEFT's DoRA on an
Embedding normalises the table's columns, an axis our DoRA does not take a PEFT magnitude on: such a file is refused
with that reason when it is loaded, rather than applied without its magnitude.

OFT (`oft_embedding_R.weight`, packed as PEFT's OFT `oft_R`, see peft_oft.py) rotates the embedding's columns:

    W' = W · blockdiag(R)        (oft/layer.py Embedding.merge: mm(W, R); its Linear merges W · blockdiag(R)ᵀ)

Same rotations, options and linear strength as PEFT's OFT on a Linear; only the side of R differs.
"""

import functools

import torch

from . import peft_oft
from .base import Algorithm, Layout, ShapeError, Tensors, expect, require, rows_2d, scale_from_alpha

LORA_A, LORA_B = "lora_embedding_A", "lora_embedding_B"
DORA_SCALE, PEFT_MAGNITUDE = "dora_scale", "lora_magnitude_vector"  # keys.py's (it imports this package)
DORA_REASON = ("PEFT's DoRA on an embedding (its magnitude scales the table's columns): not supported, the LoRA "
               "without its magnitude would be a different change")


def lora_layout(t: Tensors, alpha: float | None) -> Layout:
    if DORA_SCALE in t:
        raise ShapeError(DORA_REASON, PEFT_MAGNITUDE)
    down, up = require(t, LORA_A, LORA_B)
    expect(down.ndim == 2 and up.ndim == 2 and down.shape[0] == up.shape[1] > 0,
           f"lora_embedding_A {list(down.shape)} does not match lora_embedding_B {list(up.shape)}", LORA_A)
    rank, num_embeddings, dim = down.shape[0], down.shape[1], up.shape[0]
    return Layout(rank, scale_from_alpha(alpha, rank), num_embeddings, dim, (num_embeddings, dim))


def lora_add_into(t: Tensors, lay: Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    rows_2d(out).addmm_(t[LORA_A].transpose(0, 1), t[LORA_B].transpose(0, 1), alpha=lay.scale * m)


def lora_factored(t: Tensors, lay: Layout, weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ΔW = (s·Aᵀ) @ Bᵀ exactly."""
    return t[LORA_A].transpose(0, 1) * lay.scale, t[LORA_B].transpose(0, 1)


LORA = Algorithm(
    name="peft-lora-embedding", label="LoRA (PEFT, embedding)", markers=(LORA_A, LORA_B),
    keys=(LORA_A, LORA_B), layout=lora_layout, add_into=lora_add_into, factored=lora_factored,
    supports_dora=True,  # only to see the magnitude and refuse it (lora_layout)
    scale_from_peft_config=True, no_kohya_form="PEFT's LoRA on an embedding has no kohya/LyCORIS key",
)


OFT_R = "oft_embedding_R.weight"


def oft_merge_into(t: Tensors, lay: peft_oft.PeftOFTLayout, weight: torch.Tensor, m: float, reference: bool) -> None:
    rotation = peft_oft.rotations(t[OFT_R], lay).expand(lay.blocks, lay.block_size, lay.block_size)
    by_r_itself = rotation.transpose(-1, -2)  # rotate_inputs multiplies by R^T, PEFT's Embedding by R
    peft_oft.merge_rows(weight, m, lambda piece, start: peft_oft.rotate_inputs(piece, by_r_itself))


OFT = Algorithm(
    name="peft-oft-embedding", label="OFT (PEFT, embedding)", markers=(OFT_R,), keys=(OFT_R, *peft_oft.OPTION_KEYS),
    layout=functools.partial(peft_oft.layout, key=OFT_R), merge_into=oft_merge_into, uses_alpha=False,
    reads_param=True, assumable_options=peft_oft.ASSUMABLE_OPTIONS,
    no_kohya_form="PEFT's OFT on an embedding has no LyCORIS/kohya form",
)
