"""What every algorithm file provides, and the shape facts they share.

An algorithm is declared as data (`Algorithm`): the tensor suffixes it reads, the marker key that selects it, and
small functions:

* ``layout(t, alpha) -> Layout``: checks the tensors agree with each other and derives rank, scale and the weight
  shape they imply. Runs once, when the file is loaded; raises `ShapeError`. A bias part returns None when its
  tensors say it changes nothing for this module (PEFT's (IA)³ on a feed-forward layer).
* ``add_into(t, layout, W, m, out)``: for additive algorithms, out += m·ΔW(W) in place, with ΔW the full-strength
  change (scale applied once), so W' = W + m·ΔW. `out` is W itself when patching, a zero tensor when ΔW alone is
  wanted; ΔW of GLoRA and (IA)³ reads W, so every read of W happens before `out` is written. DoRA wraps this.
* ``merge_into(t, layout, W, m, reference)``: for algorithms that are not additive (OFT, BOFT), W ← W'(m) in place;
  `reference` picks LyCORIS' own multiplier semantics instead of the linear W + m·(W'(1) − W).
* ``factored(t, layout, W) -> (A, B)``: the full-strength change as ΔW₂ = A @ B exactly (scale included), A (out, R),
  B (R, in·∏k), without forming ΔW; for the tools (lycoris_core/tools: exact LoRA chains, SVD of a change). `W` (fp32,
  the weight before this module) is passed only to algorithms whose change reads it (GLoRA); others get None.
* ``bypass(t, layout, at) -> Form | None``: the change in a layer's forward without forming W' (bypass mode), see
  `Form`; None where this module has no such form (the caller then adds F(x; W'(m) − W) with the change formed).
* ``rows(t, layout, start, count) -> (t, layout)``: the module restricted to output rows [start, start + count) of
  the weight it was made for, as a module of its own: ΔW_rows = ΔW[start:start + count] exactly, for a model that
  keeps those rows as a separate weight (diffusers' fused `to_qkv` on ComfyUI's separate q/k/v). Views or a row
  window, never a copy; None where the change of some rows depends on other rows (OFT's rotations, GLoRA's W·A).
* ``row_adder(t, layout, m) -> add(out, first)``: add(out, first) does out += m·ΔW[first:first + len(out)] in place,
  for any window of the change's rows (the fused out-axis DoRA merge; LoKr's 16-bit patch a piece of rows at a time).

Both write into a contiguous W (in the compute dtype) and make no weight-sized temporary: what they need beyond W is
the size of the factors, or a piece of W (`casting.pieces`).

`t` maps canonical suffixes to tensors already cast to W's device and the compute dtype (see casting.py), except the
`dense` ones (as large as W), which are passed as stored and added in pieces by `casting.add_scaled`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..casting import cast

Tensors = dict[str, torch.Tensor]
RowAdder = Callable[[torch.Tensor, int], None]  # add(out, first): out += dW[first:first + len(out)] (see Algorithm)


class ShapeError(ValueError):
    """Tensors of one module that do not fit each other or the target weight; `key` is the suffix at fault."""

    def __init__(self, reason: str, key: str | None = None):
        self.reason, self.key = reason, key
        super().__init__(reason)


@dataclass(frozen=True)
class Layout:
    """Facts read from a module's shapes. `out`, `flat_in` and `shape` constrain the target weight."""

    rank: int | None
    scale: float
    out: int
    flat_in: int | None = None  # prod(W.shape[1:]) when the file pins it
    shape: tuple[int, ...] | None = None  # the full W shape when the file pins it

    def resolve(self, weight_shape: tuple[int, ...]) -> "Layout":
        """This layout for a concrete target weight, or ShapeError saying why it does not fit."""
        wanted = self.shape or (self.out, self.flat_in if self.flat_in is not None else "…")
        mismatch = ShapeError(f"module is for a weight of shape {list(wanted)}, the model's is {list(weight_shape)}")
        if self.shape is not None and tuple(weight_shape) != tuple(self.shape):
            raise mismatch
        if not weight_shape or weight_shape[0] != self.out:
            raise mismatch
        if self.flat_in is not None and math.prod(weight_shape[1:]) != self.flat_in:
            raise mismatch
        return self


@dataclass(frozen=True)
class Algorithm:
    name: str  # stable id, e.g. "lokr"
    label: str  # what users read, e.g. "LoKr"
    markers: tuple[str, ...]  # suffixes whose presence selects this algorithm
    keys: tuple[str, ...]  # every tensor suffix it may read (alpha and dora_scale are handled for all)
    layout: Callable[[Tensors, float | None], Layout | None]
    add_into: Callable[[Tensors, Layout, torch.Tensor, float, torch.Tensor], None] | None = None
    merge_into: Callable[[Tensors, Layout, torch.Tensor, float, bool], None] | None = None
    dense: tuple[str, ...] = ()  # keys as large as the weight: never cast whole (see casting.add_scaled)
    marker_ndim: int | None = None  # oft_blocks: 3-D is diag-OFT, 4-D is BOFT
    # module names (their start, as keys.py reads them) it is limited to: a trainer that writes another's key names
    # with maths of its own, told apart by where its names start (ComfyUI's trainer: `diffusion_model.`)
    prefixes: tuple[str, ...] = ()
    param: str = "weight"  # which parameter of the target layer it patches
    supports_dora: bool = False
    uses_alpha: bool = True
    optional: bool = False  # a layer without this parameter needs no change (PEFT's (IA)³ bias of a bias-less layer)
    layout_only: tuple[str, ...] = ()  # keys read for the layout only (beyond LAYOUT_ONLY_KEYS): not passed to patches
    bypass: "Callable[[Tensors, Layout, FormSite], Form | None] | None" = None
    factored: "Callable[[Tensors, Layout, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]] | None" = None
    # what users read for a module whose weight has no kernel wider than 1 (a Linear, a 1×1 conv): "LoRA", not LoCon
    pointwise_label: str | None = None
    rows: "Callable[[Tensors, Layout, int, int], tuple[Tensors, Layout]] | None" = None
    # ΔW depends on the current value of the parameter it patches (`param`), not on the file alone: OFT's and BOFT's
    # rotations of W, GLoRA's W·A, (IA)³'s scaled W, PEFT's (IA)³ bias l ⊙ b. Such a change is computed from W as the
    # changes before it left it (bypass.py), and not from a weight ComfyUI hands over in another layout than the
    # file's. DoRA reads W whatever the algorithm (Plan.reads_param).
    reads_param: bool = False
    # Its scale is alpha / r as PEFT's LoRA, LoHa and LoKr configs define theirs: a file without an alpha tensor takes
    # it from the module's PEFT config, else alpha = rank is assumed (module.build_modules).
    scale_from_peft_config: bool = False
    # row_adder(t, layout, m) -> add(out, first): out += m·ΔW[first:first + len(out)] for any window of ΔW's rows,
    # what the fused out-axis DoRA merge adds piece by piece (dora.merge_into)
    row_adder: "Callable[[Tensors, Layout, float], RowAdder] | None" = None
    # an fp16/bf16 weight is patched through `row_adder` a piece of rows at a time (patch._add_in_pieces), measured for
    # LoKr under LowVramPatch (issue #13), instead of through a whole fp32 working copy
    patch_16bit_by_rows: bool = False
    # what a trainer may have set that PEFT's defaults replace, in the warning for modules whose layout `assumed` some
    # options (lycoris_file.option_warnings)
    assumable_options: str = "other options"
    # why a module of it has no exact form as PEFT's LoRA (no_peft_form) or under kohya/LyCORIS names
    # (no_kohya_form), for the Convert tool (tools/convert.py); None where it may have one
    no_peft_form: str | None = None
    no_kohya_form: str | None = None
    # tensor names its kohya form writes differently (Convert to kohya): LightX2V's `diff_m` becomes `diff` on the
    # parameter's own name (`….modulation.diff`), as ComfyUI's generic key map names a non-.weight parameter
    kohya_renames: tuple[tuple[str, str], ...] = ()  # (file's tensor name, kohya form's), ...

    def __post_init__(self) -> None:
        if self.patch_16bit_by_rows and self.row_adder is None:
            raise ValueError(f"{self.name}: patch_16bit_by_rows needs a row_adder")

    def label_for(self, layout: Layout) -> str:
        kernel = layout.shape[2:] if layout.shape else ()
        return self.pointwise_label if self.pointwise_label and math.prod(kernel) == 1 else self.label

    def matches(self, t: Tensors, prefix: str = "") -> bool:
        found = [t[m] for m in self.markers if m in t]
        return (bool(found) and (self.marker_ndim is None or found[0].ndim == self.marker_ndim)
                and (not self.prefixes or prefix.startswith(self.prefixes)))


def scale_from_alpha(alpha: float | None, rank: int) -> float:
    """s = alpha / r; a missing alpha (or 0, as trainers write for 'unset') means alpha = r."""
    if alpha is None or alpha == 0:
        return 1.0
    return alpha / rank


def require(t: Tensors, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in t]
    if missing:
        raise ShapeError(f"missing {', '.join(missing)}", missing[0])
    return [t[n] for n in names]


def expect(condition: bool, reason: str, key: str | None = None) -> None:
    if not condition:
        raise ShapeError(reason, key)


def scalar(t: Tensors, key: str) -> torch.Tensor:
    """The one value of a scalar entry (on_input, row_offset, peft_option.*), as a 0-d tensor. Checked from the shape
    first: a file can hold any shape there, and the summary parses on meta tensors, where only one-element scalars
    carry a value."""
    value = t[key]
    expect(value.numel() == 1, f"{key} must be one number, got a tensor of shape {list(value.shape)}", key)
    return value.reshape(())


def fewer_rows(lay: Layout, count: int) -> Layout:
    """`lay` for `count` of its output rows (the input side unchanged)."""
    return replace(lay, out=count, shape=(count, *lay.shape[1:]) if lay.shape else None)


def narrowed_rows(t: Tensors, lay: Layout, start: int, count: int, *names: str, dim: int = 0
                  ) -> tuple[Tensors, Layout]:
    """`rows` for a change linear in tensors whose `dim` indexes output rows: those tensors narrowed (views)."""
    return {**t, **{n: t[n].narrow(dim, start, count) for n in names if n in t}}, fewer_rows(lay, count)


def trailing_ones(t: torch.Tensor, start: int) -> bool:
    return all(d == 1 for d in t.shape[start:])


def tucker_factors(core: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Tucker product as two small factors A (out, r), B (r, in·∏k) with A @ B = the flattened

        einsum("ij…,ip,jn->pn…", core, left, right),   core (r, r, *k), left (r, out), right (r, in)

    (the kernel is folded into the right factor, so nothing of the weight's size is formed)."""
    folded = torch.einsum("ij...,jn->in...", core, right)
    return left.transpose(0, 1), folded.reshape(folded.shape[0], -1)


def rows_2d(w: torch.Tensor) -> torch.Tensor:
    """W as (out, in·∏k): a view, W being contiguous."""
    return w.view(w.shape[0], -1)


# --- Bypass forms: an adapter in the layer's forward ------------------------------------------------------------------

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


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

    @property
    def point(self) -> tuple[int, ...]:
        """The kernel shape of a pointwise (1×1…) op of this layer's kind."""
        return (1,) * self.conv_dims

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.conv_dims:
            return F.linear(x, weight)
        return CONV[self.conv_dims](x, weight, None, self.stride, self.padding, self.dilation, self.groups)

    def pointwise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A channel mix at every position (linear, or a 1×1… conv without the layer's stride): weight (out, in)."""
        if not self.conv_dims:
            return F.linear(x, weight)
        return CONV[self.conv_dims](x, weight.reshape(*weight.shape, *self.point))

    def scale_channels(self, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """y with channel c multiplied by scale[c] (channels last for Linear, dim 1 for convs)."""
        return y * (scale if not self.conv_dims else scale.reshape(-1, *self.point))


@dataclass(frozen=True)
class FormSite:
    """Where a form runs: the layer's op, the weight (rows) it changes, the strength, and the compute dtype/device
    (the input's). `weight` is W before this adapter (earlier adapters on the layer included), fp32, given only to
    algorithms whose change reads W; `bias` likewise (the layer's bias rows, fp32, or None when it has none)."""

    op: LayerOp
    shape: tuple[int, ...]
    strength: float
    reference: bool
    dtype: torch.dtype
    device: torch.device
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def work_dtype(self) -> torch.dtype:
        """The dtype a form's own products run in: the input's, except fp16 on the CPU, whose thin and batched
        products run many times slower there than fp32 (measured ~100× for batched, 15-20% of a layer for a thin
        linear); fp32 is also the more exact."""
        return torch.float32 if self.dtype == torch.float16 and self.device.type == "cpu" else self.dtype

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor` on the site's device, in `dtype` (default: the input's dtype)."""
        return cast(tensor, self.device, dtype or self.dtype)


class Form:
    """One adapter in a layer's forward, prepared once per injection:

        W'·x = output(W · input(x), x)        W: the weight before this adapter (earlier adapters included)

    `input` is the identity unless W' = W·Q (a change on the input side); `output` gets y = W·input(x) + b (the
    layer's bias b included, once) and the input x this adapter was given, and returns W'·x + b, never forming W'.
    An output-side map P (W' = P·W) must leave the bias alone: P(y − b) + b (FormSite.bias)."""

    input_side = False

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Additive(Form):
    """W' = W + ΔW with ΔW·x computed from factors (`delta`, strength and scale included): y + delta(x)."""

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y + self.delta(x)
