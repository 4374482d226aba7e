"""PEFT's (IA)³ (`ia3_l`): the weight scaled per OUTPUT channel, or per INPUT channel on feed-forward layers.

    normal layer:        W'[o, …] = l[o] · W[o, …]         `ia3_l` (out, 1); conv (1, out, 1, 1)
    feed-forward layer:  W'[:, i, …] = l[i] · W[:, i, …]   `ia3_l` (1, in);  conv (1, in, 1, 1)
    so ΔW = (l − 1) ⊙ W along that axis (l = 1 is "no change", unlike LyCORIS' (IA)³ where it is 0).

Which side: a Linear's shape tells; a conv's does not, so it comes from the config (`feedforward_modules`, as the
scalar entry `peft_option.is_feedforward`), else from the weight when only one of its channel counts fits, else
PEFT's default (not feed-forward), listed in the layout's `assumed`.

PEFT's merge also scales the bias of a layer that is not feed-forward: b' = l ⊙ b. That is a module of its own
(`BIAS_ALGORITHM`, on the layer's bias, same strength semantics: b + m·((l − 1) ⊙ b)); a feed-forward layer has
none. Its side is told the same way; a conv without config whose `ia3_l` does not fit the bias scales the inputs.

Patched as W += m·((l − 1) ⊙ W), one in-place addcmul_ broadcast along the axis (no weight-sized temporary).

Bypass: ia3.ChannelScale with s = 1 + m·(l − 1), on the output channels (the bias kept: its own change is the bias
module's) or on the input (feed-forward layers, an input-side form).
"""

from dataclasses import dataclass, replace

import torch

from ..casting import cast
from .base import Algorithm, FormSite, Layout, ShapeError, Tensors, expect, require
from .ia3 import ChannelScale
from .peft_oft import OPTION_PREFIX, read_options

SCALES = "ia3_l"
FEEDFORWARD = "is_feedforward"
OPTION_KEYS = (OPTION_PREFIX + FEEDFORWARD,)


@dataclass(frozen=True)
class PeftIA3Layout(Layout):
    axis: int | None = None  # 0: output channels, 1: input channels; None until the weight tells (resolve)
    length: int = 0
    assumed: tuple[str, ...] = ()

    def resolve(self, weight_shape: tuple[int, ...]) -> Layout:
        fits = [axis for axis in (0, 1) if len(weight_shape) > axis and weight_shape[axis] == self.length]
        if self.axis is not None:
            if self.axis in fits:
                return self
            side = "input" if self.axis else "output"
            raise ShapeError(f"(IA)3 scales {self.length} {side} channels, the weight's shape is "
                             f"{list(weight_shape)}", SCALES)
        if not fits:
            raise ShapeError(f"(IA)3 scales {self.length} channels, the weight's shape is {list(weight_shape)}",
                             SCALES)
        if len(fits) == 1:
            return replace(self, axis=fits[0])
        return replace(self, axis=0, assumed=self.assumed + (f"{FEEDFORWARD}=False",))


def axis_from_shape(scales: torch.Tensor) -> int | None:
    """A Linear's (out, 1) or (1, in) tells the side; a conv's (1, n, 1, 1) and a (1, 1) do not."""
    if scales.ndim == 2 and scales.shape[0] > 1 and scales.shape[1] == 1:
        return 0
    if scales.ndim == 2 and scales.shape[0] == 1 and scales.shape[1] > 1:
        return 1
    return None


def _axis(t: Tensors) -> tuple[int | None, int]:
    """(side if the shape or the config tells it, number of scales)."""
    (scales,) = require(t, SCALES)
    expect(scales.ndim >= 2 and sorted(scales.shape)[-2] == 1 and (scales.ndim == 2 or scales.shape[0] == 1),
           f"ia3_l must be (out, 1), (1, in) or (1, n, 1, …), got {list(scales.shape)}", SCALES)
    axis = axis_from_shape(scales)
    if axis is None and OPTION_PREFIX + FEEDFORWARD in t:
        options, _ = read_options(t, {FEEDFORWARD: False})
        axis = 1 if options[FEEDFORWARD] else 0
    return axis, scales.numel()


def layout(t: Tensors, alpha: float | None) -> Layout:
    axis, length = _axis(t)
    return PeftIA3Layout(None, 1.0, out=-1, axis=axis, length=length)


def add_into(t: Tensors, lay: PeftIA3Layout, weight: torch.Tensor, m: float, out: torch.Tensor) -> None:
    shape = [1] * weight.ndim
    shape[lay.axis] = lay.length
    out.addcmul_(weight, t[SCALES].reshape(shape) - 1, value=m)


def bypass(t: Tensors, lay: PeftIA3Layout, at: FormSite) -> ChannelScale:
    return ChannelScale(1 + at.strength * (cast(t[SCALES], at.device, torch.float32).reshape(-1) - 1), lay.axis, at)


def _scale_rows(t: Tensors, start: int, count: int) -> Tensors:
    """ia3_l restricted to channels [start, start + count) (its one dimension longer than 1, or its first)."""
    scales = t[SCALES]
    dim = next((d for d, n in enumerate(scales.shape) if n > 1), 0)
    return {**t, SCALES: scales.narrow(dim, start, count)}


def rows(t: Tensors, lay: PeftIA3Layout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Rows of W' = diag(l)·W are scaled by their own l; a feed-forward layer's l scales every row's inputs alike."""
    if lay.axis:
        return t, lay
    return _scale_rows(t, start, count), replace(lay, out=count, length=count)


ALGORITHM = Algorithm(
    name="peft-ia3", label="(IA)³ (PEFT)", markers=(SCALES,), keys=(SCALES, *OPTION_KEYS),
    layout=layout, add_into=add_into, uses_alpha=False, bypass=bypass, rows=rows, reads_param=True,
    assumable_options="these layers in its feedforward_modules, so their inputs are scaled",
    no_kohya_form="PEFT's IA3 multiplies by its vector; LyCORIS' (IA)³ by 1 + w and only on one side: no same maths",
)


@dataclass(frozen=True)
class PeftIA3BiasLayout(Layout):
    length: int = 0
    told: bool = True  # the side is known to be the output side; else (a conv without config) the bias tells
    scales: bool = True  # False: the weight's inputs are scaled, the bias is left as it is

    def resolve(self, bias_shape: tuple[int, ...]) -> Layout:
        if tuple(bias_shape) == (self.length,):
            return self
        if not self.told:  # as PeftIA3Layout.resolve: only the weight's input count fits, so inputs are scaled
            return replace(self, scales=False)
        raise ShapeError(f"(IA)3 scales {self.length} output channels, the bias's shape is {list(bias_shape)}", SCALES)


def bias_layout(t: Tensors, alpha: float | None) -> Layout | None:
    """The bias part, or None for a feed-forward layer (PEFT leaves its bias as it is)."""
    axis, length = _axis(t)
    return None if axis == 1 else PeftIA3BiasLayout(None, 1.0, out=-1, length=length, told=axis == 0)


def add_bias_into(t: Tensors, lay: PeftIA3BiasLayout, bias: torch.Tensor, m: float, out: torch.Tensor) -> None:
    if lay.scales:
        out.addcmul_(bias, t[SCALES].reshape(-1) - 1, value=m)


def bias_rows(t: Tensors, lay: PeftIA3BiasLayout, start: int, count: int) -> tuple[Tensors, Layout]:
    """Entries [start, start + count) of b' = l ⊙ b: their own scales (none scaled when the inputs are)."""
    if not lay.scales:
        return t, lay
    return _scale_rows(t, start, count), replace(lay, out=count, length=count)


BIAS_ALGORITHM = Algorithm(
    name="peft-ia3-bias", label="(IA)³ (PEFT, bias)", markers=(SCALES,), keys=(SCALES, *OPTION_KEYS),
    layout=bias_layout, add_into=add_bias_into, param="bias", uses_alpha=False, optional=True, rows=bias_rows,
    reads_param=True,  # b' = l * b (elementwise): the change of the bias is read from the bias
    no_kohya_form="PEFT's IA3 bias part has no LyCORIS/kohya form",
)
