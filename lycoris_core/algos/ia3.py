"""(IA)³: a learned per-channel scaling of the weight.

    on_input = 0:  W'[o, …] = W[o, …] · (1 + m·w[o])        on_input = 1:  W'[:, i, …] = W[:, i, …] · (1 + m·w[i])
    so ΔW = w ⊙ W along that axis.

Patched as W += m·(w ⊙ W), one in-place addcmul_ broadcast along the axis (no temporary).

`weight` is (out,) for Linear and (1, out, 1…) for conv (or the `in` forms); only its length matters.

Bypass (`ChannelScale`): a scale of the layer's output channels, W'x + b = (1 + m·w) ⊙ (y − b) + b, or of its
input channels, W'x = W·((1 + m·w) ⊙ x) (an input-side form; a grouped conv's scale repeats for every group): one
multiply per element, whatever the kernel, stride or padding.
"""

from dataclasses import dataclass, replace

import torch

from ..casting import cast
from .base import Algorithm, Form, FormSite, Layout, ShapeError, Tensors, require, scalar

WEIGHT, ON_INPUT = "weight", "on_input"


@dataclass(frozen=True)
class IA3Layout(Layout):
    axis: int = 0  # 0: output channels, 1: input channels
    length: int = 0

    def resolve(self, weight_shape: tuple[int, ...]) -> Layout:
        if len(weight_shape) <= self.axis or weight_shape[self.axis] != self.length:
            side = "input" if self.axis else "output"
            raise ShapeError(f"(IA)3 scales {self.length} {side} channels, the weight's shape is {list(weight_shape)}",
                             WEIGHT)
        return self


def layout(t: Tensors, alpha: float | None) -> Layout:
    (scales,) = require(t, WEIGHT)
    axis = 1 if bool(scalar(t, ON_INPUT)) else 0
    return IA3Layout(None, 1.0, out=scales.numel() if axis == 0 else -1, axis=axis, length=scales.numel())


def add_into(t: Tensors, lay: IA3Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    shape = [1] * weight.ndim
    shape[lay.axis] = lay.length
    out.addcmul_(weight, t[WEIGHT].reshape(shape), value=m)


class ChannelScale(Form):
    """W' = diag(s)·W (output side: s ⊙ (y − b) + b = s ⊙ y + c, c = b − s ⊙ b) or W' = W·diag(s) (input side,
    `axis` 1: W·(s ⊙ x)), s formed once in fp32 and cast."""

    def __init__(self, scale: torch.Tensor, axis: int, at: FormSite):
        self.op, self.input_side = at.op, axis == 1
        if self.input_side:
            scale = scale.repeat(at.op.groups)  # W's axis 1 holds one group's inputs
        self.scale = at.cast(scale)
        shift = None if self.input_side or at.bias is None else at.cast(at.bias - scale * at.bias)
        self.shift = shift if shift is None or not at.op.conv_dims else shift.reshape(-1, *at.op.point)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return self.op.scale_channels(x, self.scale) if self.input_side else x

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.input_side:
            return y
        scaled = self.op.scale_channels(y, self.scale)
        return scaled if self.shift is None else scaled.add_(self.shift)


def bypass(t: Tensors, lay: IA3Layout, at: FormSite) -> ChannelScale:
    return ChannelScale(1 + at.strength * cast(t[WEIGHT], at.device, torch.float32).reshape(-1), lay.axis, at)


def rows(t: Tensors, lay: IA3Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of W' = diag(s)·W: their scales; an input-side W·diag(s) scales every row's inputs alike."""
    if lay.axis:
        return t, lay
    return {**t, WEIGHT: t[WEIGHT].reshape(-1).narrow(0, start, count)}, replace(lay, out=count, length=count)


ALGORITHM = Algorithm(
    name="ia3", label="(IA)³", markers=(ON_INPUT,), keys=(WEIGHT,),
    layout=layout, add_into=add_into, uses_alpha=False, bypass=bypass, rows=rows, reads_param=True,
    no_peft_form="LyCORIS' (IA)³ scales W's columns by 1 + w; PEFT's IA3 multiplies by its vector itself (no "
                 "identity)",
)
