"""Helpers for tests that patch real ComfyUI layers through a real `ModelPatcher` (import after conftest ran).

Nothing here computes a LyCORIS patch: truth always comes from the test (float64 formula) or the reference factory.
"""

import json
from functools import cache

import comfy.model_patcher
import comfy.ops
import comfy.quant_ops
import pytest
import torch
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.glue.apply import build_patches
from reference.lycoris_factory import LAYER, LAYERS, PREFIXES

CPU = torch.device("cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE = 2.0 ** -6  # scaled-fp8 scale_weight: a power of two, so W / SCALE holds fp8 base values exactly
# every file prefix the reference factory writes -> its layer's weight in `factory_model`
FACTORY_KEY_MAP = {f"{prefix}{layer.name}": f"{layer.name}.weight" for prefix in PREFIXES for layer in LAYERS}


def lycoris_patches(state_dict, module: torch.nn.Module, key_map: dict, *, reference: bool = False,
                    name: str = "test.safetensors"):
    """(patches for add_patches, report) for `state_dict` applied to `module` with a hand key map."""
    lfile = parse_state_dict(state_dict, name) if isinstance(state_dict, dict) else state_dict
    shapes = {"model": {k: tuple(v.shape) for k, v in module.state_dict().items()}}
    patches, report = build_patches(lfile, key_map, shapes, reference)
    return patches["model"], report


def patcher(module: torch.nn.Module) -> "comfy.model_patcher.ModelPatcher":
    return comfy.model_patcher.ModelPatcher(module, load_device=CPU, offload_device=CPU)


def full_load(mp) -> None:
    mp.patch_model(device_to=CPU, lowvram_model_memory=0)


def offload(mp) -> None:
    """Every comfy.ops layer stays offloaded; patches run in LowVramPatch at forward time."""
    mp.patch_model(device_to=CPU, lowvram_model_memory=1)


def lowvram_patched(layer: torch.nn.Module, name: str = "weight") -> bool:
    fns = getattr(layer, f"{name}_function", [])
    return any(isinstance(f, comfy.model_patcher.LowVramPatch) for f in fns)


def forward_params(layer: torch.nn.Module, x: torch.Tensor):
    """(weight, bias) exactly as the layer's forward sees them (ComfyUI's cast + weight_function chain), a weight
    the forward multiplies as a QuantizedTensor dequantized (0.33 hands those on unchanged)."""
    weight, bias = comfy.ops.cast_bias_weight(layer, x)
    return (weight.dequantize() if isinstance(weight, QuantizedTensor) else weight), bias


def set_param(layer: torch.nn.Module, name: str, value: torch.Tensor | None, dtype: torch.dtype) -> None:
    if value is None:
        setattr(layer, name, None)
    else:
        setattr(layer, name, torch.nn.Parameter(value.detach().to(dtype).clone(), requires_grad=False))


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_bit_identical(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert set(now) == set(saved)
    for k, v in saved.items():
        assert now[k].dtype == v.dtype and now[k].shape == v.shape, k
        a, b = now[k].detach().contiguous().flatten(), v.contiguous().flatten()
        if a.is_floating_point():  # compare bits (NaN-safe, -0.0 vs 0.0 counts as a change)
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{k} changed"


@cache
def _grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of a 8/16-bit float dtype, sorted, as float64; and for each bit pattern of the dtype, the
    index of its value in that grid (-0.0 is 0.0's; non-finite patterns get 0 and are never looked up)."""
    import numpy as np

    if dtype.itemsize == 1:
        raw = torch.from_numpy(np.arange(256, dtype=np.uint16).astype(np.uint8))
    else:
        raw = torch.from_numpy(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16))
    values = raw.view(dtype).to(torch.float64)
    finite = torch.isfinite(values)
    grid = torch.unique(values[finite])
    index = torch.where(finite, torch.searchsorted(grid, values.nan_to_num(0.0)), 0)
    return grid, index


def _grid_index(x: torch.Tensor, dtype: torch.dtype, index: torch.Tensor) -> torch.Tensor:
    """The grid index of each element of `x` (float64, within the dtype's finite range) rounded to `dtype`."""
    bits = x.to(dtype).view(torch.uint8 if dtype.itemsize == 1 else torch.int16).to(torch.int64)
    return index[bits & (0xFF if dtype.itemsize == 1 else 0xFFFF)]


def assert_rounded_from(actual: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, slack: float = 1e-5,
                        what: str = "") -> None:
    """Every element of `actual` is one of the two `dtype` values around `truth` (float64), i.e. `truth` rounded
    (nearest or stochastic) to `dtype`. `slack` (relative) widens the bracket for an fp32 computation path."""
    actual = actual.detach().to(torch.float64).cpu()
    truth = truth.detach().to(torch.float64).cpu()
    assert actual.shape == truth.shape, (actual.shape, truth.shape)
    if dtype in (torch.float32, torch.float64):
        err = (actual - truth).abs()
        bound = slack * truth.abs() + slack * truth.abs().max() + 1e-30
        assert bool((err <= bound).all()), f"{what}: max error {float(err.max()):.3g} beyond fp32 rounding"
        return
    grid, index = _grid(dtype)
    lo_t = (truth - slack * truth.abs() - 1e-30).clamp(grid[0], grid[-1])
    hi_t = (truth + slack * truth.abs() + 1e-30).clamp(grid[0], grid[-1])
    # lo: the largest grid value <= lo_t; hi: the smallest >= hi_t. Rounding to the dtype lands on one of the two
    # grid values around a number (a conversion through fp32 too), so one step down or up from it finds them: the
    # same bracket as a binary search of the grid, without one (the full-size CLIP tests spent most of their time
    # in torch.searchsorted).
    i = _grid_index(lo_t, dtype, index)
    i = i - (grid[i] > lo_t).to(torch.int64)
    j = _grid_index(hi_t, dtype, index)
    j = j + (grid[j] < hi_t).to(torch.int64)
    lo = grid[i.clamp(0, len(grid) - 1)]
    hi = grid[j.clamp(0, len(grid) - 1)]
    ok = (actual >= lo) & (actual <= hi)
    if not bool(ok.all()):
        i = int((~ok).flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int((~ok).sum())}/{ok.numel()} values are not {dtype} roundings of the truth, "
                             f"e.g. got {float(actual.flatten()[i])}, truth {float(truth.flatten()[i])} "
                             f"(allowed [{float(lo.flatten()[i])}, {float(hi.flatten()[i])}])")


# ComfyUI 0.3.75 holds scaled-fp8 Linear weights in `scaled_fp8_ops` layers (a plain fp8 tensor W / scale_weight);
# 0.33 dropped those ops and loads every quantized Linear from its checkpoint's per-layer `comfy_quant` entry into a
# QuantizedTensor (fp8 e4m3fn/e5m2 with `weight_scale`, and more formats).
HAS_SCALED_FP8_OPS = hasattr(comfy.ops, "scaled_fp8_ops")


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: float = 1.0,
                     compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """ComfyUI's own quantized Linear (`mixed_precision_ops`, a QuantizedTensor in an fp8 layout) holding `weight`,
    loaded from a checkpoint-like state dict as ComfyUI loads one (`weight` / `scale` must be exact in `dtype`)."""
    fmt = str(dtype).removeprefix("torch.")
    # full-precision matmul: what pick_operations chooses on a device without fp8 compute (this CPU); an fp8 matmul
    # would also round the activations, which is not what these tests measure
    ops = comfy.ops.mixed_precision_ops({"layer": {"format": fmt}}, compute_dtype=compute_dtype, full_precision_mm=True)
    holder = torch.nn.Module()
    holder.add_module("layer", ops.Linear(weight.shape[1], weight.shape[0], bias=bias is not None))
    state = {"layer.weight": (weight.double() / scale).to(dtype), "layer.weight_scale": torch.tensor(float(scale))}
    if bias is not None:
        state["layer.bias"] = bias.float()
    if not HAS_SCALED_FP8_OPS:  # 0.33 reads the layer's format from the checkpoint, 0.3.75 from the ops config
        state["layer.comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    holder.load_state_dict(state, strict=True)
    layer = holder.layer
    assert isinstance(layer.weight, QuantizedTensor)
    expected = (weight.double() / scale).to(dtype).double() * scale
    assert torch.allclose(layer.weight.dequantize().double(), expected, rtol=2 ** -23, atol=0)
    return layer.requires_grad_(False)


class ModelConfig:
    """What `pick_operations` reads of a checkpoint's model config: its per-layer comfy_quant formats."""

    def __init__(self, quant_config: dict):
        self.quant_config = self.layer_quant_config = quant_config


def comfy_quant_linear(weight: torch.Tensor, bias: torch.Tensor, fmt: str) -> torch.nn.Module:
    """A Linear in a comfy_quant layout as ComfyUI loads it from a checkpoint on this CPU: the ops
    `pick_operations` chooses for the checkpoint's config, `weight` quantized by comfy_kitchen's own quantizer."""
    layout = comfy.quant_ops.QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    q = QuantizedTensor.from_float(weight.float(), layout)
    ops = comfy.ops.pick_operations(q._qdata.dtype, torch.float32, load_device=CPU,
                                    model_config=ModelConfig({"layer": {"format": fmt}}))
    holder = torch.nn.Module()
    holder.add_module("layer", ops.Linear(weight.shape[1], weight.shape[0], bias=True))
    scale = q._params.scale
    holder.load_state_dict({
        "layer.weight": q._qdata, "layer.bias": bias.float(),
        "layer.weight_scale": scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale,
        "layer.comfy_quant": torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8),
    }, strict=True)
    return holder.layer.requires_grad_(False)


def stored(weight: torch.Tensor) -> torch.Tensor:
    """The values a weight holds as stored: a QuantizedTensor's packed data, else the tensor itself."""
    return weight._qdata if isinstance(weight, QuantizedTensor) else weight.detach()


def storage_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight's values are held in (a QuantizedTensor's packed data; 0.33 reports its compute dtype)."""
    return stored(weight).dtype


def fp8_storage(layer: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """(the stored fp8 values, their scale) of an fp8 Linear: plain fp8 (scale 1), 0.3.75's scaled-fp8 op
    (`scale_weight`) or a QuantizedTensor (whose scale 0.33 recalculates at every requantisation)."""
    weight = layer.weight
    if isinstance(weight, QuantizedTensor):
        params = getattr(weight, "_params", None)  # 0.33 (comfy_kitchen); 0.3.75 keeps them in _layout_params
        scale = params.scale if params is not None else weight._layout_params["scale"]
        return weight._qdata, float(scale)
    return weight.detach(), float(getattr(layer, "scale_weight", 1.0))


def scaled_fp8_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scale: float
                      ) -> torch.nn.Module:
    """A scaled-fp8 Linear as each ComfyUI loads one: `scaled_fp8_ops` on 0.3.75, a QuantizedTensor on 0.33."""
    if not HAS_SCALED_FP8_OPS:
        return quantized_linear(weight, bias, dtype, scale)
    layer = comfy.ops.scaled_fp8_ops().Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype)
    set_param(layer, "weight", weight.double() / scale, dtype)
    if bias is not None:
        set_param(layer, "bias", bias, torch.float32)
    layer.scale_weight.data.fill_(scale)
    return layer.requires_grad_(False)


def _ops_layer(name: str, dtype: torch.dtype):
    """The factory layer `name` rebuilt as the comfy.ops layer ComfyUI would hold a `dtype` weight in."""
    template = LAYER[name].make()
    scaled = dtype in FP8 and isinstance(template, torch.nn.Linear)
    if scaled and not HAS_SCALED_FP8_OPS:
        return None, scaled  # built by quantized_linear from its values
    if scaled:
        ops = comfy.ops.scaled_fp8_ops()
    elif dtype == torch.float32:  # what ComfyUI picks when the weight dtype is the compute dtype
        ops = comfy.ops.disable_weight_init
    else:
        ops = comfy.ops.manual_cast
    if isinstance(template, torch.nn.Linear):
        layer = ops.Linear(template.in_features, template.out_features, bias=template.bias is not None, dtype=dtype)
    elif isinstance(template, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
        cls = {1: ops.Conv1d, 2: ops.Conv2d, 3: ops.Conv3d}[template.weight.ndim - 2]
        layer = cls(template.in_channels, template.out_channels, template.kernel_size, stride=template.stride,
                    padding=template.padding, dilation=template.dilation, groups=template.groups,
                    bias=template.bias is not None, dtype=dtype)
    elif isinstance(template, torch.nn.LayerNorm):
        layer = ops.LayerNorm(template.normalized_shape, eps=template.eps, dtype=dtype)
    else:
        layer = ops.GroupNorm(template.num_groups, template.num_channels, eps=template.eps, dtype=dtype)
    return layer, scaled


def factory_model(params: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The reference factory's tiny model as `comfy.ops` layers holding `params` (`base_params(dtype)`) in `dtype`.

    fp32: `disable_weight_init` layers (cast only when offloaded); fp16/bf16: `manual_cast` layers. fp8: Linear
    layers hold W / SCALE with biases in fp32, patched through ComfyUI's dequantize/requantize path: `scaled_fp8_ops()`
    (convert_weight/set_weight) on 0.3.75, a `comfy_quant` QuantizedTensor on 0.33; conv/norm layers hold plain fp8
    weights.
    """
    net = torch.nn.Module()
    for name in params:
        layer, scaled = _ops_layer(name, dtype)
        weight = params[name]["weight"]
        if layer is None:
            layer = quantized_linear(weight, params[name]["bias"], dtype, SCALE)
        elif scaled:
            set_param(layer, "weight", weight / SCALE, dtype)
            assert torch.equal(layer.weight.double() * SCALE, weight), "scaled fp8 base is not exact"
            layer.scale_weight.data.fill_(SCALE)
            # scaled-fp8 checkpoints keep biases in a float dtype; this one holds the fp8-rounded values exactly
            set_param(layer, "bias", params[name]["bias"], torch.float32)
        else:
            set_param(layer, "weight", weight, dtype)
            set_param(layer, "bias", params[name]["bias"], dtype)
        net.add_module(name, layer)
    return net.requires_grad_(False)


def variant_dtype_params(variant_ids, dtypes) -> list:
    """pytest params (variant_id, dtype) for a table of factory variants × base dtypes, with readable ids."""
    return [pytest.param(v, d, id=f"{v}-{str(d).removeprefix('torch.')}") for v in variant_ids for d in dtypes]
