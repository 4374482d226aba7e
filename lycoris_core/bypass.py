"""Bypass (forward) mode: the layer's weight is never touched; each forward adds what a merge would have changed.

Linear and convolution layers are linear in their weight, so for the change a merge makes, D = W'(m) − W:

    F(x; W + D) = f(x) + F₀(x; D)          f: the layer's own forward (any weight format: fp8, quantized, offloaded)
                                           F₀: the same op without bias, on a float D

which makes bypass equal to merge up to rounding, for every algorithm and multiplier semantics. How D is reached:

* LoCon without DoRA (the common LoRA): factor by factor, never materialising D,
      F₀(x; s·m·U·D₂) = s·m · up(down(x))                     Tucker: up(mid(down(x))), mid carrying the conv geometry
* LoHa, LoKr, Full: D = m·ΔW from the factors alone (no weight needed).
* DoRA, OFT, BOFT, GLoRA, (IA)³: D depends on W, so it is computed from the layer's weight read as float.

Several adapters on one layer apply in order, as chained merges would: an adapter whose change depends on W sees
W plus the changes of the adapters before it. A contribution's tensors are staged on the compute device once
(`Contribution.on`, in the file's dtype); a forward then casts only their dtype, on the device (casting.py). The
stored tensors are never modified.

A layer whose weight is used without its forward gets the same changes added to its weight instead, when the
weight is cast for use (`changed_weight`).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .algos import BY_NAME
from .algos.locon import DOWN, MID, UP
from .casting import cast, cast_all, compute_dtype
from .module import Plan
from .patch import change

# Algorithms whose change reads the current weight (DoRA is decided by the plan).
READS_WEIGHT = frozenset({"glora", "ia3", "diag-oft", "oft-diag-v2", "kohya-oft", "boft",
                          "peft-oft", "peft-boft", "peft-ia3", "peft-oft-embedding"})
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class LayerOp:
    """The bias-free op of a Linear (conv_dims 0) or ConvNd layer, with the layer's geometry."""

    conv_dims: int = 0
    stride: tuple[int, ...] = (1,)
    padding: tuple[int, ...] | str = (0,)
    dilation: tuple[int, ...] = (1,)
    groups: int = 1

    @property
    def channel_dim(self) -> int:
        return 1 if self.conv_dims else -1

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.conv_dims:
            return F.linear(x, weight)
        return _CONV[self.conv_dims](x, weight, None, self.stride, self.padding, self.dilation, self.groups)


@dataclass(frozen=True)
class Contribution:
    """One adapter on one layer: its plan, its tensors (as stored), its strength, and the output rows it changes
    (`rows` = (start, length) when the target is a slice of a fused weight, else None)."""

    plan: Plan
    tensors: dict[str, torch.Tensor]
    strength: float
    rows: tuple[int, int] | None = None

    @property
    def reads_weight(self) -> bool:
        return reads_weight(self.plan)

    def rows_of(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.rows is None else weight.narrow(0, *self.rows)

    def change(self, weight: torch.Tensor) -> torch.Tensor:
        """D = W'(m) − W for the (fp32) weight rows this adapter targets."""
        w = self.rows_of(weight)
        return change(self.plan, cast_all(self.tensors, w.device, w.dtype), w, self.strength)

    def change_from_factors(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """D for algorithms that do not read W: the weight only lends its shape."""
        carrier = torch.empty(shape, device="meta")
        dtype = compute_dtype()
        return change(self.plan, cast_all(self.tensors, device, dtype), carrier, self.strength)

    def on(self, device: torch.device) -> "Contribution":
        """This contribution with its tensors on `device`, in the file's dtype: new tensors, so the stored ones
        stay where and as they are (one already there is shared, read-only). Tensors as large as the weight (Full's
        `diff`) stay where they are: staged, they would put a second copy of the model's weights on the device;
        they are cast at each forward, as ComfyUI streams an offloaded weight."""
        dense = BY_NAME[self.plan.algorithm].dense
        return replace(self, tensors={name: t if name in dense else cast(t, device, t.dtype)
                                      for name, t in self.tensors.items()})


def _factored_locon(c: Contribution, op: LayerOp, x: torch.Tensor, weight_shape: tuple[int, ...]
                    ) -> torch.Tensor | None:
    """up(mid(down(x))) · s·m in x's dtype; None where the factored form does not hold (grouped conv)."""
    if op.groups != 1:
        return None
    t = cast_all({k: v for k, v in c.tensors.items() if k in (UP, DOWN, MID)}, x.device, x.dtype)
    lay = c.plan.layout
    up, down = t[UP].reshape(lay.out, lay.rank), t[DOWN]
    if not op.conv_dims:
        return F.linear(F.linear(x, down.reshape(lay.rank, -1)), up) * (lay.scale * c.strength)
    point = (1,) * op.conv_dims
    if MID in t:
        inner = _CONV[op.conv_dims](x, down.reshape(lay.rank, weight_shape[1], *point))
        inner = LayerOp(op.conv_dims, op.stride, op.padding, op.dilation)(inner, t[MID])
    else:
        inner = op(x, down.reshape(lay.rank, *weight_shape[1:]))
    return _CONV[op.conv_dims](inner, up.reshape(lay.out, lay.rank, *point)) * (lay.scale * c.strength)


def _add(y: torch.Tensor, h: torch.Tensor, rows: tuple[int, int] | None, channel_dim: int) -> torch.Tensor:
    h = cast(h, y.device, y.dtype)
    if rows is None:
        return y + h
    y = y.clone()
    y.narrow(channel_dim, *rows).add_(h)
    return y


def forward(x: torch.Tensor, y: torch.Tensor, op: LayerOp, contributions: list[Contribution],
            weight: Callable[[], torch.Tensor], weight_shape: tuple[int, ...]) -> torch.Tensor:
    """y = f(x) plus every contribution, in order. `weight()` gives the layer's weight as fp32 on x's device (it
    may be the layer's own tensor: it is never modified); it is called at most once, and only when a contribution
    reads W."""
    readers = [i for i, c in enumerate(contributions) if c.reads_weight]
    last_reader = readers[-1] if readers else -1
    current = weight() if readers else None  # W plus the changes made so far, for the readers that follow
    private = False
    for i, c in enumerate(contributions):
        if i > last_reader and c.plan.algorithm == "locon" and c.plan.dora_axis is None:
            h = _factored_locon(c, op, x, weight_shape)
            if h is not None:
                y = _add(y, h, c.rows, op.channel_dim)
                continue
        if current is not None:
            d = c.change(current)
            if i < last_reader:
                if not private:
                    current, private = current.clone(), True
                c.rows_of(current).add_(d)
        else:
            rows_shape = weight_shape if c.rows is None else (c.rows[1], *weight_shape[1:])
            d = c.change_from_factors(rows_shape, x.device)
        y = _add(y, op(x, cast(d, x.device, x.dtype)), c.rows, op.channel_dim)
    return y


def changed_weight(weight: torch.Tensor, contributions: list[Contribution]) -> torch.Tensor:
    """W plus every contribution's change, in order (a reader sees the changes before it), as a new tensor in
    weight's dtype (`weight` may be a buffer of its owner's: it is never written). The maths runs in fp32, as
    `forward`'s does, and is rounded once."""
    current = cast(weight, weight.device, torch.float32, copy=True)
    for c in contributions:
        rows_shape = tuple(weight.shape) if c.rows is None else (c.rows[1], *weight.shape[1:])
        d = c.change(current) if c.reads_weight else c.change_from_factors(rows_shape, current.device)
        c.rows_of(current).add_(cast(d, current.device, current.dtype))
    return cast(current, weight.device, weight.dtype)


def reads_weight(plan: Plan) -> bool:
    """Whether this plan's change depends on the weight it is applied to."""
    return plan.dora_axis is not None or plan.algorithm in READS_WEIGHT


def is_bypassable(plan: Plan) -> bool:
    """Weights only: bias and norm parameters are not the weight of a linear op, so they are merged."""
    return BY_NAME[plan.algorithm].param == "weight"
