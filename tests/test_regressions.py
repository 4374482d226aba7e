"""One test per failure users reported with LyCORIS files in ComfyUI (and the LyCORIS reference), each named after it.

Truth is an explicit float64 formula written here, never our own functions' output. Every test first shows the
failure mode exists where that is possible (so it can fail), then that our patches avoid it through a real
`comfy.model_patcher.ModelPatcher` on real `comfy.ops` layers.
"""

import logging

import comfy.ops
import pytest
import torch
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.adapter import LycorisAdapter
from patcher_util import (
    CPU,
    HAS_SCALED_FP8_OPS,
    assert_bit_identical,
    assert_rounded_from,
    forward_params,
    fp8_storage,
    full_load,
    lowvram_patched,
    lycoris_patches,
    offload,
    patcher,
    scaled_fp8_linear,
    set_param,
    snapshot,
)
from safetensors.torch import save_file
from torch._subclasses.fake_tensor import FakeTensorMode

KEY_MAP = {"lin": "lin.weight", "conv": "conv.weight", "norm": "norm.weight"}
LIN_IN, LIN_OUT, CONV_IN, CONV_OUT = 12, 16, 8, 16


class Net(torch.nn.Module):
    """One Linear, one 3×3 Conv2d, one LayerNorm, as ComfyUI builds them (`comfy.ops` layers)."""

    def __init__(self, dtype=torch.float32, ops=comfy.ops.manual_cast, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = ops.Linear(LIN_IN, LIN_OUT, dtype=dtype)
        self.conv = ops.Conv2d(CONV_IN, CONV_OUT, 3, padding=1, dtype=dtype)
        self.norm = ops.LayerNorm(LIN_OUT, dtype=dtype)
        set_param(self.lin, "weight", torch.randn(LIN_OUT, LIN_IN, generator=g) * 0.3, dtype)
        set_param(self.lin, "bias", torch.randn(LIN_OUT, generator=g) * 0.1, dtype)
        set_param(self.conv, "weight", torch.randn(CONV_OUT, CONV_IN, 3, 3, generator=g) * 0.2, dtype)
        set_param(self.conv, "bias", torch.randn(CONV_OUT, generator=g) * 0.1, dtype)
        set_param(self.norm, "weight", 1 + 0.1 * torch.randn(LIN_OUT, generator=g), dtype)
        set_param(self.norm, "bias", 0.1 * torch.randn(LIN_OUT, generator=g), dtype)


def inputs(layer: str, dtype=torch.float32, device="cpu", seed=1) -> torch.Tensor:
    shape = {"lin": (3, LIN_IN), "conv": (2, CONV_IN, 5, 5), "norm": (3, LIN_OUT)}[layer]
    if device == "cpu":
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return torch.randn(*shape, dtype=dtype, device=device)


def hand_variants(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """One small fp32 file per algorithm (layouts as lycoris-lora 4.1.3 saves them), targeting Net's layers."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.3):
        return torch.randn(*shape, generator=g) * s

    alpha = torch.tensor(2.0)
    locon = {"lin.lora_up.weight": r(16, 4), "lin.lora_down.weight": r(4, 12), "lin.alpha": alpha}
    return {
        "locon": locon,
        "locon-conv-tucker": {"conv.lora_up.weight": r(16, 4, 1, 1), "conv.lora_down.weight": r(4, 8, 1, 1),
                              "conv.lora_mid.weight": r(4, 4, 3, 3), "conv.alpha": alpha},
        "dora-out": {**locon, "lin.dora_scale": r(16, 1).abs() + 0.5},
        "dora-in": {**locon, "lin.dora_scale": r(1, 12).abs() + 0.5},
        "loha": {"lin.hada_w1_a": r(16, 4), "lin.hada_w1_b": r(4, 12), "lin.hada_w2_a": r(16, 4),
                 "lin.hada_w2_b": r(4, 12), "lin.alpha": alpha},
        "loha-conv-tucker-dora": {"conv.hada_w1_a": r(4, 16), "conv.hada_w1_b": r(4, 8), "conv.hada_t1": r(4, 4, 3, 3),
                                  "conv.hada_w2_a": r(4, 16), "conv.hada_w2_b": r(4, 8), "conv.hada_t2": r(4, 4, 3, 3),
                                  "conv.alpha": alpha, "conv.dora_scale": r(16, 1, 1, 1).abs() + 0.5},
        "lokr": {"lin.lokr_w1": r(4, 3), "lin.lokr_w2_a": r(4, 2), "lin.lokr_w2_b": r(2, 4), "lin.alpha": alpha},
        "lokr-conv-tucker": {"conv.lokr_w1": r(2, 2), "conv.lokr_t2": r(2, 2, 3, 3), "conv.lokr_w2_a": r(2, 8),
                             "conv.lokr_w2_b": r(2, 4), "conv.alpha": alpha},
        "glora": {"lin.a1.weight": r(12, 4), "lin.a2.weight": r(4, 12), "lin.b1.weight": r(16, 4),
                  "lin.b2.weight": r(4, 12), "lin.alpha": alpha},
        "diag-oft": {"lin.oft_blocks": r(4, 4, 4), "lin.alpha": torch.tensor(0.05), "lin.rescale": 1 + r(16, 1, s=0.1)},
        "boft": {"lin.oft_blocks": r(3, 4, 4, 4), "lin.alpha": torch.tensor(0.05), "lin.rescale": 1 + r(16, 1, s=0.1)},
        "oft-diag-v2": {"lin.oft_diag": torch.eye(4).repeat(4, 1, 1) + r(4, 4, 4, s=0.1)},  # LyCORIS 2.0: R itself
        "ia3": {"lin.weight": r(16), "lin.on_input": torch.tensor(0)},
        "full": {"lin.diff": r(16, 12), "lin.diff_b": r(16)},
        "norm": {"norm.w_norm": r(16, s=0.1), "norm.b_norm": r(16, s=0.1)},
    }


def layer_of(variant: dict) -> str:
    return next(iter(variant)).split(".")[0]


def lora_delta64(sd: dict, prefix: str = "lin") -> torch.Tensor:
    up, down = sd[f"{prefix}.lora_up.weight"].double(), sd[f"{prefix}.lora_down.weight"].double()
    return (up.flatten(1) @ down.flatten(1)) * (float(sd[f"{prefix}.alpha"]) / down.shape[0])


# --- (a) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_glora_low_precision_base_with_fp32_adapter_comfyui_4684_lycoris_215(base_dtype, strength):
    """"expected m1 and m2 to have the same dtype": GLoRA multiplies the base weight itself with fp32 factors."""
    net = Net(base_dtype)
    sd = hand_variants()["glora"]
    W = net.lin.weight.detach()
    with pytest.raises(RuntimeError, match="same dtype"):
        W @ sd["lin.a1.weight"]  # the historic expression, on the raw bf16/fp16 weight

    a1, a2, b1, b2 = (sd[f"lin.{k}.weight"].double() for k in ("a1", "a2", "b1", "b2"))
    W64 = W.double()
    truth = W64 + strength * (float(sd["lin.alpha"]) / 4) * (W64 @ a1 @ a2 + b1 @ b2)
    x = inputs("lin", base_dtype)

    patches, report = lycoris_patches(sd, net, KEY_MAP)
    assert report.applied == {"lin.weight": "lin.weight"}
    mp = patcher(net)
    mp.add_patches(patches, strength)
    full_load(mp)
    assert net.lin.weight.dtype == base_dtype
    assert_rounded_from(net.lin.weight, truth, base_dtype, what="full load")
    mp.unpatch_model(CPU)
    assert torch.equal(net.lin.weight, W)

    offload(mp)
    assert lowvram_patched(net.lin)
    weight, _ = forward_params(net.lin, x)
    assert weight.dtype == base_dtype
    assert_rounded_from(weight, truth, base_dtype, what="offload (LowVramPatch)")
    y = net.lin(x)
    assert y.dtype == base_dtype and bool(torch.isfinite(y).all())
    mp.unpatch_model(CPU)


# --- (b) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dora-out", "dora-in"])
@pytest.mark.parametrize("intermediate", [torch.float32, torch.bfloat16])
def test_dora_scale_on_another_device_than_the_weight(variant, intermediate):
    """"Expected all tensors to be on the same device": dora_scale stays on the CPU, the weight is on the GPU."""
    sd = hand_variants()[variant]
    net = Net(torch.float32)
    patches, _ = lycoris_patches(sd, net, KEY_MAP)
    adapter = patches["lin.weight"]
    assert isinstance(adapter, LycorisAdapter)
    assert all(t.device == CPU for t in adapter.weights[1:] if isinstance(t, torch.Tensor))

    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.randn(LIN_OUT, LIN_IN, dtype=torch.bfloat16, device="cuda:0")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            weight.float() * sd["lin.dora_scale"]  # the naive DoRA expression
        for strength in (1.0, 0.5, -1.0):
            out = adapter.calculate_weight(weight, "lin.weight", strength, 1.0, None, None,
                                           intermediate_dtype=intermediate)
            assert out.device == torch.device("cuda:0")
            # a wider intermediate than the weight gets the unrounded result back (ComfyUI rounds it once)
            assert out.dtype == (torch.float32 if intermediate == torch.float32 else torch.bfloat16)
            assert out.shape == weight.shape


@pytest.mark.parametrize("variant", list(hand_variants()))
def test_offload_on_fake_cuda_every_algorithm(variant, monkeypatch):
    """ComfyUI's offload path with the compute device on cuda:0 and the weights (and patches) on the CPU."""
    sd = hand_variants()[variant]
    layer_name = layer_of(sd)
    net = Net(torch.bfloat16)
    patches, report = lycoris_patches(sd, net, KEY_MAP)
    assert not report.problems and patches
    calls = []
    original = LycorisAdapter.calculate_weight

    def spy(self, weight, *args, **kwargs):
        out = original(self, weight, *args, **kwargs)
        calls.append((weight.device, out.device, out.dtype))
        return out

    monkeypatch.setattr(LycorisAdapter, "calculate_weight", spy)
    mp = patcher(net)
    mp.add_patches(patches, 0.7)
    offload(mp)
    layer = getattr(net, layer_name)
    assert lowvram_patched(layer) or lowvram_patched(layer, "bias")
    assert layer.weight.device == CPU
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = inputs(layer_name, torch.bfloat16, device="cuda:0")
        y = layer(x)
        assert y.device == torch.device("cuda:0") and y.dtype == torch.bfloat16
    assert calls and all(c == (torch.device("cuda:0"), torch.device("cuda:0"), torch.bfloat16) for c in calls), calls
    mp.unpatch_model(CPU)


# --- (c) ------------------------------------------------------------------------------------------------------------

def dora_out_weight64(W: torch.Tensor, sd: dict, m: float) -> torch.Tensor:
    """Linear-strength DoRA (out axis): W + m·(V·g − W), V = W + ΔW, g = dora_scale / ‖V‖_row (eps fp32)."""
    W64 = W.double()
    V = W64 + lora_delta64(sd)
    g = sd["lin.dora_scale"].double() / (V.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps)
    return W64 + m * (V * g - W64)


def test_strength_change_while_offloaded_then_patch_again():
    """Strength changed while the weights are offloaded: ComfyUI unpatches and reloads (new patches_uuid)."""
    sd = hand_variants()["dora-out"]
    net = Net(torch.float32)
    saved = snapshot(net)
    W, b = net.lin.weight.detach().clone(), net.lin.bias.detach().clone()
    x = inputs("lin")
    base = patcher(net)
    patches, _ = lycoris_patches(sd, net, KEY_MAP)

    outputs = {}
    previous = None
    for strength in (1.0, 0.5, 1.0):
        clone = base.clone()
        clone.add_patches(patches, strength)
        if previous is not None:
            assert clone.patches_uuid != previous.patches_uuid
            previous.detach(unpatch_all=False)  # what load_models_gpu does to the other loaded clone
        clone.partially_load(CPU, extra_memory=1)  # LoadedModel.model_load -> lowvram load
        assert lowvram_patched(net.lin), "the module must stay offloaded (LowVramPatch attached)"
        y = net.lin(x)
        truth = x.double() @ dora_out_weight64(W, sd, strength).T + b.double()
        change = (truth - (x.double() @ W.double().T + b.double())).norm()
        assert float((y.double() - truth).norm()) < 1e-4 * float(change), f"strength {strength}"
        outputs[strength] = y
        previous = clone
    assert not torch.allclose(outputs[1.0], outputs[0.5])
    previous.detach(unpatch_all=True)
    assert_bit_identical(net, saved)
    assert not lowvram_patched(net.lin)


# --- (d) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain-fp8", "scaled-fp8-ops"])
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_fp8_base_weight_is_patched_not_a_silent_noop(fp8, scaled, strength):
    sd = hand_variants(seed=3)["locon"]
    g = torch.Generator().manual_seed(5)
    W = torch.randn(LIN_OUT, LIN_IN, generator=g) * 0.3
    scale = 0.0125 if scaled else 1.0

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if scaled:  # 0.3.75: scaled_fp8_ops (convert/set_weight); 0.33: a comfy_quant QuantizedTensor
                self.lin = scaled_fp8_linear(W, torch.zeros(LIN_OUT), fp8, scale)
            else:
                self.lin = comfy.ops.manual_cast.Linear(LIN_IN, LIN_OUT, dtype=fp8)
                set_param(self.lin, "weight", W, fp8)
                set_param(self.lin, "bias", torch.zeros(LIN_OUT), torch.float32)

    net = M()
    if scaled:
        assert hasattr(net.lin, "convert_weight") and hasattr(net.lin, "set_weight")
    stored0, scale0 = (t.clone() if isinstance(t, torch.Tensor) else t for t in fp8_storage(net.lin))
    dequant = stored0.double() * scale0
    truth = dequant + strength * lora_delta64(sd)

    patches, _ = lycoris_patches(sd, net, {"lin": "lin.weight"})
    mp = patcher(net)
    mp.add_patches(patches, strength)
    full_load(mp)
    stored, scale1 = fp8_storage(net.lin)
    assert stored.dtype == fp8
    changed = (stored.double() * scale1 != dequant).float().mean()
    assert changed > 0.5, f"only {float(changed):.0%} of the fp8 weights changed: the patch was (mostly) lost"
    # (dequantised base + ΔW) requantised: each stored value is one of the two fp8 values around truth/scale (0.33
    # recalculates the scale from the patched weight; 0.3.75 keeps it).
    assert_rounded_from(stored, truth / scale1, fp8, what="full load, stored fp8")
    mp.unpatch_model(CPU)
    restored, scale2 = fp8_storage(net.lin)
    assert torch.equal(restored.view(torch.uint8), stored0.view(torch.uint8)) and scale2 == scale0

    offload(mp)
    assert lowvram_patched(net.lin) and fp8_storage(net.lin)[0].dtype == fp8
    x = inputs("lin")
    weight, _ = forward_params(net.lin, x)
    if scaled and HAS_SCALED_FP8_OPS:  # 0.3.75: set_weight requantises inside LowVramPatch; × scale_weight after
        assert_rounded_from(weight, truth / scale, fp8, what="offload, requantised")
        assert not torch.equal(weight.double(), stored0.double())
    else:  # plain fp8, and 0.33's QuantizedTensor: dequantized to the input dtype before the patch, which stays fp32
        assert_rounded_from(weight, truth, torch.float32, what="offload")
        assert not torch.equal(weight.double(), dequant)
    mp.unpatch_model(CPU)


# --- (e) ------------------------------------------------------------------------------------------------------------

def test_same_lora_on_two_clones_at_different_strengths(tmp_path):
    """Clones share the adapter objects: patching one (any dtype, any path) must not change what the other sees."""
    variants = hand_variants(seed=7)
    sd = {**variants["locon"], **variants["locon-conv-tucker"]}
    path = tmp_path / "shared.safetensors"
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(path))
    lfile = load(path)  # memory-mapped tensors, as the nodes load them

    net = Net(torch.bfloat16)
    saved = snapshot(net)
    W = net.lin.weight.detach().clone()
    patches, _ = lycoris_patches(lfile, net, KEY_MAP)
    stored = [(a, i, t.data_ptr(), t.dtype, t.device, t.clone())
              for a in patches.values() for i, t in enumerate(a.weights) if isinstance(t, torch.Tensor)]
    assert len(stored) == 5  # up+down, up+down+mid (alpha is a number in the plan)

    base = patcher(net)
    strong, weak = base.clone(), base.clone()
    strong.add_patches(patches, 1.0)
    weak.add_patches(patches, -0.4)
    x = inputs("lin", torch.bfloat16)
    for load_fn in (full_load, offload):
        for clone, strength in ((strong, 1.0), (weak, -0.4), (strong, 1.0)):
            load_fn(clone)
            weight, _ = forward_params(net.lin, x)
            assert_rounded_from(weight, W.double() + strength * lora_delta64(sd), torch.bfloat16,
                                what=f"{load_fn.__name__} strength {strength}")
            net.lin(x)
            net.conv(inputs("conv", torch.bfloat16))
            clone.unpatch_model(CPU)
            assert_bit_identical(net, saved)

    for adapter, i, ptr, dtype, device, values in stored:
        t = adapter.weights[i]
        assert (t.data_ptr(), t.dtype, t.device) == (ptr, dtype, device)
        assert torch.equal(t, values)
    assert all(strong.patches[k][0][1] is weak.patches[k][0][1] for k in patches)


# --- (f) ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(hand_variants()))
def test_strength_zero_leaves_weights_bit_identical(variant, base_dtype, caplog):
    """Strength 0 (linear) on every algorithm: full load and offload leave every bit as it was, and nothing warns."""
    sd = hand_variants()[variant]
    layer_name = layer_of(sd)
    net = Net(base_dtype)
    saved = snapshot(net)
    patches, _ = lycoris_patches(sd, net, KEY_MAP)
    mp = patcher(net)
    mp.add_patches(patches, 0.0)
    with caplog.at_level(logging.WARNING):
        full_load(mp)
        assert_bit_identical(net, saved)
        mp.unpatch_model(CPU)

        offload(mp)
        layer = getattr(net, layer_name)
        x = inputs(layer_name, base_dtype)
        weight, bias = forward_params(layer, x)
        assert torch.equal(weight.view(torch.uint8), saved[f"{layer_name}.weight"].view(torch.uint8))
        assert torch.equal(bias.view(torch.uint8), saved[f"{layer_name}.bias"].view(torch.uint8))
        mp.unpatch_model(CPU)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_bit_identical(net, saved)
