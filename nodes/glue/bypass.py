"""Bypass mode in ComfyUI: adapters run in the layers' forward, installed through the patcher's injections.

`ModelPatcher.set_injections(key, [PatcherInjection(inject, eject)])` is ComfyUI's own hook for changing a model
while it is loaded: ComfyUI injects when it loads a clone and ejects when it unloads or detaches it, so a clone
with bypass adapters and one without share an nn.Module safely. Each node instance uses its own key, so several
bypass nodes stack (each adds its entries to the layers; none replaces another's).

A layer gets one `BypassLayer` as its `forward` while any entry is on it; it runs the layer's own forward and
every entry's form in order (lycoris_core.bypass). Ejecting removes exactly the entries that injection put there, in
any order, and the layer's own forward comes back when the last one goes.

Injecting stages each entry's tensors on the patcher's load device (private copies, dropped on eject), so a
forward moves no adapter tensor between devices. The forms are prepared outside any forward, for the input kind
ComfyUI feeds the model: at inject, or, where some change reads the weight or bias, by the injection's APPLY_MODEL
wrapper just before the model runs (outside TorchCompileModel's compiled region, so a compiled step only reads the
forms' tensors, strength included, and traces the same branch every run); an input of another kind gets its forms
at its first forward. They are kept until the entries change again: ComfyUI changes a
loaded model's weights (patching, unpatching, hooks, dynamic VRAM's re-patching) only with its injections ejected
(`ModelPatcher.use_ejected`), so an injection sees one weight for its whole life.

A layer ComfyUI uses without calling its forward (`skips_forward`) gets its entries as a `WeightChange` in its
`weight_function` list instead: ComfyUI's cast path runs those on the weight wherever the weight is used.

Never silently skipped: a comfy.ops layer a `BypassLayer` holds also carries a `CastGuard` in its weight (and bias)
function list, hidden while our forward runs. Wherever ComfyUI casts the weight without that forward (0.38's
`linear_input_act` fp16 path, 0.33's MiniMax audio VAE qkv, another pack's forward that casts), the guard adds the
entries' change at the cast (`changed_weight`, exact) and the eject logs once per run how many layers took that
path. A layer whose forward another pack replaced after ours, called in a step without reaching ours or its cast,
stops the run with an error naming it (`forward_check`, one of ComfyUI's APPLY_MODEL wrappers).
"""

import logging
from dataclasses import dataclass

import comfy.model_management
import comfy.ops
import torch
from comfy.patcher_extension import PatcherInjection
from comfy.quant_ops import QuantizedTensor

from ...lycoris_core import LycorisError
from ...lycoris_core.bypass import (
    Contribution,
    LayerOp,
    Prepared,
    changed_weight,
    changes_bias,
    forward,
    is_bypassable,
    prepare,
    reads_weight,
)
from ...lycoris_core.casting import cast
from . import gguf

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MODES = ("merge", "bypass", "auto")
_ATTRIBUTE = "_lycoris_bypass"
_CHANGE_ATTRIBUTE = "_lycoris_weight_change"
_KEPT = "_lycoris_bypass_kept"  # the layer's BypassLayer, also while no entry is on it
NAMED = 3  # layers a log line or an error names before "…"
log = logging.getLogger("lycoris_nodes")


def layer_op(layer: torch.nn.Module) -> LayerOp | None:
    """The bias-free op of a Linear-like or ConvNd layer (by structure, so ComfyUI's cast, fp8 and quantized
    layer classes count), or None for anything else (norms, embeddings, circular padding)."""
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        if layer.padding_mode != "zeros" or layer.transposed:
            return None
        # kernel_size, not weight.ndim: a GGUF weight's storage is its packed blocks
        return LayerOp(len(layer.kernel_size), tuple(layer.stride), layer.padding, tuple(layer.dilation),
                       layer.groups)
    if hasattr(layer, "in_features") and hasattr(layer, "out_features") and not isinstance(layer, torch.nn.Embedding):
        return LayerOp()
    return None


def _data(weight: torch.Tensor) -> torch.Tensor:
    return weight.data if isinstance(weight, torch.nn.Parameter) else weight


def is_plain_float(weight: torch.Tensor) -> bool:
    """A weight a merge can patch without loss beyond its dtype's rounding: an ordinary fp32/fp16/bf16/fp64 tensor,
    or a GGUF F16/F32 one (plain float data; the GGUF pack merges it like any fp16 weight)."""
    if gguf.is_gguf_tensor(weight):  # before `.data`, which drops the GGUF attributes
        return not gguf.is_packed(weight) and weight.dtype in FLOAT_DTYPES
    data = _data(weight)
    return type(data) is torch.Tensor and data.dtype in FLOAT_DTYPES


def merge_is_exact(weight: torch.Tensor) -> bool:
    """A merge patches this weight without loss beyond its dtype's rounding: plain float, or any GGUF weight (the
    GGUF pack applies merged patches to the decoded weight at every forward and never re-quantizes; measured no
    slower than bypass for LoRA and faster for changes that read W, bench/results-quantized-*.md)."""
    return is_plain_float(weight) or gguf.is_gguf_tensor(weight)


def is_readable(weight: torch.Tensor) -> bool:
    """A weight `float_weight` can read: an ordinary tensor of any float dtype (fp8 included), ComfyUI's
    QuantizedTensor, or a GGUF weight (decoded by the GGUF pack's own cast)."""
    if gguf.is_gguf_tensor(weight):
        return True
    data = _data(weight)
    return isinstance(data, QuantizedTensor) or (type(data) is torch.Tensor and data.is_floating_point())


# ComfyUI's QuantizedTensor layouts whose name says more than their stored dtype (0.33 `_layout_cls`)
_LAYOUT_FORMATS = {"TensorCoreMXFP8Layout": "mxfp8", "TensorCoreNVFP4Layout": "nvfp4", "TensorWiseINT8Layout": "int8"}


def _dtype_format(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float8_", "fp8 ")


def storage_format(weight: torch.Tensor) -> str | None:
    """How a weight is stored when that is not plain float ("GGUF Q4_0", "fp8 e4m3fn", "int8", "mxfp8"), else None
    (fp32/fp16/bf16, GGUF F16/F32)."""
    if gguf.is_gguf_tensor(weight):
        return f"GGUF {gguf.type_name(weight)}" if gguf.is_packed(weight) else None
    data = _data(weight)
    if isinstance(data, QuantizedTensor):
        layout = getattr(data, "_layout_cls", None) or getattr(data, "_layout_type", None)  # 0.33 / 0.3.75
        name = layout if isinstance(layout, str) else getattr(layout, "__name__", "")
        return _LAYOUT_FORMATS.get(name) or _dtype_format(data._qdata.dtype)
    return None if data.dtype in FLOAT_DTYPES else _dtype_format(data.dtype)


def merge_rounds(weight: torch.Tensor) -> str | None:
    """The storage format a merge re-rounds W+ΔW into (fp8, ComfyUI's quantized layouts), else None. A packed GGUF
    weight is not: the GGUF pack applies merged patches to the decoded weight at every forward."""
    fmt = storage_format(weight)
    return None if fmt is None or gguf.is_gguf_tensor(weight) else fmt


def merge_dtype(patcher) -> torch.dtype | None:
    """The dtype ComfyUI patches a fully loaded weight in (0.33's `lora_compute_dtype`: fp16 on most NVIDIA GPUs),
    or None (0.3.75 patches an fp32 copy)."""
    dtype_of = getattr(comfy.model_management, "lora_compute_dtype", None)
    return dtype_of(patcher.load_device) if dtype_of is not None else None


def merge_narrows(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """ComfyUI would merge into this plain float tensor through a narrower copy (0.33 rounds an fp32 W to fp16
    before any adapter runs), so the merge is off by that rounding. GGUF tensors are patched by the GGUF pack."""
    return (dtype is not None and is_plain_float(tensor) and not gguf.is_gguf_tensor(tensor)
            and dtype.itemsize < _data(tensor).dtype.itemsize)


def narrowed_format(tensor: torch.Tensor, dtype: torch.dtype | None) -> str | None:
    """What the report says of a plain float tensor bypassed because ComfyUI would merge it narrower."""
    if not merge_narrows(tensor, dtype):
        return None
    return f"{_dtype_format(_data(tensor).dtype)} merged by ComfyUI in {_dtype_format(dtype)}"


def is_comfy_op(layer: torch.nn.Module) -> bool:
    """A comfy.ops layer: where its weight is and what is applied to it on the way to the forward (merged patches
    of an offloaded or dynamically loaded layer, dequantisation) is up to ComfyUI's cast path."""
    return hasattr(layer, "comfy_cast_weights")


def skips_forward(layer: torch.nn.Module) -> bool:
    """An INT8 tensorwise layer, which ComfyUI 0.33's `comfy.ops.linear_input_act` (Wan/LTX feed-forward down
    projections, MiniMax, Llama-type text encoders) multiplies by its weight itself, never calling its forward
    (the same test as there; 0.3.75 has no such layout)."""
    weight = getattr(layer, "weight", None)
    return (isinstance(weight, QuantizedTensor) and getattr(weight, "_layout_cls", None) == "TensorWiseINT8Layout"
            and not getattr(getattr(weight, "_params", None), "transposed", False))


def _read_dtype(layer: torch.nn.Module, device: torch.device) -> torch.dtype:
    """fp32, or fp64 for an fp32 weight (its dynamic-VRAM geometry dtype, `_model_dtype`, where set) that reaches
    `device` through one of ComfyUI's transfer buffers (dynamic VRAM, or an offloaded layer). In a dtype other than
    the stored one the cast hands back a new tensor: the merged patches run on that copy, never in place on a buffer
    the layer's own cast reads next, and the read is no view of a buffer ComfyUI reuses."""
    weight = layer.weight
    if isinstance(weight, QuantizedTensor):
        return torch.float32  # dequantising always makes a new tensor
    through_buffer = hasattr(layer, "_v") or weight.device != device
    stored = getattr(weight, "_model_dtype", weight.dtype)
    return torch.float64 if through_buffer and stored == torch.float32 else torch.float32


def float_weight(layer: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The layer's weight as fp32 on `device`, as its forward runs it (`float_weight_and_bias`)."""
    return float_weight_and_bias(layer, device)[0]


def float_weight_and_bias(layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's weight and bias as fp32 on `device`, as its forward runs them: with the patches merged before
    this adapter (in the weight, in a LowVramPatch of an offloaded layer, or applied on the fly under dynamic VRAM),
    dequantized (QuantizedTensor) or unscaled (scaled fp8). A comfy.ops layer is read through ComfyUI's own cast
    path; new tensors, so they are released at once and hold nothing of ComfyUI's while the layer's forward runs.
    A packed GGUF weight is read through the GGUF pack's own cast, which decodes it and applies the patches its
    GGUFModelPatcher attached to it."""
    if gguf.is_gguf_layer(layer) and gguf.is_packed(layer.weight):
        weight, bias = gguf.read_weight(layer, device)
        return cast(weight, device, torch.float32), _float(bias, device)
    if not is_comfy_op(layer):
        return _own_float(layer, "weight", device), _own_float(layer, "bias", device)
    dtype = _read_dtype(layer, device)
    holder = layer.__dict__.get(_KEPT)  # its cast guards stay out of this read: it wants W as the forward gets it
    lists = holder.hide_guards() if holder is not None else {}
    try:
        weight, bias, offload = comfy.ops.cast_bias_weight(layer, dtype=dtype, device=device, bias_dtype=dtype,
                                                           offloadable=True)
    finally:
        if holder is not None:
            holder.restore(lists)
    try:
        read = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        convert = getattr(layer, "convert_weight", None)  # 0.3.75's scaled fp8: the cast gives W / scale_weight
        if convert is not None:
            read = convert(read, inplace=False)
        read = cast(read, device, torch.float32)
        read = read.as_subclass(torch.Tensor) if gguf.is_gguf_tensor(read) else read  # GGUF F16 reads as its class
        return read, _float(bias, device, copy=True)
    finally:
        comfy.ops.uncast_bias_weight(layer, weight, bias, offload)


def _float(tensor: torch.Tensor | None, device: torch.device, copy: bool = False) -> torch.Tensor | None:
    """fp32 on `device`, a plain tensor (a copy when asked: a cast's result may be a buffer ComfyUI reuses)."""
    if tensor is None:
        return None
    tensor = tensor.as_subclass(torch.Tensor) if gguf.is_gguf_tensor(tensor) else tensor
    return cast(tensor, device, torch.float32, copy=copy)


def _own_float(layer: torch.nn.Module, name: str, device: torch.device) -> torch.Tensor | None:
    """A plain torch layer's weight or bias as fp32 on `device`, with any per-forward functions applied."""
    value = getattr(layer, name, None)
    if value is None:
        return None
    if isinstance(value, QuantizedTensor):
        value = value.dequantize()
    functions = getattr(layer, f"{name}_function", None)
    if functions:  # as comfy.ops.cast_bias_weight: on a copy, the functions may work in place
        value = cast(value, device, torch.float32, copy=True)
        for function in functions:
            value = function(value)
        if isinstance(value, QuantizedTensor):
            value = value.dequantize()
    convert = getattr(layer, f"convert_{name}", None)
    if convert is not None:
        value = convert(value, inplace=False)
    return cast(value, device, torch.float32)


class BypassLayer:
    """Stands in for one layer's forward while bypass entries are on it.

    One object per layer for the layer's life (kept in `_KEPT` while no entry is on it): ComfyUI ejects and
    re-injects around every sampling run, and torch.compile's graphs guard on the forward object, so a new one would
    recompile every run. The forms are looked up by the input's kind only (never by which entries they came from:
    the guard would then name those objects) and dropped whenever the entries change, so they always belong to the
    entries on the layer now."""

    def __init__(self, layer: torch.nn.Module, op: LayerOp):
        self.layer, self.op = layer, op
        self.own_forward = None  # an instance-level forward someone else set, if any (read when installed)
        self.entries: dict[tuple[str, int], Contribution] = {}
        self.prepared: dict[tuple, Prepared] = {}
        self.kinds: set[tuple[torch.device, torch.dtype]] = set()  # of the plain-tensor inputs it has seen
        self.guards = {p: CastGuard(self, p) for p in ("weight", "bias")} if _castable(layer) else {}
        self.shown: dict[str, CastGuard] = {}  # the guards in the layer's function lists now
        self.cast_outside = False  # a guard changed a cast since the last eject
        self.watching = self.ran = False  # forward_check's question: did this run in the watched step?

    def __call__(self, x, *args, **kwargs):
        if self.watching:
            self.ran = True
        if not self.shown:
            return self._forward(x, *args, **kwargs)
        # the guards out of the lists while our forward runs: it applies the entries itself, and the layer's own
        # forward takes exactly the path it takes without them (no cast path, fp8 matmul kept)
        lists = self.hide_guards()
        try:
            return self._forward(x, *args, **kwargs)
        finally:
            self.restore(lists)

    def hide_guards(self) -> dict[str, list]:
        """The layer's function lists holding a guard, as they are; the layer gets them without the guards."""
        lists = {p: getattr(self.layer, f"{p}_function") for p in self.shown}
        for p, functions in lists.items():
            setattr(self.layer, f"{p}_function", [f for f in functions if f is not self.shown[p]])
        return lists

    def restore(self, lists: dict[str, list]) -> None:
        for p, functions in lists.items():
            setattr(self.layer, f"{p}_function", functions)

    def _forward(self, x, *args, **kwargs):
        prepared = self._prepared(x)
        # W is read before the layer's own forward: under dynamic VRAM that forward may patch ComfyUI's transfer
        # buffer in place, which a read after it would patch a second time
        weight = float_weight(self.layer, x.device) if prepared.needs_weight else None
        run = self.own_forward or type(self.layer).forward.__get__(self.layer)
        return forward(x, lambda layer_input: run(layer_input, *args, **kwargs), self.op, prepared, lambda: weight,
                       gguf.logical_shape(self.layer.weight))

    def _prepared(self, x: torch.Tensor) -> Prepared:
        """The entries' forms for inputs like x (device, dtype, tensor type: a FakeTensorMode trace gets forms of
        its own), prepared at the first forward of that kind after the entries changed."""
        key = (x.device, x.dtype, type(x))
        prepared = self.prepared.get(key)
        if prepared is None:
            shape = gguf.logical_shape(self.layer.weight)
            prepared = self.prepared[key] = prepare(list(self.entries.values()), self.op, shape, x,
                                                    lambda: float_weight_and_bias(self.layer, x.device))
            if type(x) is torch.Tensor:
                self.kinds.add(key[:2])
        return prepared

    def prepare_ahead(self, kinds: set[tuple[torch.device, torch.dtype]], read_weight: bool = False) -> bool:
        """The forms for plain-tensor inputs of these kinds (device, dtype), prepared now: outside any traced
        forward, so a compiled graph only reads their tensors (a strength is in their values, never a constant of
        the graph) and the first step traces the same code as the next. Where some entry reads the layer's weight
        or bias, only when `read_weight` (before a run, `injection`'s APPLY_MODEL wrapper; never at inject, where
        0.33's dynamic VRAM has no readable weight). Returns whether the forms are prepared."""
        entries = list(self.entries.values())
        reads = any(c.reads_weight or changes_bias(c.plan) for c in entries)
        if reads and not read_weight:
            return False
        shape = gguf.logical_shape(self.layer.weight)
        for device, dtype in kinds:  # prepare reads only the input's device and dtype
            if (device, dtype, torch.Tensor) not in self.prepared:
                self.prepared[(device, dtype, torch.Tensor)] = prepare(
                    entries, self.op, shape, torch.empty(0, device=device, dtype=dtype),
                    (lambda d=device: float_weight_and_bias(self.layer, d)) if reads else None)
        return True

    @classmethod
    def on(cls, layer: torch.nn.Module, op: LayerOp) -> "BypassLayer":
        existing = layer.__dict__.get(_ATTRIBUTE)
        if existing is None:
            existing = layer.__dict__.get(_KEPT) or cls(layer, op)
            existing.own_forward = layer.__dict__.get("forward")
            setattr(layer, _KEPT, existing)
            setattr(layer, _ATTRIBUTE, existing)
            layer.forward = existing
        return existing

    def add(self, entry_key: tuple[str, int], contribution: Contribution) -> None:
        self.entries[entry_key] = contribution
        self.prepared = {}
        self._show_guards()

    def remove(self, entry_key: tuple[str, int], contribution: Contribution) -> None:
        if self.entries.get(entry_key) is contribution:
            del self.entries[entry_key]
        self.prepared = {}  # it holds the staged tensors of the entries it was made for
        self._show_guards()
        if not self.entries:
            if self.own_forward is None:
                del self.layer.forward
            else:
                self.layer.forward = self.own_forward
            self.own_forward = None
            delattr(self.layer, _ATTRIBUTE)

    def _show_guards(self) -> None:
        """Each guard in its list while some entry changes its param, else out of it (new lists: the class default
        is shared)."""
        for p, guard in self.guards.items():
            wanted = any(changes_bias(c.plan) == (p == "bias") for c in self.entries.values())
            functions = [f for f in getattr(self.layer, f"{p}_function") if f is not guard]
            setattr(self.layer, f"{p}_function", [*functions, guard] if wanted else functions)
            if wanted:
                self.shown[p] = guard
            else:
                self.shown.pop(p, None)


def _castable(layer: torch.nn.Module) -> bool:
    """A layer ComfyUI can cast without its forward (comfy.ops' cast_bias_weight, which runs the function lists);
    a GGUF layer is cast by the GGUF pack's own code."""
    return is_comfy_op(layer) and not gguf.is_gguf_layer(layer)


class CastGuard:
    """A held layer's changes of one param ("weight" or "bias") where ComfyUI casts it outside our forward.

    In the layer's `weight_function` (or `bias_function`) list, which comfy.ops' cast path runs, except while our
    forward runs: a cast then means the layer is computed without its forward (0.38's fused `linear_input_act`,
    0.33's MiniMax audio VAE qkv, another pack's forward). It returns the param plus the entries' changes of that
    param, in order (`changed_weight`: the maths a merge does, exact), and marks the layer for the run's log line."""

    def __init__(self, holder: BypassLayer, param: str):
        self.holder, self.param = holder, param

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        self.holder.cast_outside = True
        biased = self.param == "bias"
        return changed_weight(tensor, [c for c in self.holder.entries.values() if changes_bias(c.plan) == biased])


def layer_name(weight_key: str) -> str:
    return weight_key.rsplit(".", 1)[0]


def _layer(root: torch.nn.Module, weight_key: str) -> torch.nn.Module:
    return root.get_submodule(layer_name(weight_key))


class WeightChange:
    """A layer's bypass entries as one of its `weight_function`s, for a layer ComfyUI uses without its forward:
    ComfyUI's cast path runs those on the (dequantized) weight, for the forward and for callers that use the weight
    directly. Installed while any entry is on the layer; entries apply in order, as on a `BypassLayer`."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.entries: dict[tuple[str, int], Contribution] = {}

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return changed_weight(weight, list(self.entries.values()))

    @classmethod
    def on(cls, layer: torch.nn.Module) -> "WeightChange":
        existing = layer.__dict__.get(_CHANGE_ATTRIBUTE)
        if existing is None:
            existing = cls(layer)
            setattr(layer, _CHANGE_ATTRIBUTE, existing)
            layer.weight_function = [*layer.weight_function, existing]  # a new list: the class default is shared
        return existing

    def add(self, entry_key: tuple[str, int], contribution: Contribution) -> None:
        self.entries[entry_key] = contribution

    def remove(self, entry_key: tuple[str, int], contribution: Contribution) -> None:
        if self.entries.get(entry_key) is contribution:
            del self.entries[entry_key]
        if not self.entries:
            self.layer.weight_function = [f for f in self.layer.weight_function if f is not self]
            delattr(self.layer, _CHANGE_ATTRIBUTE)


def _holder(layer: torch.nn.Module):
    """Where a layer's entries go: its weight function when ComfyUI may use the weight without the forward."""
    return WeightChange.on(layer) if skips_forward(layer) else BypassLayer.on(layer, layer_op(layer))


def _holder_of(layer: torch.nn.Module):
    return layer.__dict__.get(_CHANGE_ATTRIBUTE) or layer.__dict__.get(_ATTRIBUTE)


def _input_kind(patcher) -> tuple[torch.device, torch.dtype] | None:
    """(device, dtype) of the activations a diffusion model's layers get: ComfyUI casts the model's input to its
    manual-cast dtype, else its weights' dtype (BaseModel._apply_model); None for other models (a text encoder)."""
    model = patcher.model
    if not hasattr(model, "get_dtype"):
        return None
    dtype = getattr(model, "manual_cast_dtype", None) or model.get_dtype()
    return (torch.empty(0, device=patcher.load_device).device, dtype) if dtype in FLOAT_DTYPES else None


def injection(key: str, entries: list[tuple[str, Contribution]], root: torch.nn.Module,
              modules: dict[str, torch.nn.Module]) -> PatcherInjection:
    """One injection installing `entries` ((weight key, contribution), in order) on the patcher's model. The layers
    are looked up once, in `root`'s `modules` (clones share their model object); another model is looked up again.
    Injecting stages each contribution's tensors on the patcher's load device; ejecting drops those copies."""
    resolved = {id(root): [modules[layer_name(weight_key)] for weight_key, _ in entries]}
    staged: dict[int, list[Contribution]] = {}  # per model object: the copies inject put on the layers
    waiting: dict[int, list] = {}  # per model object: (layer, input kinds) whose forms read W, not yet prepared

    def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
        if id(model) not in resolved:
            resolved[id(model)] = [_layer(model, weight_key) for weight_key, _ in entries]
        return resolved[id(model)]

    def inject(patcher) -> None:
        copies = staged[id(patcher.model)] = [contribution.on(patcher.load_device) for _, contribution in entries]
        holders = [_holder(layer) for layer in layers(patcher.model)]
        for i, (holder, contribution) in enumerate(zip(holders, copies)):
            holder.add((key, i), contribution)
        expected = _input_kind(patcher)
        kinds = [(h, h.kinds | ({expected} if expected else set()))
                 for h in {id(h): h for h in holders}.values() if isinstance(h, BypassLayer)]
        waiting[id(patcher.model)] = [(h, k) for h, k in kinds if not h.prepare_ahead(k)]

    def prepare_waiting(executor, *args, **kwargs):
        """An APPLY_MODEL wrapper: the forms that read a weight, prepared before the model runs (outside any
        compiled region: ComfyUI's TorchCompileModel compiles the diffusion model inside this call)."""
        for holder, kinds in waiting.pop(id(executor.class_obj), ()):
            holder.prepare_ahead(kinds, read_weight=True)
        return executor(*args, **kwargs)

    def eject(patcher) -> None:
        waiting.pop(id(patcher.model), None)
        # ComfyUI may eject a clone that copied its `is_injected` flag without ever injecting: remove only ours.
        cast_outside = []
        for i, (layer, contribution) in enumerate(zip(layers(patcher.model), staged.pop(id(patcher.model), []))):
            holder = _holder_of(layer)
            if holder is not None:
                if getattr(holder, "cast_outside", False):
                    holder.cast_outside = False
                    cast_outside.append(layer_name(entries[i][0]))
                holder.remove((key, i), contribution)
        _log_cast_outside(cast_outside)

    bypass = PatcherInjection(inject, eject)
    bypass.lycoris_layers_of = lambda model: [(layer_name(k), layer) for (k, _), layer in zip(entries, layers(model))]
    bypass.lycoris_layers = frozenset(weight_key for weight_key, _ in entries)
    bypass.lycoris_readers = frozenset(weight_key for weight_key, c in entries if c.reads_weight)
    bypass.lycoris_entries = tuple(entries)  # (weight key, contribution) in order: what LycorisSave writes
    bypass.lycoris_prepare = prepare_waiting  # the patcher's APPLY_MODEL wrapper under the injection's key
    return bypass


def _named(names: list[str]) -> str:
    return ", ".join(names[:NAMED]) + (", …" if len(names) > NAMED else "")


def _log_cast_outside(names: list[str]) -> None:
    if names:
        log.info("bypass: %d layer(s) were changed at their weight cast instead of their forward, because ComfyUI "
                 "computed them without the layer's forward (fused path): %s", len(names), _named(names))


def forward_check(bypass: PatcherInjection, file: str):
    """An APPLY_MODEL wrapper stopping the run where a bypassed layer lost its change: its forward replaced after
    ours (another pack), the layer called in the step, and neither our forward nor its cast guard ran. A layer the
    step did not call is not judged (a model may not use every layer in every step); a replaced forward that calls
    ours is fine. Costs a look-up per bypassed layer per step; only replaced layers are watched."""

    def wrapper(executor, *args, **kwargs):
        replaced = [(name, layer, layer.__dict__[_ATTRIBUTE])
                    for name, layer in bypass.lycoris_layers_of(executor.class_obj)
                    if isinstance(layer.__dict__.get(_ATTRIBUTE), BypassLayer)
                    and layer.__dict__.get("forward") is not layer.__dict__[_ATTRIBUTE]]
        if not replaced:
            return executor(*args, **kwargs)
        called, hooks = set(), []
        for name, layer, holder in replaced:
            holder.watching, holder.ran, holder.cast_outside = True, False, False
            hooks.append(layer.register_forward_pre_hook(lambda module, _args, name=name: called.add(name)))
        try:
            out = executor(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            for _name, _layer, holder in replaced:
                holder.watching = False
        lost = sorted({name for name, _layer, holder in replaced
                       if name in called and not holder.ran and not holder.cast_outside})
        if lost:
            raise LycorisError(f"{len(lost)} bypassed layer(s) ran without their change: another custom node "
                               f"replaced their forward after this one and does not call it ({_named(lost)}); "
                               "use apply_mode merge, or apply this file after that node", file=file)
        return out

    return wrapper


@dataclass(frozen=True)
class BypassedBefore:
    """The weight keys our bypass injections already on a patcher act on (`layers`), and those where one of them
    reads W (`readers`)."""

    layers: frozenset[str] = frozenset()
    readers: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.layers)


def bypassed_layers(patcher) -> BypassedBefore:
    """What our bypass injections already on this patcher act on."""
    ours = [injection for injections in patcher.injections.values() for injection in injections
            if hasattr(injection, "lycoris_layers")]
    return BypassedBefore(frozenset().union(*(i.lycoris_layers for i in ours)),
                          frozenset().union(*(i.lycoris_readers for i in ours)))


def wants_bypass(mode: str, layer: torch.nn.Module | None, patch_key, plan,
                 bypassed_before: BypassedBefore = BypassedBefore(), merged_in: torch.dtype | None = None) -> bool:
    """Whether this target is bypassed: in bypass mode, every Linear/Conv weight (whole or a row slice of a fused
    weight); in auto, those a merge could not patch exactly (`merge_is_exact`: fp8, ComfyUI's quantized layouts,
    tensor types we do not know); in merge, none, except where a merge would break the workflow's order on a layer
    an earlier file bypasses: a change that reads W, merged, would not see that file's change (the weight does not
    hold it), and any change merged after a bypassed change that reads W would be in the W it reads, i.e. applied
    before it. Those run after it in the forward instead, as chained merges would order them. `merged_in`: the dtype
    ComfyUI merges in (`merge_dtype`); auto also bypasses a float weight it would merge through a narrower copy."""
    key = patch_key if isinstance(patch_key, str) else patch_key[0]
    if not _output_rows_only(patch_key) or layer_op(layer) is None:
        return False
    if changes_bias(plan) and key.endswith(".bias"):
        return wants_bias_bypass(mode, layer, key, bypassed_before, merged_in)
    if not is_bypassable(plan) or not key.endswith(".weight"):
        return False
    if reads_weight(plan):
        if not is_readable(layer.weight):
            return False  # ComfyUI's (or the GGUF pack's) own patching decodes that weight; we cannot
        if key in bypassed_before.layers:
            return True
    if key in bypassed_before.readers:
        return True
    return mode == "bypass" or (mode == "auto" and (not merge_is_exact(layer.weight)
                                                    or merge_narrows(layer.weight, merged_in)))


def _output_rows_only(patch_key) -> bool:
    """The whole parameter, or a slice of its output rows: those map onto output channels; a convert function needs
    the parameter itself."""
    return isinstance(patch_key, str) or (len(patch_key) == 2 and patch_key[1] is not None and patch_key[1][0] == 0)


def wants_bias_bypass(mode: str, layer: torch.nn.Module, key: str, bypassed_before: BypassedBefore,
                      merged_in: torch.dtype | None = None) -> bool:
    """A bias change runs in the forward (added to the output) in bypass and auto where a merge would round it into
    the stored bias (fp8, or fp32 merged through ComfyUI's fp16 copy), as the weight changes there do; else it is
    merged, exactly. After a bias change an earlier file bypassed on this layer, it runs in the forward too, so the
    order holds."""
    if skips_forward(layer) or getattr(layer, "bias", None) is None:
        return False  # a layer used without its forward only takes weight changes
    if key in bypassed_before.layers:
        return True
    return mode != "merge" and (merge_rounds(layer.bias) is not None or merge_narrows(layer.bias, merged_in))


def contribution(adapter, patch_key, strength: float) -> Contribution:
    rows = None if isinstance(patch_key, str) else (patch_key[1][1], patch_key[1][2])
    return Contribution(adapter.plan, adapter.tensors, strength, rows)
