"""Where ComfyUI's built-in adapters (comfy.weight_adapter, 0.3.75) disagree with the LyCORIS reference, and we don't.

Each test loads the same real file (made by lycoris-lora 4.1.3 through `reference.lycoris_factory`) twice: through
our `build_patches`, and through ComfyUI's own `comfy.lora.load_lora(sd, {prefix: "layer.weight"})`. Both are patched
through the same `ModelPatcher` (full load) into the same fp32 `comfy.ops` layers, and each layer's float64 output
is compared with the reference's forward pass, relative to the size of the change:

    rel = ‖y − y_truth‖ / ‖y_truth − y_base‖

Ours must be within OURS (1e-4). The built-in must be off by more than the margin stated per test, or refuse the
keys / fail. Where the spec names the cause (lycoris-formats.md §5), the built-in's output is also matched against an
explicit float64 formula of that deviation, so the test shows *why* it differs. Where the built-in agrees with the
reference (layers with no constraint active, 4-D LoKr factors) the test asserts that too.
"""

import dataclasses
import logging

import comfy.lora
import comfy.utils
import pytest
import torch
from lycoris_nodes.lycoris_core import load
from patcher_util import CPU, FACTORY_KEY_MAP, factory_model, full_load, lycoris_patches, patcher
from reference.lycoris_factory import BY_ID, Lazy, base_params, functional_forward, generate, probe

OURS = 1e-4
F32 = torch.float32
# Diag-OFT with an active constraint on some layers *and* rescale: the factory's oft_constraint plus rescaled=True
OFT_BOTH = dataclasses.replace(BY_ID["oft_constraint"], id="oft_constraint_rescaled",
                               kwargs={**BY_ID["oft_constraint"].kwargs, "rescaled": True},
                               expect=("oft_blocks", "alpha", "rescale"))
VARIANTS = {v.id: v for v in (OFT_BOTH, BY_ID["boft"], BY_ID["boft_constraint"], BY_ID["locon_dora_out"],
                              BY_ID["ia3"], BY_ID["lokr_full_matrix"], BY_ID["lokr_tucker"])}




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("builtin_disagreements")
    return Lazy(lambda variant_id: generate(VARIANTS[variant_id], directory))


@pytest.fixture(scope="module")
def base():
    return base_params(F32)


def _outputs(net, patches, strength, layers) -> dict[str, torch.Tensor]:
    """Each layer's float64 output with the weights a full load through ModelPatcher leaves in it."""
    mp = patcher(net)
    mp.add_patches(patches, strength)
    full_load(mp)
    try:
        sd = net.state_dict()
        return {n: functional_forward(n, probe(n), sd[f"{n}.weight"].double(),
                                      sd[f"{n}.bias"].double() if f"{n}.bias" in sd else None) for n in layers}
    finally:
        mp.unpatch_model(CPU)


def ours(generated, base, strength, reference=False, layers=None):
    net = factory_model(base, F32)
    patches, report = lycoris_patches(load(generated.path), net, FACTORY_KEY_MAP, reference=reference)
    assert not report.problems and not report.unused_keys, report.details()
    return _outputs(net, patches, strength, layers or generated.variant.layers)


def builtin_patches(generated, layers):
    sd = comfy.utils.load_torch_file(str(generated.path), safe_load=True)
    return comfy.lora.load_lora(sd, {f"lycoris_{n}": f"{n}.weight" for n in layers}), sd


def builtin(generated, base, strength, layers=None):
    layers = layers or generated.variant.layers
    patches, _ = builtin_patches(generated, layers)
    assert set(patches) == {f"{n}.weight" for n in layers}, sorted(patches)
    return _outputs(factory_model(base, F32), patches, strength, layers)


def rel(y, truth, y_base, layer) -> float:
    return float((y[layer] - truth[layer]).norm() / (truth[layer] - y_base[layer]).norm())


def _q(sd, layer) -> torch.Tensor:
    blocks = sd[f"lycoris_{layer}.oft_blocks"].double()
    return blocks - blocks.transpose(-1, -2)


def _cayley(q: torch.Tensor, constraint: float) -> torch.Tensor:
    norm = q.norm() + 1e-8
    if constraint > 0 and norm > constraint:
        q = q * constraint / norm
    eye = torch.eye(q.shape[-1], dtype=q.dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


# --- Diag-OFT -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_diag_oft_constraint_and_rescale(files, base, strength):
    """Built-in: constraint compared with the raw alpha (not alpha·out), rescale loaded but never applied, and the
    strength applied twice (W + m²(RᵀW − W))."""
    generated = files["oft_constraint_rescaled"]
    layers = generated.variant.layers
    assert set(generated.clamp_active.values()) == {True, False}  # the reference clamps some layers, not others
    y_base = generated.y_base[F32]
    linear, lycoris = generated.truth(F32, strength, False), generated.truth(F32, strength, True)
    mine, mine_ref = ours(generated, base, strength), ours(generated, base, strength, reference=True)
    theirs = builtin(generated, base, strength)
    _, sd = builtin_patches(generated, layers)
    for n in layers:
        assert rel(mine, linear, y_base, n) < OURS and rel(mine_ref, lycoris, y_base, n) < OURS, n
        assert rel(theirs, linear, y_base, n) > 0.3 and rel(theirs, lycoris, y_base, n) > 0.3, n
        # what the built-in computes, written out: raw-alpha clamp, no rescale, m²
        W = base[n]["weight"]
        R = _cayley(_q(sd, n), float(sd[f"lycoris_{n}.alpha"]))
        rows = W.reshape(R.shape[0], R.shape[1], *W.shape[1:])
        rotated = torch.einsum("knm,kn...->km...", R, rows).reshape(W.shape)
        expected = functional_forward(n, probe(n), W + strength ** 2 * (rotated - W), base[n]["bias"])
        assert float((theirs[n] - expected).norm() / expected.norm()) < 1e-5, n


# --- BOFT -----------------------------------------------------------------------------------------------------------

def test_boft_half_strength(files, base):
    """Built-in at m ≠ 1: interpolates every stage (LyCORIS' semantics) *and* scales the delta by m again, so it
    matches neither the linear nor LyCORIS' multiplier: it gives y_base + m·(y_ref(m) − y_base)."""
    generated = files["boft"]
    m = 0.5
    y_base = generated.y_base[F32]
    linear, lycoris = generated.truth(F32, m, False), generated.truth(F32, m, True)
    mine, mine_ref = ours(generated, base, m), ours(generated, base, m, reference=True)
    theirs = builtin(generated, base, m)
    for n in generated.variant.layers:
        assert rel(mine, linear, y_base, n) < OURS and rel(mine_ref, lycoris, y_base, n) < OURS, n
        assert rel(theirs, linear, y_base, n) > 0.3 and rel(theirs, lycoris, y_base, n) > 0.3, n
        twice = {n: y_base[n] + m * (lycoris[n] - y_base[n])}
        assert float((theirs[n] - twice[n]).norm() / (twice[n] - y_base[n]).norm()) < 1e-4, n
    # at m = 1 (no constraint, no rescale) the built-in BOFT is the reference: the harness is fair
    theirs_1, truth_1 = builtin(generated, base, 1.0), generated.truth(F32, 1.0, False)
    assert all(rel(theirs_1, truth_1, y_base, n) < OURS for n in generated.variant.layers)


def test_boft_constraint(files, base):
    """Built-in: the constraint is the raw alpha, not alpha·out. It differs exactly where either clamp is active."""
    generated = files["boft_constraint"]
    y_base, truth = generated.y_base[F32], generated.truth(F32, 1.0, False)
    mine, theirs = ours(generated, base, 1.0), builtin(generated, base, 1.0)
    _, sd = builtin_patches(generated, generated.variant.layers)
    differ, agree = [], []
    for n in generated.variant.layers:
        assert rel(mine, truth, y_base, n) < OURS, n
        out = base[n]["weight"].shape[0]
        c, norm = float(sd[f"lycoris_{n}.alpha"]), float(_q(sd, n).norm()) + 1e-8
        reference_clamps, builtin_clamps = norm > c * out, norm > c
        assert reference_clamps == generated.clamp_active[n]
        r = rel(theirs, truth, y_base, n)
        if reference_clamps:  # the built-in clamps to a norm `out` times smaller
            assert r > 0.5, (n, r)
            differ.append(n)
        elif builtin_clamps:  # only the built-in clamps (its raw alpha is below ‖Q‖)
            assert r > 1e-3, (n, r)
            differ.append(n)
        else:  # neither clamps: the built-in agrees with the reference
            assert r < OURS, (n, r)
            agree.append(n)
    assert differ and agree, (differ, agree)


# --- DoRA -----------------------------------------------------------------------------------------------------------

def test_dora_out_axis(files, base):
    """Built-in `weight_decompose` on the output axis normalises by ‖W‖ per row instead of ‖W + ΔW‖ (PR #15458)."""
    generated = files["locon_dora_out"]
    y_base, truth = generated.y_base[F32], generated.truth(F32, 1.0, False)
    mine, theirs = ours(generated, base, 1.0), builtin(generated, base, 1.0)
    _, sd = builtin_patches(generated, generated.variant.layers)
    for n in generated.variant.layers:
        assert rel(mine, truth, y_base, n) < OURS, n
        assert rel(theirs, truth, y_base, n) > 0.1, n
        W = base[n]["weight"]
        up, down = sd[f"lycoris_{n}.lora_up.weight"].double(), sd[f"lycoris_{n}.lora_down.weight"].double()
        V = W + (up.flatten(1) @ down.flatten(1) * float(sd[f"lycoris_{n}.alpha"]) / down.shape[0]).reshape(W.shape)
        row_norm_of_w = W.reshape(W.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (W.ndim - 1))
        scale = sd[f"lycoris_{n}.dora_scale"].double().reshape(row_norm_of_w.shape)
        expected = functional_forward(n, probe(n), V * scale / (row_norm_of_w + torch.finfo(F32).eps), base[n]["bias"])
        assert float((theirs[n] - expected).norm() / (expected - y_base[n]).norm()) < 1e-4, n


# --- (IA)³ ----------------------------------------------------------------------------------------------------------

def test_ia3_is_not_loaded_by_builtin(files, base, caplog):
    generated = files["ia3"]
    layers = generated.variant.layers
    with caplog.at_level(logging.WARNING):
        patches, sd = builtin_patches(generated, layers)
    assert patches == {}
    not_loaded = {r.getMessage().removeprefix("lora key not loaded: ") for r in caplog.records
                  if r.getMessage().startswith("lora key not loaded: ")}
    assert not_loaded == set(sd), sorted(set(sd) - not_loaded)
    y_base, truth = generated.y_base[F32], generated.truth(F32, 1.0, False)
    mine = ours(generated, base, 1.0)
    for n in layers:
        assert rel(mine, truth, y_base, n) < OURS, n


# --- LoKr with N-D factors ------------------------------------------------------------------------------------------

def test_lokr_full_nd_w2_on_conv1d_conv3d(files, base, caplog):
    """Built-in LoKr unsqueezes w1 only for a 4-D w2: a 3-D/5-D lokr_w2 gives a wrong kron, silently."""
    generated = files["lokr_full_matrix"]
    _, sd = builtin_patches(generated, generated.variant.layers)
    assert sd["lycoris_conv1d.lokr_w2"].ndim == 3 and sd["lycoris_conv3d.lokr_w2"].ndim == 5
    y_base, truth = generated.y_base[F32], generated.truth(F32, 1.0, False)
    mine = ours(generated, base, 1.0)
    with caplog.at_level(logging.WARNING):
        theirs = builtin(generated, base, 1.0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no error: the wrong answer is silent
    for n in generated.variant.layers:
        assert rel(mine, truth, y_base, n) < OURS, n
        r = rel(theirs, truth, y_base, n)
        if n in ("conv1d", "conv3d"):
            assert r > 0.5, (n, r)
        else:  # 2-D and 4-D factors: the built-in agrees
            assert r < OURS, (n, r)


@pytest.mark.parametrize("layer", ["conv1d", "conv2d", "conv2d_grouped", "conv3d"])
def test_lokr_tucker(files, base, layer, caplog):
    """LyCORIS 4 tucker LoKr (lokr_t2 + transposed w2_a/w2_b). Built-in: its einsum is written for 4-D t2 only and
    raises *outside* its try/except, so a Conv1d/Conv3d file aborts ComfyUI's whole model load; on Conv2d the
    non-contiguous einsum result breaks torch.kron, which is logged and the weight left unpatched."""
    generated = files["lokr_tucker"]
    y_base, truth = generated.y_base[F32], generated.truth(F32, 1.0, False)
    assert rel(ours(generated, base, 1.0, layers=[layer]), truth, y_base, layer) < OURS
    patches, sd = builtin_patches(generated, [layer])
    assert sd[f"lycoris_{layer}.lokr_t2"].ndim == base[layer]["weight"].ndim
    net = factory_model(base, F32)
    if layer in ("conv1d", "conv3d"):
        with pytest.raises(RuntimeError, match="einsum"):
            _outputs(net, patches, 1.0, [layer])
        return
    with caplog.at_level(logging.ERROR):
        theirs = _outputs(net, patches, 1.0, [layer])
    assert any(r.getMessage().startswith(f"ERROR lokr {layer}.weight") for r in caplog.records)
    assert torch.equal(theirs[layer], y_base[layer])  # unpatched
