"""The tools' shared core: rank rules against the tools that define them, the spectrum of factored and dense changes,
and the error it reports (the writer's tests are in test_tools_writer.py).

Truth: lycoris-lora 4.1.3's own `lycoris.utils.extract_linear` (its rank for each mode), kohya sd-scripts'
resize_lora rules as written there (networks/resize_lora.py: `index_sv_*` clamp to [1, len(S) − 1], `rank_resize`
adds 1 and caps at --new_rank; a largest σ ≤ 1e-6 gives rank 1), torch.linalg.svd of the dense product, and the
residual measured on the reconstructed matrix.
"""

import pytest
import torch
from lycoris.utils import extract_linear
from lycoris_nodes.lycoris_core.tools import lowrank
from lycoris_nodes.lycoris_core.tools.lowrank import Factors, RankRule, choose_rank, spectrum


def decaying(out: int, inner: int, seed: int = 0, decay: float = 0.8) -> torch.Tensor:
    """A matrix with a known, geometrically decaying spectrum."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out, min(out, inner), generator=gen))
    v, _ = torch.linalg.qr(torch.randn(inner, min(out, inner), generator=gen))
    s = decay ** torch.arange(min(out, inner), dtype=torch.float32)
    return (u * s) @ v.T


@pytest.mark.parametrize("mode,value", [("fixed", 5), ("threshold", 0.05), ("ratio", 0.1), ("ratio", 0.5),
                                        ("quantile", 0.5), ("quantile", 0.9)])
def test_lycoris_rules_pick_lycoris_lora_rank(mode, value):
    weight = decaying(96, 40, seed=1)
    result, kind = extract_linear(weight, mode, value, "cpu")
    assert kind == "low rank"
    ours = choose_rank(spectrum(weight).s, RankRule(mode, value))
    assert ours == result[0].shape[0]


# σ, rule, value, cap -> kohya's rank (rank_resize: index + 1, capped; index clamped to [1, len − 1])
KOHYA = [
    ([8, 4, 2, 1], "sv_ratio", 3, None, 3),  # σ > 8/3: {8, 4} -> index 2 -> rank 3
    ([8, 4, 2, 1], "sv_ratio", 100, None, 4),  # index clamped to 3 -> 4
    ([8, 4, 2, 1], "sv_ratio", 1, None, 2),  # none above 8 -> index clamped to 1 -> 2
    ([5, 3, 1, 1], "sv_cumulative", 0.5, None, 2),  # cumsum/sum = .5,.8,.9,1; searchsorted(.5) = 0 -> index 1
    ([5, 3, 1, 1], "sv_cumulative", 0.85, None, 4),  # searchsorted(.85) = 2 -> index 3 -> rank 4
    ([3, 2, 1, 0.5], "sv_fro", 0.9, None, 3),  # σ² shares .63,.91,.98,1; searchsorted(.81) = 1 -> index 2
    ([8, 4, 2, 1], "sv_ratio", 100, 2, 2),  # the cap
    ([1e-7, 1e-8, 0, 0], "sv_fro", 0.9, None, 1),  # a zero change: rank 1
]


def kohya_rank(s: list[float], mode: str, value: float, cap: int | None) -> int:
    """kohya's functions, written out from their definitions (networks/resize_lora.py)."""
    t = torch.tensor(s, dtype=torch.float64)
    if t[0] <= 1e-6:
        return 1
    if mode == "sv_ratio":
        index = int((t > t[0] / value).sum())
    elif mode == "sv_cumulative":
        index = int(torch.searchsorted(torch.cumsum(t, 0) / t.sum(), torch.tensor(value, dtype=t.dtype))) + 1
    else:
        sq = t.square()
        index = int(torch.searchsorted(torch.cumsum(sq, 0) / sq.sum(), torch.tensor(value ** 2, dtype=t.dtype))) + 1
    rank = max(1, min(index, len(s) - 1)) + 1
    return min(rank, cap) if cap is not None else rank


@pytest.mark.parametrize("s,mode,value,cap,expected", KOHYA)
def test_kohya_rules(s, mode, value, cap, expected):
    assert kohya_rank(s, mode, value, cap) == expected  # the table agrees with kohya's definitions
    assert choose_rank(torch.tensor(s), RankRule(mode, value, cap)) == expected


def test_factored_spectrum_is_the_dense_one_without_forming_it():
    gen = torch.Generator().manual_seed(2)
    factors = Factors(torch.randn(96, 12, generator=gen), torch.randn(12, 200, generator=gen))
    exact = torch.linalg.svdvals(factors.dense().double())
    spec = spectrum(factors)
    assert torch.allclose(spec.s.double(), exact[:12], rtol=1e-4)
    for rank in (1, 5, 12):
        approx = lowrank.lora_tensors(spec, rank, (96, 200))
        built = approx.tensors["lora_up.weight"] @ approx.tensors["lora_down.weight"]
        assert approx.error == pytest.approx(lowrank.stored_error(factors.dense(), built), abs=1e-5)
    assert spec.error(12) < 1e-3


# wide (decomposed through its transpose), tall, square, and a convolution (wide once flattened)
@pytest.mark.parametrize("shape", [(40, 90), (90, 40), (50, 50), (8, 3, 3, 3)])
def test_the_dense_spectrum_is_the_change_s_own_whichever_side_is_longer(shape):
    gen = torch.Generator().manual_seed(3)
    change = torch.randn(*shape, generator=gen)
    flat = change.reshape(shape[0], -1)
    spec = spectrum(change)
    k = min(flat.shape)
    assert spec.u.shape == (flat.shape[0], k) and spec.vh.shape == (k, flat.shape[1])
    assert torch.allclose(spec.s.double(), torch.linalg.svdvals(flat.double()), rtol=1e-4)
    assert torch.allclose(spec.u @ torch.diag(spec.s) @ spec.vh, flat, atol=1e-4)
    assert torch.allclose(spec.u.T @ spec.u, torch.eye(k), atol=1e-4)


def test_concatenated_factors_are_the_sum():
    gen = torch.Generator().manual_seed(3)
    a = Factors(torch.randn(30, 4, generator=gen), torch.randn(4, 20, generator=gen))
    b = Factors(torch.randn(30, 2, generator=gen), torch.randn(2, 20, generator=gen))
    assert torch.allclose(Factors.concat([a, b]).dense(), a.dense() + b.dense(), atol=1e-5)


def test_randomized_svd_error_is_measured_and_near_optimal():
    """A 1280 × 1536 change (SDXL width) of decaying spectrum plus noise at rank 32: the randomized path is taken,
    its reported error is the measured residual of its own factors, and it is within 1% of the optimal tail."""
    change = decaying(1280, 1536, seed=4, decay=0.9) + 1e-3 * torch.randn(1280, 1536,
                                                                         generator=torch.Generator().manual_seed(5))
    fast = spectrum(change, fixed_rank=32)
    assert not fast.complete
    approx = lowrank.lora_tensors(fast, 32, (1280, 1536))
    measured = lowrank.stored_error(change, approx.tensors["lora_up.weight"] @ approx.tensors["lora_down.weight"])
    assert approx.error == pytest.approx(measured, rel=1e-3)
    optimal = spectrum(change).error(32)
    assert measured <= optimal * 1.01


def test_conv_lora_tensors_have_locon_shapes():
    change = decaying(16, 8 * 9, seed=6).reshape(16, 8, 3, 3)
    made = lowrank.low_rank(change, (16, 8, 3, 3), RankRule("fixed", 4))
    assert made.tensors["lora_up.weight"].shape == (16, 4, 1, 1)
    assert made.tensors["lora_down.weight"].shape == (4, 8, 3, 3)
    assert float(made.tensors["alpha"]) == 4


@pytest.mark.parametrize("mode,value", [("fixed", 0), ("nonsense", 1)])
def test_bad_rules_are_refused(mode, value):
    with pytest.raises(ValueError):
        RankRule(mode, value)
