"""A LyCORIS module from the difference of two weights: base W₀ and tuned W₁, ΔW = W₁ − W₀ (fp32, on one device).

LoCon (every rank rule of lowrank.RULES, LyCORIS' extractor's names):

    ΔW₂ = ΔW.reshape(out, −1) = U Σ Vᵀ,   rank r by the rule,   ΔW₂ ≈ (U_r Σ_r^½)(Σ_r^½ V_rᵀ) = lora_up @ lora_down

  LyCORIS' extractor (lycoris.utils.extract_linear / extract_conv, 4.1.3) clamps r to [1, min(out, in)] (for a
  conv: its input channels, not in·k², as extract_conv does) and writes
  the module as a full diff (`diff`, exact) when r ≥ out / 2: that is kept here (after our optional cap `max_rank`).
  A conv is written as LoCon with a k×k lora_down, the best rank-r approximation. LyCORIS' `small_conv` step (a
  `lora_mid` Tucker core) is not taken: it truncates lora_down (r, in, k, k), read as (in, r·k²), to rank r again,
  which loses accuracy wherever min(in, r·k²) > r (nearly always), so it is a different, worse approximation.

LoKr (nearest Kronecker product, Van Loan & Pitsianis 1993): with out = a·b and in = c·d split by LyCORIS'
`factorization(dim, factor)` (w1 (a, c) the smaller factor), the rearrangement

    R(ΔW)[(i, l), (j, q)] = ΔW[i·b + j, l·d + q]          (q runs over d and the kernel)

turns ‖ΔW − A ⊗ B‖_F into ‖R(ΔW) − vec(A) vec(B)ᵀ‖_F, so the best A ⊗ B is the first singular triplet of R(ΔW):
A = √σ₁ u₁, B = √σ₁ v₁. The rank rule then applies to B (lokr_w2_a @ lokr_w2_b), which LyCORIS stores whole when
r ≥ max(b, d)/2 (its LokrModule rule). The residual of the fit is orthogonal to A ⊗ E for any E, so
ε² = ε²_kron + ‖A‖²‖B − B_r‖² / ‖ΔW‖²; both are reported (the first as `fit_error`). A single Kronecker product
fits a change that has this structure (a LoKr fine-tune) exactly and a generic low-rank change poorly: the error
says which.

LoHa is not offered: ΔW = (W₁ₐW₁ᵦ) ⊙ (W₂ₐW₂ᵦ) has no closed-form best fit (a non-convex problem with no known
optimum), and the exact embedding of a rank-r LoCon (W₂ₐW₂ᵦ = 𝟙𝟙ᵀ) doubles the parameters for nothing.

Every error reported is measured: ‖ΔW − Â‖_F / ‖ΔW‖_F with Â rebuilt from the tensors as stored (after rounding
to the file's dtype). `change` = ‖ΔW‖_F / ‖W₀‖_F decides `skip_below`.
"""

import math
from dataclasses import dataclass

import torch

from .lowrank import RULES, RankRule, choose_rank, spectrum, stored_error

# the modes offered: LyCORIS' extractor's (fixed, threshold, ratio, quantile, full), kohya's Frobenius share
# ("energy", lowrank's sv_fro) and "full" (every changed weight as an exact diff)
MODES: dict[str, str] = {
    "fixed": RULES["fixed"],
    "threshold": RULES["threshold"],
    "ratio": RULES["ratio"],
    "quantile": RULES["quantile"],
    "energy": "keep the rank whose Frobenius norm reaches this share of the change's (0-1; kohya's sv_fro)",
    "full": "every changed weight as an exact full diff (no SVD)",
}
ALGOS = ("locon", "lokr")


def rank_rule(mode: str, value: float, max_rank: int | None = None) -> RankRule | None:
    """The lowrank rule for an extract mode; None for "full". ValueError for an unknown mode or a bad value."""
    if mode not in MODES:
        raise ValueError(f"unknown extract mode '{mode}'; one of {', '.join(MODES)}")
    if mode == "full":
        return None
    if mode in ("ratio", "quantile", "energy") and not 0 <= value <= 1:
        raise ValueError(f"mode '{mode}' takes a value between 0 and 1, got {value}")
    if mode == "threshold" and value < 0:
        raise ValueError(f"mode 'threshold' takes a value of at least 0, got {value}")
    return RankRule("sv_fro" if mode == "energy" else mode, value, max_rank if max_rank else None)


@dataclass(frozen=True)
class Extracted:
    """One weight's module: tensors under LyCORIS/kohya suffixes (empty when nothing is written), its form
    ("locon", "lokr", "full", "bias" for a bias-only change, "skipped", "unchanged"), the rank (None
    for a full diff or a full lokr_w2), the measured relative error ε and the relative change ‖ΔW‖/‖W₀‖."""

    tensors: dict[str, torch.Tensor]
    form: str
    rank: int | None
    error: float
    change: float
    fit_error: float | None = None  # LoKr: the relative error of the best kron(A, B) alone

    @property
    def written(self) -> bool:
        return bool(self.tensors)


def relative_change(delta: torch.Tensor, base: torch.Tensor) -> float:
    """‖ΔW‖_F / ‖W₀‖_F (inf for a zero base with a change, 0 for no change)."""
    change, norm = float(delta.double().norm()), float(base.double().norm())
    if change == 0:
        return 0.0
    return change / norm if norm > 0 else math.inf


@torch.no_grad()
def extract_weight(base: torch.Tensor, tuned: torch.Tensor, rule: RankRule | None, algo: str = "locon",
                   dtype: torch.dtype = torch.float16, device: torch.device | str | None = None,
                   skip_below: float = 0.0, factor: int = -1,
                   base_bias: torch.Tensor | None = None, tuned_bias: torch.Tensor | None = None) -> Extracted:
    """The module for tuned − base (same shape, any float dtype), computed in fp32 on `device` (default: tuned's).

    `rule` None writes a full diff. `skip_below`: a weight whose ‖ΔW‖/‖W₀‖ is below it is not written ("skipped";
    its bias change neither). A bias pair that differs adds `diff_b` (exact up to `dtype`)."""
    if tuple(base.shape) != tuple(tuned.shape):
        raise ValueError(f"base weight {list(base.shape)} and tuned weight {list(tuned.shape)} differ in shape")
    if algo not in ALGOS:
        raise ValueError(f"unknown algo '{algo}'; one of {', '.join(ALGOS)}")
    device = tuned.device if device is None else torch.device(device)
    w0 = base.to(device=device, dtype=torch.float32)
    delta = tuned.to(device=device, dtype=torch.float32) - w0
    change = relative_change(delta, w0)
    bias = _bias_change(base_bias, tuned_bias, device, dtype)
    if change == 0:
        return Extracted(bias, "bias", None, 0.0, 0.0) if bias else Extracted({}, "unchanged", None, 0.0, 0.0)
    if change < skip_below:
        return Extracted({}, "skipped", None, 0.0, change)
    if rule is None or delta.ndim < 2:
        module = full_diff(delta, dtype)
    elif algo == "lokr":
        module = lokr(delta, rule, dtype, factor)
    else:
        module = locon(delta, rule, dtype)
    module.tensors.update(bias)
    return Extracted(module.tensors, module.form, module.rank, module.error, change, module.fit_error)


def _bias_change(base_bias, tuned_bias, device, dtype) -> dict[str, torch.Tensor]:
    if base_bias is None or tuned_bias is None:
        return {}
    diff = tuned_bias.to(device=device, dtype=torch.float32) - base_bias.to(device=device, dtype=torch.float32)
    return {"diff_b": diff.to(dtype)} if bool(diff.any()) else {}


@dataclass
class _Module:
    tensors: dict[str, torch.Tensor]
    form: str
    rank: int | None
    error: float
    fit_error: float | None = None


def full_diff(delta: torch.Tensor, dtype: torch.dtype) -> _Module:
    stored = delta.to(dtype)
    return _Module({"diff": stored}, "full", None, stored_error(delta, stored.float()))


def lycoris_writes_full(rank: int, out: int) -> bool:
    """LyCORIS' extract_linear/extract_conv: a rank reaching half the output size is stored as the full diff."""
    return rank >= out / 2


def locon(delta: torch.Tensor, rule: RankRule, dtype: torch.dtype) -> _Module:
    """LoCon at the rule's rank, or the full diff where LyCORIS' extractor writes one."""
    out = delta.shape[0]
    spec = spectrum(delta, int(rule.value) if rule.mode == "fixed" else None)
    rank = min(choose_rank(spec.s, rule), delta.shape[1])  # LyCORIS clamps a conv's rank to its input channels
    if lycoris_writes_full(rank, out):
        return full_diff(delta, dtype)
    root = spec.s[:rank].sqrt()
    up = spec.u[:, :rank] * root
    down = root[:, None] * spec.vh[:rank]
    ones = (1,) * (delta.ndim - 2)
    tensors = {"lora_up.weight": up.reshape(out, rank, *ones).to(dtype).contiguous(),
               "lora_down.weight": down.reshape(rank, *delta.shape[1:]).to(dtype).contiguous(),
               "alpha": torch.tensor(float(rank))}
    return _Module(tensors, "locon", rank, stored_error(delta, rebuild_locon(tensors, delta.shape)))


def rebuild_locon(tensors: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """up @ down in fp32, scale alpha / r = 1."""
    return (tensors["lora_up.weight"].float().flatten(1) @ tensors["lora_down.weight"].float().flatten(1)).reshape(shape)


# --- LoKr ---------------------------------------------------------------------------------------------------------

def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a dimension into (m, n), m ≤ n, m·n = dimension (lycoris.functional.general.factorization,
    4.1.3): the given factor when it divides the dimension, else the divisor pair closest to √dimension with
    m ≤ factor (factor −1: no limit)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    if factor < 0:
        factor = dimension
    m, n = 1, dimension
    length = m + n
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > length or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def kron_split(shape: tuple[int, ...], factor: int = -1) -> tuple[int, int, int, int]:
    """(a, b, c, d): out = a·b, in = c·d as LyCORIS' LokrModule splits them; w1 (a, c), w2 (b, d, *k)."""
    a, b = factorization(shape[0], factor)
    c, d = factorization(shape[1], factor)
    return a, b, c, d


def rearrange(delta: torch.Tensor, a: int, b: int, c: int, d: int) -> torch.Tensor:
    """R(ΔW) (a·c, b·d·∏k): row (i, l), column (j, q, kernel) holds ΔW[i·b + j, l·d + q, kernel]."""
    kernel = math.prod(delta.shape[2:])
    return delta.reshape(a, b, c, d * kernel).permute(0, 2, 1, 3).reshape(a * c, b * d * kernel)


def nearest_kronecker(delta: torch.Tensor, factor: int = -1) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The A (a, c) and B (b, d, *k) minimising ‖ΔW − A ⊗ B‖_F, and that minimum relative to ‖ΔW‖_F."""
    a, b, c, d = kron_split(delta.shape, factor)
    spec = spectrum(rearrange(delta, a, b, c, d))
    root = spec.s[0].sqrt()
    w1 = (spec.u[:, 0] * root).reshape(a, c)
    w2 = (spec.vh[0] * root).reshape(b, d, *delta.shape[2:])
    fit = stored_error(delta, rebuild_lokr({"lokr_w1": w1, "lokr_w2": w2}, delta.shape))  # measured: 1 - s1^2 / |dW|^2 cancels
    return w1, w2, fit


def lokr(delta: torch.Tensor, rule: RankRule, dtype: torch.dtype, factor: int = -1) -> _Module:
    """The nearest Kronecker product, its w2 at the rule's rank (whole where LyCORIS keeps it whole)."""
    w1, w2, fit = nearest_kronecker(delta, factor)
    b = w2.shape[0]
    w2_flat = w2.reshape(b, -1)
    spec = spectrum(w2_flat, int(rule.value) if rule.mode == "fixed" else None)
    rank = choose_rank(spec.s, rule)
    tensors = {"lokr_w1": w1.to(dtype).contiguous()}
    if rank >= max(b, w2.shape[1]) / 2:  # LyCORIS' LokrModule: w2 stored whole, scale 1
        tensors["lokr_w2"] = w2.to(dtype).contiguous()
        rank = None
    else:
        root = spec.s[:rank].sqrt()
        tensors["lokr_w2_a"] = (spec.u[:, :rank] * root).to(dtype).contiguous()
        tensors["lokr_w2_b"] = (root[:, None] * spec.vh[:rank]).to(dtype).contiguous()
        tensors["alpha"] = torch.tensor(float(rank))
    return _Module(tensors, "lokr", rank, stored_error(delta, rebuild_lokr(tensors, delta.shape)), fit)


def rebuild_lokr(tensors: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """kron(w1, w2) in fp32 in W's shape (scale alpha / r = 1)."""
    w1 = tensors["lokr_w1"].float()
    w2 = tensors["lokr_w2"].float() if "lokr_w2" in tensors else \
        tensors["lokr_w2_a"].float() @ tensors["lokr_w2_b"].float()
    a, c = w1.shape
    b = w2.shape[0]
    w2 = w2.reshape(b, -1, *shape[2:])
    d = w2.shape[1]
    kron = torch.einsum("il,jq...->ijlq...", w1, w2)
    return kron.reshape(a * b, c * d, *shape[2:])
