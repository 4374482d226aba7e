"""PEFT's LoRA bias (`lora_bias=True`): `lora_B` is a layer with a bias, which PEFT's merge adds to the layer's bias.

    b' = b + s · lora_B.bias,   s = alpha / r (alpha / √r with rsLoRA), the scale of the module's LoRA weight

A bias part of its own (on the layer's bias), additive, at the same strength as the weight: b + m·s·lora_B.bias.
Its scale is the LoRA's: from an alpha in the file (the rank read from the module's `lora_B.weight`), else from the
PEFT config (module.build_modules, as for the weight), else alpha = rank (s = 1), as diffusers assumes.
"""

import torch

from .base import Algorithm, Layout, Tensors, expect, narrowed_rows, require, scale_from_alpha

BIAS = "lora_B.bias"
UP = "lora_up.weight"  # lora_B.weight under its canonical name: only its rank is read


def layout(t: Tensors, alpha: float | None) -> Layout:
    bias, up = require(t, BIAS, UP)
    expect(bias.ndim == 1 and bias.shape[0] == up.shape[0],
           f"lora_B.bias {list(bias.shape)} does not match lora_B.weight {list(up.shape)}", BIAS)
    rank = up.shape[1]
    return Layout(rank, scale_from_alpha(alpha, rank), bias.shape[0], shape=tuple(bias.shape))


def add_into(t: Tensors, lay: Layout, bias: torch.Tensor, m: float, out: torch.Tensor) -> None:
    out.add_(t[BIAS], alpha=lay.scale * m)


def rows(t: Tensors, lay: Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows [start, start + count) of the bias change: those entries of lora_B.bias (and lora_B's rows)."""
    return narrowed_rows(t, lay, start, count, BIAS, UP)


ALGORITHM = Algorithm(
    name="peft-lora-bias", label="LoRA (PEFT, bias)", markers=(BIAS,), keys=(BIAS, UP),
    layout=layout, add_into=add_into, param="bias", layout_only=(UP,), rows=rows, scale_from_peft_config=True,
    no_kohya_form="PEFT's LoRA bias (lora_B.bias) has no kohya/LyCORIS LoRA key",
)
