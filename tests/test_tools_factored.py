"""`Algorithm.factored`: every additive algorithm that declares one gives ΔW₂ = A @ B exactly, scale included, at full
strength, equal to the loader's own dense change (patch.change) of the same module on the same weight.

Files: every variant lycoris-lora 4.1.3 writes (tests/reference/lycoris_factory.py), and a LoRA on an nn.Embedding
written by PEFT's save_pretrained. Maths in fp32; the tolerance is a few fp32 ulps of the change's norm."""

import pytest
import torch
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.lycoris_core.algos import BY_NAME
from lycoris_nodes.lycoris_core.tools.changes import dense_change, factored_change, is_factored
from reference.lycoris_factory import VARIANTS, base_params, layer_of

CPU = torch.device("cpu")
TOLERANCE = 1e-5  # relative Frobenius: fp32 sums of up to ~10³ terms
# algorithms whose change must come out factored (DoRA variants of them do not: their change is not linear in ΔW)
EXPECTED = {"locon", "loha", "lokr", "glora"}


@pytest.fixture(scope="module")
def weights():
    return base_params(torch.float32)


def modules_of(generated, weights):
    """(module key, plan, module, W fp32) for every weight module of a generated file."""
    lfile = load(generated.path)
    for key, module in lfile.modules.items():
        layer = layer_of(module.prefix)
        if layer is None or module.param != "weight":
            continue
        weight = weights[layer]["weight"].float()
        yield key, module.plan_for(tuple(weight.shape)), module, weight


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


@pytest.mark.parametrize("variant_id", [v.id for v in VARIANTS])
def test_factored_equals_dense_change(reference_files, weights, variant_id, one_thread):
    generated = reference_files[variant_id]
    checked = 0
    for key, plan, module, weight in modules_of(generated, weights):
        declared = BY_NAME[plan.algorithm].factored is not None
        assert is_factored(plan) == (declared and not module.has_dora), key
        if plan.algorithm in EXPECTED:
            assert declared, f"{key}: {plan.algorithm} has no factored form"
        if not is_factored(plan):
            continue
        factors = factored_change(plan, module.tensors, 1.0, weight, CPU)
        dense = dense_change(plan, module.tensors, 1.0, weight, CPU)
        flat = dense.reshape(dense.shape[0], -1)
        assert factors.shape == tuple(flat.shape), key
        assert float(flat.norm()) > 0, key
        error = relative(factors.dense(), flat)
        assert error <= TOLERANCE, f"{key}: factored differs from the dense change by {error:.2e}"
        checked += 1
    wants = generated.variant.algo in {"lora", "loha", "lokr", "glora", "dylora"} and "dora" not in variant_id
    assert (checked > 0) == (wants and variant_id != "norm"), f"{variant_id}: {checked} modules checked"


def test_factored_strength_is_linear(reference_files, weights):
    """m·A@B: the factors at m = −0.5 are −0.5 times those at m = 1 (the strength the tools apply)."""
    generated = reference_files["loha_tucker"]
    for key, plan, module, weight in modules_of(generated, weights):
        full = factored_change(plan, module.tensors, 1.0, weight, CPU).dense()
        half = factored_change(plan, module.tensors, -0.5, weight, CPU).dense()
        assert relative(half, -0.5 * full) <= TOLERANCE, key


def test_peft_embedding_lora_factored(tmp_path):
    """PEFT's LoRA on an nn.Embedding, as save_pretrained writes it (alpha ≠ r, from adapter_config.json)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    base = torch.nn.Sequential()
    base.add_module("embed", torch.nn.Embedding(50, 24))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, target_modules=["embed"]))
    model.save_pretrained(tmp_path)
    lfile = load(tmp_path / "adapter_model.safetensors")
    (key, module), = lfile.modules.items()
    weight = base.embed.base_layer.weight.detach().clone() if hasattr(base.embed, "base_layer") else base.embed.weight.detach().clone()
    plan = module.plan_for(tuple(weight.shape))
    assert plan.algorithm == "peft-lora-embedding" and is_factored(plan)
    factors = factored_change(plan, module.tensors, 1.0, weight, CPU)
    dense = dense_change(plan, module.tensors, 1.0, weight, CPU)
    assert relative(factors.dense(), dense) <= TOLERANCE, key
    model.merge_and_unload()
    assert relative(dense, base.embed.weight.detach().float() - weight) <= TOLERANCE  # PEFT's own merge
