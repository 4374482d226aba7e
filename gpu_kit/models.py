"""The models the checks patch: sets of real-size layers of SDXL's UNet and Flux's transformer (tiny in a dry run),
and ComfyUI's whole SDXL UNet and Flux transformer with random weights for the speed section.

A layer set is a `torch.nn.Module` whose `diffusion_model` holds ComfyUI layers (`comfy.ops`, picked by
`pick_operations` for the storage and compute dtypes, as ComfyUI picks them) under their real key names, with the
real model's `model_config`: ComfyUI's own key maps, and so the pack's loader path, treat it as that model.
"""

import math
from dataclasses import dataclass

import comfy.ops
import comfy.supported_models
import torch
from reference.lycoris_factory import attach

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class LayerSpec:
    path: str  # under diffusion_model
    kind: str  # the reference factory's layer name this layer stands for (linear_b, linear_nb, conv2d, ...)
    args: tuple  # in/out features, or (in, out, kernel), or (groups, channels) / (channels,)

    @property
    def key(self) -> str:
        return f"diffusion_model.{self.path}.weight"


def _sdxl(s) -> tuple[LayerSpec, ...]:
    t = "middle_block.1.transformer_blocks.0"
    return (
        LayerSpec(f"{t}.attn1.to_q", "linear_nb", (s(1280), s(1280))),
        LayerSpec(f"{t}.attn2.to_k", "linear_nb", (s(2048), s(1280))),
        LayerSpec(f"{t}.attn1.to_out.0", "linear_b", (s(1280), s(1280))),
        LayerSpec(f"{t}.ff.net.0.proj", "linear_b", (s(1280), s(10240))),
        LayerSpec(f"{t}.ff.net.2", "linear_b", (s(5120), s(1280))),
        LayerSpec("input_blocks.4.0.in_layers.2", "conv2d", (s(320), s(640), 3)),
        LayerSpec("input_blocks.4.0.skip_connection", "conv2d_1x1", (s(320), s(640), 1)),
        LayerSpec("middle_block.1.norm", "groupnorm", (32 if s(32) == 32 else 16, s(1280))),
        LayerSpec(f"{t}.norm1", "layernorm", (s(1280),)),
    )


def _flux(s) -> tuple[LayerSpec, ...]:
    return (
        LayerSpec("img_in", "linear_b", (64, s(3072))),
        LayerSpec("double_blocks.0.img_attn.qkv", "linear_b", (s(3072), s(9216))),
        LayerSpec("double_blocks.0.img_attn.proj", "linear_b", (s(3072), s(3072))),
        LayerSpec("double_blocks.0.img_mlp.2", "linear_b", (s(12288), s(3072))),
        LayerSpec("single_blocks.0.linear2", "linear_b", (s(15360), s(3072))),
    )


def sdxl_config() -> dict:
    return {**comfy.supported_models.SDXL.unet_config, "use_checkpoint": False, "image_size": 32, "in_channels": 4,
            "out_channels": 4, "use_spatial_transformer": True, "legacy": False, "num_classes": "sequential",
            "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4], "transformer_depth_middle": 10,
            "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "num_head_channels": 64,
            "use_temporal_resblock": False}


def flux_config(tiny: bool = False) -> dict:
    """Flux.1-dev's transformer; tiny: one double and one single block of width 128."""
    width = 128 if tiny else 3072
    return {"image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
            "context_in_dim": 4096 if not tiny else 64, "hidden_size": width, "mlp_ratio": 4.0,
            "num_heads": width // 128, "depth": 1 if tiny else 19, "depth_single_blocks": 1 if tiny else 38,
            "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True}


SETS = {"sdxl": (_sdxl, lambda tiny: comfy.supported_models.SDXL(sdxl_config())),
        "flux": (_flux, lambda tiny: comfy.supported_models.Flux(flux_config(tiny)))}


def layer_specs(name: str, tiny: bool) -> tuple[LayerSpec, ...]:
    """Real sizes, or every width divided by 16 in a dry run: the same code paths (and the same widths BOFT can
    factor), a CPU's work."""
    make, _ = SETS[name]
    return make((lambda n: n // 16) if tiny else (lambda n: n))


def compute_dtype(storage: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if storage == FP8 else storage


def master_weights(specs, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """float32 weights per layer path (CPU, seeded): the one source every storage dtype is rounded from."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in specs:
        if spec.kind in ("groupnorm", "layernorm"):
            channels = spec.args[-1]
            out[spec.path] = {"weight": 1 + 0.1 * torch.randn(channels, generator=gen),
                              "bias": 0.1 * torch.randn(channels, generator=gen)}
            continue
        if spec.kind.startswith("conv"):
            inp, outp, k = spec.args
            shape = (outp, inp, k, k)
        else:
            inp, outp = spec.args
            shape = (outp, inp)
        weight = torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
        bias = None if spec.kind == "linear_nb" else 0.1 * torch.randn(outp, generator=gen)
        out[spec.path] = {"weight": weight, "bias": bias}
    return out


def stored(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Parameter | None:
    return None if tensor is None else torch.nn.Parameter(tensor.to(dtype), requires_grad=False)


def layer_set(name: str, specs, master: dict, storage: torch.dtype, load_device: torch.device) -> torch.nn.Module:
    """The set's layers as ComfyUI builds them for weights stored in `storage` (norms and biases in the compute
    dtype, as fp8 checkpoints keep them), on the CPU (the offload device), with the real model's model_config."""
    compute = compute_dtype(storage)
    ops = comfy.ops.pick_operations(storage, compute, load_device=load_device)
    norm_ops = comfy.ops.pick_operations(compute, compute, load_device=load_device)
    root = torch.nn.Module()
    root.add_module("diffusion_model", torch.nn.Module())
    for spec in specs:
        params = master[spec.path]
        if spec.kind == "groupnorm":
            layer = norm_ops.GroupNorm(*spec.args, dtype=compute)
        elif spec.kind == "layernorm":
            layer = norm_ops.LayerNorm(spec.args[0], dtype=compute)
        elif spec.kind.startswith("conv"):
            inp, outp, k = spec.args
            layer = ops.Conv2d(inp, outp, k, padding=k // 2, dtype=storage)
        else:
            inp, outp = spec.args
            layer = ops.Linear(inp, outp, bias=params["bias"] is not None, dtype=storage)
        weight_dtype = compute if spec.kind.endswith("norm") else storage
        layer.weight = stored(params["weight"], weight_dtype)
        layer.bias = stored(params["bias"], compute)
        attach(root.diffusion_model, spec.path, layer)
    _, config = SETS[name]
    root.model_config = config(tiny=False)
    return root.requires_grad_(False)


def probe_input(spec: LayerSpec, tokens: int, dtype: torch.dtype, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if spec.kind.startswith("conv"):
        side = max(4, int(math.sqrt(tokens)))
        x = torch.randn(1, spec.args[0], side, side, generator=gen)
    elif spec.kind == "groupnorm":
        x = torch.randn(2, spec.args[1], 4, 4, generator=gen)
    elif spec.kind == "layernorm":
        x = torch.randn(tokens, spec.args[0], generator=gen)
    else:
        x = torch.randn(tokens, spec.args[0], generator=gen)
    return x.to(device=device, dtype=dtype)
