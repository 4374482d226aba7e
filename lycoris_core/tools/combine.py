"""One weight's applied chain of modules as one module of a file: kept, concatenated, a full diff, or a LoRA by SVD.

A weight W₀ patched by a chain of modules ends as W = fₙ(…f₁(W₀)); what a file must hold for it is the change
ΔW = W − W₀. Forms, cheapest exact first (`exact_module`):

* kept: one module at strength 1, no fused-row window: its own tensors (and alpha) are that change by definition.
* lora: every module additive with factors, ΔWᵢ₂ = mᵢ·Aᵢ@Bᵢ: ΔW₂ = Σ mᵢAᵢ@Bᵢ = [m₁A₁ … mₙAₙ] @ [B₁; …; Bₙ], one LoRA
  of rank R = Σ rᵢ with alpha = R (scale 1). A module on a row window (start, length) of a fused weight has its A
  placed in those rows (zeros elsewhere). Chosen when R·(out + in·∏k) < out·in·∏k, i.e. smaller than the diff.
* full: ΔW itself (`diff`; a bias change as `diff_b`).

`lora_module` turns any change into a LoRA/LoCon by SVD (lowrank.py) at the smallest rank whose relative error is at
most a target, capped by a maximum rank (target 0: the maximum rank). Biases and 1-D weights (norms) have no low-rank
form: they are written as full diffs.

Every form's error is measured, not assumed: the written tensors (rounded to the file's dtype) are parsed back by the
loader's own parser and their change computed by the loader's own patch code (`reproduced`), then compared with ΔW
(lowrank.stored_error).
"""

import math
from dataclasses import dataclass

import torch

from ..algos import BY_NAME
from ..bypass import reads_weight
from ..casting import cast_all
from ..lycoris_file import parse_state_dict
from ..module import Plan
from ..patch import change as patch_change
from . import lowrank
from .changes import factored_change, is_factored
from .metadata import ModuleRecord

# fp32 relative error above which a kept or concatenated module is not what the chain did (then the next form)
KEPT_TOLERANCE = 1e-5
# dW = W - W0 computed in fp32 carries up to about this much of |W0| in rounding
FP32_STEP = 2.0 ** -23


def tolerance(delta: torch.Tensor, w0: torch.Tensor) -> float:
    """How far an exact form may read back from ΔW: KEPT_TOLERANCE plus the fp32 rounding ΔW itself carries, which
    is relative to ‖W₀‖ (a small change to a large weight)."""
    return KEPT_TOLERANCE + 4 * FP32_STEP * float(w0.double().norm()) / max(float(delta.double().norm()), 1e-30)
PROBE_PREFIX = "m"  # the module name tensors are parsed back under


@dataclass(frozen=True)
class Entry:
    """One of our modules in a weight's chain: its plan, tensors (as stored), strength, and the output rows it
    changes ((start, length) of a fused weight, or None for the whole weight)."""

    plan: Plan
    tensors: dict[str, torch.Tensor]
    strength: float
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Written:
    """One weight's module in the output: tensor suffix -> tensor, and what it is (form, rank, measured error)."""

    tensors: dict[str, torch.Tensor]
    record: ModuleRecord


def reproduced(tensors: dict[str, torch.Tensor], w0: torch.Tensor, param: str = "weight") -> torch.Tensor:
    """The change these tensors make to `w0` at strength 1, as our loader reads and applies them (fp32, w0's device)."""
    lfile = parse_state_dict({f"{PROBE_PREFIX}.{suffix}": t for suffix, t in tensors.items()}, "output")
    module = lfile.modules[f"{PROBE_PREFIX}.{param}"]
    plan = module.plan_for(tuple(w0.shape))
    t = cast_all(module.tensors, w0.device, torch.float32, keep=module.algorithm.dense)
    return patch_change(plan, t, w0.float(), 1.0)


def _measured(form: str, rank: int | None, tensors: dict[str, torch.Tensor], delta: torch.Tensor,
              w0: torch.Tensor, param: str) -> Written:
    error = lowrank.stored_error(delta, reproduced(tensors, w0, param))
    return Written(tensors, ModuleRecord(form, rank, error))


def _rounded(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in the file's dtype (alpha stays fp32: a scalar, and bf16 would round it)."""
    return {k: t.to(dtype) if t.is_floating_point() and k != "alpha" else t for k, t in tensors.items()}


# --- full diff -------------------------------------------------------------------------------------------------------

def full_module(delta: torch.Tensor, w0: torch.Tensor, param: str, dtype: torch.dtype) -> Written:
    suffix = "diff_b" if param == "bias" else "diff"
    return _measured("full", None, {suffix: delta.to(dtype).contiguous()}, delta, w0, param)


# --- kept ------------------------------------------------------------------------------------------------------------

def kept_alpha(plan: Plan) -> float | None:
    """The alpha that gives this layout its scale back: OFT/BOFT's constraint C = alpha·n·b, else s = alpha / rank
    (None: alpha = rank, scale 1)."""
    layout = plan.layout
    constraint = getattr(layout, "constraint", None)
    if constraint is not None:
        return constraint / layout.out if constraint else None
    if layout.rank and layout.scale != 1.0:
        return layout.scale * layout.rank
    return None


def kept_tensors(entry: Entry) -> dict[str, torch.Tensor]:
    tensors = dict(entry.tensors)
    alpha = kept_alpha(entry.plan)
    if alpha is not None:
        tensors["alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return tensors


def is_keepable(entries: list[Entry] | None, param: str) -> bool:
    """One module at strength 1 on the whole parameter, whose suffixes name this parameter (`weight` for every key
    but a bias, whose module names the layer): a part named after its layer's other parameter (LightX2V's `diff_m`
    on a Wan block's `modulation`) is written as that parameter's own `.diff` instead."""
    return (entries is not None and len(entries) == 1 and entries[0].strength == 1.0 and entries[0].rows is None
            and BY_NAME[entries[0].plan.algorithm].param == param)


def _kept(entry: Entry, delta: torch.Tensor, w0: torch.Tensor, param: str, dtype: torch.dtype) -> Written | None:
    """The module's own tensors, when they read back as the chain's change (checked in fp32 first: a layout whose
    scale alpha cannot restore, or tensors the parser reads otherwise, fall through to another form)."""
    tensors = kept_tensors(entry)
    if lowrank.stored_error(delta, reproduced(tensors, w0, param)) > tolerance(delta, w0):
        return None
    written = _measured("kept", entry.plan.layout.rank, _rounded(tensors, dtype), delta, w0, param)
    return Written(written.tensors, ModuleRecord(f"kept {entry.plan.label}", written.record.rank,
                                                 written.record.error))


# --- concatenated LoRA ------------------------------------------------------------------------------------------------

def is_concatenable(entries: list[Entry] | None, param: str) -> bool:
    return (param == "weight" and bool(entries)
            and all(is_factored(e.plan) for e in entries))


def concatenated(entries: list[Entry], w0: torch.Tensor) -> lowrank.Factors | None:
    """Σ mᵢ·Aᵢ@Bᵢ as one Factors of the whole weight (flattened), each A placed in its rows; None when a module's
    factors do not have its target's shape (a form that knows only the fused weight's). A module whose change reads
    the weight gets the weight as the modules before it left it."""
    device, out = w0.device, w0.shape[0]
    flat_in = math.prod(w0.shape[1:])
    reads = any(reads_weight(e.plan) for e in entries)
    current = w0.float().clone() if reads else None
    parts = []
    for entry in entries:
        before = None if current is None else _rows(current, entry.rows)
        part = factored_change(entry.plan, entry.tensors, entry.strength, before, device)
        up = part.up
        rows = out if entry.rows is None else entry.rows[1]
        if up.shape[0] != rows or part.down.numel() != part.down.shape[0] * flat_in:
            return None
        if entry.rows is not None:
            up = torch.zeros(out, up.shape[1], device=device, dtype=up.dtype)
            up[entry.rows[0]:entry.rows[0] + entry.rows[1]] = part.up
        parts.append(lowrank.Factors(up, part.down.reshape(part.down.shape[0], -1)))
        if current is not None:
            current.view(out, -1).add_(parts[-1].dense())
    return lowrank.Factors.concat(parts)


def _rows(weight: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return weight if rows is None else weight.narrow(0, *rows)


def is_smaller_than_diff(rank: int, shape: tuple[int, ...]) -> bool:
    flat_in = math.prod(shape[1:])
    return rank * (shape[0] + flat_in) < shape[0] * flat_in


def lora_tensors(factors: lowrank.Factors, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """ΔW₂ = up @ down as LoRA/LoCon tensors with alpha = rank (scale 1)."""
    rank = factors.up.shape[1]
    ones = (1,) * (len(shape) - 2)
    return {"lora_up.weight": factors.up.reshape(shape[0], rank, *ones).to(dtype).contiguous(),
            "lora_down.weight": factors.down.reshape(rank, *shape[1:]).to(dtype).contiguous(),
            "alpha": torch.tensor(float(rank))}


# --- the two modes ----------------------------------------------------------------------------------------------------

def exact_module(entries: list[Entry] | None, delta: torch.Tensor, w0: torch.Tensor, param: str,
                 dtype: torch.dtype) -> Written:
    """The chain's change in the first exact form that fits (module docstring). `entries`: the chain when every
    module in it is ours and additive in the weight's rows (None when some patch is not: a full diff then)."""
    if is_keepable(entries, param):
        kept = _kept(entries[0], delta, w0, param, dtype)
        if kept is not None:
            return kept
    if is_concatenable(entries, param) and delta.ndim >= 2:
        factors = concatenated(entries, w0)
        if factors is not None and is_smaller_than_diff(factors.up.shape[1], tuple(delta.shape)):
            tensors = lora_tensors(factors, tuple(delta.shape), torch.float32)
            if lowrank.stored_error(delta, reproduced(tensors, w0, param)) <= tolerance(delta, w0):
                return _measured("lora", factors.up.shape[1], _rounded(tensors, dtype), delta, w0, param)
    return full_module(delta, w0, param, dtype)


def chosen_rank(spec: lowrank.Spectrum, max_rank: int, max_error: float) -> int:
    """The smallest rank whose error ε(r) ≤ max_error, at most max_rank (max_error 0: max_rank); at least 1."""
    cap = max(1, min(max_rank, len(spec.s)))
    if max_error <= 0 or spec.energy <= 0:
        return cap
    kept = torch.cumsum(spec.s[:cap].double().square(), 0)
    errors = ((spec.energy - kept).clamp(min=0) / spec.energy).sqrt()
    good = (errors <= max_error).nonzero()
    return int(good[0]) + 1 if len(good) else cap


def lora_module(delta: torch.Tensor, factors: lowrank.Factors | None, w0: torch.Tensor, param: str,
                max_rank: int, max_error: float, dtype: torch.dtype) -> Written:
    """The change as a LoRA/LoCon by SVD (of `factors` when the change is known factored: exact and cheaper), or a
    full diff for a bias or a 1-D weight."""
    if param == "bias" or delta.ndim < 2:
        return full_module(delta, w0, param, dtype)
    if factors is not None and factors.up.shape[1] >= min(factors.shape):
        factors = None  # an inner size beyond the matrix's own: the factored SVD is exact but no cheaper
    spec = lowrank.spectrum(factors if factors is not None else delta,
                            fixed_rank=max_rank if max_error <= 0 else None)
    rank = chosen_rank(spec, max_rank, max_error)
    low = lowrank.lora_tensors(spec, rank, tuple(delta.shape), dtype)
    return _measured("lora", rank, low.tensors, delta, w0, param)
