"""Helpers for tests that patch real ComfyUI layers through a real `ModelPatcher` (import after conftest ran).

Nothing here computes a LyCORIS patch: truth always comes from the test (float64 formula) or the reference factory.
"""

from functools import cache

import comfy.model_patcher
import comfy.ops
import pytest
import torch
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.apply import build_patches
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
    """(weight, bias) exactly as the layer's forward sees them (ComfyUI's cast + weight_function chain)."""
    return comfy.ops.cast_bias_weight(layer, x)


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
def _grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 8/16-bit float dtype, sorted, as float64."""
    import numpy as np

    if dtype.itemsize == 1:
        raw = torch.from_numpy(np.arange(256, dtype=np.uint16).astype(np.uint8))
    else:
        raw = torch.from_numpy(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16))
    values = raw.view(dtype).to(torch.float64)
    return torch.unique(values[torch.isfinite(values)])


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
    grid = _grid(dtype)
    lo_t = truth - slack * truth.abs() - 1e-30
    hi_t = truth + slack * truth.abs() + 1e-30
    lo = grid[(torch.searchsorted(grid, lo_t.flatten(), right=True) - 1).clamp(0, len(grid) - 1)].reshape(truth.shape)
    hi = grid[torch.searchsorted(grid, hi_t.flatten(), right=False).clamp(0, len(grid) - 1)].reshape(truth.shape)
    ok = (actual >= lo) & (actual <= hi)
    if not bool(ok.all()):
        i = int((~ok).flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int((~ok).sum())}/{ok.numel()} values are not {dtype} roundings of the truth, "
                             f"e.g. got {float(actual.flatten()[i])}, truth {float(truth.flatten()[i])} "
                             f"(allowed [{float(lo.flatten()[i])}, {float(hi.flatten()[i])}])")


def _ops_layer(name: str, dtype: torch.dtype):
    """The factory layer `name` rebuilt as the comfy.ops layer ComfyUI would hold a `dtype` weight in."""
    template = LAYER[name].make()
    scaled = dtype in FP8 and isinstance(template, torch.nn.Linear)
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

    fp32: `disable_weight_init` layers (cast only when offloaded); fp16/bf16: `manual_cast` layers. fp8: Linear layers from `scaled_fp8_ops()` (stored W / SCALE, biases in
    fp32, patched through ComfyUI's convert_weight/set_weight); conv/norm layers hold plain fp8 weights.
    """
    net = torch.nn.Module()
    for name in params:
        layer, scaled = _ops_layer(name, dtype)
        weight = params[name]["weight"]
        if scaled:
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
