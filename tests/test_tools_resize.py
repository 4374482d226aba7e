"""Resize LyCORIS (issue #14): any algorithm the pack reads, as plain LoRA/LoCon of a new rank.

Truth is independent of the code under test: the reference files of lycoris-lora 4.1.3 (tests/reference), the change
our loader applies for each module (patch.change, itself tested against the reference's forward), an independent
`torch.linalg.svd` of that change (Eckart–Young: the best rank-r error is √(Σ_{i>r} σᵢ²)/‖ΔW‖), kohya's rank rules
written out from their definitions, ComfyUI's own core LoRA loader, and the written file read back by our loader."""

import math

import pytest
import torch
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.lycoris_core.tools import resize
from lycoris_nodes.lycoris_core.tools.changes import dense_change
from lycoris_nodes.lycoris_core.tools.lowrank import RankRule
from reference.lycoris_factory import VARIANTS, base_params, layer_of
from safetensors.torch import save_file

CPU = torch.device("cpu")
EXACT = 1e-4  # fp32, full rank: relative Frobenius error of the reloaded change (the bound)
SAME = 2e-5  # reported vs measured vs Eckart-Young, fp32


@pytest.fixture(scope="module")
def weights():
    return base_params(torch.float32)


def bases_for(lfile, weights) -> dict[str, resize.Base]:
    """The factory model's weight for every module of a reference file (what MODEL/CLIP give the node)."""
    bases = {}
    for key, module in lfile.modules.items():
        layer = layer_of(module.prefix)
        param = weights[layer][module.param] if layer else None
        if param is not None:
            bases[key] = resize.Base(tuple(param.shape), param.float())
    return bases


def truth_changes(lfile, bases) -> dict[str, torch.Tensor]:
    """The loader's own full-strength change of every module (patch.change), fp32."""
    out = {}
    for key, module in lfile.modules.items():
        base = bases[key]
        out[key] = dense_change(module.plan_for(base.shape), module.tensors, 1.0, base.weight, CPU)
    return out


def reloaded_changes(path, bases) -> dict[str, torch.Tensor]:
    """The written file read back by our loader: each module's change on the same weights."""
    lfile = load(path)
    return truth_changes(lfile, bases)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    b = b.double()
    norm = float(b.norm())
    return float((a.double().reshape(b.shape) - b).norm()) / norm if norm > 0 else float(a.double().norm())


def write(result: resize.Result, path) -> None:
    save_file({k: v.contiguous() for k, v in result.tensors.items()}, str(path))


def by_layer(keys) -> dict[str, str]:
    return {k: k for k in keys}


# --- every algorithm variant ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant_id", [v.id for v in VARIANTS])
def test_full_rank_reproduces_every_variant(reference_files, weights, variant_id, tmp_path, one_thread):
    """Rank 4096 (more than any layer has): every module reproduces the change within 1e-4 when loaded back,
    and the reported error is the measured one."""
    lfile = load(reference_files[variant_id].path)
    bases = bases_for(lfile, weights)
    assert set(bases) == set(lfile.modules), "every module maps onto the factory model"
    settings = resize.Settings(RankRule("fixed", 4096), torch.float32, tucker=True)
    result = resize.resize_file(lfile, bases, settings, CPU)
    assert not result.not_written
    write(result, tmp_path / "out.safetensors")
    truth = truth_changes(lfile, bases)
    reloaded = reloaded_changes(tmp_path / "out.safetensors", bases)
    assert set(reloaded) == set(truth)
    for key, change in truth.items():
        error = relative(reloaded[key], change)
        assert error <= EXACT, f"{key}: {error:.2e}"
        assert abs(result.modules[key].error - error) <= SAME, key


@pytest.mark.parametrize("variant_id", [v.id for v in VARIANTS])
def test_low_rank_error_is_reported_measured_and_optimal(reference_files, weights, variant_id, tmp_path, one_thread):
    """Rank 2 (flat LoRA/LoCon, Tucker off): reported error = error of the reloaded file = Eckart–Young's tail from
    an independent SVD of the dense change."""
    lfile = load(reference_files[variant_id].path)
    bases = bases_for(lfile, weights)
    settings = resize.Settings(RankRule("fixed", 2), torch.float32, tucker=False)
    result = resize.resize_file(lfile, bases, settings, CPU)
    write(result, tmp_path / "out.safetensors")
    truth = truth_changes(lfile, bases)
    reloaded = reloaded_changes(tmp_path / "out.safetensors", bases)
    for key, change in truth.items():
        record = result.modules[key]
        measured = relative(reloaded[key], change)
        assert abs(record.error - measured) <= SAME, f"{key}: reported {record.error:.3e}, measured {measured:.3e}"
        if change.ndim < 2 or lfile.modules[key].param != "weight":
            assert record.form == "full" and measured <= EXACT, key
            continue
        s = torch.linalg.svd(change.double().reshape(change.shape[0], -1))[1]
        optimal = math.sqrt(float(s[2:].square().sum()) / float(s.square().sum())) if float(s[0]) > 0 else 0.0
        assert record.rank <= 2 and abs(measured - optimal) <= SAME, \
            f"{key}: {measured:.4e} vs Eckart-Young {optimal:.4e}"
