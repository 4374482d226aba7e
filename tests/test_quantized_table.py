"""Every quantized layer type ComfyUI has (that runs on the CPU) × algorithm × apply mode × loading path (issue #15).

Rows are ComfyUI's own layers, built as ComfyUI builds them for a checkpoint in that format:
* both versions: plain fp8 weights (e4m3fn, e5m2) in `manual_cast` Linear and 3×3 Conv2d layers;
* 0.3.75: scaled fp8 (`scaled_fp8_ops`, e4m3fn and e5m2 with `scale_weight`) and `comfy_quant` float8_e4m3fn
  (`mixed_precision_ops`, a QuantizedTensor), Linear only;
* 0.33: `comfy_quant` QuantizedTensor layouts float8_e4m3fn, float8_e5m2, mxfp8 (emulated on the CPU) and
  int8_tensorwise (its int8 kernel also quantizes the activations), Linear only. 0.33 has no scaled_fp8 ops: it
  converts scaled-fp8 checkpoints to comfy_quant float8_e4m3fn layers (`convert_old_quants`), the float8 rows.
ComfyUI quantizes only Linear layers in those formats (their convs are plain `manual_cast` layers), so the 3×3 Conv
rows are plain fp8. nvfp4 and the int4 layouts need a GPU kernel and are not here.

Columns: the LyCORIS reference's files (lycoris-lora 4.1.3, `reference.lycoris_factory`) for LoCon, LoHa, LoKr,
GLoRA, LoCon+DoRA, diag-OFT, BOFT, (IA)³ and full, at linear strength 0.7, applied with `merge`, `bypass` and `auto`,
then loaded fully, offloaded (LowVramPatch) and, on 0.33, as dynamic VRAM leaves a layer (see
test_bypass_dynamic.py: emulated on the CPU).

Truth: the reference's change on the DECODED weight. Formats whose decoded weight is exactly the factory's base
rounded to fp8 (plain, scaled and float8 layouts with a power-of-two scale) use the factory's recorded forward;
mxfp8 and int8 hold the float32 base quantized by ComfyUI's own quantizer, and the truth is the reference's forward
on that decoded weight. Each cell compares the layer's forward on the factory's probe:
* bypass and auto (auto bypasses every one of these layers): within 1e-4 of the change, as fp32 maths; int8 too,
  well inside the format's own floor (ComfyUI's int8 forward of the unpatched layer against its decoded weight,
  1–4% of the change): the change is added at the weight cast, and ComfyUI then multiplies in full precision;
* merge, where ComfyUI re-quantizes W + ΔW (full load; 0.3.75 also when offloaded scaled/quantized layers): every
  element of the weight the forward multiplies is one of the two values of the stored format's grid (with the scale
  ComfyUI picked) around the exact W', so at most one step off (stochastic rounding may pick either neighbour), and
  the output is that weight's output (int8: within twice its kernel's floor); where it does not re-quantize, fp32
  exact like bypass.
Every cell applies every module of the file for that layer.
"""

import dataclasses
import inspect
import json

import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.quant_ops
import comfy.sd
import comfy.utils
import pytest
import test_bypass_nodes
import test_nodes
import torch
import torch.nn.functional as F
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.apply import patched_clone
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from node_runner import execute
from patcher_util import (
    CPU,
    HAS_SCALED_FP8_OPS,
    SCALE,
    assert_rounded_from,
    comfy_quant_linear,
    full_load,
    lycoris_patches,
    offload,
    patcher,
    quantized_linear,
    scaled_fp8_linear,
    set_param,
)
from reference.lycoris_factory import LAYER, functional_forward, probe
from safetensors.torch import save_file
from test_bypass import CHANGE_TOLERANCE, NOISE, bias_rounding
from test_bypass_dynamic import (
    COMFYUI_VERSION,
    HAS_DYNAMIC_VRAM,
    dynamic_state,
    leave_dynamic_state,
    prefetch,
    reference_delta,
    reference_output,
)

STRENGTH = 0.7
ALGORITHMS = {"LoCon": "locon", "LoHa": "loha", "LoKr": "lokr", "GLoRA": "glora", "DoRA": "locon_dora_out",
              "OFT": "oft", "BOFT": "boft", "IA3": "ia3", "full": "full"}
MODES = ("merge", "bypass", "auto")
PATHS = ("full", "offload", "dynamic") if HAS_DYNAMIC_VRAM else ("full", "offload")
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Format:
    id: str  # the table's row label
    kind: str  # "plain" fp8 weights, 0.3.75's "scaled" fp8 ops, or a comfy_quant "quant" layout
    storage: torch.dtype  # the dtype of the stored values
    layers: tuple[str, ...]  # the factory layers ComfyUI holds in this format
    quant_format: str | None = None  # the comfy_quant format name
    # the factory base dtype the layer decodes to exactly (its truth is recorded), or None: mxfp8/int8 hold the
    # float32 base as ComfyUI quantizes it, and the truth is computed on the decoded weight
    base_dtype: torch.dtype | None = None


def formats() -> list[Format]:
    """The rows this ComfyUI has: plain fp8 (Linear and 3×3 conv), then its quantized Linear layers."""
    rows = [Format(f"fp8_{name}", "plain", dtype, ("linear_b", "conv2d"), base_dtype=dtype)
            for name, dtype in FP8.items()]
    if HAS_SCALED_FP8_OPS:
        rows += [Format(f"scaled_fp8_{name}", "scaled", dtype, ("linear_b",), base_dtype=dtype)
                 for name, dtype in FP8.items()]
    for name in comfy.quant_ops.QUANT_ALGOS:
        if name.startswith("float8_"):
            dtype = comfy.quant_ops.QUANT_ALGOS[name]["storage_t"]
            rows.append(Format(f"quant_{name}", "quant", dtype, ("linear_b",), name, base_dtype=dtype))
        elif name in ("mxfp8", "int8_tensorwise"):
            rows.append(Format(f"quant_{name}", "quant", comfy.quant_ops.QUANT_ALGOS[name]["storage_t"],
                               ("linear_b",), name))
    return rows


FORMATS = {fmt.id: fmt for fmt in formats()}
CELLS = [pytest.param(fmt.id, layer, algo, mode, path, id=f"{fmt.id}-{layer}-{algo}-{mode}-{path}")
         for fmt in FORMATS.values() for layer in fmt.layers for algo in ALGORITHMS for mode in MODES
         for path in PATHS if path != "dynamic" or layer == "linear_b"]  # the dynamic emulation drives linear_b


# --- ComfyUI's layers --------------------------------------------------------------------------------------------

def plain_fp8_layer(name: str, params: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The factory layer as the `manual_cast` layer ComfyUI builds for an fp8 checkpoint (weight and bias fp8)."""
    ops = comfy.ops.pick_operations(dtype, torch.float32, load_device=CPU)
    template = LAYER[name].make()
    if isinstance(template, torch.nn.Linear):
        layer = ops.Linear(template.in_features, template.out_features, dtype=dtype)
    else:
        layer = ops.Conv2d(template.in_channels, template.out_channels, template.kernel_size, padding=template.padding,
                           dtype=dtype)
    set_param(layer, "weight", params["weight"], dtype)
    set_param(layer, "bias", params["bias"], dtype)
    return layer.requires_grad_(False)


def build_layer(fmt: Format, name: str, bases) -> torch.nn.Module:
    if fmt.kind == "plain":
        return plain_fp8_layer(name, bases[fmt.storage][name], fmt.storage)
    if fmt.base_dtype is None:
        params = bases[torch.float32][name]
        return comfy_quant_linear(params["weight"], params["bias"], fmt.quant_format)
    params = bases[fmt.storage][name]
    if fmt.kind == "scaled":
        return scaled_fp8_linear(params["weight"], params["bias"], fmt.storage, SCALE)
    return quantized_linear(params["weight"], params["bias"], fmt.storage, SCALE)


def one_layer_net(layer: torch.nn.Module, name: str) -> torch.nn.Module:
    net = torch.nn.Module()
    net.add_module(name, layer)
    return net.requires_grad_(False)


def decoded(layer: torch.nn.Module) -> torch.Tensor:
    """The weight a layer holds, decoded (dequantized, times its scale), in float64."""
    weight = layer.weight
    if isinstance(weight, QuantizedTensor):
        return weight.dequantize().double()
    return weight.detach().double() * float(getattr(layer, "scale_weight", 1.0))


# --- truth ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Truth:
    x: torch.Tensor  # the probe, float64
    y: torch.Tensor  # the layer's output with the change at STRENGTH
    y_base: torch.Tensor  # the unpatched layer's output on its decoded weight
    weight: torch.Tensor  # W' (float64), fitted from y; only merge cells need it
    bias: torch.Tensor


def fit_parameters(name: str, x: torch.Tensor, y: torch.Tensor, precision: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W', b') of the Linear/3×3 conv that maps the probe x to y, by least squares: the factory's probes have
    more rows (patches) than a layer has inputs, so y determines them (the residual, checked, is the truth's own
    rounding: `precision`, float32 for the OFT/BOFT reference)."""
    template = LAYER[name].make()
    if isinstance(template, torch.nn.Linear):
        rows, targets = x, y
    else:
        rows = F.unfold(x, template.kernel_size, padding=template.padding).transpose(1, 2).flatten(0, 1)
        targets = y.flatten(2).transpose(1, 2).flatten(0, 1)
    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], dim=1)
    solution = torch.linalg.lstsq(rows, targets).solution
    weight, bias = solution[:-1].T, solution[-1]
    residual = float((rows @ solution - targets).norm())
    assert residual <= precision * float(targets.norm()), f"{name}: the probe does not determine the layer ({residual})"
    return weight.reshape(template.weight.shape), bias


def reference_on(generated, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """linear_b(x) after the file (m = 1) on a base holding `weight`: the reference's own forward; LoKr, whose
    layout the reference loader cannot read back, as W + its reference ΔW (independent of W)."""
    if generated.variant.algo == "lokr":
        return F.linear(x, weight + reference_delta(generated), bias)
    return reference_output(generated, weight, bias, x)


_TRUTHS: dict[tuple[str, str, str], Truth] = {}


def truth_for(fmt: Format, name: str, algo: str, reference_files, bases) -> Truth:
    """The cell's truth, made once per (format, layer, algorithm) for every mode and path."""
    if (fmt.id, name, algo) not in _TRUTHS:
        _TRUTHS[fmt.id, name, algo] = make_truth(fmt, name, reference_files[ALGORITHMS[algo]], bases)
    return _TRUTHS[fmt.id, name, algo]


def make_truth(fmt: Format, name: str, generated, bases) -> Truth:
    x = probe(name)
    if fmt.base_dtype is not None:
        y = generated.truth(fmt.base_dtype, STRENGTH, False)[name]
        y_base = generated.y_base[fmt.base_dtype][name]
    else:
        layer = build_layer(fmt, name, bases)
        weight, bias = decoded(layer), layer.bias.double()
        y_base = F.linear(x, weight, bias)
        y = y_base + STRENGTH * (reference_on(generated, weight, bias, x) - y_base)
    precision = 1e-6 if generated.variant.container == torch.float32 else 1e-9
    return Truth(x, y, y_base, *fit_parameters(name, x, y, precision))


# --- running a cell --------------------------------------------------------------------------------------------------

def requantizes(fmt: Format, mode: str, path: str) -> bool:
    """Whether ComfyUI rounds W + ΔW back to the stored format: a merge fully loaded (patch_weight_to_device:
    set_weight or stochastic_rounding); 0.3.75 also in the offloaded forward of a layer with set_weight (LowVramPatch
    hands it the fp32 result); 0.33 also in the dynamic cast of a layer that runs its quantized kernel (int8 here: the
    CPU has no fp8 compute, so fp8/mxfp8 layers multiply in full precision). 0.33's offloaded cast, and its dynamic
    cast of full-precision layers, keep the patched weight in the compute dtype."""
    if mode != "merge":
        return False
    return (path == "full" or (path == "offload" and HAS_SCALED_FP8_OPS and fmt.kind != "plain")
            or (path == "dynamic" and runs_quantized_kernel(fmt)))


def runs_quantized_kernel(fmt: Format) -> bool:
    return fmt.storage == torch.int8


def run(clone, layer: torch.nn.Module, name: str, path: str, x: torch.Tensor, monkeypatch, requant: bool = False
        ) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """(layer(x), (weight, bias) as the forward got them from ComfyUI's cast, the weight the layer held) with
    `clone` loaded along `path`."""
    if path == "full":
        full_load(clone)
    elif path == "offload":
        offload(clone)
    else:
        stored = dynamic_state(clone, layer)
        key = f"{name}.weight"
        layer.weight_lowvram_function = layer.weight_lowvram_function if key in clone.patches else None
        if f"{name}.bias" in clone.patches:
            layer.bias_lowvram_function = comfy.model_patcher.LowVramPatch(f"{name}.bias", clone.patches)
        clone.patch_model(device_to=CPU, load_weights=False)  # injects, as ModelPatcherDynamic.load does
        prefetch(layer, *stored)
        monkeypatch.setattr(comfy.model_management, "is_device_cpu", lambda device: False)  # see run_loaded
    try:
        with torch.no_grad():
            y = layer(x)
            if path == "dynamic":
                prefetch(layer, *stored)
            if requant:  # the cast the int8 forward makes: the patched weight re-quantized to the stored layout
                used = comfy.ops.cast_bias_weight(layer, None, dtype=layer.weight.dtype, device=x.device,
                                                  bias_dtype=x.dtype, compute_dtype=x.dtype, want_requant=True)[:2]
            else:
                used = comfy.ops.cast_bias_weight(layer, x)[:2]
        return y, used, layer.weight
    finally:
        if path == "dynamic":
            monkeypatch.undo()
            leave_dynamic_state(layer, *stored)
        clone.unpatch_model(CPU)


def grid_values(fmt: Format, layer: torch.nn.Module, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values `weight` holds on its format's grid, the scale of each) in float64: W = values × scale."""
    if isinstance(weight, QuantizedTensor):
        values, scale = weight._qdata.double(), weight._params.scale if hasattr(weight, "_params") \
            else weight._layout_params["scale"]
        if fmt.quant_format == "mxfp8":  # one power-of-two scale per 32 inputs, stored in cuBLAS' tiled layout
            from comfy_kitchen.float_utils import from_blocked

            rows, cols = values.shape
            blocks = from_blocked(scale.view(torch.uint8), rows, cols // 32).view(torch.float8_e8m0fnu)
            return values, blocks.double().repeat_interleave(32, dim=1)
        return values, torch.full_like(values, float(scale))
    values = weight.detach().double()
    return values, torch.full_like(values, float(getattr(layer, "scale_weight", 1.0)))


def assert_on_grid_around(fmt: Format, values: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    """Every stored value is one of the two grid values of the format around the exact `truth` (same units)."""
    if fmt.storage == torch.int8:
        lo, hi = torch.floor(truth - 1e-5 * truth.abs()), torch.ceil(truth + 1e-5 * truth.abs())
        outside = (values < lo) | (values > hi)
        assert not bool(outside.any()), f"{what}: {int(outside.sum())} int8 values are not roundings of W'"
    else:
        below = fp16_exponent_slip(values, truth, fmt.storage)
        assert_rounded_from(values[~below], truth[~below], fmt.storage, what=what)


def fp16_exponent_slip(values: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where comfy_kitchen's stochastic fp8 rounding (0.33) lands one step below the lower neighbour: it takes the
    exponent as floor(log2(x)) of x in fp16, which rounds up to 2^k for x just below it; the mantissa index is then
    -1 and the value 2^k·(1 − 2^-m) (m mantissa bits), e.g. 56 for 63.93 in e4m3fn. A mask of those elements."""
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    half = truth.abs().to(torch.float16)
    slipped = torch.floor(torch.log2(half)).double() > torch.floor(torch.log2(truth.abs()))
    value = truth.sign() * 2.0 ** torch.floor(torch.log2(half)).double() * (1 - 2.0 ** -mantissa_bits)
    return slipped & (values == value)


def lost_change(y: torch.Tensor, truth: Truth) -> float:
    return float((y.double() - truth.y).norm() / (truth.y - truth.y_base).norm())


def int8_floor(layer: torch.nn.Module, x: torch.Tensor) -> float:
    """‖ComfyUI's int8 forward − the decoded weight's exact output‖ of the unpatched layer: the format's own error
    (comfy_kitchen quantizes the activations too)."""
    with torch.no_grad():
        y = layer(x.float()).double()
    return float((y - F.linear(x, decoded(layer), layer.bias.double())).norm())


@pytest.mark.parametrize("fmt_id,name,algo,mode,path", CELLS)
def test_cell(reference_files, bases, monkeypatch, fmt_id, name, algo, mode, path):
    fmt = FORMATS[fmt_id]
    generated = reference_files[ALGORITHMS[algo]]
    truth = truth_for(fmt, name, algo, reference_files, bases)
    layer = build_layer(fmt, name, bases)
    net = one_layer_net(layer, name)
    key_map = {f"{prefix}{name}": f"{name}.weight" for prefix in ("lycoris_", "lora_unet_")}
    patches, report = lycoris_patches(load(generated.path), net, key_map)
    targets = {k for k in patches if k.startswith(f"{name}.")}
    # the file's module for this layer applies (the net holds only this layer: the other modules have no target)
    mine = f"lycoris_{name}"
    assert not [key for key, _ in report.problems if key.split(".")[0] == mine], report.details()
    assert {key.split(".")[0] for key in report.applied} == {mine} and f"{name}.weight" in targets, report.line()
    clone, bypassed = patched_clone(patcher(net), patches, STRENGTH, apply_mode=mode, key="lycoris:table")
    # auto bypasses every quantized layer; merge merges everything; nothing is dropped. Bypass and auto also run a
    # bias change in the forward where merging would round it: into an fp8 bias.
    bias_bypassed = mode != "merge" and f"{name}.bias" in targets and layer.bias.dtype.itemsize == 1
    assert bypassed == (0 if mode == "merge" else 1 + bias_bypassed)
    assert set(clone.patches) == targets - ({f"{name}.weight"} if bypassed else set()) - (
        {f"{name}.bias"} if bias_bypassed else set())
    floor = int8_floor(layer, truth.x) if fmt.storage == torch.int8 else 0.0
    x = truth.x.float()
    requant = requantizes(fmt, mode, path)
    y, (weight, bias), held = run(clone, layer, name, path, x, monkeypatch, requant and path == "dynamic")
    y = y.double()
    error = float((y - truth.y).norm())
    fp32 = CHANGE_TOLERANCE * float((truth.y - truth.y_base).norm()) + NOISE * float(truth.y_base.norm())
    what = f"{fmt_id} {name} {algo} {mode} {path}"
    if requant:
        # fully loaded, the stored weight is what was re-quantized (the cast may hand it on dequantized)
        values, scale = grid_values(fmt, layer, held if path == "full" else weight)
        assert_on_grid_around(fmt, values, truth.weight / scale, f"{what}: W")
        used_weight = values * scale
        exact = functional_forward(name, truth.x, used_weight, bias.double())
        own = float((y - exact).norm())
        assert own <= floor * 2 + NOISE * float(truth.y_base.norm()), f"{what}: output is not its weight's"
        print(f"\n{what}: re-quantized, {100 * lost_change(y, truth):.1f}% of the change lost")
    else:
        slack = bias_rounding(layer, x, f"{name}.bias" in targets and not bias_bypassed) * y.numel() ** .5
        # fp32-exact, int8 included: a change added at the weight cast makes ComfyUI multiply in full precision, so
        # the int8 kernel's own error (`floor`, 1–4% of the change here) does not apply
        allowed = fp32 + slack
        assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g} (int8 kernel's floor {floor:.3g})"


def test_scaled_fp8_rows_per_version():
    """0.3.75 holds scaled-fp8 checkpoints in its scaled_fp8 ops (rows scaled_fp8_*); 0.33 has no such ops and turns
    a scaled-fp8 checkpoint into comfy_quant float8_e4m3fn layers (`convert_old_quants`): the quant_float8 rows."""
    if HAS_SCALED_FP8_OPS:
        assert {"scaled_fp8_e4m3fn", "scaled_fp8_e5m2"} <= set(FORMATS)
        return
    assert "quant_float8_e4m3fn" in FORMATS and not any(f.startswith("scaled") for f in FORMATS)
    weight = torch.randn(4, 8).to(torch.float8_e4m3fn)
    checkpoint = {"scaled_fp8": torch.tensor([], dtype=torch.float8_e4m3fn), "layer.weight": weight,
                  "layer.scale_weight": torch.tensor(SCALE)}
    converted, _ = comfy.utils.convert_old_quants(checkpoint)
    assert json.loads(converted["layer.comfy_quant"].numpy().tobytes()) == {"format": "float8_e4m3fn"}
    assert float(converted["layer.weight_scale"]) == SCALE and converted["layer.weight"] is weight


def test_quantized_layers_are_linear_only():
    """ComfyUI quantizes only Linear layers in its scaled/comfy_quant ops; their convs are plain `manual_cast` layers
    (fp8 weights in an fp8 checkpoint: the plain fp8 conv rows)."""
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32)
    assert ops.Conv2d is comfy.ops.manual_cast.Conv2d and ops.Linear is not comfy.ops.manual_cast.Linear
    if HAS_SCALED_FP8_OPS:
        scaled = comfy.ops.scaled_fp8_ops()
        assert scaled.Conv2d is comfy.ops.manual_cast.Conv2d and scaled.Linear is not comfy.ops.manual_cast.Linear


# --- the loaders' default apply mode ----------------------------------------------------------------------------------

sd15, loras, kinds = test_nodes.sd15, test_nodes.loras, test_bypass_nodes.kinds  # fixtures
fp8_models = test_bypass_nodes.fp8_models


@pytest.mark.parametrize("node", [LycorisLoader, LycorisLoaderModelOnly])
def test_loaders_default_to_auto(node):
    """The widget's default (what the frontend puts in a new node) and the default an API prompt without the input
    gets should both be `auto`: exact on quantized layers (the table above), a plain merge elsewhere (issue #15)."""
    assert node.INPUT_TYPES()["optional"]["apply_mode"][1]["default"] == "auto"
    assert inspect.signature(node.execute).parameters["apply_mode"].default == "auto"


def test_loader_without_apply_mode_bypasses_fp8_layers_and_merges_float_ones(fp8_models, kinds, loras):
    """A prompt that does not set apply_mode: on the tiny SD1.5 UNet loaded with fp8 weights every patched layer
    should be bypassed (nothing rounded into fp8); on its float32 copy every patch merged, as `merge` would."""
    fp8, f32 = fp8_models
    sd = test_bypass_nodes.fp8_file(kinds)
    name = test_nodes.write(loras, "default.safetensors", sd)
    layers = len({k.split(".")[0] for k in sd})
    out = execute(LycorisLoaderModelOnly, model=fp8, lycoris_name=name, strength_model=1.0, inference=True)
    assert out.ui["lycoris"][0]["bypassed"] == layers and out.result[0].patches == {}
    out = execute(LycorisLoaderModelOnly, model=f32, lycoris_name=name, strength_model=1.0, inference=True)
    merged = execute(LycorisLoaderModelOnly, model=f32, lycoris_name=name, strength_model=1.0, apply_mode="merge",
                     inference=True)
    assert out.ui["lycoris"][0]["bypassed"] == 0 and not out.result[0].injections
    assert set(out.result[0].patches) == set(merged.result[0].patches) and len(merged.result[0].patches) == layers


# --- the loader on a comfy_quant checkpoint, as a prompt runs it -------------------------------------------------------

def comfy_quant_checkpoint(path: str, out: str) -> str:
    """The tiny SD1.5 checkpoint with every UNet Linear weight stored as comfy_quant float8_e4m3fn (weight / scale in
    fp8, a power-of-two scale near amax / 448, a per-layer `comfy_quant` entry), as ComfyUI 0.33 saves such models."""
    sd = comfy.utils.load_torch_file(path)
    for key in [k for k in sd if k.startswith("model.diffusion_model.") and k.endswith(".weight") and sd[k].ndim == 2]:
        layer = key.removesuffix(".weight")
        scale = 2.0 ** torch.ceil(torch.log2(sd[key].float().abs().max() / 448)).item()
        sd[key] = (sd[key].float() / scale).to(torch.float8_e4m3fn)
        sd[f"{layer}.weight_scale"] = torch.tensor(scale)
        sd[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                  dtype=torch.uint8)
    save_file(sd, out)
    return out


def test_loader_on_a_comfy_quant_checkpoint_in_a_prompt(tmp_path, loras):
    """LyCORIS Loader (Model Only) on a comfy_quant float8 checkpoint, in inference mode with the panel measured, as
    a prompt runs it: every module applies, the QuantizedTensor layers in bypass under auto."""
    if not HAS_DYNAMIC_VRAM:
        # 0.3.75 reads no per-layer comfy_quant entries (it has no convert_old_quants): no such checkpoint there.
        # The converter must be absent too, or the skip would hide comfy_quant checkpoints this test could load.
        assert not hasattr(comfy.utils, "convert_old_quants")
        pytest.skip(f"ComfyUI {COMFYUI_VERSION} loads no comfy_quant checkpoints (comfy.utils.convert_old_quants)")
    path = comfy_quant_checkpoint(str(test_nodes._tiny_sd15_path()), str(tmp_path / "quant.safetensors"))
    model = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False)[0]
    unet = model.model.diffusion_model
    name = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    assert isinstance(unet.get_submodule(name).weight, QuantizedTensor)
    prefix = "lora_unet_" + name.replace(".", "_")
    g = torch.Generator().manual_seed(0)
    sd = {f"{prefix}.lora_down.weight": torch.randn(4, 320, generator=g) * 0.05,
          f"{prefix}.lora_up.weight": torch.randn(320, 4, generator=g) * 0.05, f"{prefix}.alpha": torch.tensor(4.0)}
    file = test_nodes.write(loras, "quant.safetensors", sd)
    out = execute(LycorisLoaderModelOnly, model=model, lycoris_name=file, strength_model=1.0, apply_mode="auto",
                  inference=True)
    assert out.ui["lycoris"][0]["bypassed"] == 1 and out.ui["lycoris"][0]["applied"] == 1
