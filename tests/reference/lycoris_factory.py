"""Real LyCORIS files made by the reference (lycoris-lora 4.1.3), and ground truth from its own forward pass.

One tiny seeded base model holds one layer of every kind we patch (`LAYERS`). Each `Variant` (one row of `VARIANTS`)
says how to call the reference (`create_lycoris`, or `lycoris.kohya.create_network` for rs_lora) and which layers it
targets. `generate(variant, directory)` then:

1. creates the network on the base model, with the variant's layers picked by an anchored `name_algo_map` preset
   (the preset is class-global in LyCORIS, so it is reset after every network);
2. sets every adapter parameter to seeded random values (LyCORIS starts up/b/w factors at zero, so ΔW would be 0),
   all exactly representable in float32, so the float32-saved file holds exactly what the reference computes with;
3. saves the file with `save_weights(path, save_dtype, {})`;
4. for every base dtype, rounds the base model's weights to that dtype, rebuilds the same network on the rounded model
   with the same adapter values (or, for `truth="loader"` variants, reads the saved file back with the reference's
   own loader, create_lycoris_from_weights), and records the layer outputs y_ref(m) = layer(x) after
   `set_multiplier(m)` (the reference's forward pass, never merge_to/get_merged_weight, which scale LoHa/LoKr twice;
   spec §4.1), plus y_base = the untouched rounded layer's output.

The reference computes in float64 (float32 for Diag-OFT/BOFT, whose Cayley transform cannot run in float64), so the
only error left in a patched low-precision weight is our own final rounding.

Pairs the reference cannot make are listed in each variant's `skips` with the reason; `reference_fails()` lets a
test prove the reason still holds.
"""

import os

os.environ["LYCORIS_KERNEL_BACKEND"] = "torch"  # the eager reference bodies (spec §3, §6), before lycoris is imported

import contextlib
import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from lycoris import LycorisNetwork, create_lycoris, create_lycoris_from_weights, kohya
from lycoris.logging import logger as lycoris_logger
from safetensors.torch import load_file
from torch import nn

lycoris_logger.setLevel(logging.ERROR)

SEED = 20240518
STRENGTHS = (1.0, 0.5, 0.0, -1.0)
# Base dtypes the ground truth is computed for (weights rounded to each, then held in float64 / float32).
BASE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
PREFIXES = ("lycoris_", "lora_unet_")  # create_lycoris and lycoris.kohya (unet) name prefixes


# --------------------------------------------------------------------------------------------------- the base model

@dataclass(frozen=True)
class Layer:
    name: str  # attribute name in the base model; no dots, so the file prefix is "<PREFIX><name>"
    kind: str  # "linear", "conv" or "norm"
    make: Callable[[], nn.Module]
    probe: tuple[int, ...]  # probe input shape: enough rows/patches that y determines the whole weight


LAYERS: tuple[Layer, ...] = (
    Layer("linear_b", "linear", lambda: nn.Linear(64, 96), (72, 64)),
    Layer("linear_nb", "linear", lambda: nn.Linear(96, 64, bias=False), (104, 96)),
    Layer("conv1d", "conv", lambda: nn.Conv1d(16, 32, 3), (4, 16, 16)),
    Layer("conv2d", "conv", lambda: nn.Conv2d(16, 32, 3, padding=1), (2, 16, 9, 9)),
    Layer("conv2d_1x1", "conv", lambda: nn.Conv2d(32, 16, 1), (2, 32, 5, 5)),
    Layer("conv2d_grouped", "conv", lambda: nn.Conv2d(16, 32, 3, groups=4), (2, 16, 8, 8)),
    Layer("conv3d", "conv", lambda: nn.Conv3d(8, 16, 3), (2, 8, 7, 7, 7)),
    Layer("layernorm", "norm", lambda: nn.LayerNorm(64), (8, 64)),
    Layer("groupnorm", "norm", lambda: nn.GroupNorm(4, 32), (2, 32, 3, 3)),
)
LAYER = {layer.name: layer for layer in LAYERS}
LINEAR_CONV = tuple(layer.name for layer in LAYERS if layer.kind != "norm")
# Convs with k > 1, where tucker layouts exist; on Linear/1×1 the reference ignores use_tucker (same file as plain),
# so tucker variants target only these (not a skip: nothing is missing).
KERNEL_CONV = ("conv1d", "conv2d", "conv2d_grouped", "conv3d")
NORMS = tuple(layer.name for layer in LAYERS if layer.kind == "norm")


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        for layer in LAYERS:
            self.add_module(layer.name, layer.make())


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t's values rounded to `dtype` (round to nearest even), returned in float64."""
    return t.detach().to(torch.float32).to(dtype).to(torch.float64)


def base_model(dtype: torch.dtype = torch.float32, container: torch.dtype = torch.float64) -> TinyModel:
    """The seeded base model with every parameter rounded to `dtype`, held in `container` (exact: float32 ⊃ all)."""
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = TinyModel()
        for name in NORMS:  # make γ/β non-trivial (default init is 1/0)
            norm = getattr(model, name)
            norm.weight.data = 1 + 0.2 * torch.randn_like(norm.weight)
            norm.bias.data = 0.2 * torch.randn_like(norm.bias)
    with torch.no_grad():
        for p in model.parameters():
            p.data = round_to(p.data, dtype).to(container)
    return model.requires_grad_(False)


def base_params(dtype: torch.dtype) -> dict[str, dict[str, torch.Tensor | None]]:
    """{layer: {"weight": W, "bias": b or None}} rounded to `dtype`, as float64."""
    model = base_model(dtype)
    return {layer.name: {name: None if p is None else p.detach().clone()
                         for name, p in (("weight", getattr(model, layer.name).weight),
                                         ("bias", getattr(model, layer.name).bias))}
            for layer in LAYERS}


@functools.cache
def _probe(layer: str) -> torch.Tensor:
    """The seeded probe input of a layer (float32-representable values, float64)."""
    gen = torch.Generator().manual_seed(SEED + 1 + [entry.name for entry in LAYERS].index(layer))
    return torch.randn(LAYER[layer].probe, generator=gen).double()


def probe(layer: str) -> torch.Tensor:
    """The seeded probe input of a layer (float32-representable values, float64); a fresh copy."""
    return _probe(layer).clone()


def layer_of(prefix: str) -> str | None:
    """The name of the base-model layer a file module prefix belongs to, or None."""
    for start in PREFIXES:
        if prefix.startswith(start) and prefix[len(start):] in LAYER:
            return prefix[len(start):]
    return None


def layer_for(prefix: str) -> tuple[Layer, torch.Tensor] | None:
    """The layer a file module prefix belongs to and its probe input, or None."""
    name = layer_of(prefix)
    return None if name is None else (LAYER[name], probe(name))


@functools.cache
def _template(layer: str) -> nn.Module:
    """A throwaway instance of the layer, for its hyper-parameters (stride, groups, eps…)."""
    return LAYER[layer].make()


def functional_forward(layer: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The layer's forward pass with the given parameters (used with float64 everything)."""
    module = _template(layer)
    if isinstance(module, nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        op = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[weight.ndim - 2]
        return op(x, weight, bias, module.stride, module.padding, module.dilation, module.groups)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)
    return F.group_norm(x, module.num_groups, weight, bias, module.eps)


def magnitude_forward(layer: str, x: torch.Tensor, weight_error: torch.Tensor,
                      bias_error: torch.Tensor | None) -> torch.Tensor:
    """An elementwise upper bound of |layer(x; E_w, E_b)| for parameter perturbations |E| ≤ the given tensors.

    Linear/conv: op(|x|, E_w, E_b) (triangle inequality over each output's sum). Norms: |x̂|·E_w + E_b, x̂ being the
    normalised input (the perturbation does not change the normalisation).
    """
    module = _template(layer)
    if LAYER[layer].kind != "norm":
        return functional_forward(layer, x.abs(), weight_error, bias_error)
    if isinstance(module, nn.LayerNorm):
        normed = F.layer_norm(x, module.normalized_shape, None, None, module.eps).abs()
        shape = weight_error.shape
    else:
        normed = F.group_norm(x, module.num_groups, None, None, module.eps).abs()
        shape = (1, -1) + (1,) * (x.ndim - 2)
    out = normed * weight_error.reshape(shape)
    return out if bias_error is None else out + bias_error.reshape(shape)


# ------------------------------------------------------------------------------------------------------ variants

def _dylora_as_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """LyCORIS-DyLoRA saves a conv lora_up 2-D (out, r); the reference loader needs (out, r, 1…) (spec §4.2)."""
    fixed = dict(state)
    for key, up in state.items():
        if key.endswith(".lora_up.weight"):
            down = state[key.replace("lora_up", "lora_down")]
            fixed[key] = up.reshape(*up.shape, *([1] * (down.ndim - 2)))
    return fixed


@dataclass(frozen=True)
class Variant:
    id: str
    algo: str
    layers: tuple[str, ...]  # layers the network is made for
    kwargs: dict = field(default_factory=dict)  # create_lycoris (or kohya.create_network) keyword arguments
    layer_kwargs: dict = field(default_factory=dict)  # layer -> module kwargs (via the preset's name_algo_map)
    skips: dict = field(default_factory=dict)  # layer -> why the reference cannot make this pair
    markers: tuple[str, ...] = ()  # key suffixes that identify the algorithm (to prove a skip)
    expect: tuple[str, ...] = ()  # key suffixes the file must contain: proves the intended layout was made
    absent: tuple[str, ...] = ()  # key suffixes the file must not contain
    reference_semantics: bool = False  # DoRA/OFT/BOFT: LyCORIS' own multiplier differs from linear strength
    fp32_only: bool = False  # Diag-OFT/BOFT: the reference cannot run in float64 (spec §2.6 d)
    save_dtype: torch.dtype = torch.float32
    via: str = "wrapper"  # "wrapper": lycoris.create_lycoris; "kohya": lycoris.kohya.create_network
    # "forward": the created network itself; "loader": create_lycoris_from_weights on the saved file (the
    # reference's own reading of the stored, possibly rounded, values), after `loader_fixup`
    truth: str = "forward"
    loader_fixup: Callable[[dict], dict] | None = None

    @property
    def container(self) -> torch.dtype:
        return torch.float32 if self.fp32_only else torch.float64


LORA = ("lora_up.weight",)
LOHA = ("hada_w1_a",)
LOKR = ("lokr_w1", "lokr_w1_a")
LOCON_DIMS = {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}
LOKR_DIMS = {"linear_dim": 2, "linear_alpha": 1.5, "conv_dim": 2, "conv_alpha": 1.0}
OFT_DIMS = {"linear_dim": 4, "conv_dim": 4}
BOFT_DIMS = {"linear_dim": 8, "conv_dim": 8}  # 96 = 6·16 (power-of-two block count) needs a factor ≥ 6
# C = c·out against ‖Q‖ ≈ 0.07·√(out·b) for oft_blocks ~ 0.05·randn: the clamp is active on the first three
# layers and inactive on the rest (test_reference_files_are_sound checks both occur).
CONSTRAINTS = {"linear_b": 0.004, "linear_nb": 0.004, "conv1d": 0.01, "conv2d": 1.0, "conv2d_1x1": 1.0,
               "conv2d_grouped": 1.0, "conv3d": 1.0}


def _grouped(what: str) -> str:
    return (f"4.1.3 sizes {what} with in_channels (16), the grouped conv weight has in_channels/groups (4): "
            "its forward raises")


VARIANTS: tuple[Variant, ...] = (
    # LoRA / LoCon
    Variant("locon", "lora", LINEAR_CONV, LOCON_DIMS, markers=LORA,
            expect=("lora_up.weight", "lora_down.weight", "alpha"), absent=("lora_mid.weight",)),
    Variant("locon_tucker", "lora", KERNEL_CONV, dict(LOCON_DIMS, use_tucker=True), markers=LORA,
            expect=("lora_mid.weight",)),
    Variant("locon_scalar", "lora", LINEAR_CONV, dict(LOCON_DIMS, use_scalar=True), markers=LORA),
    Variant("locon_rs_lora", "lora", LINEAR_CONV,
            {"linear_dim": 4, "linear_alpha": 1.0, "conv_dim": 4, "conv_alpha": 0.5, "rs_lora": True}, via="kohya",
            markers=LORA, expect=("lora_up.weight",)),
    Variant("locon_dora_out", "lora", LINEAR_CONV, dict(LOCON_DIMS, dora_wd=True, wd_on_output=True),
            markers=LORA, expect=("dora_scale",), reference_semantics=True),
    Variant("locon_dora_in", "lora", LINEAR_CONV, dict(LOCON_DIMS, dora_wd=True, wd_on_output=False),
            markers=LORA, expect=("dora_scale",), reference_semantics=True),
    # alpha = 0.3 is not representable: the file stores 0.2998046875 (fp16) / 0.30078125 (bf16) and that is the alpha
    Variant("locon_fp16_file", "lora", LINEAR_CONV, dict(LOCON_DIMS, linear_alpha=0.3, conv_alpha=0.3),
            markers=LORA, save_dtype=torch.float16, truth="loader"),
    Variant("locon_bf16_file", "lora", LINEAR_CONV, dict(LOCON_DIMS, linear_alpha=0.3, conv_alpha=0.3),
            markers=LORA, save_dtype=torch.bfloat16, truth="loader"),
    # LoHa
    Variant("loha", "loha", LINEAR_CONV, LOCON_DIMS, markers=LOHA,
            expect=("hada_w1_a", "hada_w2_b"), absent=("hada_t1",)),
    Variant("loha_tucker", "loha", KERNEL_CONV, dict(LOCON_DIMS, use_tucker=True), markers=LOHA,
            expect=("hada_t1", "hada_t2")),
    Variant("loha_dora_out", "loha", LINEAR_CONV, dict(LOCON_DIMS, dora_wd=True, wd_on_output=True),
            markers=LOHA, expect=("dora_scale",), reference_semantics=True),
    Variant("loha_dora_in", "loha", LINEAR_CONV, dict(LOCON_DIMS, dora_wd=True, wd_on_output=False),
            markers=LOHA, expect=("dora_scale",), reference_semantics=True),
    # LoKr (shapes: out = a·b, in = c·d from factorization(); the layouts each variant must produce are in `expect`)
    Variant("lokr", "lokr", LINEAR_CONV, LOKR_DIMS, markers=LOKR,
            expect=("lokr_w1", "lokr_w2_a", "lokr_w2_b", "lokr_w2"), absent=("lokr_w1_a", "lokr_t2")),
    Variant("lokr_decompose_both", "lokr", LINEAR_CONV, dict(LOKR_DIMS, decompose_both=True), markers=LOKR,
            expect=("lokr_w1_a", "lokr_w1_b", "lokr_w2_a")),
    Variant("lokr_full_matrix", "lokr", LINEAR_CONV, dict(LOCON_DIMS, full_matrix=True), markers=LOKR,
            expect=("lokr_w1", "lokr_w2"), absent=("lokr_w1_a", "lokr_w2_a")),  # both full: alpha forced to dim
    Variant("lokr_tucker", "lokr", KERNEL_CONV, dict(LOKR_DIMS, conv_dim=1, use_tucker=True), markers=LOKR,
            expect=("lokr_t2",)),
    Variant("lokr_dora_out", "lokr", LINEAR_CONV, dict(LOKR_DIMS, dora_wd=True, wd_on_output=True),
            markers=LOKR, expect=("dora_scale",), reference_semantics=True),
    Variant("lokr_dora_in", "lokr", LINEAR_CONV, dict(LOKR_DIMS, dora_wd=True, wd_on_output=False),
            markers=LOKR, expect=("dora_scale",), reference_semantics=True),
    Variant("lokr_factor4", "lokr", LINEAR_CONV, dict(LOKR_DIMS, factor=4), markers=LOKR,
            expect=("lokr_w1", "lokr_w2_a"), absent=("lokr_w1_a",)),
    Variant("lokr_factor16_both", "lokr", LINEAR_CONV,
            dict(LOKR_DIMS, linear_dim=1, conv_dim=1, factor=16, decompose_both=True), markers=LOKR,
            expect=("lokr_w1_a", "lokr_w1")),
    Variant("lokr_unbalanced", "lokr", LINEAR_CONV, dict(LOKR_DIMS, unbalanced_factorization=True), markers=LOKR),
    # GLoRA
    Variant("glora", "glora", tuple(n for n in LINEAR_CONV if n != "conv2d_grouped"), LOCON_DIMS,
            skips={"conv2d_grouped": _grouped("GLoRA's a1/a2/b2")}, markers=("a1.weight",),
            expect=("a1.weight", "a2.weight", "b1.weight", "b2.weight")),
    # Diag-OFT (alpha = constraint; the reference computes in float32)
    Variant("oft", "diag-oft", LINEAR_CONV, OFT_DIMS, markers=("oft_blocks",),
            expect=("oft_blocks",), absent=("rescale",), reference_semantics=True, fp32_only=True),
    Variant("oft_constraint", "diag-oft", LINEAR_CONV, OFT_DIMS,
            layer_kwargs={name: {"constraint": c} for name, c in CONSTRAINTS.items()}, markers=("oft_blocks",),
            expect=("alpha",), reference_semantics=True, fp32_only=True),
    Variant("oft_rescaled", "diag-oft", LINEAR_CONV, dict(OFT_DIMS, rescaled=True), markers=("oft_blocks",),
            expect=("rescale",), reference_semantics=True, fp32_only=True),
    # BOFT
    Variant("boft", "boft", LINEAR_CONV, BOFT_DIMS, markers=("oft_blocks",),
            expect=("oft_blocks",), reference_semantics=True, fp32_only=True),
    Variant("boft_constraint", "boft", LINEAR_CONV, BOFT_DIMS,
            layer_kwargs={name: {"constraint": c} for name, c in CONSTRAINTS.items()}, markers=("oft_blocks",),
            reference_semantics=True, fp32_only=True),
    Variant("boft_rescaled", "boft", LINEAR_CONV, dict(BOFT_DIMS, rescaled=True), markers=("oft_blocks",),
            expect=("rescale",), reference_semantics=True, fp32_only=True),
    # (IA)³: on_input is chosen per module by IA3Module(train_on_input=…); create_lycoris does not forward it,
    # the preset's name_algo_map does
    Variant("ia3", "ia3", LINEAR_CONV, {}, markers=("on_input",),
            expect=("weight", "on_input")),
    Variant("ia3_on_input", "ia3", tuple(n for n in LINEAR_CONV if n != "conv2d_grouped"), {},
            layer_kwargs={name: {"train_on_input": True} for name in LINEAR_CONV},
            skips={"conv2d_grouped": _grouped("the on_input (IA)3 scale")}, markers=("on_input",),
            expect=("on_input",)),
    # Full (diff, diff_b where the layer has a bias) and Norm (train_norm)
    Variant("full", "full", LINEAR_CONV, {}, markers=("diff",),
            expect=("diff", "diff_b")),
    Variant("norm", "lora", NORMS, {"train_norm": True},
            skips={name: "w_norm/b_norm are made only for *Norm layers (train_norm); this layer gets LoCon"
                   for name in LINEAR_CONV}, markers=("w_norm",), expect=("w_norm", "b_norm")),
    # DyLoRA: plain LoRA keys (its training forward picks a random rank, so the truth is the reference loader's
    # LoCon reading of the file, spec §2.11)
    Variant("dylora", "dylora", LINEAR_CONV, {"linear_dim": 8, "linear_alpha": 4.0, "conv_dim": 8,
                                              "conv_alpha": 2.0, "block_size": 4},
            markers=LORA, expect=("lora_up.weight",), truth="loader",
            loader_fixup=_dylora_as_lora),
)
# Every variant for linear/conv layers also records the norm layers as skipped (the reference has no such module).
VARIANTS = tuple(
    variant if set(variant.layers) & set(NORMS) else dataclasses.replace(variant, skips={
        **{name: f"4.1.3 makes no '{variant.algo}' module for LayerNorm/GroupNorm (only train_norm's w_norm/b_norm)"
           for name in NORMS},
        **variant.skips})
    for variant in VARIANTS)
BY_ID = {variant.id: variant for variant in VARIANTS}
assert len(BY_ID) == len(VARIANTS), "duplicate variant id"


# ------------------------------------------------------------------------------------------- making the networks

_PRESET_ATTRS = {
    LycorisNetwork: ("ENABLE_CONV", "TARGET_REPLACE_MODULE", "TARGET_REPLACE_NAME", "MODULE_ALGO_MAP",
                     "NAME_ALGO_MAP", "LORA_PREFIX", "USE_FNMATCH", "TARGET_EXCLUDE_NAME"),
    kohya.LycorisNetworkKohya: ("ENABLE_CONV", "UNET_TARGET_REPLACE_MODULE", "UNET_TARGET_REPLACE_NAME",
                                "TEXT_ENCODER_TARGET_REPLACE_MODULE", "TEXT_ENCODER_TARGET_REPLACE_NAME",
                                "MODULE_ALGO_MAP", "NAME_ALGO_MAP", "USE_FNMATCH", "TARGET_EXCLUDE_NAME"),
}
_PRESET_DEFAULTS = {cls: {name: copy.deepcopy(getattr(cls, name)) for name in names}
                    for cls, names in _PRESET_ATTRS.items()}


def plain_copy(layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """A plain torch Linear/Conv2d shaped like ComfyUI's `layer`, holding `weight`/`bias` in `dtype`: what the
    reference network wraps to make a file for that layer."""
    if isinstance(layer, nn.Linear):
        out = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, dtype=dtype)
    else:
        out = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                        padding=layer.padding, bias=bias is not None, dtype=dtype)
    out.weight.data = weight.to(dtype).clone()
    if bias is not None:
        out.bias.data = bias.to(dtype).clone()
    return out.requires_grad_(False)


def attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at dotted `path` under `root`, creating empty parents: the module names the saved file gets."""
    node = root
    for part in path.split(".")[:-1]:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(path.split(".")[-1], module)


@contextlib.contextmanager
def _class_presets_restored():
    """LyCORIS presets are class attributes that outlive the network: put the defaults back afterwards."""
    try:
        yield
    finally:
        for cls, values in _PRESET_DEFAULTS.items():
            for name, value in values.items():
                setattr(cls, name, copy.deepcopy(value))


def _anchored(name: str) -> str:
    return f"{name}$"  # re.match anchors the start; `$` keeps "conv2d" from also matching "conv2d_1x1"


def _create(variant: Variant, model: nn.Module, layers: tuple[str, ...], work_dir: Path):
    """The variant's network on `model` for `layers` (not yet applied, except kohya's: see _apply)."""
    with _class_presets_restored():
        if variant.via == "kohya":
            assert not variant.layer_kwargs, "per-layer kwargs are only wired for the generic wrapper"
            preset = work_dir / f"{variant.id}.preset.toml"
            names = ", ".join(f'"{_anchored(n)}"' for n in layers)
            preset.write_text(f"unet_target_module = []\nunet_target_name = [{names}]\n"
                              "text_encoder_target_module = []\ntext_encoder_target_name = []\n")
            kwargs = dict(variant.kwargs)
            net = kohya.create_network(1.0, kwargs.pop("linear_dim"), kwargs.pop("linear_alpha"), None, None, model,
                                       warn_on_unmatched=False, algo=variant.algo, preset=str(preset), **kwargs)
            net.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
        else:
            LycorisNetwork.apply_preset({
                "target_module": [], "target_name": [],
                "name_algo_map": {_anchored(n): dict(variant.layer_kwargs.get(n, {})) for n in layers},
            })
            net = create_lycoris(model, 1.0, warn_on_unmatched=False, algo=variant.algo, **variant.kwargs)
    for lora in net.loras:  # modules are built in the default dtype; compute in the base model's
        lora.to(variant.container)
    return net


def _apply(net) -> None:
    if isinstance(net, kohya.LycorisNetworkKohya):
        return  # applied in _create (its apply_to needs the models)
    net.apply_to()


def _randomise(net, gen: torch.Generator) -> None:
    """Seeded values for every adapter parameter, exactly representable in float32.

    Factor matrices get N(0, 1/fan) ("unit gain"), so a product of them is about as large as a row of W; one factor
    per algorithm (`_HALF_GAIN`) gets half that. LoHa's two products are multiplied elementwise, so each is made
    about √|W| large. The rest are chosen so that ΔW is clearly visible while the OFT Cayley transform stays well
    conditioned; test_reference_files_are_sound checks the resulting change of every layer's output.
    """
    for lora in net.loras:
        kind = type(lora).__name__
        fan_w = math.prod(lora.shape[1:]) if len(lora.shape) > 1 else 1  # in·∏k of the target weight
        for name, p in lora.named_parameters():
            shape, fan = p.shape, max(1, math.prod(p.shape[1:]))

            def randn(std: float, mean: float = 0.0, shape=shape) -> torch.Tensor:
                return mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)

            if name == "oft_blocks":
                value = randn(0.05)
            elif name == "rescale":
                value = randn(0.1, 1.0)
            elif name == "dora_scale":
                value = p.detach().float().cpu() * randn(0.1, 1.0)  # the CPU generator's values, any device
            elif name == "scalar":
                value = torch.full(shape, 0.5)  # a power of two: the folded lora_up·scalar stays exact
            elif kind == "IA3Module":
                value = randn(0.3)
            elif kind == "FullModule":  # the difference itself (before apply_to adds the original)
                value = randn(0.05)
            elif kind == "NormModule":
                value = randn(0.2)
            elif kind == "LohaModule":
                root_w = 0.7 * fan_w ** -0.25  # each of the two products ≈ √|W|, |W| ≈ 1/√(3·fan)
                tucker = hasattr(lora, "hada_t1") and lora.tucker
                if name.startswith("hada_t"):
                    value = randn(root_w)
                elif tucker or name.endswith("_a"):
                    value = randn(1 / math.sqrt(lora.lora_dim))
                else:
                    value = randn(root_w)
            else:
                gain = 0.5 if name in _HALF_GAIN or name.startswith("up_list") else 1.0
                value = randn(gain / math.sqrt(fan))
            with torch.no_grad():
                p.copy_(value.to(p.dtype))


_HALF_GAIN = ("lora_up.weight", "lokr_w1", "lokr_w1_a", "a2.weight", "b2.weight")


def _snapshot(net) -> list[tuple[str, dict[str, torch.Tensor]]]:
    return [(lora.lora_name, {name: t.detach().clone()
                              for name, t in [*lora.named_parameters(), *lora.named_buffers()]})
            for lora in net.loras]


def _load_snapshot(net, snapshot) -> None:
    assert [lora.lora_name for lora in net.loras] == [name for name, _ in snapshot]
    for lora, (_, values) in zip(net.loras, snapshot):
        own = dict([*lora.named_parameters(), *lora.named_buffers()])
        assert set(own) == set(values), (lora.lora_name, set(own) ^ set(values))
        with torch.no_grad():
            for name, value in values.items():
                own[name].copy_(value)


# --------------------------------------------------------------------------------------------- generated files

@dataclass
class GeneratedFile:
    variant: Variant
    path: Path
    # {base dtype: {layer: y_base}}, {(base dtype, m): {layer: y_ref(m)}}; all float64
    y_base: dict[torch.dtype, dict[str, torch.Tensor]] = field(repr=False)
    y_ref: dict[tuple[torch.dtype, float], dict[str, torch.Tensor]] = field(repr=False)
    clamp_active: dict[str, bool]  # OFT/BOFT layers with a constraint: does the reference clamp ‖Q‖?

    def truth(self, base_dtype: torch.dtype, strength: float, reference: bool) -> dict[str, torch.Tensor]:
        """Per layer: y_ref(m) (reference semantics) or y_base + m·(y_ref(1) − y_base) (linear; y is affine in W)."""
        if reference:
            return self.y_ref[(base_dtype, strength)]
        base, full = self.y_base[base_dtype], self.y_ref[(base_dtype, 1.0)]
        return {layer: base[layer] + strength * (full[layer] - base[layer]) for layer in base}

    def change_ratio(self) -> dict[str, float]:
        """‖y_ref(1) − y_base‖ / ‖y_base‖ per layer, for the float32 base."""
        base, full = self.y_base[torch.float32], self.y_ref[(torch.float32, 1.0)]
        return {layer: float((full[layer] - base[layer]).norm() / base[layer].norm()) for layer in base}


def _truth_network(variant: Variant, model: nn.Module, snapshot, path: Path, work_dir: Path):
    if variant.truth == "loader":
        state = load_file(str(path))
        if variant.loader_fixup is not None:
            state = variant.loader_fixup(state)
        with _class_presets_restored():
            net, _ = create_lycoris_from_weights(1.0, str(path), model, weights_sd=state)
        for lora in net.loras:
            lora.to(variant.container)
        net.apply_to()
        return net
    net = _create(variant, model, variant.layers, work_dir)
    _load_snapshot(net, snapshot)
    _apply(net)
    return net


def _clamp_active(net) -> dict[str, bool]:
    out = {}
    for lora in net.loras:
        if getattr(lora, "constraint", 0) and hasattr(lora, "oft_blocks"):
            q = lora.oft_blocks - lora.oft_blocks.transpose(-1, -2)
            out[layer_of(lora.lora_name)] = bool(torch.norm(q) + 1e-8 > lora.constraint)
    return out


def _seeded_network(variant: Variant, directory: Path):
    """The variant's network on the float32 base with its seeded adapter values, not yet applied (kohya's is)."""
    gen = torch.Generator().manual_seed(SEED + sum(map(ord, variant.id)))
    net = _create(variant, base_model(torch.float32, variant.container), variant.layers, directory)
    _randomise(net, gen)
    return net


@torch.no_grad()
def generate(variant: Variant, directory: Path) -> GeneratedFile:
    directory = Path(directory)
    net = _seeded_network(variant, directory)
    snapshot = _snapshot(net)
    _apply(net)
    path = directory / f"{variant.id}.safetensors"
    net.save_weights(str(path), variant.save_dtype, {})
    clamp = _clamp_active(net)

    y_base, y_ref = {}, {}
    for dtype in BASE_DTYPES:
        plain = base_model(dtype, torch.float64)
        y_base[dtype] = {name: getattr(plain, name)(probe(name)) for name in variant.layers}
        model = base_model(dtype, variant.container)
        truth_net = _truth_network(variant, model, snapshot, path, directory)
        for m in STRENGTHS if variant.reference_semantics else (1.0,):  # linear truth needs y_ref(1) only
            truth_net.set_multiplier(m)
            y_ref[(dtype, m)] = {name: getattr(model, name)(probe(name).to(variant.container)).double()
                                 for name in variant.layers}
    return GeneratedFile(variant, path, y_base, y_ref, clamp)


@torch.no_grad()
def effective_parameters(layer: str, forward: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, b) of an affine Linear/conv `forward` shaped like `layer`, read off the forward alone: b = f(0), and the
    column of input (channel c, kernel tap t) = f(e_{c,t}) − b. A conv is fed windows the size of its kernel and read
    at the output position whose window is exactly that input (index = padding; stride and dilation are 1 here); an
    output channel of group g sees only its group's input channels, so the rest must read 0."""
    module = _template(layer)
    if isinstance(module, nn.Linear):
        bias = forward(torch.zeros(1, module.in_features, dtype=dtype))[0]
        return (forward(torch.eye(module.in_features, dtype=dtype)) - bias).T, bias
    assert set(module.stride) == {1} and set(module.dilation) == {1}, layer
    kernel, groups = module.kernel_size, module.groups
    columns = module.in_channels * math.prod(kernel)
    at = (slice(None), slice(None), *module.padding)
    bias = forward(torch.zeros(1, module.in_channels, *kernel, dtype=dtype))[at][0]
    basis = torch.eye(columns, dtype=dtype).reshape(columns, module.in_channels, *kernel)
    full = (forward(basis)[at] - bias).T.reshape(module.out_channels, module.in_channels, *kernel)
    per_out, per_in = module.out_channels // groups, module.in_channels // groups
    blocks = [full[g * per_out:(g + 1) * per_out, g * per_in:(g + 1) * per_in] for g in range(groups)]
    outside = full.clone()
    for g in range(groups):
        outside[g * per_out:(g + 1) * per_out, g * per_in:(g + 1) * per_in] = 0
    assert not outside.any(), f"{layer}: the forward mixes groups"
    return torch.cat(blocks), bias


def truth_network(generated: GeneratedFile, model: nn.Module, directory: Path):
    """The reference network of a generated file built and applied on `model` (whatever its weights), as `generate`
    builds its truth: the seeded adapter values, or the reference's loader reading the file."""
    snapshot = _snapshot(_seeded_network(generated.variant, Path(directory)))
    return _truth_network(generated.variant, model, snapshot, generated.path, Path(directory))


@torch.no_grad()
def chain_truth(first: GeneratedFile, second: GeneratedFile, layers: list[str], strength: float,
                directory: Path) -> dict[str, torch.Tensor]:
    """Per layer, the output of `first` at multiplier 1 followed by `second` at `strength` (linear strength), from
    the reference's forward passes only: (W_A, b_A) read off network A's forward (`effective_parameters`), network B
    built on a float32 base whose layers hold them, and y = y_A + strength·(y_AB − y_A), y_A the output with
    (W_A, b_A) and y_AB network B's forward at multiplier 1."""
    model_a = base_model(torch.float32, first.variant.container)
    truth_network(first, model_a, directory).set_multiplier(1.0)
    container = second.variant.container
    model_b = base_model(torch.float32, container)
    for name in layers:
        weight, bias = effective_parameters(name, getattr(model_a, name), first.variant.container)
        target = getattr(model_b, name)
        target.weight.data = weight.to(container)
        if target.bias is None:
            assert not bias.any(), f"{first.variant.id} gave {name} a bias"
        else:
            target.bias.data = bias.to(container)
    y_a = {name: getattr(model_b, name)(probe(name).to(container)).double() for name in layers}
    truth_network(second, model_b, directory).set_multiplier(1.0)
    y_ab = {name: getattr(model_b, name)(probe(name).to(container)).double() for name in layers}
    return {name: y_a[name] + strength * (y_ab[name] - y_a[name]) for name in layers}


def reference_fails(variant: Variant, layer: str, directory: Path) -> str | None:
    """How the reference fails to make `variant` for `layer` alone, or None when it succeeds.

    Failing means: creating or running it raises, or its state dict has no key of the variant's algorithm for this
    layer (e.g. no module at all).
    """
    model = base_model(torch.float32, variant.container)
    try:
        net = _create(variant, model, (layer,), Path(directory))
        _randomise(net, torch.Generator().manual_seed(SEED))
        _apply(net)
        getattr(model, layer)(probe(layer).to(variant.container))
        keys = list(net.state_dict())
    except Exception as e:  # noqa: BLE001 - any failure of the reference is what is being shown
        return f"{type(e).__name__}: {e}"
    if not any(key.endswith("." + marker) for key in keys for marker in variant.markers):
        return f"no {'/'.join(variant.markers)} key among {keys}"
    return None


class Lazy(dict):
    """Made on first use, once per session, so a `-k` selection only generates what it needs."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, key):
        self[key] = value = self._make(key)
        return value

    def __repr__(self):  # pytest prints fixture values in tracebacks; the tensors would take seconds
        return f"<{len(self)} made: {', '.join(map(str, self))}>"
