"""Bypass under ComfyUI's current loading (issue #9, points 2–4), through a real `ModelPatcher` on `comfy.ops` layers.

1. A bypassed change that reads W (DoRA, OFT, GLoRA, (IA)³) on a layer that also carries merged patches (a core
   LoRA through ComfyUI's own `comfy.lora.load_lora`, or a LyCORIS file in merge mode) must see W as the layer runs
   it: with those patches in the weight (full load), in a LowVramPatch (offloaded), or applied on the fly by 0.33's
   dynamic VRAM cast (`resolve_cast_module_with_vbar`). Dynamic VRAM needs an NVIDIA GPU and comfy-aimdo; here the
   layer is put in the state `ModelPatcherDynamic.load` and `cast_modules_with_vbar` leave it in (see
   `dynamic_state`), on the CPU. Truth: the LyCORIS reference's own forward (lycoris-lora 4.1.3, files from
   `reference.lycoris_factory`) on a float64 base holding W + ΔA, the merged file's change.
2. Adapter tensors are staged on the patcher's load device once per injection: no host→device copy in a forward
   (counted on a fake cuda:0), and ejecting drops the staged copies while the stored tensors stay as they were.
3. ComfyUI 0.33's `comfy.ops.linear_input_act` multiplies an INT8 tensorwise layer by its weight without calling
   its forward; the change on such a layer must reach it anyway (and the report says how it was applied).
"""

import gc
import importlib
import json
import weakref

import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfyui_version
import pytest
import torch
import torch.nn.functional as F
from comfy.quant_ops import QuantizedTensor
from lycoris import create_lycoris_from_weights
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.apply import patched_clone
from lycoris_nodes.nodes.glue.coverage import ApplyReport
from patcher_util import CPU, factory_model, full_load, lycoris_patches, offload, patcher
from reference.lycoris_factory import _class_presets_restored, base_model, probe
from safetensors.torch import load_file
from test_regressions import KEY_MAP, Net, hand_variants, inputs, layer_of
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

LAYER = "linear_b"  # the factory's Linear 64 → 96 with a bias
KEY = f"{LAYER}.weight"
FILE_KEY_MAP = {f"lycoris_{LAYER}": KEY, f"lora_unet_{LAYER}": KEY}
CHANGE_TOLERANCE = 1e-4  # ‖error‖ / ‖truth − y_merged‖: fp32 maths, as in test_bypass.py
NOISE = 1e-6  # float32 forward noise, relative to ‖y‖
COMFYUI_VERSION = comfyui_version.__version__  # named in the reasons of the tests skipped for a missing feature
HAS_DYNAMIC_VRAM = hasattr(comfy.model_patcher, "ModelPatcherDynamic")
# 0.33's transfer-buffer layout helpers (0.3.75 has no such module: no dynamic VRAM)
memory_management = importlib.import_module("comfy.memory_management") if HAS_DYNAMIC_VRAM else None
HAS_INT8_INPUT_ACT = hasattr(comfy.ops, "linear_input_act")
READERS = ("locon_dora_out", "oft_rescaled", "glora", "ia3")  # DoRA, OFT, GLoRA, (IA)³: each reads W
BYPASS_ATTRIBUTE = "_lycoris_bypass"


# --- truth: the LyCORIS reference on a given linear_b weight ---------------------------------------------------------

def reference_output(generated, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, m: float = 1.0
                     ) -> torch.Tensor:
    """linear_b(x) in float64 with the file of `generated` applied at multiplier m by the reference's own forward
    (the network read back from the file by create_lycoris_from_weights) to a base whose linear_b holds `weight`.

    (IA)³ is the exception: that loader cannot read it back (lycoris-formats.md §3), so its truth is the §2.8
    formula, W'[o] = W[o]·(1 + m·w[o]); `test_truth_matches_the_factory` checks it against the factory's forward."""
    container = generated.variant.container
    if generated.variant.algo == "ia3":
        w = load_file(str(generated.path))[f"lycoris_{LAYER}.weight"].double()
        return F.linear(x.double(), weight.double() * (1 + m * w)[:, None], bias.double())
    model = base_model(torch.float32, container)
    model.linear_b.weight.data = weight.to(container)
    model.linear_b.bias.data = bias.to(container)
    with _class_presets_restored():
        net, _ = create_lycoris_from_weights(1.0, str(generated.path), model, weights_sd=load_file(str(generated.path)))
    for lora in net.loras:
        lora.to(container)
    net.apply_to()
    net.set_multiplier(m)
    with torch.no_grad():
        return model.linear_b(x.to(container)).double()


def reference_weight(generated, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """linear_b's weight after the file (m = 1), read off the reference forward: y(I) − b = W'ᵀ for a Linear."""
    eye = torch.eye(weight.shape[1], dtype=torch.float64)
    return (reference_output(generated, weight, bias, eye) - bias.double()).T


def reference_delta(generated) -> torch.Tensor:
    """ΔW of an additive file (independent of W) from the factory's recorded reference forward on the probe:
    y_ref − y_base = probe·ΔWᵀ, and the probe has full column rank, so least squares recovers ΔW (to float64
    rounding)."""
    y = generated.y_ref[(torch.float32, 1.0)][LAYER] - generated.y_base[torch.float32][LAYER]
    return torch.linalg.lstsq(probe(LAYER), y).solution.T


def assert_close_to_truth(y: torch.Tensor, truth: torch.Tensor, before: torch.Tensor, what: str) -> None:
    """‖y − truth‖ within fp32 error of the change truth − before."""
    error = float((y.double() - truth).norm())
    allowed = CHANGE_TOLERANCE * float((truth - before).norm()) + NOISE * float(before.norm())
    assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g}"


def only_layer(patches: dict) -> dict:
    return {k: a for k, a in patches.items() if (k if isinstance(k, str) else k[0]).startswith(f"{LAYER}.")}


@pytest.mark.parametrize("variant_id", READERS)
def test_truth_matches_the_factory(reference_files, bases, variant_id):
    """The truth helpers on the base weights give the factory's recorded reference forward."""
    generated = reference_files[variant_id]
    base = bases[torch.float32][LAYER]
    got = reference_output(generated, base["weight"], base["bias"], probe(LAYER))
    truth = generated.y_ref[(torch.float32, 1.0)][LAYER]
    assert_close_to_truth(got, truth, generated.y_base[torch.float32][LAYER], variant_id)
    if variant_id != "ia3":
        weight = reference_weight(generated, base["weight"], base["bias"])
        assert_close_to_truth(F.linear(probe(LAYER), weight, base["bias"]), truth,
                              generated.y_base[torch.float32][LAYER], f"{variant_id}, W' from y(I)")


@pytest.mark.parametrize("variant_id", ["loha", "locon", "lokr"])
def test_delta_is_the_reference_change(reference_files, bases, variant_id):
    """reference_delta fits the factory's 72 probe rows with 64 unknowns per output: a change that were not one
    linear map would leave a residual. Where the reference loader reads the file back (not LoKr's layout here), its
    own W'(1) − W agrees."""
    generated = reference_files[variant_id]
    base = bases[torch.float32][LAYER]
    delta = reference_delta(generated)
    got = F.linear(probe(LAYER), base["weight"] + delta, base["bias"])
    truth = generated.y_ref[(torch.float32, 1.0)][LAYER]
    assert_close_to_truth(got, truth, generated.y_base[torch.float32][LAYER], f"{variant_id}, residual")
    if variant_id != "lokr":
        loaded = reference_weight(generated, base["weight"], base["bias"]) - base["weight"]
        assert float((loaded - delta).norm()) <= 1e-9 * float(delta.norm()), variant_id


# --- 1. a bypassed reader after merged patches, in every loading mode ------------------------------------------------

def core_lora(seed: int = 7, rank: int = 4, alpha: float = 2.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"lora_unet_{LAYER}.lora_up.weight": torch.randn(96, rank, generator=g) * 0.1,
            f"lora_unet_{LAYER}.lora_down.weight": torch.randn(rank, 64, generator=g) * 0.1,
            f"lora_unet_{LAYER}.alpha": torch.tensor(alpha)}


def merged_first(kind: str, base, net, reference_files, weight: torch.Tensor, bias: torch.Tensor):
    """(a clone of `base` with the first file merged, W + ΔA in float64): a core LoRA through ComfyUI's own
    load_lora and add_patches, or the factory's LoHa file through our adapter in merge mode."""
    strength = 0.8
    if kind == "core lora":
        sd = core_lora()
        clone = base.clone()
        patches = comfy.lora.load_lora(sd, FILE_KEY_MAP)
        assert set(clone.add_patches(patches, strength)) == {KEY}
        up, down = sd[f"lora_unet_{LAYER}.lora_up.weight"].double(), sd[f"lora_unet_{LAYER}.lora_down.weight"].double()
        scale = float(sd[f"lora_unet_{LAYER}.alpha"]) / down.shape[0]
        return clone, weight.double() + strength * scale * up @ down
    generated = reference_files["loha"]
    patches, _ = lycoris_patches(load(generated.path), net, FILE_KEY_MAP)
    clone, bypassed = patched_clone(base, only_layer(patches), strength, apply_mode="merge")
    assert bypassed == 0 and set(clone.patches) == {KEY}
    return clone, weight.double() + strength * reference_delta(generated)


def dynamic_state(patched, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Puts a comfy.ops layer in the state 0.33's `ModelPatcherDynamic.load` leaves it in (model_patcher.py,
    `setup_param`): cast weights, the merged patches as `weight_lowvram_function` (a LowVramPatch), no
    `weight_function`, a vbar allocation `_v`. The weight is not on the compute device: its parameter is moved to
    `meta` (so `cast_bias_weight` takes the vbar branch, and nothing may read it directly) and its bytes come from
    the transfer buffer `prefetch` fills. Returns the real (weight, bias)."""
    weight, bias = layer.weight.data, layer.bias.data
    layer.comfy_cast_weights = True
    layer.seed_key = LAYER
    layer.weight_lowvram_function = comfy.model_patcher.LowVramPatch(KEY, patched.patches)
    layer.bias_lowvram_function = None
    layer.weight_function, layer.bias_function = [], []
    layer._v = ("vbar", 0, memory_management.vram_aligned_size([weight, bias]))  # comfy-aimdo's allocation
    layer._v_signature = None
    layer.weight = torch.nn.Parameter(weight.to("meta"), requires_grad=False)
    layer.weight._model_dtype = weight.dtype
    layer.bias = torch.nn.Parameter(bias.to("meta"), requires_grad=False)
    return weight, bias


def prefetch(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """`_prefetch` as `cast_modules_with_vbar` sets it for a layer the vbar could not fault in (signature None, as
    under VRAM pressure): weight and bias copied into one byte buffer laid out by interpret_gathered_like. With
    `_prefetch` set, `cast_bias_weight` resolves from it without calling comfy-aimdo. A fresh one per forward, as
    ComfyUI prefetches per block: ComfyUI's own cast may patch that buffer in place."""
    buffer = torch.zeros(memory_management.vram_aligned_size([weight, bias]), dtype=torch.uint8)
    for view, tensor in zip(memory_management.interpret_gathered_like([weight, bias], buffer), (weight, bias)):
        view.copy_(tensor)
    layer._prefetch = {"signature": None, "resident": False, "xfer_dest": buffer, "cast_dest": None,
                       "cast_geometry": memory_management.tensors_to_geometries([layer.weight, layer.bias]),
                       "needs_cast": False}


def leave_dynamic_state(layer: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    for name in ("_prefetch", "_v", "_v_signature", "weight_lowvram_function", "bias_lowvram_function", "seed_key",
                 "weight_function", "bias_function", "comfy_cast_weights"):
        layer.__dict__.pop(name, None)


def run_loaded(clone, net, loading: str, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """linear_b(x) with `clone` loaded as `loading` says, then unloaded (every bypass entry gone)."""
    layer = getattr(net, LAYER)
    if loading == "full":
        full_load(clone)
    elif loading == "offload":
        offload(clone)
        assert any(isinstance(f, comfy.model_patcher.LowVramPatch) for f in layer.weight_function)
    else:
        stored = dynamic_state(clone, layer)
        clone.patch_model(device_to=CPU, load_weights=False)  # injects, as load() does when it finishes
    try:
        assert BYPASS_ATTRIBUTE in vars(layer)
        if loading != "dynamic":
            return layer(x)
        prefetch(layer, *stored)
        # the compute device stands for a GPU: on a CPU device cast_bias_weight copies a `_v` layer's stored
        # weight instead (no patches), a path ComfyUI keeps only for custom nodes that move layers to the CPU
        monkeypatch.setattr(comfy.model_management, "is_device_cpu", lambda device: False)
        y = layer(x)
        monkeypatch.undo()
        assert layer.weight.device.type == "meta"  # the vbar path ran: the CPU one materialises it (zeros)
        return y
    finally:
        if loading == "dynamic":
            leave_dynamic_state(layer, *stored)
        clone.unpatch_model(CPU)
        assert BYPASS_ATTRIBUTE not in vars(layer) and "forward" not in vars(layer)


LOADINGS = [pytest.param(first, reader, loading, dtype,
                         id=f"{first.replace(' ', '_')}-{reader}-{loading}-{str(dtype).removeprefix('torch.')}")
            for first in ("core lora", "lycoris merge") for reader in READERS
            for loading, dtype in (("full", torch.float32), ("offload", torch.float32), ("dynamic", torch.float32),
                                   ("dynamic", torch.bfloat16))]


@pytest.mark.parametrize("first,reader,loading,dtype", LOADINGS)
def test_bypassed_reader_reads_w_as_the_layer_runs_it(reference_files, bases, monkeypatch, first, reader, loading,
                                                      dtype):
    """A file merged first, then a bypassed reader at m = 0.7 on the same layer: the layer's output is the reader
    applied to W + ΔA (linear strength: y_A + m·(y_AB − y_A)). fp32 storage is the case where ComfyUI's dynamic
    cast patches its transfer buffer in place; bf16 storage is cast to the fp32 input dtype first."""
    if loading == "dynamic" and not HAS_DYNAMIC_VRAM:
        # 0.3.75 has no dynamic VRAM (no vbar cast path); its offloaded patches are the LowVramPatch case above.
        # The cast path must be absent too, or the skip would hide a dynamic VRAM this test does not recognise.
        assert not hasattr(comfy.ops, "resolve_cast_module_with_vbar")
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} has no dynamic VRAM (comfy.model_patcher.ModelPatcherDynamic)")
    m = 0.7
    net = factory_model(bases[dtype], dtype)
    base_params = bases[dtype][LAYER]
    weight, bias = base_params["weight"], base_params["bias"]
    base = patcher(net)
    first_clone, merged_weight = merged_first(first, base, net, reference_files, weight, bias)
    generated = reference_files[reader]
    patches, _ = lycoris_patches(load(generated.path), net, FILE_KEY_MAP)
    clone, bypassed = patched_clone(first_clone, only_layer(patches), m, apply_mode="bypass", key="lycoris:reader")
    assert bypassed == 1 and set(clone.patches) == {KEY}

    x = probe(LAYER)
    y = run_loaded(clone, net, loading, x.float(), monkeypatch)
    y_merged = F.linear(x, merged_weight, bias)
    truth = y_merged + m * (reference_output(generated, merged_weight, bias, x) - y_merged)
    # the test can fail: the reader applied to the weight without the merged file is far off
    y_plain = F.linear(x, weight, bias)
    unmerged = y_merged + m * (reference_output(generated, weight, bias, x) - y_plain)
    assert float((unmerged - truth).norm()) > 100 * CHANGE_TOLERANCE * float((truth - y_merged).norm())
    assert_close_to_truth(y, truth, y_merged, f"{first} then {reader}, {loading}")


# --- 2. staged adapter tensors ---------------------------------------------------------------------------------------

def moved_to_cuda(func, args, kwargs) -> torch.Tensor | None:
    """The CPU tensor an explicit cast (`_to_copy`) or a `copy_` moves to a cuda device, or None."""
    if func is torch.ops.aten._to_copy.default:
        source, target = args[0], kwargs.get("device")
        to_cuda = target is not None and torch.device(target).type == "cuda"
    elif func is torch.ops.aten.copy_.default:
        source, to_cuda = args[1], args[0].device.type == "cuda"
    else:
        return None
    return source if to_cuda and source.device.type == "cpu" else None


class HostToDevice(TorchDispatchMode):
    """Records the shape of every tensor copied from CPU memory to a cuda device."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = moved_to_cuda(func, args, kwargs)
        if source is not None:
            self.copies.append(tuple(source.shape))
        return func(*args, **kwargs)


BYPASSABLE = [v for v in hand_variants() if v != "norm"]  # norm layers are always merged
CUDA = torch.device("cuda:0")
FORWARDS = 3


@pytest.mark.parametrize("variant", BYPASSABLE)
def test_adapter_tensors_are_staged_once_per_injection(variant):
    """Model loaded on a (fake) cuda:0, adapter tensors on the CPU: injecting stages copies on cuda:0, so three
    forwards copy nothing from the CPU (before staging: every tensor, every forward); Full's diff (as large as the
    weight) is the one tensor left on the CPU, cast at each forward. Ejecting drops the staged copies; the shared
    adapter's tensors stay on the CPU, bit-identical."""
    sd = hand_variants()[variant]
    name = layer_of(sd)
    net = Net(torch.bfloat16)
    patches, report = lycoris_patches(sd, net, KEY_MAP)
    assert not report.problems
    stored = {k: dict(a.tensors) for k, a in patches.items()}
    saved = {k: {n: t.clone() for n, t in tensors.items()} for k, tensors in stored.items()}
    base = comfy.model_patcher.ModelPatcher(net, load_device=CUDA, offload_device=CPU)
    clone, bypassed = patched_clone(base, patches, 0.7, apply_mode="bypass", key="lycoris:staged")
    assert bypassed == 1
    layer = getattr(net, name)
    dense = {"diff"} if variant == "full" else set()
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in net.modules():  # the model as loaded on cuda:0 (patch_model cannot move fake parameters)
            for param_name, param in list(module.named_parameters(recurse=False)):
                setattr(module, param_name, torch.nn.Parameter(param.to(CUDA), requires_grad=False))
        clone.patch_model(device_to=CUDA, load_weights=False)  # no weight to patch: this injects
        x = inputs(name, torch.bfloat16, device="cuda:0")
        with HostToDevice() as moved:
            for _ in range(FORWARDS):
                y = layer(x)
        assert y.device == CUDA and y.dtype == torch.bfloat16
        assert len(moved.copies) == FORWARDS * len(dense), moved.copies
        (entry,) = layer.__dict__[BYPASS_ATTRIBUTE].entries.values()
        assert {n for n, t in entry.tensors.items() if t.device == CPU} == dense
        staged = [weakref.ref(t) for n, t in entry.tensors.items() if n not in dense]
        assert len(staged) == len(entry.tensors) - len(dense) and all(r().device == CUDA for r in staged)
        del entry
        clone.eject_model()
    gc.collect()
    assert [r() for r in staged] == [None] * len(staged), "eject left staged copies alive"
    assert BYPASS_ATTRIBUTE not in vars(layer)
    for key, tensors in stored.items():
        assert dict(patches[key].tensors) == tensors  # the same tensor objects...
        for n, t in tensors.items():  # ... still real CPU tensors holding what they held
            assert type(t) is torch.Tensor and t.device == CPU and torch.equal(t, saved[key][n]), n


# --- 3. int8 layers ComfyUI multiplies without their forward ---------------------------------------------------------

def int8_layer(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    """ComfyUI 0.33's INT8 tensorwise Linear (mixed_precision_ops, a `comfy_quant` QuantizedTensor), loaded from a
    checkpoint-like state dict as ComfyUI loads one (comfy_kitchen quantizes `weight` for it)."""
    q = QuantizedTensor.from_float(weight.float(), "TensorWiseINT8Layout")
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32)
    holder = torch.nn.Module()
    holder.add_module("layer", ops.Linear(weight.shape[1], weight.shape[0], bias=True))
    holder.load_state_dict({
        "layer.weight": q._qdata, "layer.weight_scale": q._params.scale, "layer.bias": bias.float(),
        "layer.comfy_quant": torch.tensor(list(json.dumps({"format": "int8_tensorwise"}).encode()), dtype=torch.uint8),
    }, strict=True)
    layer = holder.layer.requires_grad_(False)
    assert isinstance(layer.weight, QuantizedTensor) and layer.weight._layout_cls == "TensorWiseINT8Layout"
    return layer


def gelu_input(seed: int = 3) -> torch.Tensor:
    return torch.randn(24, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("apply_mode", ["bypass", "auto"])
@pytest.mark.parametrize("variant_id", ["locon", "lokr", "locon_dora_out"])
def test_int8_layer_run_without_its_forward_gets_the_change(reference_files, bases, apply_mode, variant_id):
    """`comfy.ops.linear_input_act(layer, x, "gelu_tanh")` on an INT8 tensorwise layer (what Wan/LTX feed-forwards
    call) equals the truth: the file applied to the dequantized W, times gelu(x), within the int8 path's own error
    (measured on the unpatched layer). The change is added to the weight when ComfyUI casts it (a weight_function,
    which linear_input_act honours), so it is exact to fp32; the report counts it. The layer's own forward agrees."""
    if not HAS_INT8_INPUT_ACT:
        # 0.3.75 has neither int8 layouts nor linear_input_act: there every layer runs its forward.
        # The int8 layout must be absent too, or the skip would hide int8 layers this test does not reach.
        assert "TensorWiseINT8Layout" not in dir(comfy.quant_ops)
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} has no int8 layers run without their forward "
                    "(comfy.ops.linear_input_act)")
    m = 0.8
    base_params = bases[torch.float32][LAYER]
    layer = int8_layer(base_params["weight"], base_params["bias"])
    net = torch.nn.Module()
    net.add_module(LAYER, layer)
    dequantized, bias = layer.weight.dequantize().double(), layer.bias.double()
    x = gelu_input()
    act = F.gelu(x.double(), approximate="tanh")
    with torch.no_grad():
        before = comfy.ops.linear_input_act(layer, x, "gelu_tanh")
    floor = float((before.double() - F.linear(act, dequantized, bias)).norm())  # the int8 kernel's own error
    stored = (layer.weight._qdata.clone(), layer.weight._params.scale.clone())

    generated = reference_files[variant_id]
    patches, _ = lycoris_patches(load(generated.path), net, FILE_KEY_MAP)
    report = ApplyReport("int8.safetensors", 1)
    report.labels["test"] = 1
    clone, bypassed = patched_clone(patcher(net), only_layer(patches), m, apply_mode=apply_mode,
                                    key="lycoris:int8", report=report)
    assert bypassed == 1 and not clone.patches
    assert (report.bypassed, report.at_weight_cast) == (1, 1)
    assert report.to_json()["at_weight_cast"] == 1
    assert "1 in bypass, 1 of them added at the weight cast (int8 layers" in report.line(), report.line()

    changed = (reference_weight(generated, dequantized, bias) if variant_id == "locon_dora_out"
               else dequantized + reference_delta(generated))
    truth = F.linear(act, dequantized + m * (changed - dequantized), bias)
    change = float((truth - F.linear(act, dequantized, bias)).norm())
    assert change > 20 * floor, "the change must stand out of the int8 error, or a dropped change would pass"
    full_load(clone)
    try:
        weight = layer.weight  # nothing was merged (rounded) into the int8 weight
        assert torch.equal(weight._qdata, stored[0]) and torch.equal(weight._params.scale, stored[1])
        with torch.no_grad():
            y = comfy.ops.linear_input_act(layer, x, "gelu_tanh")
            own = layer(F.gelu(x, approximate="tanh"))
    finally:
        clone.unpatch_model(CPU)
    error = float((y.double() - truth).norm())
    assert error <= floor, f"linear_input_act: ‖error‖ {error:.3g} above the int8 floor {floor:.3g}"
    assert_close_to_truth(y, truth, F.linear(act, dequantized, bias), "linear_input_act, fp32")
    assert_close_to_truth(own, truth, F.linear(act, dequantized, bias), "the layer's forward")
    assert list(layer.weight_function) == [] and not vars(layer).get("_lycoris_weight_change")
    with torch.no_grad():
        assert torch.equal(comfy.ops.linear_input_act(layer, x, "gelu_tanh"), before)  # the int8 path is back
