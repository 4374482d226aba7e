"""Converting a module between the kohya/LyCORIS and the diffusers/PEFT forms, exactly, or saying why not.

The two forms of LoRA hold the same change:

    kohya/LyCORIS:  ΔW₂ = (alpha / r) · up₂ @ down₂          (`lora_up.weight`, `lora_down.weight`, `alpha`)
    PEFT/diffusers: ΔW₂ = s · lora_B₂ @ lora_A₂,  s = lora_alpha / r  (rsLoRA: lora_alpha / √r)

where r, lora_alpha (and use_rslora) live in the adapter's config: diffusers keeps it as JSON in the safetensors
metadata `lora_adapter_metadata`, one config per component (`unet.r`, `text_encoder.lora_alpha`, ...), with
`rank_pattern` / `alpha_pattern` giving the modules whose values differ from `r` / `lora_alpha`. A module converts
by renaming its factors and carrying its scale s as alpha = s·r (so PEFT's rsLoRA scale becomes a kohya alpha, and
a kohya alpha becomes a `lora_alpha` of the same value). The factors are copied as they are (cast only if asked).

Tucker (`lora_mid`, LyCORIS' conv LoCon) has no PEFT form, but its change is an exact LoCon of the same rank:
ΔW = s · Σᵢⱼ mid[i, j, k…] up[o, i] down[j, n], so down'[i, n, k…] = Σⱼ mid[i, j, k…] down[j, n] is PEFT's lora_A.
Other additive algorithms that know their change as A @ B exactly (LoHa, LoKr, GLoRA: `Algorithm.factored`) are
written to diffusers as a LoRA of that inner rank (scale folded into A, alpha = rank): exact, possibly larger.

DoRA: LyCORIS' out-axis `dora_scale` (out, 1…) and PEFT's `lora_magnitude_vector` ((out,), or (1, out, 1…) for a
conv) both give W' = m ⊙ V / ‖V‖ per output row, V = W + ΔW (LyCORIS adds ε = finfo(fp32).eps to the norm: 1e-7
relative). The in-axis `dora_scale` (1, in, 1…) normalises columns: PEFT has nothing like it, it is reported.
OFT, BOFT, (IA)³ and full diffs (LyCORIS' or PEFT's) have no form with the same maths on the other side: reported.
"""

import itertools
import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..algos import BY_NAME
from ..algos.base import tucker_factors
from ..dora import OUT
from ..keys import ALPHA, DORA_SCALE, PEFT_MAGNITUDE
from ..module import Module, Plan
from ..peft_config import METADATA_KEY
from .changes import factored_change, is_factored
from .lowrank import Factors

KOHYA, DIFFUSERS = "kohya", "diffusers"
TARGETS = (KOHYA, DIFFUSERS)
UP, DOWN, MID = "lora_up.weight", "lora_down.weight", "lora_mid.weight"
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"
# The pipeline components diffusers' save_lora_weights prefixes its names with.
COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")

IN_AXIS_DORA = ("DoRA on the input axis (LyCORIS' original dora_scale (1, in, 1...)): PEFT's magnitude is per "
                "output row, a different weight decomposition")


@dataclass(frozen=True)
class Converted:
    """One module in the target's form: tensors by suffix (the caller prefixes the module's name), its rank and
    alpha (the scale s = alpha / r), and what was done to it."""

    tensors: dict[str, torch.Tensor]
    rank: int | None
    alpha: float | None
    form: str


# --- names -----------------------------------------------------------------------------------------------------------

def component_path(name: str) -> tuple[str, str] | None:
    """(component, module path in that component) of a diffusers name, e.g. ("unet", "down_blocks.0…to_q")."""
    for component in sorted(COMPONENTS, key=len, reverse=True):
        if name.startswith(component + "."):
            return component, name[len(component) + 1:]
    return None


def rows_of(change: "Factors | torch.Tensor", start: int, length: int) -> "Factors | torch.Tensor":
    """Rows start..start+length of a change: ΔW's rows are up's rows times down."""
    if isinstance(change, Factors):
        return Factors(change.up[start:start + length], change.down)
    return change[start:start + length]


def row_part(converted: "Converted", start: int, length: int) -> "Converted":
    """The PEFT LoRA of rows start..start+length of a converted module: lora_B's rows (and the DoRA magnitude's,
    one per output row), lora_A as it is."""
    tensors = dict(converted.tensors)
    tensors[LORA_B] = tensors[LORA_B][start:start + length]
    if PEFT_MAGNITUDE in tensors:
        magnitude = tensors[PEFT_MAGNITUDE]
        tensors[PEFT_MAGNITUDE] = (magnitude[start:start + length] if magnitude.ndim == 1
                                   else magnitude[:, start:start + length])
    return Converted(tensors, converted.rank, converted.alpha, converted.form + f" (rows {start}..{start + length})")


def join_rows(pieces: list[tuple[int, "Factors"]], shape: tuple[int, ...]) -> "Converted | str":
    """One LoRA for a fused weight from low-rank changes of its row parts (first row, Factors): up holds each
    part's up in that part's rows and its own columns, down stacks the parts' downs, so up @ down is each part's
    change in its rows and zero elsewhere (rows no part changes stay as they are). Scales are in the factors:
    alpha = rank."""
    spans = sorted((start, start + f.up.shape[0]) for start, f in pieces)
    if any(a_end > b_start for (_a, a_end), (b_start, _b) in itertools.pairwise(spans)):
        return "two modules change overlapping rows of this fused weight"
    rank = sum(f.down.shape[0] for _s, f in pieces)
    up = torch.zeros(shape[0], rank, dtype=torch.float32, device=pieces[0][1].up.device)
    column = 0
    for start, f in pieces:
        up[start:start + f.up.shape[0], column:column + f.down.shape[0]] = f.up
        column += f.down.shape[0]
    down = torch.cat([f.down for _s, f in pieces], dim=0)
    up_shape, down_shape = _factor_shapes(shape, rank)
    return Converted({UP: up.cpu().reshape(up_shape), DOWN: down.cpu().reshape(down_shape),
                      ALPHA: torch.tensor(float(rank), dtype=torch.float32)},
                     rank, float(rank), f"lora of rank {rank} ({len(pieces)} parts of a fused weight joined)")


# --- tensors ---------------------------------------------------------------------------------------------------------

def _factor_shapes(shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(up, down) shapes of a LoRA on a weight of `shape`, as kohya and PEFT store them: a conv's down carries
    the kernel (r, in, k…), its up is pointwise (out, r, 1…)."""
    return (shape[0], rank, *[1] * (len(shape) - 2)), (rank, *shape[1:])


def lora_factors(module: Module, plan: Plan, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(up, down, tucker folded) of a LoCon module in the target weight's layout, as stored (Tucker: fp32 fold)."""
    t, rank = module.tensors, plan.layout.rank
    up_shape, down_shape = _factor_shapes(shape, rank)
    if MID not in t:
        return t[UP].reshape(up_shape), t[DOWN].reshape(down_shape), False
    _left, folded = tucker_factors(t[MID].float(), t[UP].reshape(shape[0], rank).transpose(0, 1).float(),
                                   t[DOWN].reshape(rank, -1).float())
    return t[UP].reshape(up_shape), folded.to(t[DOWN].dtype).reshape(down_shape), True


def peft_magnitude(dora_scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """PEFT's magnitude layout: (out,) for a Linear, (1, out, 1…) for a conv (its norm, kept, transposed)."""
    flat = dora_scale.reshape(-1)
    return flat if len(shape) == 2 else flat.reshape(1, shape[0], *[1] * (len(shape) - 2))


def to_peft(module: Module, plan: Plan, shape: tuple[int, ...], weight: torch.Tensor | None,
            device: torch.device) -> Converted | str:
    """The module as PEFT's LoRA (lora_A/lora_B[/lora_magnitude_vector]), or the reason it has no exact form."""
    name = plan.algorithm
    if name == "locon":
        if plan.dora_axis is not None and plan.dora_axis != OUT:
            return IN_AXIS_DORA
        up, down, folded = lora_factors(module, plan, shape)
        tensors = {LORA_A: down, LORA_B: up}
        if plan.dora_axis is not None:
            tensors[PEFT_MAGNITUDE] = peft_magnitude(module.tensors[DORA_SCALE], shape)
        form = "lora" + (" (Tucker folded into lora_A)" if folded else "") + ("+dora" if plan.dora_axis else "")
        return Converted(tensors, plan.layout.rank, plan.layout.scale * plan.layout.rank, form)
    algorithm = BY_NAME[name]
    if algorithm.no_peft_form is not None:
        return algorithm.no_peft_form
    if algorithm.no_kohya_form is not None:  # PEFT's own algorithms: every one declares it
        return f"{module.label} is PEFT's own form; only LoRA converts between PEFT files here"
    if plan.dora_axis is not None and plan.dora_axis != OUT:
        return IN_AXIS_DORA
    bare = replace(plan, dora_axis=None)  # an out-axis DoRA normalises W + dW whatever form dW has: PEFT's DoRA
    if not is_factored(bare):
        return f"{module.label} has no exact low-rank form"
    change = factored_change(bare, module.tensors, 1.0, weight, device)
    rank = change.down.shape[0]
    up_shape, down_shape = _factor_shapes(shape, rank)
    dtype = next(iter(module.tensors.values())).dtype
    tensors = {LORA_A: change.down.to("cpu", dtype).reshape(down_shape),
               LORA_B: change.up.to("cpu", dtype).reshape(up_shape)}
    if plan.dora_axis is not None:
        tensors[PEFT_MAGNITUDE] = peft_magnitude(module.tensors[DORA_SCALE], shape)
    return Converted(tensors, rank, float(rank),
                     f"lora of rank {rank}{'+dora' if plan.dora_axis else ''} (exact form of {module.label})")


def with_identity_magnitude(converted: Converted, change: "Factors | torch.Tensor", weight: torch.Tensor,
                            shape: tuple[int, ...]) -> Converted:
    """A plain LoRA as a DoRA that changes nothing more: PEFT's `use_dora` covers a whole component, so a LoRA
    beside DoRA modules gets the magnitude m = ‖V‖ per output row (V = W + ΔW), and m ⊙ V / ‖V‖ = V."""
    dense = change.dense() if isinstance(change, Factors) else change
    v = weight.to(dense.device, torch.float32).reshape(shape[0], -1) + dense.reshape(shape[0], -1)
    magnitude = peft_magnitude(v.norm(dim=1).cpu(), shape)
    return Converted({**converted.tensors, PEFT_MAGNITUDE: magnitude}, converted.rank, converted.alpha,
                     converted.form + "+dora (magnitude = norm of W + dW: unchanged)")


def to_kohya(module: Module, plan: Plan, shape: tuple[int, ...]) -> Converted | str:
    """The module under kohya/LyCORIS suffixes, or the reason it has none. LyCORIS' own algorithms keep their
    tensors; a PEFT LoRA gets its scale as alpha = s·r and its magnitude as an out-axis dora_scale (out, 1…)."""
    algorithm = BY_NAME[plan.algorithm]
    if algorithm.no_kohya_form is not None:
        return algorithm.no_kohya_form
    renames = dict(algorithm.kohya_renames)
    tensors = {renames.get(k, k): t for k, t in module.tensors.items() if k != DORA_SCALE}
    if plan.dora_axis is not None:
        scale = module.tensors[DORA_SCALE]
        tensors[DORA_SCALE] = (scale.reshape(shape[0], *[1] * (len(shape) - 1)) if plan.dora_axis == OUT else scale)
    rank = plan.layout.rank
    alpha = None
    if rank and module.algorithm.uses_alpha:
        alpha = plan.layout.scale * rank
        tensors[ALPHA] = torch.tensor(alpha, dtype=torch.float32)
    label = module.algorithm.label.lower() + ("+dora" if plan.dora_axis else "")
    return Converted(tensors, rank, alpha, label)


def cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating tensors in `dtype` (None: as they are); alpha stays fp32 (a scale, not a weight)."""
    if dtype is None:
        return dict(tensors)
    return {k: t.to(dtype) if t.is_floating_point() and k != ALPHA else t for k, t in tensors.items()}


# --- PEFT's config -----------------------------------------------------------------------------------------------

def _exact_pattern(path: str) -> str:
    """A pattern PEFT matches against this module's path only: PEFT tries `(.*\\.)?(pattern)$`, and `^` keeps a
    longer path that ends the same way from matching (diffusers writes its rank patterns the same way)."""
    return "^" + re.escape(path)


def peft_component_config(modules: Mapping[str, Converted]) -> dict[str, object]:
    """A LoraConfig dict (what diffusers passes to `LoraConfig(**metadata)`) for one component: module path ->
    converted module. `r` and `lora_alpha` are the most common values; the other modules get theirs by
    rank_pattern / alpha_pattern."""
    ranks = Counter(m.rank for m in modules.values())
    alphas = Counter(m.alpha for m in modules.values())
    r, alpha = ranks.most_common(1)[0][0], alphas.most_common(1)[0][0]
    return {
        "r": r,
        "lora_alpha": alpha,
        "rank_pattern": {_exact_pattern(p): m.rank for p, m in modules.items() if m.rank != r},
        "alpha_pattern": {_exact_pattern(p): m.alpha for p, m in modules.items() if m.alpha != alpha},
        "target_modules": sorted(modules),
        "use_dora": any(PEFT_MAGNITUDE in m.tensors for m in modules.values()),
        "use_rslora": False,
        "lora_bias": False,
        "init_lora_weights": True,
    }


def peft_metadata(modules: Mapping[str, Converted]) -> dict[str, str]:
    """The metadata diffusers writes and reads back: `lora_adapter_metadata` (one config per component, flattened
    as diffusers' save_lora_weights flattens them: `unet.r`, ...) and `format: pt`. `modules`: diffusers name ->
    converted module."""
    by_component: dict[str, dict[str, Converted]] = {}
    for name, converted in modules.items():
        component, path = component_path(name)
        by_component.setdefault(component, {})[path] = converted
    flat = {f"{component}.{key}": value for component, group in sorted(by_component.items())
            for key, value in peft_component_config(group).items()}
    return {METADATA_KEY: json.dumps(flat, indent=2, sort_keys=True), "format": "pt"}


# --- checking -----------------------------------------------------------------------------------------------------

def _frobenius_sq(f: Factors) -> float:
    """‖A B‖²_F = trace((AᵀA)(BBᵀ)): r×r products, nothing of the weight's size."""
    up, down = f.up.double(), f.down.double()
    return float(((up.T @ up) * (down @ down.T)).sum())


def change_norm(change: "Factors | torch.Tensor") -> float:
    """‖ΔW‖_F of a change in either form."""
    if isinstance(change, Factors):
        return max(_frobenius_sq(change), 0.0) ** 0.5
    return float(change.double().norm())


def relative_difference(source: "Factors | torch.Tensor", converted: "Factors | torch.Tensor") -> float:
    """‖ΔW_converted − ΔW_source‖ / ‖ΔW_source‖ (0 for a zero change): in factors when both are factored."""
    if isinstance(source, Factors) and isinstance(converted, Factors):
        norm = _frobenius_sq(source)
        difference = Factors.concat([converted, Factors(-source.up, source.down)])
        return (max(_frobenius_sq(difference), 0.0) / norm) ** 0.5 if norm > 0 else 0.0
    a = source.dense() if isinstance(source, Factors) else source
    b = converted.dense() if isinstance(converted, Factors) else converted
    a, b = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
    norm = float(a.norm())
    return float((b - a).norm()) / norm if norm > 0 else 0.0
