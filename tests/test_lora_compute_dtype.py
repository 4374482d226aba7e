"""ComfyUI 0.33 patches a copy of W in `lora_compute_dtype(device)` — fp16 on most NVIDIA GPUs — and rounds what
`comfy.lora.calculate_weight` returns into the storage dtype once (issue #9, point 1).

`ModelPatcher.patch_weight_to_device` calls `calculate_weight` with its default `intermediate_dtype=torch.float32`
and rounds the RETURNED tensor; an adapter's return value is the weight of the next patch and the result. So our
adapter returns its fp32 result rather than the fp16 copy it also writes W' into: W' is rounded once, to the storage
dtype, and values above fp16's 65504 stay finite. Two callers use the weight they hand over: a patch with an `offset`
(calculate_weight keeps the parent tensor and drops the return value, so the narrowed view is what counts: fp32 →
fp16 → storage, two roundings) and `LowVramPatch`, which passes `intermediate_dtype=weight.dtype` and feeds the
result to the forward.

What no adapter can undo: W itself is rounded to fp16 by ComfyUI before any adapter (ours or a core one) sees it, so
an fp32 model is patched from W rounded to fp16 (values above 65504 are already inf there, those below fp16's
resolution lose bits). Bypass mode never touches W.

Everything runs through a real `ModelPatcher` over `comfy.ops` layers on the CPU, with
`comfy.model_management.lora_compute_dtype` made to answer fp16 as on such a GPU. 0.3.75 has no lora_compute_dtype:
it patches an fp32 copy, which every test asserts there instead (`TEMP` is the dtype of ComfyUI's copy).
Truth: our float64 patch (checked against the LyCORIS reference's forward pass here and in test_core_reference.py),
explicit float64 formulas, and ComfyUI's own fp32-copy path.
"""

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import pytest
import torch
from lycoris_nodes.lycoris_core import apply, load, parse_state_dict
from lycoris_nodes.nodes.glue.adapter import LycorisAdapter
from patcher_util import (
    FACTORY_KEY_MAP,
    assert_rounded_from,
    factory_model,
    full_load,
    lycoris_patches,
    patcher,
    set_param,
)
from reference.lycoris_factory import functional_forward, layer_of, magnitude_forward, probe

# 0.33 copies W into lora_compute_dtype(device) to patch it; 0.3.75 always into fp32
HAS_LORA_COMPUTE_DTYPE = hasattr(comfy.model_management, "lora_compute_dtype")
TEMP = torch.float16 if HAS_LORA_COMPUTE_DTYPE else torch.float32  # ComfyUI's copy with lora_compute_dtype = fp16
FP16_MAX = torch.finfo(torch.float16).max
STRENGTH = 0.5
# LoCon, LoHa, LoKr, DoRA (both axes), Diag-OFT, BOFT, GLoRA, (IA)³ and Full (its diff_b patches biases)
VARIANTS = ("locon", "loha", "lokr", "locon_dora_out", "lokr_dora_in", "oft_rescaled", "boft", "glora", "ia3",
            "full")
COMPUTE_SLACK = 2e-6  # float32 maths, relative to |W| + |ΔW| (as test_patch_memory.py)
TRUTH_TOLERANCE = {False: 1e-10, True: 1e-4}  # ‖y64 − y_ref‖ / ‖y_ref − y_base‖; True: the reference is float32

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lora_compute(monkeypatch):
    """lora_compute(dtype): ComfyUI 0.33 patches in a copy of W in `dtype`, as on a GPU where
    lora_compute_dtype answers it. 0.3.75 always uses fp32 and is left as it is."""
    def set_dtype(dtype: torch.dtype) -> None:
        if HAS_LORA_COMPUTE_DTYPE:
            monkeypatch.setattr(comfy.model_management, "lora_compute_dtype", lambda device: dtype)
    return set_dtype


def patched_model(lycoris_file, params: dict, dtype: torch.dtype, strength: float = STRENGTH) -> torch.nn.Module:
    """The factory model holding `params` in `dtype`, with `lycoris_file` fully loaded at `strength`."""
    net = factory_model(params, dtype)
    patches, report = lycoris_patches(lycoris_file, net, FACTORY_KEY_MAP)
    assert report.applied, "nothing to patch"
    mp = patcher(net)
    mp.add_patches(patches, strength)
    full_load(mp)
    return net


def float64_patches(lycoris_file, params: dict, strength: float = STRENGTH) -> dict[str, torch.Tensor]:
    """{state-dict key: W'(strength) in float64} for every parameter the file patches, from float64 `params`."""
    out = {}
    for module in lycoris_file.modules.values():
        key = f"{layer_of(module.prefix)}.{module.param}"
        weight = out.get(key, params[layer_of(module.prefix)][module.param]).clone()
        apply(module.plan_for(tuple(weight.shape)), module.tensors, weight, strength,
              intermediate_dtype=torch.float64)
        out[key] = weight
    return out


def fp16_exact(params: dict) -> dict:
    """`params` with every value also exact in fp16: ComfyUI's fp16 copy of W then loses nothing, so any rounding
    left in the patched weight is the adapter's. (The factory's bf16 conv3d weight holds one value, 1.9e-7, finer
    than fp16 resolves there; it is taken as its fp16 rounding.)"""
    return {layer: {name: None if t is None else t.to(torch.float16).double() for name, t in ps.items()}
            for layer, ps in params.items()}


def assert_matches_reference(generated, lycoris_file, params: dict, base_dtype: torch.dtype) -> None:
    """Our float64 patch of the factory's `base_dtype` base gives the reference's forward pass (linear semantics)."""
    exact = float64_patches(lycoris_file, params)
    truth = generated.truth(base_dtype, STRENGTH, False)
    for layer in truth:
        weight = exact.get(f"{layer}.weight", params[layer]["weight"])
        bias = exact.get(f"{layer}.bias", params[layer]["bias"])
        y = functional_forward(layer, probe(layer), weight, bias)
        change = float((truth[layer] - generated.y_base[base_dtype][layer]).norm())
        error = float((y - truth[layer]).norm()) / change
        assert error < TRUTH_TOLERANCE[generated.variant.fp32_only], f"{layer}: float64 patch off the reference"


def error_ratio(ours: torch.Tensor, exact: torch.Tensor, before: torch.Tensor, layer: str | None) -> float:
    """max |ours − exact| / (half an fp32 ulp of |W'| + COMPUTE_SLACK · (|W| + |ΔW|)), ≤ 1 passes. For a layer's
    weight both go through the layer on its probe as magnitudes (as test_patch_memory.py): float32 sums with
    cancellation inside ΔW may miss single elements by more, never what the layer computes from them."""
    bound = torch.finfo(torch.float32).eps / 2 * exact.abs() + COMPUTE_SLACK * (before.abs() + (exact - before).abs())
    error = (ours.double() - exact).abs()
    if layer is not None:
        x = probe(layer)
        error, bound = magnitude_forward(layer, x, error, None), magnitude_forward(layer, x, bound, None)
    return float((error / bound).max())


def patched_keys(lycoris_file) -> set[str]:
    return {f"{layer_of(module.prefix)}.{module.param}" for module in lycoris_file.modules.values()}


# --- what ComfyUI hands the adapters ---------------------------------------------------------------------------------

def test_comfyui_patches_a_copy_in_lora_compute_dtype(lora_compute, monkeypatch):
    """The premise: 0.33 hands calculate_weight a copy of a bf16 W in lora_compute_dtype (fp16 here), with the default
    fp32 intermediate, so a W above 65504 is already inf in it, before any adapter runs. 0.3.75: an fp32 copy."""
    lora_compute(torch.float16)
    seen = []
    calculate_weight = comfy.lora.calculate_weight

    def spy(patches, weight, key, intermediate_dtype=torch.float32, original_weights=None):
        seen.append((weight.dtype, intermediate_dtype, bool(torch.isinf(weight).any())))
        return calculate_weight(patches, weight, key, intermediate_dtype, original_weights)

    monkeypatch.setattr(comfy.lora, "calculate_weight", spy)
    net = torch.nn.Module()
    net.lin = comfy.ops.manual_cast.Linear(4, 2, dtype=torch.bfloat16)
    set_param(net.lin, "weight", torch.tensor([[1.0, 2.0, 3.0, 7e4], [0.5, -1.0, 1.5, -2.0]]), torch.bfloat16)
    sd = {"lin.lora_up.weight": torch.ones(2, 1), "lin.lora_down.weight": torch.ones(1, 4), "lin.alpha": torch.tensor(1.)}
    patches, _ = lycoris_patches(sd, net, {"lin": "lin.weight"})
    mp = patcher(net)
    mp.add_patches(patches, 1.0)
    full_load(mp)
    assert seen == [(TEMP, torch.float32, HAS_LORA_COMPUTE_DTYPE)]


# --- bf16 storage: W' rounded once --------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant_id", VARIANTS)
def test_bf16_weights_rounded_once(reference_files, bases, lora_compute, variant_id):
    """bf16 model, fp16 lora_compute_dtype: every patched weight is bit-identical to what ComfyUI's fp32 copy gives
    (lora_compute_dtype fp32, or 0.3.75): the adapter's fp32 W' rounded once to bf16 (round to nearest). It is also a
    bf16 rounding of the float64 W', which matches the reference's forward pass. Through the fp16 copy it would be
    rounded twice (fp32 → fp16 → bf16), which moves a few percent of the elements by one bf16 ulp."""
    generated = reference_files[variant_id]
    lycoris_file = load(generated.path)
    assert_matches_reference(generated, lycoris_file, bases[torch.bfloat16], torch.bfloat16)
    params = fp16_exact(bases[torch.bfloat16])
    lora_compute(torch.float32)
    once = patched_model(lycoris_file, params, torch.bfloat16).state_dict()
    lora_compute(torch.float16)
    ours = patched_model(lycoris_file, params, torch.bfloat16).state_dict()
    exact = float64_patches(lycoris_file, params)
    for key in sorted(patched_keys(lycoris_file)):
        assert ours[key].dtype == torch.bfloat16
        differ = ours[key] != once[key]
        assert not bool(differ.any()), (f"{key}: {int(differ.sum())}/{differ.numel()} elements differ from one "
                                        f"rounding of the fp32 result")
        assert_rounded_from(ours[key], exact[key], torch.bfloat16, slack=COMPUTE_SLACK, what=key)


def test_bf16_change_beyond_fp16_range_stays_finite(lora_compute):
    """A bf16 W within fp16's range whose W' goes beyond 65504: finite, and W' (float64 formula) rounded once to bf16.
    Through the fp16 copy those elements would be inf."""
    lora_compute(torch.float16)
    gen = torch.Generator().manual_seed(7)
    base = (3e4 + 3e4 * torch.rand(16, 12, generator=gen)).to(torch.bfloat16).double()
    up, down = torch.rand(16, 2, generator=gen) * 200, torch.rand(2, 12, generator=gen) * 200
    truth = base + 1.0 * (2.0 / 2) * (up.double() @ down.double())  # alpha = rank = 2
    assert float(base.abs().max()) < FP16_MAX < float(truth.abs().max())
    net = torch.nn.Module()
    net.lin = comfy.ops.manual_cast.Linear(12, 16, bias=False, dtype=torch.bfloat16)
    set_param(net.lin, "weight", base, torch.bfloat16)
    sd = {"lin.lora_up.weight": up, "lin.lora_down.weight": down, "lin.alpha": torch.tensor(2.0)}
    patches, _ = lycoris_patches(sd, net, {"lin": "lin.weight"})
    mp = patcher(net)
    mp.add_patches(patches, 1.0)
    full_load(mp)
    weight = net.lin.weight
    assert weight.dtype == torch.bfloat16
    assert bool(torch.isfinite(weight).all()), f"{int(torch.isinf(weight).sum())} elements became inf"
    assert_rounded_from(weight, truth, torch.bfloat16, slack=COMPUTE_SLACK, what="W' beyond 65504")


# --- fp32 storage: patched from ComfyUI's fp16 copy of W, in fp32 -----------------------------------------------------

@pytest.mark.parametrize("variant_id", ("locon", "loha", "lokr", "locon_dora_out", "oft_rescaled", "glora"))
def test_fp32_weights_keep_an_fp32_change(reference_files, bases, lora_compute, variant_id):
    """fp32 model, fp16 lora_compute_dtype: ComfyUI rounds W to fp16 (W16) before any adapter sees it; nothing in the
    adapter contract can undo that. What the adapter controls is kept in fp32: the patched weight is W'(W16), the
    float64 patch of W16, within half an fp32 ulp of W' plus float32 maths (2e-6 · (|W16| + |ΔW|)), through the
    layer on its probe (`error_ratio`). On
    0.3.75, W16 is W itself. Written into the fp16 copy, W' would carry fp16's error (~5e-4 relative) instead."""
    lycoris_file = load(reference_files[variant_id].path)
    params = bases[torch.float32]
    lora_compute(torch.float16)
    ours = patched_model(lycoris_file, params, torch.float32).state_dict()
    seen = {layer: {name: None if t is None else t.to(TEMP).double() for name, t in ps.items()}
            for layer, ps in params.items()}  # what ComfyUI hands the adapter
    exact = float64_patches(lycoris_file, seen)
    failures = []
    for key in sorted(patched_keys(lycoris_file)):
        layer, name = key.split(".")
        before, truth = seen[layer][name], exact[key]
        assert ours[key].dtype == torch.float32
        ratio = error_ratio(ours[key], truth, before, layer if name == "weight" else None)
        if ratio > 1:
            failures.append(f"{key}: error/bound {ratio:.3g}")
        # the part no adapter can reach: ComfyUI's copy already changed W (0.33), or is W itself (0.3.75)
        assert bool((before != params[layer][name]).any()) == HAS_LORA_COMPUTE_DTYPE, key
    assert not failures, "\n".join(failures)


# --- where the result must stay in place ---------------------------------------------------------------------------

FUSED_ROWS, FUSED_IN, SLICE = 48, 24, (0, 16, 16)  # a qkv-like fused Linear; the patch targets rows 16..31


def _fused_net(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(11)
    net = torch.nn.Module()
    net.qkv = comfy.ops.manual_cast.Linear(FUSED_IN, FUSED_ROWS, bias=False, dtype=dtype)
    set_param(net.qkv, "weight", torch.randn(FUSED_ROWS, FUSED_IN, generator=gen) / 4, dtype)
    return net


def _locon_sd(out: int, flat_in: int, rank: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    return {"m.lora_up.weight": torch.randn(out, rank, generator=gen) / rank ** .5,
            "m.lora_down.weight": torch.randn(rank, flat_in, generator=gen) / flat_in ** .5,
            "m.alpha": torch.tensor(2.0)}


def test_offset_patch_is_written_in_place(lora_compute):
    """A fused weight patched by offset: ComfyUI keeps the parent copy and drops the adapter's return value, so the
    narrowed view is written in place. Rows outside the slice stay bit-identical; the slice is W' (float64 formula)
    rounded through ComfyUI's copy: fp32 → fp16 → bf16 on 0.33 with fp16 lora_compute_dtype (the one double rounding
    left), fp32 → bf16 on 0.3.75."""
    lora_compute(torch.float16)
    net = _fused_net(torch.bfloat16)
    before = net.qkv.weight.detach().clone()
    sd = _locon_sd(SLICE[2], FUSED_IN)
    patches, report = lycoris_patches(sd, net, {"m": ("qkv.weight", SLICE)})
    assert report.applied
    mp = patcher(net)
    mp.add_patches(patches, STRENGTH)
    full_load(mp)
    after = net.qkv.weight.detach()
    rows = torch.zeros(FUSED_ROWS, dtype=torch.bool)
    rows[SLICE[1]:SLICE[1] + SLICE[2]] = True
    assert torch.equal(after[~rows], before[~rows])
    up, down = sd["m.lora_up.weight"].double(), sd["m.lora_down.weight"].double()
    truth = before[rows].double() + STRENGTH * (2.0 / 4) * (up @ down)
    assert not torch.equal(after[rows], before[rows]), "the offset patch was dropped"
    assert_rounded_from(after[rows], truth, torch.bfloat16, slack=COMPUTE_SLACK, what="fused slice")
    fp32_result = before[rows].float()
    (module,) = parse_state_dict(sd, "fused.safetensors").modules.values()
    apply(module.plan_for(tuple(fp32_result.shape)), module.tensors, fp32_result, STRENGTH)
    assert torch.equal(after[rows], fp32_result.to(TEMP).to(torch.bfloat16))


def test_calculate_weight_contract_per_caller():
    """comfy.lora.calculate_weight with our adapter, as each ComfyUI caller uses it:

    * patch_weight_to_device (a narrower copy, default fp32 intermediate): an fp32 result, W' rounded by the caller
      (the copy holds W' rounded to its dtype too);
    * LowVramPatch and 0.33's dynamic-VRAM cast (intermediate_dtype = weight.dtype): the weight itself, in its dtype,
      since the forward uses it as it is;
    * an offset patch: the parent tensor, its slice written in place."""
    (module,) = parse_state_dict(_locon_sd(16, 24), "m.safetensors").modules.values()
    adapter = LycorisAdapter.from_module(module, module.plan_for((16, 24)))
    gen = torch.Generator().manual_seed(13)
    base = torch.randn(16, 24, generator=gen, dtype=torch.float64) / 4
    exact = base.clone()
    apply(adapter.plan, adapter.tensors, exact, STRENGTH, intermediate_dtype=torch.float64)

    for dtype in (torch.float16, torch.bfloat16):
        copy = base.to(dtype)
        result = comfy.lora.calculate_weight([(STRENGTH, adapter, 1.0, None, None)], copy, "k")
        truth = exact + (base.to(dtype).double() - base)  # W'(W rounded to dtype): LoCon's ΔW does not read W
        assert result.dtype == torch.float32
        assert_rounded_from(result, truth, torch.float32, slack=COMPUTE_SLACK, what=f"{dtype} copy, fp32 intermediate")
        assert torch.equal(copy, result.to(dtype))

        weight = base.to(dtype)
        result = comfy.lora.calculate_weight([(STRENGTH, adapter, 1.0, None, None)], weight, "k",
                                             intermediate_dtype=dtype)
        assert result is weight and result.dtype == dtype
        assert_rounded_from(result, truth, dtype, slack=COMPUTE_SLACK, what=f"{dtype}, LowVramPatch")

        fused = torch.cat([base, base]).to(dtype)
        untouched = fused[:16].clone()
        result = comfy.lora.calculate_weight([(STRENGTH, adapter, 1.0, (0, 16, 16), None)], fused, "k")
        assert result is fused and torch.equal(fused[:16], untouched)
        assert_rounded_from(fused[16:], truth, dtype, slack=COMPUTE_SLACK, what=f"{dtype} offset")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("float16", "bfloat16"))
def test_lowvram_patch_keeps_the_weight_dtype(lora_compute, dtype):
    """ComfyUI's own LowVramPatch (offloaded layers, and 0.33's dynamic cast into lora_compute_dtype) returns the
    weight's dtype: the forward multiplies with it directly."""
    lora_compute(torch.float16)
    net = _fused_net(dtype)
    sd = _locon_sd(FUSED_ROWS, FUSED_IN)
    patches, _ = lycoris_patches(sd, net, {"m": "qkv.weight"})
    mp = patcher(net)
    mp.add_patches(patches, STRENGTH)
    lowvram = comfy.model_patcher.LowVramPatch("qkv.weight", mp.patches)
    weight = net.qkv.weight.detach().clone()
    up, down = sd["m.lora_up.weight"].double(), sd["m.lora_down.weight"].double()
    truth = weight.double() + STRENGTH * (2.0 / 4) * (up @ down)
    out = lowvram(weight)
    assert out.dtype == dtype
    assert_rounded_from(out, truth, dtype, slack=COMPUTE_SLACK, what="LowVramPatch")
    x = torch.randn(3, FUSED_IN, generator=torch.Generator().manual_seed(14)).to(dtype)
    assert torch.nn.functional.linear(x, out).dtype == dtype
