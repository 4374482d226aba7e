"""Bypass (forward) mode: the layer's weight is never touched; each forward adds what a merge would have changed.

Linear and convolution layers are linear in their weight. Several adapters on one layer apply in order, as chained
merges would (W₀ = W, Wₖ = the k-th adapter applied to Wₖ₋₁, each reading the weight before it), and each has a
form (algos.base.Form) with

    Wₖ·x = outputₖ(Wₖ₋₁ · inputₖ(x), x)

so the whole chain runs the layer's own forward f once, on the input every input-side change has mapped, then
each adapter's output in order:

    x₀ = input₁(input₂(… inputₙ(x))),   y = f(x₀) = W·x₀ + b,   y ← outputₖ(y, xₖ) for k = 1…n   (xₖ: what adapter
    k was given, xₙ = x)

f is the layer's own forward in whatever form its weight is stored (fp8, quantized, offloaded, GGUF); the forms
never form a weight-sized tensor per forward. Forms are prepared once per injection (`prepare`), reading the
weight then if some adapter's change depends on it (DoRA's norm, GLoRA's W·A, the bias an output-side map keeps).

An adapter without a form (Full, a Tucker LoHa, a grouped conv, an input-side change on some rows of a fused
weight) takes the dense path: its change D = W'(m) − W is formed in every forward and F₀(xₖ; D) added, F₀ being the
op without bias; if D depends on W, W is read in every forward. Both paths equal a merge up to rounding.

A contribution's tensors are staged on the compute device once (`Contribution.on`, in the file's dtype); forms cast
what they keep to the input's dtype once. The stored tensors are never modified.

A layer whose weight is used without its forward gets the same changes added to its weight instead, when the
weight is cast for use (`changed_weight`).

A change of the layer's bias (a `diff_b`, PEFT's bias parts) is bypassed only where merging it would round it into
the stored bias (the nodes decide: an fp8 bias, or one ComfyUI merges through a narrower copy): the bias changes, in order, are summed once per injection (`prepare`, reading the
bias) and added to the output after every weight change, as a merged bias would be (output-side maps keep the
layer's stored bias, so they never scale it).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import dora
from .algos import BY_NAME
from .algos.base import Form, FormSite, LayerOp
from .casting import cast, cast_all, compute_dtype
from .module import Plan
from .patch import change


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


def _rows(t: torch.Tensor | None, rows: tuple[int, int] | None, dim: int) -> torch.Tensor | None:
    return t if t is None or rows is None else t.narrow(dim, *rows)


def _form(c: Contribution, op: LayerOp, shape: tuple[int, ...], x: torch.Tensor,
          weight: torch.Tensor | None, bias: torch.Tensor | None) -> Form | None:
    """The contribution's form at this site, or None for the dense path."""
    algorithm = BY_NAME[c.plan.algorithm]
    if algorithm.bypass is None:
        return None
    rows_shape = shape if c.rows is None else (c.rows[1], *shape[1:])
    site = FormSite(op, rows_shape, c.strength, c.plan.reference, x.dtype, x.device,
                    c.rows_of(weight) if c.reads_weight and weight is not None else None, _rows(bias, c.rows, 0))
    if c.plan.dora_axis is not None:  # the algorithm's own form inside DoRA's gains (dora.py)
        form = dora.bypass(algorithm, c.tensors, c.plan.layout, c.plan.dora_axis, site)
    else:
        form = algorithm.bypass(c.tensors, c.plan.layout, site)
    if form is not None and form.input_side and c.rows is not None:
        return None  # an input-side change of some rows only is no change of the layer's input
    return form


@dataclass(frozen=True)
class Prepared:
    """The forms of one layer's contributions (None: dense path), prepared for inputs like `x`."""

    contributions: tuple[Contribution, ...]
    forms: tuple[Form | None, ...]  # None for a bias contribution too (its change is in bias_shift)
    needs_weight: bool  # some dense contribution reads W: every forward reads it
    bias_shift: torch.Tensor | None = None  # b' - b of the bias contributions, in the input's dtype
    # per contribution, where its change is linear in the strength (D(m) = m·D(1): every change but LyCORIS' own
    # DoRA/OFT/BOFT semantics): the contribution at strength 1 and m as a 0-d fp32 tensor, so a compiled graph of
    # the dense path reads m as data and a strength change reuses it; () or None: D formed at the strength itself
    units: tuple[Contribution, ...] = ()
    strengths: tuple[torch.Tensor | None, ...] = ()

    def change(self, k: int, current: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
               ) -> torch.Tensor:
        """D of contribution k (`_change`), as m·D(1) where that is its definition."""
        strength = self.strengths[k] if self.strengths else None
        if strength is None:
            return _change(self.contributions[k], current, shape, device)
        return _change(self.units[k], current, shape, device) * strength


def prepare(contributions: list[Contribution], op: LayerOp, shape: tuple[int, ...], x: torch.Tensor,
            weight_and_bias: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> Prepared:
    """Each contribution's form. `weight_and_bias()` gives the layer's weight and bias as fp32 on x's device (the
    weight may be the layer's own tensor: it is never modified); called once, only when some change reads W or
    the bias is changed."""
    readers = [i for i, c in enumerate(contributions) if c.reads_weight and not changes_bias(c.plan)]
    biased = [c for c in contributions if changes_bias(c.plan)]
    weight, bias = weight_and_bias() if readers or biased else (None, None)
    current = weight if readers else None
    form_bias = bias if readers else None  # what output-side maps keep; only readers have those
    private = False
    forms = []
    for i, c in enumerate(contributions):
        if changes_bias(c.plan):
            forms.append(None)
            continue
        forms.append(_form(c, op, shape, x, current, form_bias))
        if current is not None and i < readers[-1]:  # a later reader sees this change
            if not private:
                current, private = current.clone(), True
            c.rows_of(current).add_(_change(c, current, shape, current.device))
    dense_readers = [i for i in readers if forms[i] is None]
    shift = _bias_shift(biased, bias, op, x)
    linear = [not c.plan.reference and not changes_bias(c.plan) for c in contributions]
    return Prepared(tuple(contributions), tuple(forms), bool(dense_readers), shift,
                    tuple(replace(c, strength=1.0) if lin else c for c, lin in zip(contributions, linear)),
                    tuple(torch.full((), float(c.strength), dtype=torch.float32, device=x.device) if lin else None
                          for c, lin in zip(contributions, linear)))


def _bias_shift(biased: list[Contribution], bias: torch.Tensor | None, op: LayerOp, x: torch.Tensor
                ) -> torch.Tensor | None:
    """b' − b of the bias contributions in order (each reads the bias the ones before it left, as chained merges),
    in fp32, then cast once to x's dtype, shaped to broadcast over the layer's output."""
    if not biased or bias is None:
        return None
    current = bias.clone()
    for c in biased:
        c.rows_of(current).add_(c.change(current))
    shift = (current - bias).reshape(-1, *op.point) if op.conv_dims else current - bias
    return cast(shift, x.device, x.dtype)


def _change(c: Contribution, current: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
            ) -> torch.Tensor:
    """D = W'(m) − W of one contribution: from `current` (W with the changes before it) when it reads W."""
    if c.reads_weight:
        return c.change(current)
    rows_shape = shape if c.rows is None else (c.rows[1], *shape[1:])
    return c.change_from_factors(rows_shape, device)


def _add(y: torch.Tensor, h: torch.Tensor, rows: tuple[int, int] | None, channel_dim: int) -> torch.Tensor:
    h = cast(h, y.device, y.dtype)
    if rows is None:
        return y + h
    y = y.clone()
    y.narrow(channel_dim, *rows).add_(h)
    return y


def _output(form: Form, y: torch.Tensor, x: torch.Tensor, rows: tuple[int, int] | None,
            channel_dim: int) -> torch.Tensor:
    if rows is None:
        return form.output(y, x)
    out = form.output(y.narrow(channel_dim, *rows), x)
    y = y.clone()
    y.narrow(channel_dim, *rows).copy_(out)
    return y


def forward(x: torch.Tensor, layer_forward: Callable[[torch.Tensor], torch.Tensor], op: LayerOp,
            prepared: Prepared, weight: Callable[[], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """W'x + b for the prepared contributions, in order (module docstring). `layer_forward` is the layer's own
    forward; `weight()` gives W as fp32 on x's device, read before `layer_forward` runs and only when a dense
    contribution needs it."""
    contributions, forms = prepared.contributions, prepared.forms
    inputs, x0 = [], x  # inputs[k]: what adapter k is given; x0: what the layer's own forward gets
    for form in reversed(forms):
        inputs.append(x0)
        if form is not None and form.input_side:
            x0 = form.input(x0)
    inputs.reverse()
    current = weight() if prepared.needs_weight else None  # W plus the changes so far, for the dense readers
    last_dense_reader = max((i for i, (c, f) in enumerate(zip(contributions, forms))
                             if f is None and c.reads_weight and not changes_bias(c.plan)),
                            default=-1)
    y = layer_forward(x0)
    private = False
    for k, (c, form) in enumerate(zip(contributions, forms)):
        if changes_bias(c.plan):
            continue  # in prepared.bias_shift, added last
        if form is not None:
            y = _output(form, y, inputs[k], c.rows, op.channel_dim)
        else:
            d = prepared.change(k, current, shape, x.device)
            y = _add(y, op(inputs[k], cast(d, x.device, x.dtype)), c.rows, op.channel_dim)
        if current is not None and k < last_dense_reader:  # a later dense reader sees this change
            if not private:
                current, private = current.clone(), True
            change = d if form is None else prepared.change(k, current, shape, current.device)
            c.rows_of(current).add_(cast(change, current.device, current.dtype))
    if prepared.bias_shift is not None:
        y = y + cast(prepared.bias_shift, y.device, y.dtype)
    return y


def layer_output(x: torch.Tensor, layer_forward: Callable[[torch.Tensor], torch.Tensor], op: LayerOp,
                 contributions: list[Contribution], weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Prepare and run in one go, for a layer given as its fp32 weight and bias (tests, one-off calls)."""
    shape = tuple(weight.shape)
    prepared = prepare(contributions, op, shape, x, lambda: (weight, bias))
    return forward(x, layer_forward, op, prepared, lambda: weight, shape)


def changed_weight(weight: torch.Tensor, contributions: list[Contribution]) -> torch.Tensor:
    """W plus every contribution's change, in order (a reader sees the changes before it), as a new tensor in
    weight's dtype (`weight` may be a buffer of its owner's: it is never written). The maths runs in fp32, as
    `forward`'s does, and is rounded once."""
    current = cast(weight, weight.device, torch.float32, copy=True)
    for c in contributions:
        rows_shape = tuple(weight.shape) if c.rows is None else (c.rows[1], *weight.shape[1:])
        reads = c.reads_weight or changes_bias(c.plan)  # a bias change may read the bias ((IA)³'s l·b)
        d = c.change(current) if reads else c.change_from_factors(rows_shape, current.device)
        c.rows_of(current).add_(cast(d, current.device, current.dtype))
    return cast(current, weight.device, weight.dtype)


def reads_weight(plan: Plan) -> bool:
    """Whether this plan's change depends on the layer's weight (Plan.reads_param, for a change of the weight). A
    change of the bias that reads the bias (PEFT's (IA)³ l ⊙ b) is prepared from the bias apart (`changes_bias`)."""
    return plan.reads_param and BY_NAME[plan.algorithm].param == "weight"


def is_bypassable(plan: Plan) -> bool:
    """Weights only: bias and norm parameters are not the weight of a linear op, so they are merged (a bias change
    may still be bypassed, see `changes_bias`)."""
    return BY_NAME[plan.algorithm].param == "weight"


def changes_bias(plan: Plan) -> bool:
    """A change of a layer's bias: bypassed as a shift of the layer's output (the module docstring)."""
    return BY_NAME[plan.algorithm].param == "bias"
