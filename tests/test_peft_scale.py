"""PEFT/diffusers adapter files: scale from their config, PEFT's DoRA magnitude layout, PEFT's LoHa/LoKr.

Every file is written by PEFT/diffusers' own helpers from small torch layers (a Linear, square 1×1 and 3×3 convs and a
non-square 3×3 conv) adapted with random weights: diffusers' `save_lora_weights` (config in the safetensors metadata
field `lora_adapter_metadata`, or without it) and PEFT's `save_pretrained` (config in a sibling adapter_config.json).
The truth is PEFT's own `merge()` of each layer (W_merged − W); the file is applied through lycoris_core alone
(`load` + `Module.plan_for` + `apply`) and must match to 1e-4 of the change in fp32.
"""

import copy
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from comfy_env import REPO_ROOT
from safetensors.torch import save_file
from torch import nn

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended, not prepended: ComfyUI's own `nodes` must keep winning

import peft
import test_nodes
from diffusers.loaders import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from peft import LoHaConfig, LoKrConfig, LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from test_coverage import panel, run

import lycoris_core
from lycoris_core import peft_config
from lycoris_core.bypass import Contribution, LayerOp, layer_output

# test_nodes' fixtures: the tiny SD1.5 (model, clip) and an empty loras folder that ComfyUI lists
sd15 = test_nodes.sd15
loras = test_nodes.loras

LAYERS = ("lin", "c1", "c3", "c3n")
TOLERANCE = 1e-4


class Net(nn.Module):
    """A Linear, square 1×1 and 3×3 convs (in == out, where a per-input and a per-output vector look alike) and a
    non-square 3×3 conv."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 10)
        self.c1 = nn.Conv2d(8, 8, 1)
        self.c3 = nn.Conv2d(8, 8, 3)
        self.c3n = nn.Conv2d(6, 10, 3)

    def forward(self, x):
        return x


def adapted(config, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(the Net with the adapter injected (random factors), each layer's W before merging)."""
    torch.manual_seed(seed)
    net = Net()
    base = {name: getattr(net, name).weight.detach().clone() for name in LAYERS}
    model = peft.inject_adapter_in_model(config, net)
    perturb_magnitudes(model)
    return model, base


def perturb_magnitudes(model: nn.Module) -> None:
    """PEFT starts DoRA's m at ‖W + ΔW‖, where the norm cancels out and any axis would pass."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.5 * torch.rand_like(param))


def merged_changes(model: nn.Module, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's own merge() of every adapted layer: W_merged − W."""
    changes = {}
    for name in LAYERS:
        layer = getattr(model, name)
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
            changes[name] = layer.get_base_layer().weight.detach() - base[name]
    return changes


def applied_changes(path: Path, base: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
    """Every module of the file applied through lycoris_core to its layer's W: the change it makes."""
    lfile = lycoris_core.load(path)
    changes = {}
    for module in lfile.modules.values():
        name = module.prefix.rsplit(".", 1)[-1]
        weight = base[name].clone()
        plan = module.plan_for(tuple(weight.shape), file=lfile.name)
        lycoris_core.apply(plan, module.tensors, weight, 1.0)
        changes[name] = weight - base[name]
    return changes, lfile


def assert_same_changes(got: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(truth)
    for name, change in truth.items():
        error = float((got[name] - change).abs().max() / change.abs().max())
        assert error <= TOLERANCE, f"{name}: error {error:.3g} of the change"


def config_dict(config) -> dict:
    """The config as diffusers stores it (sets as lists)."""
    return {k: list(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def save_diffusers(tmp_path: Path, model: nn.Module, config=None) -> Path:
    """diffusers' own `save_lora_weights`: keys under `unet.`, the config (if given) in `lora_adapter_metadata`."""
    StableDiffusionLoraLoaderMixin.save_lora_weights(
        tmp_path, unet_lora_layers=get_peft_model_state_dict(model),
        unet_lora_adapter_metadata=config_dict(config) if config is not None else None)
    return tmp_path / "pytorch_lora_weights.safetensors"


def save_pretrained(tmp_path: Path, config, seed: int = 0) -> tuple[Path, dict, dict]:
    """PEFT's own `save_pretrained` of a PeftModel: `base_model.model.` keys, config in adapter_config.json."""
    torch.manual_seed(seed)
    net = Net()
    base = {name: getattr(net, name).weight.detach().clone() for name in LAYERS}
    model = peft.get_peft_model(net, copy.deepcopy(config))
    perturb_magnitudes(model)
    model.save_pretrained(tmp_path)
    return tmp_path / "adapter_model.safetensors", base, merged_changes(model.base_model.model, base)


def lora(**options) -> LoraConfig:
    return LoraConfig(target_modules=list(LAYERS), init_lora_weights=False, **options)


# ------------------------------------------------------------------------------------------------- scale

SCALE_CASES = {
    "alpha_not_r": lora(r=4, lora_alpha=11),
    "patterns": lora(r=4, lora_alpha=6, rank_pattern={"c3": 2, "^lin": 3}, alpha_pattern={"c.*n": 13, "c1": 1}),
    "rslora": lora(r=4, lora_alpha=7, use_rslora=True),
}


@pytest.mark.parametrize("case", SCALE_CASES)
def test_lora_scale_from_lora_adapter_metadata(tmp_path, case):
    config = SCALE_CASES[case]
    model, base = adapted(config)
    path = save_diffusers(tmp_path, model, config)
    truth = merged_changes(model, base)
    got, lfile = applied_changes(path, base)
    assert_same_changes(got, truth)
    assert lfile.warnings == []


@pytest.mark.parametrize("case", SCALE_CASES)
def test_lora_scale_from_adapter_config_json(tmp_path, case):
    path, base, truth = save_pretrained(tmp_path, SCALE_CASES[case])
    got, lfile = applied_changes(path, base)
    assert_same_changes(got, truth)
    assert lfile.warnings == []


def test_pattern_rule_is_peft_s():
    """First pattern key in order that matches the whole name or a tail starting after a dot, as PEFT resolves it."""
    config = peft_config.PeftConfig("test", {"unet": {"r": 4, "lora_alpha": 8,
                                                      "rank_pattern": {"to_q": 2, "attn1.to_q": 3, "down.*k": 5},
                                                      "alpha_pattern": {"down_blocks.0.attn1.to_q": 1}}})
    options = peft_config.module_options
    assert options(config, "unet.down_blocks.0.attn1.to_q")["r"] == 2  # "to_q" comes first and matches a tail
    assert options(config, "unet.down_blocks.0.attn1.to_q")["lora_alpha"] == 1
    assert options(config, "unet.up_blocks.0.attn1.to_q")["lora_alpha"] == 8  # "up_" is no dot-separated tail
    assert options(config, "unet.down_blocks.0.attn1.to_k")["r"] == 5
    assert options(config, "unet.down_blocks.0.attn1.to_qx")["r"] == 4  # a pattern must match up to the end
    assert options(config, "unet.down_blocks.0.attn1.xto_q")["r"] == 4  # … and start at a dot
    assert options(config, "text_encoder.layers.0.q_proj") == {}  # no config for that component


@pytest.mark.parametrize("name", ["down_blocks.0.attn1.to_q", "up_blocks.1.attn2.to_k", "mid.conv", "conv",
                                  "a.b.c3n", "c3", "x.to_out.0"])
def test_pattern_rule_agrees_with_peft_s_own(name):
    from peft.utils.other import get_pattern_key
    patterns = {"to_q": 1, "attn2.to_k": 2, r"^mid\.conv": 3, "conv": 4, "c.*n": 5, "to_out.0": 6, "b.c3n": 7}
    assert peft_config.pattern_value(patterns, name, None) == patterns.get(get_pattern_key(patterns, name))


def test_no_config_assumes_alpha_equal_rank_and_warns_once(tmp_path):
    """No alpha in the tensors, no metadata, no adapter_config.json: diffusers' convention (alpha = rank, scale 1)
    with one warning naming the file."""
    config = lora(r=4, lora_alpha=4)  # alpha = r: the assumption is right for this file
    model, base = adapted(config)
    path = save_diffusers(tmp_path, model)
    assert "lora_adapter_metadata" not in lycoris_core.SafetensorsFile(path).metadata
    got, lfile = applied_changes(path, base)
    assert_same_changes(got, merged_changes(model, base))
    assert len(lfile.warnings) == 1
    assert path.name in lfile.warnings[0] and "alpha = rank" in lfile.warnings[0]


def test_alpha_tensor_wins_over_config(tmp_path):
    """A kohya/LyCORIS-style alpha tensor is the module's own: the config's scale does not override it."""
    config = lora(r=4, lora_alpha=11)
    model, _base = adapted(config)
    path = save_diffusers(tmp_path, model, config)
    state = lycoris_core.SafetensorsFile(path)
    tensors = {k: t.clone() for k, t in state.tensors().items()}
    tensors["unet.lin.alpha"] = torch.tensor(2.0)
    save_file(tensors, tmp_path / "with_alpha.safetensors", metadata=dict(state.metadata))
    lfile = lycoris_core.load(tmp_path / "with_alpha.safetensors")
    assert lfile.modules["unet.lin.weight"].layout.scale == pytest.approx(2.0 / 4)
    assert lfile.modules["unet.c1.weight"].layout.scale == pytest.approx(11 / 4)


# -------------------------------------------------------------------------------------------------- DoRA

def test_dora_linear_and_convs_from_metadata(tmp_path):
    """PEFT's magnitude is per output channel: (out,) for Linear, (1, out, 1, 1) for conv — on a square conv that
    shape is also LyCORIS' per-input-channel dora_scale."""
    config = lora(r=3, lora_alpha=5, use_dora=True)
    model, base = adapted(config, seed=1)
    path = save_diffusers(tmp_path, model, config)
    truth = merged_changes(model, base)
    got, _ = applied_changes(path, base)
    assert_same_changes(got, truth)


def test_dora_square_convs_are_not_read_per_input_channel(tmp_path):
    """Square convs alone: PEFT's (1, out, 1, 1) magnitude has the shape of LyCORIS' per-input dora_scale."""
    config = LoraConfig(r=3, lora_alpha=3, use_dora=True, target_modules=["c1", "c3"], init_lora_weights=False)
    model, base = adapted(config, seed=6)
    path = save_diffusers(tmp_path, model, config)
    truth = merged_changes(model, base)
    got, _ = applied_changes(path, base)
    assert_same_changes(got, truth)


OPS = {"lin": LayerOp(), "c1": LayerOp(2, (1, 1), (0, 0), (1, 1)), "c3": LayerOp(2, (1, 1), (0, 0), (1, 1)),
       "c3n": LayerOp(2, (1, 1), (0, 0), (1, 1))}
INPUTS = {"lin": (3, 12), "c1": (2, 8, 6, 6), "c3": (2, 8, 6, 6), "c3n": (2, 6, 6, 6)}


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_dora_in_bypass_equals_peft_s_merged_layer(tmp_path, strength):
    """The forward-time bypass reads the same axis as the merge: y = f(x; W) + m·f(x; W_merged − W)."""
    config = lora(r=3, lora_alpha=5, use_dora=True)
    model, base = adapted(config, seed=8)
    path = save_diffusers(tmp_path, model, config)
    truth = merged_changes(model, base)
    lfile = lycoris_core.load(path)
    torch.manual_seed(9)
    for name, change in truth.items():
        module, op, weight = lfile.modules[f"unet.{name}.weight"], OPS[name], base[name]
        x = torch.randn(INPUTS[name])
        y = layer_output(x, lambda xi, w=weight, o=op: o(xi, w), op,
                [Contribution(module.plan_for(tuple(weight.shape)), module.tensors, strength)], weight)
        want = op(x, strength * change)
        error = float((y - op(x, weight) - want).abs().max() / want.abs().max())
        assert error <= TOLERANCE, f"{name}: error {error:.3g} of the change"


def test_dora_converted_to_kohya_names_keeps_its_magnitude(tmp_path):
    """diffusers' convert_state_dict_to_kohya leaves the magnitude's last dot (`lora_unet.c3.lora_magnitude_vector`
    beside `lora_unet_c3.lora_down.weight`) and writes alpha = rank: the magnitude must still reach its module."""
    from diffusers.utils import convert_state_dict_to_kohya
    config = lora(r=3, lora_alpha=3, use_dora=True)  # the converter writes alpha = rank whatever lora_alpha was
    model, base = adapted(config, seed=12)
    state = {f"unet.{k}": v for k, v in get_peft_model_state_dict(model).items()}
    path = tmp_path / "kohya.safetensors"
    save_file(convert_state_dict_to_kohya(state), path)
    assert "lora_unet.c3.lora_magnitude_vector" in lycoris_core.SafetensorsFile(path).entries
    truth = merged_changes(model, base)
    lfile = lycoris_core.load(path)
    assert lfile.unused == [] and {m.label for m in lfile.modules.values()} == {"LoRA+DoRA", "LoCon+DoRA"}
    for name, change in truth.items():
        module = lfile.modules[f"lora_unet_{name}.weight"]
        weight = base[name].clone()
        lycoris_core.apply(module.plan_for(tuple(weight.shape)), module.tensors, weight, 1.0)
        error = float((weight - base[name] - change).abs().max() / change.abs().max())
        assert error <= TOLERANCE, f"{name}: error {error:.3g} of the change"


def test_dora_from_adapter_config_json(tmp_path):
    path, base, truth = save_pretrained(tmp_path, lora(r=3, lora_alpha=5, use_dora=True), seed=2)
    got, _ = applied_changes(path, base)
    assert_same_changes(got, truth)


# ----------------------------------------------------------------------------------------------- LoHa/LoKr

LYCORIS_CASES = {
    "loha": LoHaConfig(r=3, alpha=5, target_modules=list(LAYERS), init_weights=False),
    "loha_effective_conv": LoHaConfig(r=3, alpha=5, target_modules=list(LAYERS), init_weights=False,
                                      use_effective_conv2d=True),
    "lokr": LoKrConfig(r=1, alpha=5, target_modules=list(LAYERS), init_weights=False),
    "lokr_decompose_both": LoKrConfig(r=1, alpha=5, target_modules=list(LAYERS), init_weights=False,
                                      decompose_both=True),
    "lokr_effective_conv": LoKrConfig(r=2, alpha=5, target_modules=list(LAYERS), init_weights=False,
                                      use_effective_conv2d=True),
    "lokr_full": LoKrConfig(r=64, alpha=5, target_modules=list(LAYERS), init_weights=False),
}


# the factors each case must produce (else PEFT chose another layout than the case is about)
LYCORIS_KEYS = {"loha_effective_conv": "c3n.hada_t1", "lokr": "lin.lokr_w2_a", "lokr_decompose_both": "lin.lokr_w1_a",
                "lokr_effective_conv": "c3n.lokr_t2", "lokr_full": "c3n.lokr_w2"}


@pytest.mark.parametrize("case", LYCORIS_CASES)
def test_peft_loha_lokr_from_metadata(tmp_path, case):
    config = LYCORIS_CASES[case]
    model, base = adapted(config, seed=4)
    path = save_diffusers(tmp_path, model, config)
    assert f"unet.{LYCORIS_KEYS.get(case, 'lin.hada_w1_a')}" in lycoris_core.SafetensorsFile(path).entries
    truth = merged_changes(model, base)
    got, lfile = applied_changes(path, base)
    assert_same_changes(got, truth)
    assert lfile.warnings == []


@pytest.mark.parametrize("case", ["loha_effective_conv", "lokr_decompose_both"])
def test_peft_loha_lokr_from_adapter_config_json(tmp_path, case):
    path, base, truth = save_pretrained(tmp_path, LYCORIS_CASES[case], seed=5)
    got, _ = applied_changes(path, base)
    assert_same_changes(got, truth)


def test_each_component_has_its_own_config(tmp_path):
    """SDXL's saver: one config per component (unet., text_encoder., text_encoder_2.), each read for its own keys."""
    configs = {"unet": lora(r=4, lora_alpha=2), "text_encoder": lora(r=4, lora_alpha=8),
               "text_encoder_2": lora(r=4, lora_alpha=32)}
    models, bases = {}, {}
    for seed, (component, config) in enumerate(configs.items()):
        models[component], bases[component] = adapted(config, seed=10 + seed)
    StableDiffusionXLLoraLoaderMixin.save_lora_weights(
        tmp_path, **{f"{c}_lora_layers": get_peft_model_state_dict(m) for c, m in models.items()},
        **{f"{c}_lora_adapter_metadata": config_dict(configs[c]) for c in configs})
    lfile = lycoris_core.load(tmp_path / "pytorch_lora_weights.safetensors")
    assert lfile.warnings == []
    for component, model in models.items():
        truth = merged_changes(model, bases[component])
        for name, change in truth.items():
            module = lfile.modules[f"{component}.{name}.weight"]
            weight = bases[component][name].clone()
            lycoris_core.apply(module.plan_for(tuple(weight.shape)), module.tensors, weight, 1.0)
            got = weight - bases[component][name]
            assert float((got - change).abs().max() / change.abs().max()) <= TOLERANCE, f"{component}.{name}"


def test_metadata_is_read_as_diffusers_writes_it(tmp_path):
    """The pipeline saver prefixes each option with its component, like the tensor keys."""
    config = lora(r=4, lora_alpha=11)
    model, _ = adapted(config)
    path = save_diffusers(tmp_path, model, config)
    raw = json.loads(lycoris_core.SafetensorsFile(path).metadata["lora_adapter_metadata"])
    assert raw["unet.lora_alpha"] == 11
    found = peft_config.read_config(path, lycoris_core.SafetensorsFile(path).metadata)
    assert peft_config.module_options(found, "unet.lin")["lora_alpha"] == 11


# ------------------------------------------------------------------------------------ through the loader node

def at_path(path: str, layer: nn.Module) -> nn.Module:
    """A module tree holding `layer` at the dotted `path` (diffusers' name of one SD1.5 layer)."""
    root = node = nn.Module()
    *parents, leaf = path.split(".")
    for part in parents:
        child = nn.Module()
        node.add_module(part, child)
        node = child
    node.add_module(leaf, layer)
    return root


def sd15_proj_in_file(folder: Path, weight: torch.Tensor, with_config: bool) -> tuple[str, torch.Tensor]:
    """A DoRA on the tiny SD1.5's first proj_in (a square 1×1 conv) under its diffusers name, saved by diffusers'
    save_lora_weights with or without its config: (file name, PEFT's merged change at strength 1)."""
    name = "down_blocks.0.attentions.0.proj_in"
    conv = nn.Conv2d(weight.shape[1], weight.shape[0], 1)
    with torch.no_grad():
        conv.weight.copy_(weight)
    # alpha = r without a config: the assumption the loader makes and warns about is then the right one
    config = LoraConfig(r=4, lora_alpha=12 if with_config else 4, use_dora=True, target_modules=[name],
                        init_lora_weights=False)
    torch.manual_seed(7)
    model = peft.inject_adapter_in_model(config, at_path(name, conv))
    perturb_magnitudes(model)
    out = folder / ("with_config" if with_config else "without_config")
    path = save_diffusers(out, model, config if with_config else None)
    target = model.get_submodule(name)
    target.merge()
    change = target.get_base_layer().weight.detach() - weight
    file_name = f"peft_dora_{out.name}.safetensors"
    path.rename(folder / file_name)
    return file_name, change


@pytest.mark.parametrize("with_config", [True, False], ids=["metadata", "no_config"])
def test_loader_node_applies_peft_dora_at_its_scale_and_warns_without_config(with_config, sd15, loras, caplog):
    model, _clip = sd15
    key = test_nodes.PROJ_IN_KEY
    weight = model.model.state_dict()[key].detach().float().clone()
    name, change = sd15_proj_in_file(loras, weight, with_config)
    with caplog.at_level(logging.INFO, logger=test_nodes.LOGGER):
        (patched,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0)
    got = test_nodes.weights_after_full_load(patched, [key])[key].float() - weight
    error = float((got - change).abs().max() / change.abs().max())
    assert error <= TOLERANCE
    p = panel(ui)
    assert (p["applied"], p["total"]) == (1, 1)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "alpha = rank" in r.getMessage()]
    if with_config:
        assert p["warnings"] == [] and warned == []
    else:
        (warning,) = p["warnings"]
        assert name in warning and "assumed alpha = rank" in warning
        assert len(warned) == 1 and name in warned[0]


def test_cache_reads_the_sibling_config_and_rereads_it_when_edited(tmp_path):
    """The node's file cache: a save_pretrained file at its adapter_config.json's scale, re-read once that is edited."""
    from lycoris_nodes.nodes.glue import cache
    cache.clear()
    path, _base, _truth = save_pretrained(tmp_path, lora(r=4, lora_alpha=11), seed=13)
    key = "base_model.model.lin.weight"
    assert cache.load_cached(path).modules[key].layout.scale == pytest.approx(11 / 4)
    config_path = tmp_path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 2
    config_path.write_text(json.dumps(config))
    stat = config_path.stat()
    os.utime(config_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock may not tick
    assert cache.load_cached(path).modules[key].layout.scale == pytest.approx(2 / 4)
    cache.clear()
