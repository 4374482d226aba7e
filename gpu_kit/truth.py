"""Ground truth from the LyCORIS reference (lycoris-lora 4.1.3) on the kit's layer sets, on the device.

For one algorithm variant (a row of the tests' `reference.lycoris_factory.VARIANTS`), one layer set and one storage
dtype: the reference creates its network on a float64 copy of the set whose weights are those of the stored model
(float32 for Diag-OFT/BOFT, whose Cayley transform cannot run in float64), gives every adapter parameter seeded
values, saves the file (that file is what the pack loads), and runs its own forward. Each layer's parameters after
the reference's change are read off that forward (`effective_params`), never from its merge functions (merge_to
scales LoHa/LoKr twice, spec 4.1). At linear strength m the truth is P + m·(P1 − P) (the layer is affine in them).

Two outputs per layer then judge a patched model: the truth y* (float64), and the ideal y° (the best any
implementation can do in the model's dtypes: the true parameters rounded once to the stored dtype, the forward
computed in the compute dtype on the same device). A layer passes when ‖y − y*‖ ≤ 2·‖y° − y*‖: an error of
one rounding (ComfyUI rounds fp8 stochastically: √2 on average), not the size of the change.
"""

import contextlib
import dataclasses
import math
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from reference import lycoris_factory as factory

from .models import LayerSpec, compute_dtype

TOLERANCE = 2.0  # ‖y − y*‖ ≤ TOLERANCE · ‖y° − y*‖
# The reference names modules "<prefix>_<path with _>"; "lora_unet" is what its kohya wrapper (sd-scripts) writes,
# and with ComfyUI's own module paths these are sd-scripts' names for SDXL and Flux.
PREFIX = "lora_unet"
NORMS = ("groupnorm", "layernorm")


def raised_by_reference(error: BaseException) -> bool:
    """The reference's own refusal (BOFT cannot factor a width, ...): raised inside the lycoris package. Anything
    else (the kit's code, torch on this device) is a failure to report, never a skip."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}lycoris{os.sep}" in frames[-1].filename


def _prefixed(fn, *args):
    """`fn(*args)` with the reference's module-name prefix set (the factory restores its class presets after each
    network, so it is set for each call)."""
    cls = factory.LycorisNetwork
    saved, cls.LORA_PREFIX = cls.LORA_PREFIX, PREFIX
    try:
        return fn(*args)
    finally:
        cls.LORA_PREFIX = saved


@contextlib.contextmanager
def exact_float32():
    """No TF32 while the truth is computed: cuDNN convolutions use it by default on Ampere and newer."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def variants() -> tuple:
    return factory.VARIANTS


def targets(variant, specs) -> list[LayerSpec]:
    """The set's layers this variant is made for (the factory's layer kinds, minus those the reference cannot do)."""
    return [s for s in specs if s.kind in variant.layers and s.kind not in variant.skips]


def for_layers(variant, chosen: list[LayerSpec]):
    """The variant with its layers and per-layer options named by the set's paths instead of the factory's."""
    return dataclasses.replace(variant, layers=tuple(s.path for s in chosen),
                               layer_kwargs={s.path: variant.layer_kwargs[s.kind] for s in chosen
                                             if s.kind in variant.layer_kwargs})


def reference_model(specs, params: dict, dtype: torch.dtype, device) -> torch.nn.Module:
    """Plain torch layers holding `params` (the stored model's values) in `dtype`: what the reference wraps."""
    root = torch.nn.Module()
    for spec in specs:
        p = params[spec.path]
        if spec.kind == "groupnorm":
            layer = torch.nn.GroupNorm(*spec.args)
        elif spec.kind == "layernorm":
            layer = torch.nn.LayerNorm(spec.args[0])
        elif spec.kind.startswith("conv"):  # skip_init: no random init of a Flux-size weight that is replaced
            inp, outp, k = spec.args
            layer = torch.nn.utils.skip_init(torch.nn.Conv2d, inp, outp, k, padding=k // 2,
                                             bias=p["bias"] is not None, device=device)
        else:
            layer = torch.nn.utils.skip_init(torch.nn.Linear, *spec.args, bias=p["bias"] is not None, device=device)
        layer.to(device)
        layer.weight.data = p["weight"].to(device=device, dtype=dtype, copy=True)  # the reference may write W
        if p["bias"] is not None:
            layer.bias.data = p["bias"].to(device=device, dtype=dtype, copy=True)
        factory.attach(root, spec.path, layer.requires_grad_(False))
    return root


def stored_params(specs, master: dict, storage: torch.dtype, device=None) -> dict:
    """The model's parameters as stored (weights in `storage`, norms and biases in the compute dtype), in float64,
    on `device` (the CPU by default): the truth is computed there."""
    compute = compute_dtype(storage)
    out = {}
    for spec in specs:
        m = master[spec.path]
        weight_dtype = compute if spec.kind in NORMS else storage
        out[spec.path] = {"weight": m["weight"].to(weight_dtype).to(device=device, dtype=torch.float64),
                          "bias": None if m["bias"] is None else m["bias"].to(compute).to(device, torch.float64)}
    return out


@torch.no_grad()
def effective_params(spec: LayerSpec, layer: torch.nn.Module, dtype: torch.dtype, device, has_bias: bool) -> dict:
    """(weight, bias) of the affine map `layer` computes, read off its forward in `dtype` (float64 results, on
    `device`). `has_bias`: whether the layer has one (the reference's Full module takes the layer's own bias away)."""
    def run(x):
        return layer(x.to(device=device, dtype=dtype)).double()

    if spec.kind in NORMS:  # y = γ·x̂ + β, x̂ the normalised input: γ, β by least squares per channel
        channels = spec.args[-1]
        shape = (64, channels) if spec.kind == "layernorm" else (16, channels, 4, 4)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device)
        if spec.kind == "layernorm":
            u = F.layer_norm(x, (channels,), eps=layer.eps)
        else:
            u = F.group_norm(x, spec.args[0], eps=layer.eps)
        y = run(x)
        u, y = u.transpose(0, 1).reshape(channels, -1), y.transpose(0, 1).reshape(channels, -1)
        uc, yc = u - u.mean(1, keepdim=True), y - y.mean(1, keepdim=True)
        gamma = (uc * yc).sum(1) / (uc * uc).sum(1)
        return {"weight": gamma, "bias": y.mean(1) - gamma * u.mean(1)}
    if spec.kind.startswith("conv"):  # unit impulses over one kernel window: the centre output is Σ W·x + b
        inp, outp, k = spec.args
        bias = run(torch.zeros(1, inp, k, k))[0, :, k // 2, k // 2]
        eye = torch.eye(inp * k * k, dtype=torch.float64, device=device).reshape(inp * k * k, inp, k, k)
        columns = torch.cat([run(chunk)[:, :, k // 2, k // 2] for chunk in eye.split(4096)])
        weight = (columns - bias).T.reshape(outp, inp, k, k)
        return {"weight": weight, "bias": bias if has_bias else None}
    inp = spec.args[0]
    bias = run(torch.zeros(1, inp))[0]
    eye = torch.eye(inp, dtype=torch.float64, device=device)
    columns = torch.cat([run(chunk) for chunk in eye.split(4096)])
    return {"weight": (columns - bias).T.contiguous(), "bias": bias if has_bias else None}


def functional(spec: LayerSpec, x: torch.Tensor, params: dict) -> torch.Tensor:
    w, b = params["weight"], params["bias"]
    if spec.kind == "groupnorm":
        return F.group_norm(x, spec.args[0], w, b, eps=1e-5)
    if spec.kind == "layernorm":
        return F.layer_norm(x, (spec.args[0],), w, b, eps=1e-5)
    if spec.kind.startswith("conv"):
        return F.conv2d(x, w, b, padding=spec.args[2] // 2)
    return F.linear(x, w, b)


@dataclass
class Truth:
    """One file and what the reference says it does to each layer it targets."""

    path: Path
    base: dict  # layer path -> stored params (float64, on the device)
    full: dict  # layer path -> params after the file at multiplier 1 (float64, on the device)

    def params(self, path: str, strength: float) -> dict:
        base, full = self.base[path], self.full[path]
        bias = None if base["bias"] is None else base["bias"] + strength * (full["bias"] - base["bias"])
        return {"weight": base["weight"] + strength * (full["weight"] - base["weight"]), "bias": bias}


def make(variant, chosen: list[LayerSpec], base: dict, device, directory: Path, seed: int) -> Truth:
    """The variant's file for `chosen` layers of the set whose stored parameters are `base` (stored_params), and
    its truth (see the module doc), computed on `device`."""
    named = for_layers(variant, chosen)
    container = variant.container
    with exact_float32(), torch.no_grad():
        model = reference_model(chosen, base, container, device)
        net = _prefixed(factory._create, named, model, named.layers, directory)
        net.to(device)
        factory._randomise(net, torch.Generator().manual_seed(seed))
        snapshot = factory._snapshot(net)
        factory._apply(net)
        path = directory / f"{variant.id}-{seed}.safetensors"
        net.cpu()  # saved from the CPU, as a trainer saves
        net.save_weights(str(path), variant.save_dtype, {})
        net.to(device)
        if variant.truth != "forward":  # the reference's own reading of the saved (rounded) file, on a fresh copy
            model = reference_model(chosen, base, container, device)
            net = _prefixed(factory._truth_network, named, model, snapshot, path, directory)
            net.to(device)
        net.set_multiplier(1.0)
        full = {s.path: effective_params(s, model.get_submodule(s.path), container, device,
                                         base[s.path]["bias"] is not None) for s in chosen}
    for params in full.values():
        if not all(torch.isfinite(t).all() for t in params.values() if t is not None):
            raise ValueError(f"the reference's {variant.id} gives non-finite parameters")
    return Truth(path, {s.path: base[s.path] for s in chosen}, full)


def ideal_output(spec: LayerSpec, x: torch.Tensor, params: dict, storage: torch.dtype) -> torch.Tensor:
    """The forward with the true parameters rounded once to how they are stored, computed like the model does."""
    compute = compute_dtype(storage)
    weight_dtype = compute if spec.kind in NORMS else storage
    device = x.device
    rounded = {"weight": params["weight"].to(weight_dtype).to(device=device, dtype=compute),
               "bias": None if params["bias"] is None else params["bias"].to(compute).to(device)}
    with torch.no_grad():
        return functional(spec, x.to(compute), rounded)


def true_output(spec: LayerSpec, x: torch.Tensor, params: dict) -> torch.Tensor:
    with exact_float32(), torch.no_grad():
        device = x.device
        return functional(spec, x.double(), {k: None if v is None else v.to(device) for k, v in params.items()})


def judge(y: torch.Tensor, truth: torch.Tensor, ideal: torch.Tensor, base: torch.Tensor) -> dict:
    """Errors relative to the layer's output: ours, the ideal's, and the change the file makes."""
    norm = float(truth.norm()) or 1.0
    ours = float((y.double() - truth).norm()) / norm
    best = float((ideal.double() - truth).norm()) / norm
    change = float((truth - base).norm()) / norm
    finite = bool(torch.isfinite(y).all())
    # Conclusive: the change is larger than the allowed error, so a lost patch could not pass (on fp8 weights a
    # small change can sit inside one rounding: merging it into fp8 keeps little of it, whoever does it).
    return {"error": ours, "ideal_error": best, "change": change,
            "ratio": ours / best if best else (0.0 if ours == 0 else math.inf),
            "ok": finite and ours <= TOLERANCE * best + 1e-12, "conclusive": change > TOLERANCE * best}
