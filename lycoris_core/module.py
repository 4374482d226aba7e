"""One module of a file: its algorithm, tensors and layout; and the plan for patching one concrete weight."""

from dataclasses import dataclass

import torch

from . import dora
from .algos import BIAS_ALGORITHMS, BY_NAME, LAYOUT_ONLY_KEYS, WEIGHT_ALGORITHMS, Algorithm, Layout, ShapeError
from .errors import LycorisError
from .keys import ALPHA, DORA_SCALE


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
        label = BY_NAME[self.algorithm].label
        return f"{label}+DoRA" if self.dora_axis else label


@dataclass(frozen=True)
class Module:
    prefix: str  # the key prefix in the file
    algorithm: Algorithm
    layout: Layout
    tensors: dict[str, torch.Tensor]  # canonical suffix -> tensor as loaded (file dtype, CPU)
    alpha: float | None

    @property
    def param(self) -> str:
        return self.algorithm.param

    @property
    def has_dora(self) -> bool:
        return DORA_SCALE in self.tensors

    @property
    def label(self) -> str:
        return f"{self.algorithm.label}+DoRA" if self.has_dora else self.algorithm.label

    def plan_for(self, weight_shape: tuple[int, ...], *, reference: bool = False, file: str | None = None) -> Plan:
        """Check this module against the target weight's shape; LycorisError (naming file and key) if it does not fit."""
        try:
            layout = self.layout.resolve(tuple(weight_shape))
            axis = dora.axis_for(tuple(self.tensors[DORA_SCALE].shape), tuple(weight_shape)) if self.has_dora else None
        except ShapeError as e:
            raise LycorisError(e.reason, file=file, key=f"{self.prefix}.{e.key}" if e.key else self.prefix) from e
        return Plan(self.algorithm.name, layout, tuple(self.tensors), axis, reference)


def detect(group: dict[str, torch.Tensor]) -> list[Algorithm]:
    """The algorithms a group of keys holds: at most one for the weight (first marker match) plus bias parts."""
    weight = next((a for a in WEIGHT_ALGORITHMS if a.matches(group)), None)
    return ([weight] if weight else []) + [a for a in BIAS_ALGORITHMS if a.matches(group)]


def read_alpha(tensor: torch.Tensor) -> float:
    """alpha is 0-d, shape (1,), any dtype (bf16-rounded values are used as stored, like the reference does)."""
    return float(tensor.reshape(-1)[0])


def build_modules(prefix: str, group: dict[str, torch.Tensor], file: str | None = None
                  ) -> tuple[list[Module], list[str]]:
    """Parse one key group into modules; returns them and the suffixes no module read."""
    alpha = read_alpha(group[ALPHA]) if ALPHA in group else None
    modules, used = [], {ALPHA} if ALPHA in group else set()
    for algorithm in detect(group):
        names = [k for k in algorithm.markers + algorithm.keys if k in group]
        if algorithm.supports_dora and DORA_SCALE in group:
            names.append(DORA_SCALE)
        tensors = {k: group[k] for k in dict.fromkeys(names)}
        try:
            layout = algorithm.layout(tensors, alpha if algorithm.uses_alpha else None)
        except ShapeError as e:
            raise LycorisError(e.reason, file=file, key=f"{prefix}.{e.key}" if e.key else prefix) from e
        # keys only needed to read the layout (IA3's on_input, LoKr's row_offset) are not needed to compute the patch
        compute_tensors = {k: t for k, t in tensors.items()
                           if (k in algorithm.keys and k not in LAYOUT_ONLY_KEYS) or k == DORA_SCALE}
        modules.append(Module(prefix, algorithm, layout, compute_tensors, alpha))
        used.update(tensors)
    if modules and modules[0].has_dora and modules[0].tensors[DORA_SCALE].ndim == 0:
        raise LycorisError("dora_scale must have at least one dimension", file=file, key=f"{prefix}.{DORA_SCALE}")
    return modules, sorted(set(group) - used)
