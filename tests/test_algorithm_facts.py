"""What each algorithm declares about itself (`Algorithm`, lycoris_core/algos/base.py), checked against what its maths
does, for every algorithm in the registry (issue #37: a fact kept far from its algorithm is forgotten for a new one).

* `reads_param`: the change ΔW = W'(m) − W depends on W, the current value of the parameter it patches, exactly when
  the algorithm says so (DoRA reads W whatever the algorithm: Plan.reads_param). Computed with the core's own path
  (bypass.Contribution.change → patch.change) for two different W: equal ΔW iff it does not read W. Declared wrong,
  bypass computes a reader's change from a weight without the changes before it (or no weight at all), and a change
  read from a converted parameter is applied (nodes/glue/apply.py).
* `row_adder`: adds m·ΔW[first:first + n] for any window of rows, the same as ΔW's rows.
* `assumable_options`: declared wherever a module's layout assumes PEFT defaults (the warning names them).
* `no_peft_form` / `no_kohya_form`: what the Convert tool answers for such a module.

Every algorithm in the registry needs a case in CASES (a small valid module on a small parameter), so a new one
without a case fails here.
"""

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from lycoris_nodes.lycoris_core import LycorisError, parse_state_dict
from lycoris_nodes.lycoris_core.algos import BY_NAME
from lycoris_nodes.lycoris_core.bypass import Contribution, reads_weight
from lycoris_nodes.lycoris_core.keys import DORA_SCALE
from lycoris_nodes.lycoris_core.module import Module
from lycoris_nodes.lycoris_core.tools.convert import Converted, to_kohya, to_peft

OUT, IN = 32, 24
STRENGTHS = (1.0, 0.5)
ROW_TOLERANCE = 1e-6  # relative: a window's product sums the same terms as the whole change's


def _rand(seed: int, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


@dataclass(frozen=True)
class Case:
    """A file's tensors holding one module of the algorithm (among others it implies, e.g. a LoRA's weight beside
    its bias part), and the shape of the parameter it patches."""

    tensors: Callable[[], dict[str, torch.Tensor]]
    shape: tuple[int, ...]
    refused: bool = False  # the algorithm refuses every module at load (its reason is the point): nothing to compute


def _lora(prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.lora_up.weight": _rand(1, OUT, 4), f"{prefix}.lora_down.weight": _rand(2, 4, IN),
            f"{prefix}.alpha": torch.tensor(2.0)}


CASES: dict[str, Case] = {
    "locon": Case(lambda: _lora("lora_unet_m"), (OUT, IN)),
    "loha": Case(lambda: {"lora_unet_m.hada_w1_a": _rand(1, OUT, 2), "lora_unet_m.hada_w1_b": _rand(2, 2, IN),
                          "lora_unet_m.hada_w2_a": _rand(3, OUT, 3), "lora_unet_m.hada_w2_b": _rand(4, 3, IN),
                          "lora_unet_m.alpha": torch.tensor(1.0)}, (OUT, IN)),
    "ia3": Case(lambda: {"lora_unet_m.weight": _rand(1, OUT), "lora_unet_m.on_input": torch.tensor(0)}, (OUT, IN)),
    "lokr": Case(lambda: {"lora_unet_m.lokr_w1": _rand(1, 4, 3), "lora_unet_m.lokr_w2_a": _rand(2, 8, 2),
                          "lora_unet_m.lokr_w2_b": _rand(3, 2, 8), "lora_unet_m.alpha": torch.tensor(1.0)},
                 (OUT, IN)),
    "diff": Case(lambda: {"lora_unet_m.diff": _rand(1, OUT, IN)}, (OUT, IN)),
    "w-norm": Case(lambda: {"lora_unet_m.w_norm": _rand(1, OUT)}, (OUT,)),
    "kohya-oft": Case(lambda: {"oft_unet_m.oft_blocks": _rand(1, 4, 8, 8), "oft_unet_m.alpha": torch.tensor(1e-2)},
                      (OUT, IN)),
    "comfy-oft": Case(lambda: {"diffusion_model.m.oft_blocks": _rand(1, 4, 8, 8),
                               "diffusion_model.m.alpha": torch.tensor(1.0)}, (OUT, IN)),
    "diag-oft": Case(lambda: {"lora_unet_m.oft_blocks": _rand(1, 4, 8, 8), "lora_unet_m.alpha": torch.tensor(0.0)},
                     (OUT, IN)),
    "boft": Case(lambda: {"lora_unet_m.oft_blocks": _rand(1, 4, 8, 4, 4), "lora_unet_m.alpha": torch.tensor(0.0)},
                 (OUT, IN)),
    "glora": Case(lambda: {"lora_unet_m.a1.weight": _rand(1, IN, 4), "lora_unet_m.a2.weight": _rand(2, 4, IN),
                           "lora_unet_m.b1.weight": _rand(3, OUT, 4), "lora_unet_m.b2.weight": _rand(4, 4, IN),
                           "lora_unet_m.alpha": torch.tensor(2.0)}, (OUT, IN)),
    "oft-diag-v2": Case(lambda: {"lora_unet_m.oft_diag": torch.linalg.matrix_exp(_skew(1, 4, 8))}, (OUT, IN)),
    "peft-oft": Case(lambda: {"m.oft_R.weight": _rand(1, IN // 8, 8 * 7 // 2)}, (OUT, IN)),
    "peft-oft-old": Case(lambda: {"m.oft_r": _rand(1, 3, 8, 8)}, (OUT, IN), refused=True),
    "peft-boft": Case(lambda: {"m.boft_R": _rand(1, 1, IN // 8, 8, 8), "m.boft_s": 1 + _rand(2, OUT, 1)}, (OUT, IN)),
    # a square conv without config: either side fits, so PEFT's default side is assumed (and warned about)
    "peft-ia3": Case(lambda: {"m.ia3_l": 1 + _rand(1, 1, 8, 1, 1)}, (8, 8, 3, 3)),
    "peft-lora-embedding": Case(lambda: {"m.lora_embedding_A": _rand(1, 4, 50), "m.lora_embedding_B": _rand(2, 16, 4)},
                                (50, 16)),
    "peft-oft-embedding": Case(lambda: {"m.oft_embedding_R.weight": _rand(1, 2, 8 * 7 // 2)}, (50, 16)),
    "diff-b": Case(lambda: {"lora_unet_m.diff_b": _rand(1, OUT)}, (OUT,)),
    "b-norm": Case(lambda: {"lora_unet_m.b_norm": _rand(1, OUT)}, (OUT,)),
    "peft-lora-bias": Case(lambda: {"m.lora_A.weight": _rand(1, 4, IN), "m.lora_B.weight": _rand(2, OUT, 4),
                                    "m.lora_B.bias": _rand(3, OUT)}, (OUT,)),
    "peft-ia3-bias": Case(lambda: {"m.ia3_l": 1 + _rand(1, 1, 8, 1, 1)}, (8,)),
    "diff-m": Case(lambda: {"blocks_0.diff_m": _rand(1, 1, 6, OUT)}, (1, 6, OUT)),
}
# DoRA on top of the algorithm (LyCORIS' dora_scale per output row, per input column; `lora_unet_m` cases)
DORA = ("locon", "loha", "lokr")


def _skew(seed: int, blocks: int, size: int) -> torch.Tensor:
    q = _rand(seed, blocks, size, size)
    return q - q.transpose(1, 2)


def module_of(name: str, dora_axis: str | None = None) -> Module:
    """The case's module of algorithm `name` (a file may hold several, e.g. PEFT's (IA)³ weight and bias parts)."""
    tensors = CASES[name].tensors()
    if dora_axis is not None:
        shape = (OUT, 1) if dora_axis == "out" else (1, IN)
        tensors[f"lora_unet_m.{DORA_SCALE}"] = 3 + _rand(90, *shape).abs()
    found = [m for m in parse_state_dict(tensors, "facts.safetensors").modules.values() if m.algorithm.name == name]
    assert len(found) == 1, f"{name}: the case holds {len(found)} modules of it"
    return found[0]


def changes(module: Module, shape: tuple[int, ...], strength: float) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(declared reads, ΔW for W₁, ΔW for W₂) by the core's own path, W₁ and W₂ different everywhere."""
    plan = module.plan_for(shape)
    contribution = Contribution(plan, module.tensors, strength)
    w1, w2 = 1 + _rand(11, *shape, std=1.0).abs(), -1 - _rand(12, *shape, std=1.0).abs()
    if BY_NAME[plan.algorithm].param == "weight":
        assert reads_weight(plan) == plan.reads_param, "bypass reads the weight exactly where the plan reads it"
    return plan.reads_param, contribution.change(w1), contribution.change(w2)


def test_every_registered_algorithm_has_a_case():
    assert set(CASES) == set(BY_NAME)


READ_CASES = [(name, None) for name in CASES if not CASES[name].refused] + [(n, a) for n in DORA for a in ("out", "in")]


@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("name,dora_axis", READ_CASES, ids=[f"{n}+dora-{a}" if a else n for n, a in READ_CASES])
def test_change_depends_on_the_parameter_exactly_when_declared(name, dora_axis, strength):
    reads, d1, d2 = changes(module_of(name, dora_axis), CASES[name].shape, strength)
    assert float(d1.norm()) > 0 and float(d2.norm()) > 0, f"{name}: the case changes nothing"
    if reads:
        assert not torch.equal(d1, d2), f"{name} declares that its change reads the parameter, and it does not"
    else:
        assert torch.equal(d1, d2), (f"{name}'s change reads the parameter it patches (max difference "
                                     f"{float((d1 - d2).abs().max()):.3g}): declare reads_param=True")


def test_refused_algorithms_refuse_at_load():
    for name in (n for n, case in CASES.items() if case.refused):
        with pytest.raises(LycorisError):
            parse_state_dict(CASES[name].tensors(), "facts.safetensors")


def test_dora_is_declared_for_the_dora_cases():
    """Every algorithm that takes a dora_scale has DoRA cases above, or refuses one at load (PEFT's embedding)."""
    for name, algorithm in BY_NAME.items():
        if not algorithm.supports_dora or name in DORA:
            continue
        tensors = CASES[name].tensors()
        prefix = next(iter(tensors)).rpartition(".")[0]
        with pytest.raises(LycorisError, match="DoRA"):
            parse_state_dict({**tensors, f"{prefix}.lora_magnitude_vector": torch.ones(CASES[name].shape[0])},
                             "facts.safetensors")


def test_row_adders_are_those_of_locon_loha_lokr():
    """The algorithms that add a window of rows (fused out-axis DoRA merge), and the one patched a piece of rows at a
    time on fp16/bf16 weights, as before the facts moved onto the algorithms."""
    assert {n for n, a in BY_NAME.items() if a.row_adder is not None} == {"locon", "loha", "lokr"}
    assert {n for n, a in BY_NAME.items() if a.patch_16bit_by_rows} == {"lokr"}


@pytest.mark.parametrize("name", sorted(n for n, a in BY_NAME.items() if a.row_adder is not None))
def test_row_adder_adds_the_rows_of_the_change(name):
    module = module_of(name)
    shape, strength = CASES[name].shape, 0.5
    plan = module.plan_for(shape)
    whole = Contribution(plan, module.tensors, strength).change(torch.zeros(shape))
    add = BY_NAME[name].row_adder(module.tensors, plan.layout, strength)
    for first, count in ((0, 5), (5, 11), (16, OUT - 16)):
        window = torch.zeros((count, *shape[1:]))
        add(window, first)
        expected = whole.narrow(0, first, count)
        assert float((window - expected).norm()) <= ROW_TOLERANCE * float(expected.norm()), (name, first, count)


def test_assumed_options_are_named_by_their_algorithm():
    """A module whose layout took PEFT's defaults is warned about with what the trainer may have set instead."""
    assuming = set()
    for name, case in CASES.items():
        if case.refused:
            continue
        module = module_of(name)
        if getattr(module.layout, "assumed", ()) or getattr(module.plan_for(case.shape).layout, "assumed", ()):
            assuming.add(name)
            assert BY_NAME[name].assumable_options != "other options", name
    assert assuming == {"peft-oft", "peft-oft-embedding", "peft-ia3"}


def test_convert_gives_the_declared_reasons():
    for name, case in CASES.items():
        algorithm = BY_NAME[name]
        if case.refused:
            continue
        module = module_of(name)
        plan = module.plan_for(case.shape)
        peft = to_peft(module, plan, case.shape, 1 + _rand(11, *case.shape).abs(), torch.device("cpu"))
        kohya = to_kohya(module, plan, case.shape)
        if algorithm.no_peft_form is not None:
            assert peft == algorithm.no_peft_form, name
        if algorithm.no_kohya_form is not None:
            assert kohya == algorithm.no_kohya_form, name
        else:  # the kohya form keeps the file's tensor names, but for the declared renames
            renames = dict(algorithm.kohya_renames)
            assert {renames.get(k, k) for k in module.tensors} <= set(kohya.tensors), name
            assert not set(renames) & set(kohya.tensors), name
        assert isinstance(peft, Converted | str) and isinstance(kohya, Converted | str), name
