"""(IA)³: a learned per-channel scaling of the weight.

    on_input = 0:  W'[o, …] = W[o, …] · (1 + m·w[o])        on_input = 1:  W'[:, i, …] = W[:, i, …] · (1 + m·w[i])
    so ΔW = w ⊙ W along that axis.

Patched as W += m·(w ⊙ W), one in-place addcmul_ broadcast along the axis (no temporary).

`weight` is (out,) for Linear and (1, out, 1…) for conv (or the `in` forms); only its length matters.
"""

from dataclasses import dataclass

import torch

from .base import Algorithm, Layout, ShapeError, Tensors, require, scalar

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


ALGORITHM = Algorithm(
    name="ia3", label="(IA)³", markers=(ON_INPUT,), keys=(WEIGHT,),
    layout=layout, add_into=add_into, uses_alpha=False,
)
