"""Resize: a file's modules, whatever their algorithm, as plain LoRA/LoCon of a new rank, by SVD of each change.

For a module with full-strength change ΔW (the loader's own maths, `changes`):

    ΔW₂ = ΔW.reshape(out, −1) = U Σ Vᵀ,   rank r by the rule (fixed, or kohya's/LyCORIS' dynamic rules on σ)
    up = U_r Σ_r^½, down = Σ_r^½ V_rᵀ, alpha = r        (Eckart–Young: the best rank-r change in Frobenius norm)

The spectrum comes from the factors when the algorithm knows its change as A @ B (LoCon, LoHa, LoKr, GLoRA: exact,
ΔW never formed) unless the inner size is no smaller than the layer's rank (then the dense SVD is cheaper), else
from the dense change (randomized for a fixed small rank on a large layer: lowrank.spectrum). Convs with a kernel
may be written in LoCon's Tucker form instead (tucker.py) where that has fewer parameters for no larger error.
Biases and 1-D (norm) weights are written as full diffs (`diff_b`, `w_norm`): exact, and they are small.

Every error reported is measured on the tensors as written (after rounding to the file's dtype):
ε = ‖ΔW − ΔŴ‖_F / ‖ΔW‖_F.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..algos import BY_NAME
from ..algos.lokr import RowWindowLayout
from ..bypass import reads_weight
from ..casting import cast_all
from ..errors import LycorisError
from ..keys import WITH_ADAPTER_NAME
from ..lycoris_file import LycorisFile
from ..module import Module, Plan
from ..patch import change
from . import tucker
from .changes import dense_change, factored_change, is_factored
from .lowrank import RULES, Factors, RankRule, choose_rank, lora_tensors, spectrum, stored_error
from .metadata import ModuleRecord

NEEDS_BASE = "needs the base model (connect MODEL/CLIP)"
NOT_IN_BASE = "reads the base weight, and the connected MODEL/CLIP has no weight that fits it"
# what `value` may be, per dynamic rule: (lowest, highest, whether the lowest itself is allowed)
VALUE_RANGES: dict[str, tuple[float, float, bool]] = {
    "threshold": (0.0, math.inf, True),
    "ratio": (0.0, 1.0, True),
    "quantile": (0.0, 1.0, False),
    "sv_ratio": (1.0, math.inf, True),
    "sv_cumulative": (0.0, 1.0, False),
    "sv_fro": (0.0, 1.0, False),
}


@dataclass(frozen=True)
class Settings:
    rule: RankRule
    dtype: torch.dtype = torch.float16
    tucker: bool = True  # LoCon's Tucker form for convs with a kernel, where it pays


def rank_rule(mode: str, rank: int, value: float) -> RankRule:
    """The rule a user asked for: `rank` is the rank (fixed) or the cap (dynamic rules, as kohya's --new_rank).
    LycorisError for a rank below 1, an unknown mode or a value out of the rule's range."""
    if mode not in RULES:
        raise LycorisError(f"unknown rank rule '{mode}'; one of {', '.join(RULES)}")
    if rank < 1:
        raise LycorisError(f"the rank must be at least 1, got {rank}")
    if mode == "fixed":
        return RankRule("fixed", rank)
    low, high, low_allowed = VALUE_RANGES[mode]
    if not (low < value or (low_allowed and value == low)) or value > high or math.isnan(value):
        bound = "[" if low_allowed else "("
        raise LycorisError(f"rule {mode} ({RULES[mode]}) needs a value in {bound}{low:g}, {high:g}], got {value:g}")
    return RankRule(mode, value, max_rank=rank)


@dataclass(frozen=True)
class Resized:
    """One written module: tensors by suffix and its record (form, rank, error measured after rounding)."""

    tensors: dict[str, torch.Tensor]
    record: ModuleRecord


def factored_error(change: Factors, up: torch.Tensor, down: torch.Tensor) -> float:
    """‖A B − U D‖_F / ‖A B‖_F without forming either product: ‖X Y‖²_F = Σ (XᵀX) ⊙ (Y Yᵀ), X = [A | −U],
    Y = [B ; D] (float64: the difference of two nearly equal sums)."""
    x = torch.cat([change.up, -up.to(change.up)], dim=1).double()
    y = torch.cat([change.down, down.to(change.down)], dim=0).double()
    a, b = change.up.double(), change.down.double()
    energy = float(((a.T @ a) * (b @ b.T)).sum())
    if energy <= 0:
        return 0.0
    residual = float(((x.T @ x) * (y @ y.T)).sum())
    return math.sqrt(max(residual, 0.0) / energy)


def _measured(change: "Factors | torch.Tensor", t: dict[str, torch.Tensor], shape: tuple[int, ...]) -> float:
    rank = t["lora_down.weight"].shape[0]
    up = t["lora_up.weight"].float().reshape(shape[0], rank)
    down = t["lora_down.weight"].float().reshape(rank, -1)
    if isinstance(change, Factors):
        return factored_error(change, up, down)
    return stored_error(change, up @ down)


def resize_weight(change: "Factors | torch.Tensor", shape: tuple[int, ...], settings: Settings) -> Resized:
    """A weight change (Factors of the flattened shape, or dense in `shape`) as LoRA/LoCon (or LoCon Tucker)."""
    flat = (shape[0], math.prod(shape[1:]))
    if isinstance(change, Factors) and change.up.shape[1] >= min(flat):
        change = change.dense()  # no cheaper than the dense SVD
    rule = settings.rule
    spec = spectrum(change, int(rule.value) if rule.mode == "fixed" else None)
    rank = choose_rank(spec.s, rule)
    low = lora_tensors(spec, rank, shape, settings.dtype)
    error = _measured(change, low.tensors, shape)
    best = Resized(low.tensors, ModuleRecord("locon" if len(shape) > 2 else "lora", rank, error))
    if settings.tucker and tucker.has_kernel(shape):
        dense = change.dense() if isinstance(change, Factors) else change
        best = _tucker_if_it_pays(dense.reshape(shape), shape, best, settings.dtype)
    return best


def _tucker_if_it_pays(change: torch.Tensor, shape: tuple[int, ...], flat: Resized, dtype: torch.dtype) -> Resized:
    hosvd = tucker.basis(change)
    rank = tucker.choose(hosvd, shape, flat.record.rank, flat.record.error)
    if rank is None:
        return flat
    t = tucker.tensors(hosvd, rank, shape, dtype)
    error = stored_error(change, tucker.rebuilt(t, shape))
    if error > flat.record.error + tucker.SAME_ERROR:  # rounding made it worse than the flat one
        return flat
    return Resized(t, ModuleRecord("locon-tucker", rank, error))


def full_diff(change: torch.Tensor, suffix: str, dtype: torch.dtype) -> Resized:
    stored = change.to(dtype).contiguous()
    return Resized({suffix: stored}, ModuleRecord("full", None, stored_error(change, stored.float())))


# --- a whole file ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Base:
    """What the base model says about one module: the target weight's shape and, for changes that read it, the
    weight itself (fp32, the weight before this module), given or fetched when the module's turn comes (`fetch`:
    one weight-sized copy at a time, not a copy of the whole model)."""

    shape: tuple[int, ...]
    weight: torch.Tensor | None = None
    fetch: Callable[[], torch.Tensor] | None = None

    @property
    def has_weight(self) -> bool:
        return self.weight is not None or self.fetch is not None

    def resolved(self) -> "Base":
        """This base with its weight in hand (fetched now if it is fetched)."""
        return Base(self.shape, self.fetch()) if self.weight is None and self.fetch is not None else self


@dataclass
class Result:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # full keys, as written
    modules: dict[str, ModuleRecord] = field(default_factory=dict)
    not_written: list[tuple[str, str]] = field(default_factory=list)
    shape_from_file: list[str] = field(default_factory=list)  # modules whose full weight shape the file does not pin


def layout_shape(module: Module) -> tuple[int, ...]:
    """The target weight's shape as far as the file pins it: the full shape, else (out, in·∏k) (a conv kernel the
    file does not record is then written flat, which ComfyUI and this pack read the same), else (out,)."""
    lay = module.layout
    if lay.shape is not None:
        return tuple(lay.shape)
    return (lay.out, lay.flat_in) if lay.flat_in is not None else (lay.out,)


def needs_base(module: Module, plan: Plan) -> bool:
    """Whether the module's change cannot be computed from the file alone."""
    return reads_weight(plan) or isinstance(plan.layout, RowWindowLayout)


def module_change(module: Module, plan: Plan, base: Base, device: torch.device) -> "Factors | torch.Tensor":
    """ΔW at full strength: factored when the algorithm knows it so, else dense in the target's shape."""
    if is_factored(plan) and not isinstance(plan.layout, RowWindowLayout):
        return factored_change(plan, module.tensors, 1.0, base.weight, device)
    if base.weight is not None:
        return dense_change(plan, module.tensors, 1.0, base.weight, device)
    # a change that does not read W: a meta weight lends its shape (patch.change), none of W's size is read
    tensors = cast_all(module.tensors, device, torch.float32, keep=BY_NAME[plan.algorithm].dense)
    return change(plan, tensors, torch.empty(base.shape, device="meta"), 1.0)


def resize_module(module: Module, plan: Plan, base: Base, settings: Settings, device: torch.device) -> Resized:
    change = module_change(module, plan, base, device)
    if BY_NAME[plan.algorithm].param != "weight":
        return full_diff(change, "diff_b", settings.dtype)
    if len(base.shape) < 2:
        return full_diff(change, "w_norm", settings.dtype)
    return resize_weight(change, base.shape, settings)


def missing_base(lfile: LycorisFile, bases: Mapping[str, Base], have_model: bool) -> list[tuple[str, str]]:
    """(key, reason) for every module whose change needs a weight that was not given."""
    missing = []
    for key, module in lfile.modules.items():
        base = bases.get(key)
        if base is not None and base.has_weight:
            continue
        plan = module.plan_for(base.shape if base else layout_shape(module), file=lfile.name)
        if needs_base(module, plan):
            missing.append((key, f"{module.label}: {NOT_IN_BASE if have_model else NEEDS_BASE}"))
    return missing


@torch.no_grad()  # a model's weights are Parameters: nothing here is to be differentiated
def resize_file(lfile: LycorisFile, bases: Mapping[str, Base], settings: Settings, device: torch.device,
                skip: Mapping[str, str] | None = None, step: Callable[[], None] = lambda: None) -> Result:
    """Every module of `lfile` resized (those in `skip` listed as not written with their reason). `bases[key]`: the
    target weight's shape (and weight, for changes that read it) where the model gives it; else the file's own."""
    result = Result(not_written=list((skip or {}).items()))
    for key, module in lfile.modules.items():
        if skip and key in skip:
            step()
            continue
        base = bases.get(key)
        if base is None:
            base = Base(layout_shape(module))
            if module.layout.shape is None and len(base.shape) == 2:
                result.shape_from_file.append(key)
        plan = module.plan_for(base.shape, file=lfile.name)
        resized = resize_module(module, plan, base.resolved() if needs_base(module, plan) else base, settings, device)
        names = WITH_ADAPTER_NAME if module.adapter_named else {}  # the mark decides some layouts (keymap.py)
        for suffix, tensor in resized.tensors.items():
            result.tensors[f"{module.prefix}.{names.get(suffix, suffix)}"] = tensor.cpu()
        result.modules[key] = resized.record
        step()
    return result
