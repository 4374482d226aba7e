"""One module of a file: its algorithm, tensors and layout; and the plan for patching one concrete weight."""

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import dora
from .algos import (
    BIAS_ALGORITHMS,
    BY_NAME,
    LAYOUT_ONLY_KEYS,
    WEIGHT_ALGORITHMS,
    Algorithm,
    Layout,
    ShapeError,
    option_entries,
)
from .algos.base import expect
from .errors import LycorisError
from .keys import ALPHA, DORA_SCALE, PEFT_MAGNITUDE

# Where a module's rows go when each block of them is applied as a module of its own (Module.rows)
ROW_BLOCKS = ("separate weights (a fused module on a model that keeps its parts apart) or separate row blocks (a "
              "weight whose rows the file stores in another order)")


@dataclass(frozen=True)
class Plan:
    """Everything needed to compute a patch except the tensors. Immutable and cheap to share between clones."""

    algorithm: str  # name in algos.BY_NAME
    layout: Layout
    names: tuple[str, ...]  # the tensors' names, in the order they are passed around as a flat tuple
    dora_axis: str | None = None
    reference: bool = False  # LyCORIS' own multiplier semantics for DoRA/OFT/BOFT instead of linear strength

    @property
    def label(self) -> str:
        label = BY_NAME[self.algorithm].label_for(self.layout)
        return f"{label}+DoRA" if self.dora_axis else label

    @property
    def reads_param(self) -> bool:
        """Whether the change depends on the current value of the parameter it patches: the algorithm's own maths
        (Algorithm.reads_param), or DoRA's norm of W + ΔW."""
        return self.dora_axis is not None or BY_NAME[self.algorithm].reads_param


@dataclass(frozen=True)
class Module:
    prefix: str  # the key prefix in the file
    algorithm: Algorithm
    layout: Layout
    tensors: dict[str, torch.Tensor]  # canonical suffix -> tensor as loaded (file dtype, CPU)
    alpha: float | None
    dora_per_output: bool = False  # dora_scale is PEFT's magnitude: per output channel whatever its shape
    scale_assumed: bool = False  # no alpha tensor and no PEFT config: alpha = rank was assumed
    adapter_named: bool = False  # its keys keep PEFT's adapter name (keys.ADAPTER_NAMED): how some writers save

    @property
    def param(self) -> str:
        return self.algorithm.param

    @property
    def has_dora(self) -> bool:
        return DORA_SCALE in self.tensors

    @property
    def label(self) -> str:
        label = self.algorithm.label_for(self.layout)
        return f"{label}+DoRA" if self.has_dora else label

    def plan_for(self, weight_shape: tuple[int, ...], *, reference: bool = False, file: str | None = None) -> Plan:
        """Check this module against the target weight's shape; LycorisError (naming file and key) if it does not fit."""
        try:
            layout = self.layout.resolve(tuple(weight_shape))
            axis = (dora.axis_for(tuple(self.tensors[DORA_SCALE].shape), tuple(weight_shape), self.dora_per_output)
                    if self.has_dora else None)
        except ShapeError as e:
            raise LycorisError(e.reason, file=file, key=f"{self.prefix}.{e.key}" if e.key else self.prefix) from e
        return Plan(self.algorithm.name, layout, tuple(self.tensors), axis, reference)

    def rows(self, start: int, count: int, fused_shape: tuple[int, ...], *, file: str | None = None) -> "Module":
        """This module, made for a fused weight of shape `fused_shape`, restricted to its output rows [start, start +
        count) as a module of its own: W'_rows = W_rows + ΔW[start:start + count] for a model that keeps those rows
        as a separate weight. DoRA per output row (LyCORIS' wd_on_out, PEFT's magnitude) keeps its rows' gains:
        g_r = scale_r / ‖W_r + ΔW_r‖ reads row r alone. Per input column, ‖V[:, j]‖ runs over every fused row, which
        a separate weight does not hold: refused, like an algorithm whose rows depend on other rows."""
        try:
            expect(self.algorithm.rows is not None,
                   f"{self.label} has no split by output rows (OFT/BOFT rotate blocks of rows together), and its rows "
                   f"go to {ROW_BLOCKS}")
            layout = self.layout.resolve(tuple(fused_shape))
            tensors, layout = self.algorithm.rows(self.tensors, layout, start, count)
            if self.has_dora:
                scale = self.tensors[DORA_SCALE]
                expect(dora.axis_for(tuple(scale.shape), tuple(fused_shape), self.dora_per_output) == dora.OUT,
                       f"DoRA normalises each input column over all {fused_shape[0]} rows of the module (the input "
                       f"axis, wd_on_out=False), and its rows go to {ROW_BLOCKS}", DORA_SCALE)
                dim = 0 if scale.shape[0] == fused_shape[0] else 1  # PEFT's conv magnitude is (1, out, 1…)
                tensors = {**tensors, DORA_SCALE: scale.narrow(dim, start, count)}
        except ShapeError as e:
            raise LycorisError(e.reason, file=file, key=f"{self.prefix}.{e.key}" if e.key else self.prefix) from e
        return replace(self, tensors=tensors, layout=layout)


def detect(group: dict[str, torch.Tensor], prefix: str = "") -> list[Algorithm]:
    """The algorithms a group of keys (of module `prefix`) holds: at most one for the weight (first marker match)
    plus bias parts."""
    weight = next((a for a in WEIGHT_ALGORITHMS if a.matches(group, prefix)), None)
    return ([weight] if weight else []) + [a for a in BIAS_ALGORITHMS if a.matches(group, prefix)]


def read_alpha(tensor: torch.Tensor) -> float:
    """alpha is 0-d, shape (1,), any dtype (bf16-rounded values are used as stored, like the reference does).
    One number, checked from the shape alone: the summary parses on meta tensors, where only one-element scalars
    carry their values."""
    if tensor.numel() != 1:
        raise ShapeError(f"alpha must be one number, got a tensor of shape {list(tensor.shape)}", ALPHA)
    return float(tensor.reshape(-1)[0])


def peft_scale(options: dict[str, Any]) -> float | None:
    """PEFT's scale from a module's config options: alpha / r, or alpha / √r with rsLoRA; None without both."""
    r, alpha = options.get("r"), options.get("lora_alpha", options.get("alpha"))
    if not r or alpha is None:
        return None
    return alpha / math.sqrt(r) if options.get("use_rslora") else alpha / r


def _with_peft_magnitude(group: dict[str, torch.Tensor], file: str | None, prefix: str) -> dict[str, torch.Tensor]:
    """PEFT's lora_magnitude_vector read as the module's dora_scale (flagged per output by the caller)."""
    if PEFT_MAGNITUDE not in group:
        return group
    if DORA_SCALE in group:
        raise LycorisError(f"two keys of module '{prefix}' mean the same '{DORA_SCALE}'", file=file,
                           key=f"{prefix}.{PEFT_MAGNITUDE}")
    return {(DORA_SCALE if k == PEFT_MAGNITUDE else k): t for k, t in group.items()}


def build_modules(prefix: str, group: dict[str, torch.Tensor], file: str | None = None,
                  options: dict[str, Any] | None = None, module_name: str | None = None
                  ) -> tuple[list[Module], list[str]]:
    """Parse one key group into modules; returns them and the suffixes no module read.

    `options` are the module's PEFT config options (peft_config.module_options), `module_name` its name in the model
    PEFT wrapped (peft_config.module_name). Without an alpha tensor, LoRA, LoHa and LoKr take PEFT's scale from them;
    a dotted (diffusers/PEFT) module with neither is scaled 1 (alpha = rank, diffusers' convention for PEFT files
    without alpha) and marked `scale_assumed`. PEFT's OFT, BOFT and (IA)³ get the options their maths needs as
    `peft_option.*` entries (algos.option_entries); entries the file holds itself win."""
    per_output = PEFT_MAGNITUDE in group
    group = _with_peft_magnitude(group, file, prefix)
    try:
        alpha = read_alpha(group[ALPHA]) if ALPHA in group else None
    except ShapeError as e:
        raise LycorisError(e.reason, file=file, key=f"{prefix}.{e.key}") from e
    scale = peft_scale(options or {}) if alpha is None else None
    modules, used = [], {ALPHA} if ALPHA in group else set()
    for algorithm in detect(group, prefix):
        given = {**option_entries(algorithm, options or {}, module_name or prefix), **group}
        names = [k for k in algorithm.markers + algorithm.keys if k in given]
        if algorithm.supports_dora and DORA_SCALE in given:
            names.append(DORA_SCALE)
        tensors = {k: given[k] for k in dict.fromkeys(names)}
        try:
            layout = algorithm.layout(tensors, alpha if algorithm.uses_alpha else None)
        except ShapeError as e:
            raise LycorisError(e.reason, file=file, key=f"{prefix}.{e.key}" if e.key else prefix) from e
        if layout is None:  # a bias part its tensors say changes nothing here
            used.update(tensors)
            continue
        module_alpha, assumed = alpha, False
        if alpha is None and algorithm.scale_from_peft_config:
            if scale is not None:  # PEFT's scale whatever our own rule for this layout (LoKr's full factors: 1)
                layout = replace(layout, scale=scale)
                module_alpha = scale * layout.rank if layout.rank else None
            else:
                assumed = "." in prefix
        # keys only needed to read the layout (IA3's on_input, LoKr's row_offset) are not needed to compute the patch
        compute_tensors = {k: t for k, t in tensors.items()
                           if (k in algorithm.keys and k not in LAYOUT_ONLY_KEYS and k not in algorithm.layout_only)
                           or k == DORA_SCALE}
        modules.append(Module(prefix, algorithm, layout, compute_tensors, module_alpha, per_output, assumed))
        used.update(tensors)
    if modules and modules[0].has_dora and modules[0].tensors[DORA_SCALE].ndim == 0:
        raise LycorisError("dora_scale must have at least one dimension", file=file, key=f"{prefix}.{DORA_SCALE}")
    leftover = sorted(set(group) - used)
    return modules, [PEFT_MAGNITUDE if k == DORA_SCALE and per_output else k for k in leftover]
