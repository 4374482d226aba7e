"""A module's change as a low-rank LoRA/LoCon: its SVD, the rank rules users know, the factors, the error.

    ΔW₂ = ΔW.reshape(out, −1) = U Σ Vᵀ,      rank r keeps σ₁ … σ_r:
    ΔW₂ ≈ (U_r Σ_r^½)(Σ_r^½ V_rᵀ) = up @ down,      alpha = r (scale 1)
    relative error ε(r) = ‖ΔW₂ − up @ down‖_F / ‖ΔW₂‖_F = √(‖ΔW₂‖²_F − Σ_{i≤r} σᵢ²) / ‖ΔW₂‖_F

The error is exact whichever SVD found the σᵢ: for orthonormal U_r, the residual of the projection U_r U_rᵀ ΔW₂ has
‖ΔW₂‖² − ‖U_rᵀ ΔW₂‖² as its squared norm, and ‖ΔW₂‖² is measured on the change itself.

Three ways to the spectrum, cheapest first:
* `Factors` (a change known as A @ B of inner size R, e.g. LoRA chains, LoHa's rank r₁·r₂ product): QR of A and Bᵀ and
  the SVD of the R × R core. Exact, never forms ΔW. (An inner size R ≥ min(out, in) is formed and takes the dense
  path: no cheaper otherwise.)
* A dense change, full SVD (`torch.linalg.svd`, of the tall side: `_svd`), for every rule that reads the whole
  spectrum.
* A dense change with a fixed rank r ≤ min(out, in)/4 on a large layer: randomized SVD (`torch.svd_lowrank`,
  Halko-Martinsson-Tropp 2011) with p = 8 oversampling and q = 2 power iterations. Its bound (HMT Cor. 10.10, spectral
  norm): E‖ΔW₂ − U_r U_rᵀ ΔW₂‖ ≤ (1 + 4√(r+p)/(p−1) · √min(out, in))^{1/(2q+1)} · σ_{r+1}, i.e. ≤ 2.7 σ_{r+1} at
  r = 32 on a 1280-wide layer, and far closer when the spectrum decays (measured: tests/test_tools_lowrank.py). The
  reported ε is the measured one (above), never the bound.
"""

import math
from dataclasses import dataclass

import torch

# kohya's resize_lora: a spectrum whose largest σ is at most this is a zero change, kept at rank 1
MIN_SV = 1e-6
RANDOMIZED_MIN_SIDE = 1024  # layers narrower than this get the full SVD: it is fast there and exact
RANDOMIZED_MAX_SHARE = 4  # ... and so do ranks above min(out, in) / 4, where the randomized one stops paying
OVERSAMPLE, POWER_ITERATIONS = 8, 2


@dataclass(frozen=True)
class Factors:
    """A change known as ΔW₂ = up @ down exactly: up (out, R), down (R, in·∏k)."""

    up: torch.Tensor
    down: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.up.shape[0], self.down.shape[1]

    def dense(self) -> torch.Tensor:
        return self.up @ self.down

    @staticmethod
    def concat(parts: "list[Factors]") -> "Factors":
        """Σ upᵢ @ downᵢ as one product: the inner sizes side by side (LoRA + LoRA is a LoRA of the summed ranks)."""
        return Factors(torch.cat([p.up for p in parts], dim=1), torch.cat([p.down for p in parts], dim=0))


@dataclass(frozen=True)
class Spectrum:
    """The leading singular triplets of ΔW₂ (σ descending) and ‖ΔW₂‖²_F. `complete` when every σ is known."""

    u: torch.Tensor  # (out, k)
    s: torch.Tensor  # (k,)
    vh: torch.Tensor  # (k, in * prod(kernel))
    energy: float  # squared Frobenius norm of the change
    complete: bool

    def error(self, rank: int) -> float:
        """ε(rank): the relative Frobenius error of keeping the first `rank` triplets (0 for a zero change)."""
        if self.energy <= 0:
            return 0.0
        kept = float(self.s[:rank].double().square().sum())
        return math.sqrt(max(self.energy - kept, 0.0) / self.energy)


def _as_2d(change: torch.Tensor) -> torch.Tensor:
    return change.reshape(change.shape[0], -1)


def spectrum(change: "torch.Tensor | Factors", fixed_rank: int | None = None) -> Spectrum:
    """The SVD of a change (dense, any shape with out first; or `Factors`), in fp32 on the change's device.

    `fixed_rank`: the only rank that will be read, which allows the randomized SVD on large layers (see the module
    docstring); without it every σ is computed."""
    if isinstance(change, Factors):
        if change.up.shape[1] < min(change.shape):  # else the QR path is exact but no cheaper than the dense SVD
            return _factored(change.up.float(), change.down.float())
        change = change.up.float() @ change.down.float()
    dense = _as_2d(change).float()
    energy = float(dense.double().square().sum())
    side = min(dense.shape)
    if fixed_rank is not None and side >= RANDOMIZED_MIN_SIDE and fixed_rank * RANDOMIZED_MAX_SHARE <= side:
        u, s, v = torch.svd_lowrank(dense, q=min(fixed_rank + OVERSAMPLE, side), niter=POWER_ITERATIONS)
        return Spectrum(u, s, v.transpose(0, 1), energy, complete=False)
    u, s, vh = _svd(dense)
    return Spectrum(u, s, vh, energy, complete=True)


def _svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD, of the transpose when the matrix is wide: Mᵀ = U Σ Vᵀ gives M = V Σ Uᵀ, the same σ.

    Why: on the CPU (MKL's gesdd, torch 2.14) a wide matrix takes 1.5-7x longer than its tall transpose, and every
    convolution's change is wide (out × in·k·k): 11.0 s against 1.5 s for SDXL's 1280 × 11520, 1.2 s against 0.33 s for
    640 × 5120 (measured on a 2-core machine, 2026-11-29)."""
    if matrix.shape[0] >= matrix.shape[1]:
        return torch.linalg.svd(matrix, full_matrices=False)
    u, s, vh = torch.linalg.svd(matrix.transpose(0, 1), full_matrices=False)
    return vh.transpose(0, 1), s, u.transpose(0, 1)


def _factored(up: torch.Tensor, down: torch.Tensor) -> Spectrum:
    """SVD of up @ down without forming it: up = Q₁R₁, downᵀ = Q₂R₂, R₁R₂ᵀ = U_c Σ V_cᵀ, so up @ down =
    (Q₁U_c) Σ (Q₂V_c)ᵀ. Costs O((out + in)·R²)."""
    q1, r1 = torch.linalg.qr(up)
    q2, r2 = torch.linalg.qr(down.transpose(0, 1))
    uc, s, vch = _svd(r1 @ r2.transpose(0, 1))
    energy = float(s.double().square().sum())
    return Spectrum(q1 @ uc, s, vch @ q2.transpose(0, 1), energy, complete=True)


# --- Rank rules ----------------------------------------------------------------------------------------------------

# mode -> what `value` means. LyCORIS' extractor (lycoris.utils.extract_linear/extract_conv) and kohya's resize_lora
# (networks/resize_lora.py, --dynamic_method) define these; their rank rules are reproduced exactly.
RULES: dict[str, str] = {
    "fixed": "the rank itself",
    "threshold": "LyCORIS: keep every singular value above this value",
    "ratio": "LyCORIS: keep singular values above this share of the largest (0-1)",
    "quantile": "LyCORIS: keep singular values until their running sum reaches this share of the total (0-1)",
    "sv_ratio": "kohya: keep singular values within this factor of the largest (>= 1)",
    "sv_cumulative": "kohya: keep singular values until their running sum reaches this share of the total (0-1)",
    "sv_fro": "kohya: keep the rank whose Frobenius norm reaches this share of the change's (0-1)",
}


@dataclass(frozen=True)
class RankRule:
    mode: str  # a key of RULES
    value: float
    max_rank: int | None = None  # a cap for the dynamic rules (kohya's --new_rank), None for none

    def __post_init__(self):
        if self.mode not in RULES:
            raise ValueError(f"unknown rank rule '{self.mode}'; one of {', '.join(RULES)}")
        if self.mode == "fixed" and self.value < 1:
            raise ValueError(f"a fixed rank must be at least 1, got {self.value}")


def choose_rank(s: torch.Tensor, rule: RankRule) -> int:
    """The rank a rule picks from σ (descending), clamped to [1, len(σ)] and the rule's cap."""
    n = len(s)
    if n == 0:
        return 0
    s = s.double()
    if rule.mode == "fixed":
        rank = int(rule.value)
    elif rule.mode in ("threshold", "ratio", "quantile"):
        rank = _lycoris_rank(s, rule.mode, rule.value)
    elif float(s[0]) <= MIN_SV:  # kohya: a zero change is kept at rank 1
        rank = 1
    else:
        rank = _kohya_index(s, rule.mode, rule.value) + 1
    if rule.max_rank is not None:
        rank = min(rank, rule.max_rank)
    return max(1, min(rank, n))


def _lycoris_rank(s: torch.Tensor, mode: str, value: float) -> int:
    """lycoris.utils.extract_linear's rules (4.1.3), before its clamp to [1, min(out, in)]."""
    if mode == "threshold":
        return int((s > value).sum())
    if mode == "ratio":
        return int((s > s.max() * value).sum())
    return int((torch.cumsum(s, 0) < value * s.sum()).sum())  # quantile


def _kohya_index(s: torch.Tensor, mode: str, value: float) -> int:
    """kohya's index_sv_ratio / index_sv_cumulative / index_sv_fro: each clamped to [1, len(σ) − 1]."""
    if mode == "sv_ratio":
        index = int((s > s[0] / value).sum())
    elif mode == "sv_cumulative":
        index = int(torch.searchsorted(torch.cumsum(s, 0) / s.sum(), torch.tensor(value, dtype=s.dtype))) + 1
    else:  # sv_fro
        squares = s.square()
        index = int(torch.searchsorted(torch.cumsum(squares, 0) / squares.sum(),
                                       torch.tensor(value * value, dtype=s.dtype))) + 1
    return max(1, min(index, len(s) - 1))


# --- LoRA / LoCon tensors ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LowRank:
    """One module's LoRA/LoCon: its tensors under LyCORIS/kohya suffixes, the rank and the relative error ε."""

    tensors: dict[str, torch.Tensor]
    rank: int
    error: float


def lora_tensors(spec: Spectrum, rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
                 ) -> LowRank:
    """`lora_up` (out, r[, 1, 1…]), `lora_down` (r, *shape[1:]) and alpha = r (scale 1), each factor carrying √σ
    (balanced: neither factor's range grows with the change's, which keeps fp16/bf16 storage accurate)."""
    root = spec.s[:rank].sqrt()
    up = spec.u[:, :rank] * root
    down = root[:, None] * spec.vh[:rank]
    ones = (1,) * (len(shape) - 2)
    return LowRank({"lora_up.weight": up.reshape(shape[0], rank, *ones).to(dtype).contiguous(),
                    "lora_down.weight": down.reshape(rank, *shape[1:]).to(dtype).contiguous(),
                    "alpha": torch.tensor(float(rank))},
                   rank, spec.error(rank))


def low_rank(change: "torch.Tensor | Factors", shape: tuple[int, ...], rule: RankRule,
             dtype: torch.dtype = torch.float32) -> LowRank:
    """The LoRA/LoCon a rule picks for one change (dense in `shape`, or `Factors` of the flattened `shape`)."""
    spec = spectrum(change, int(rule.value) if rule.mode == "fixed" else None)
    return lora_tensors(spec, choose_rank(spec.s, rule), shape, dtype)


def stored_error(change: torch.Tensor, approximation: torch.Tensor) -> float:
    """ε measured on tensors as written (after rounding to the file's dtype): ‖ΔW − Â‖ / ‖ΔW‖, 0 for a zero change."""
    change, approximation = _as_2d(change).double(), _as_2d(approximation).double()
    norm = float(change.norm())
    return float((change - approximation).norm()) / norm if norm > 0 else 0.0
