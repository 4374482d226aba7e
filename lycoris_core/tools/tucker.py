"""A conv change with a kernel (k > 1) as LoCon's Tucker form (lora_up, lora_mid, lora_down), where that pays.

    ΔW[o, n, …] ≈ Σᵢⱼ mid[i, j, …]·U[o, i]·D[j, n],      U (out, r), D (r, in), mid (r, r, *k),  alpha = r

by the truncated higher-order SVD (De Lathauwer, De Moor, Vandewalle 2000): U and Dᵀ are the leading left singular
vectors of ΔW unfolded along out, (out, in·K), and along in, (in, out·K), and mid[i, j, …] = Σₒₙ ΔW[o, n, …]·U[o, i]·
D[j, n]. With orthonormal U and D that is an orthogonal projection, so

    ‖ΔW − Tucker_r‖²_F = ‖ΔW‖²_F − ‖mid_r‖²_F      (exact; mid_r is the r × r corner of the full core G)

and every rank's error comes from one core by a 2-D running sum, without rebuilding anything.

When it pays: a Tucker change of rank r has out- and in-mode ranks ≤ r, so its flat unfolding has rank ≤ r too: at
the same rank it is never more exact than the flat LoCon. It can be smaller at a higher rank:
r_t·(out + in) + r_t²·K parameters against the flat rank r's r·(out + in·K). `choose` takes the smallest r_t whose
error is no larger than the flat LoCon's and which has fewer parameters; otherwise the flat LoCon is kept.
"""

import math
from dataclasses import dataclass

import torch

UP, DOWN, MID, ALPHA = "lora_up.weight", "lora_down.weight", "lora_mid.weight", "alpha"
# the Tucker error may exceed the flat one by this much (fp32 round-off of two SVDs of the same change) and still count
# as "no larger": below what any stored dtype can tell apart
SAME_ERROR = 1e-6


@dataclass(frozen=True)
class Basis:
    """The full HOSVD of one conv change: U (out, a), D (b, in), the core G (a, b, K) and ‖ΔW‖²_F."""

    u: torch.Tensor
    d: torch.Tensor
    core: torch.Tensor
    energy: float
    kept: torch.Tensor  # kept[i, j]: squared Frobenius norm of G[:i+1, :j+1] (float64)

    def error(self, rank: int) -> float:
        """Relative Frobenius error of the rank-`rank` Tucker form."""
        if self.energy <= 0:
            return 0.0
        r = min(rank, self.kept.shape[0], self.kept.shape[1])
        return math.sqrt(max(self.energy - float(self.kept[r - 1, r - 1]), 0.0) / self.energy)


def has_kernel(shape: tuple[int, ...]) -> bool:
    """A Conv2d weight (out, in, kh, kw) with a kernel larger than 1×1: where Tucker is written. Defined for any conv,
    but ComfyUI's core LoRA loader reads lora_mid for Conv2d only (weight_adapter/lora.py builds a 4-D shape from it
    and fails on a 3-D or 5-D one), and the output must load wherever the input did."""
    return len(shape) == 4 and math.prod(shape[2:]) > 1


def parameters(shape: tuple[int, ...], rank: int) -> int:
    return rank * (shape[0] + shape[1]) + rank * rank * math.prod(shape[2:])


def flat_parameters(shape: tuple[int, ...], rank: int) -> int:
    return rank * (shape[0] + math.prod(shape[1:]))


def basis(change: torch.Tensor) -> Basis:
    """The HOSVD of a change (out, in, *k), fp32 on its device."""
    out, inputs, taps = change.shape[0], change.shape[1], math.prod(change.shape[2:])
    w = change.float().reshape(out, inputs, taps)
    u = _leading_vectors(w.reshape(out, -1))
    v = _leading_vectors(w.transpose(0, 1).reshape(inputs, -1))
    # float64: the error is √(‖ΔW‖² − ‖core‖²), a difference of two nearly equal sums where the form is near exact
    core = torch.einsum("onk,oi,nj->ijk", w.double(), u, v)
    kept = core.square().sum(dim=2).cumsum(0).cumsum(1)
    return Basis(u.float(), v.transpose(0, 1).float(), core.float(), float(w.double().square().sum()), kept)


def _leading_vectors(unfolding: torch.Tensor) -> torch.Tensor:
    """The left singular vectors of an unfolding (rows × cols), most significant first, float64, from the
    eigenvectors of its Gram matrix (rows × rows): the unfoldings are wide (out × in·K), and this is several times
    cheaper than their SVD. Any orthonormal basis keeps the error formula exact; only the order matters."""
    gram = unfolding.double() @ unfolding.double().transpose(0, 1)  # float64: the Gram holds squared singular values
    _values, vectors = torch.linalg.eigh(gram)
    return vectors.flip(1)


def choose(hosvd: Basis, shape: tuple[int, ...], flat_rank: int, flat_error: float) -> int | None:
    """The smallest Tucker rank with no larger error than the flat LoCon of `flat_rank` and fewer parameters than
    it, or None when there is none."""
    budget = flat_parameters(shape, flat_rank)
    limit = min(hosvd.kept.shape)
    for rank in range(1, limit + 1):
        if parameters(shape, rank) >= budget:
            return None
        if hosvd.error(rank) <= flat_error + SAME_ERROR:
            return rank
    return None


def tensors(hosvd: Basis, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """LoCon Tucker tensors: up (out, r, 1…), down (r, in, 1…), mid (r, r, *k), alpha = r (scale 1)."""
    ones = (1,) * (len(shape) - 2)
    up = hosvd.u[:, :rank].reshape(shape[0], rank, *ones)
    down = hosvd.d[:rank].reshape(rank, shape[1], *ones)
    mid = hosvd.core[:rank, :rank].reshape(rank, rank, *shape[2:])
    return {UP: up.to(dtype).contiguous(), DOWN: down.to(dtype).contiguous(), MID: mid.to(dtype).contiguous(),
            ALPHA: torch.tensor(float(rank))}


def rebuilt(t: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The change the written tensors hold (fp32, after their rounding), flattened to (out, in·K)."""
    rank = t[DOWN].shape[0]
    up = t[UP].float().reshape(shape[0], rank)
    down = t[DOWN].float().reshape(rank, shape[1])
    folded = torch.einsum("ij...,jn->in...", t[MID].float(), down)  # (r, in, *k)
    return up @ folded.reshape(rank, -1)
