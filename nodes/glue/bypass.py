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

import torch
from comfy.patcher_extension import PatcherInjection

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
from . import gguf
from .patch_key import BIAS, WEIGHT, PatchKey
from .routing import Earlier, LayerFacts, PatchFacts, Route, route
from .weight_format import (
    BYPASS_HOLDER,
    FLOAT_DTYPES,
    float_weight,
    float_weight_and_bias,
    is_comfy_op,
    layer_op,
    skips_forward,
    weight_format,
)

_ATTRIBUTE = "_lycoris_bypass"
_CHANGE_ATTRIBUTE = "_lycoris_weight_change"
_KEPT = BYPASS_HOLDER  # the layer's BypassLayer, also while no entry is on it
NAMED = 3  # layers a log line or an error names before "…"
log = logging.getLogger("lycoris_nodes")


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


def patch_route(mode: str, layer: torch.nn.Module | None, patch_key: PatchKey, plan,
                bypassed_before: BypassedBefore = BypassedBefore(), merged_in: torch.dtype | None = None) -> Route:
    """Merge or bypass this patch (routing.route, on the facts read here off its key, plan, layer and the bypass
    injections already on the patcher); `merged_in`: the dtype ComfyUI merges in (`merge_dtype`)."""
    key = patch_key.weight
    param = "weight" if key.endswith(WEIGHT) else "bias" if key.endswith(BIAS) else None
    patch = PatchFacts(param, patch_key.output_rows_only, is_bypassable(plan), reads_weight(plan), changes_bias(plan))
    earlier = Earlier(key in bypassed_before.layers, key in bypassed_before.readers)
    return route(mode, patch, _layer_facts(layer), earlier, merged_in)


def _layer_facts(layer: torch.nn.Module | None) -> LayerFacts | None:
    if layer is None:
        return None
    weight, bias = (getattr(layer, p, None) for p in ("weight", "bias"))
    return LayerFacts(layer_op(layer) is not None, skips_forward(layer),
                      weight_format(weight) if isinstance(weight, torch.Tensor) else None,
                      weight_format(bias) if isinstance(bias, torch.Tensor) else None)


def contribution(adapter, patch_key: PatchKey, strength: float) -> Contribution:
    rows = None if patch_key.offset is None else (patch_key.offset.start, patch_key.offset.length)
    return Contribution(adapter.plan, adapter.tensors, strength, rows)
