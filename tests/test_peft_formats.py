"""PEFT's own OFT, BOFT and (IA)³ files, applied as PEFT defines them (issue #10).

The adapters are made by PEFT 0.21 on small modules (Linear, 1×1 and 3×3 Conv2d), perturbed so the change is not
zero, and saved by PEFT's own helpers (`get_peft_model_state_dict` + safetensors with the config in
`lora_adapter_metadata`, and `save_pretrained`). The truth is PEFT's `merge_and_unload()`: W_merged − W per layer.
We apply W + s·(W_merged − W) (linear strength) and ask for fp32 error ≤ 1e-4 of the change, by merge and by the
bypass forward.
"""

import copy
import json
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
from lycoris_nodes.lycoris_core import apply, load, parse_state_dict
from lycoris_nodes.lycoris_core.algos import option_entries
from lycoris_nodes.lycoris_core.bypass import Contribution, LayerOp, layer_output
from lycoris_nodes.lycoris_core.keys import split_key
from lycoris_nodes.lycoris_core.module import detect
from lycoris_nodes.lycoris_core.summary import summarize
from peft.tuners.boft import layer as boft_layer
from safetensors.torch import save_file
from torch import nn

PREFIX = "base_model.model."
STRENGTHS = (1.0, 0.5, -1.0)
TOLERANCE = 1e-4


class Net(nn.Module):
    """One of each layer kind; `square` has as many inputs as outputs (a conv (IA)³ shape that tells no side)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 12)
        self.ff = nn.Linear(32, 12)
        self.pw = nn.Conv2d(16, 6, 1)
        self.conv = nn.Conv2d(8, 6, 3, padding=1)
        self.square = nn.Conv2d(6, 6, 1)


LAYERS = {"lin": LayerOp(), "ff": LayerOp(), "pw": LayerOp(2, (1, 1), (0, 0), (1, 1)),
          "conv": LayerOp(2, (1, 1), (1, 1), (1, 1)), "square": LayerOp(2, (1, 1), (0, 0), (1, 1))}
INPUTS = {"lin": (5, 32), "ff": (5, 32), "pw": (2, 16, 5, 5), "conv": (2, 8, 5, 5), "square": (2, 6, 5, 5)}


class FakeBlockDiagKernel:
    """Stands in for PEFT's CUDA block-diagonal kernel (fbd_cuda), which only lets PEFT keep more than one butterfly
    factor: (N, D, b, b) -> [(N, D·b, D·b)], each factor's blocks on the diagonal, as the kernel computes."""

    @staticmethod
    def forward(blocks):
        return [torch.stack([torch.block_diag(*factor) for factor in blocks])]


def _oft(**options):
    return peft.OFTConfig(r=0, oft_block_size=4, target_modules=["lin", "pw", "conv"], init_weights=False,
                          **options)


def _boft(**options):
    return peft.BOFTConfig(target_modules=["lin", "pw", "conv"], init_weights=False, **options)


def _ia3(**options):
    return peft.IA3Config(target_modules=["lin", "ff", "pw", "conv", "square"], init_ia3_weights=False, **options)


# id -> (config, layers it adapts). Every OFT option that changes the maths, BOFT's factor settings, IA3's sides.
VARIANTS = {
    "oft-neumann-default": (_oft(), ("lin", "pw", "conv")),
    "oft-neumann-3-terms": (_oft(num_cayley_neumann_terms=3), ("lin", "pw", "conv")),
    "oft-exact-cayley": (_oft(use_cayley_neumann=False), ("lin", "pw", "conv")),
    "oft-block-share": (_oft(block_share=True), ("lin", "pw", "conv")),
    "oft-coft": (_oft(coft=True, eps=0.2), ("lin", "pw", "conv")),
    "oft-coft-exact": (_oft(coft=True, eps=0.2, use_cayley_neumann=False), ("lin", "pw", "conv")),
    "boft-1-factor": (_boft(boft_block_size=4), ("lin", "pw", "conv")),
    "boft-2-factors": (_boft(boft_block_size=4, boft_n_butterfly_factor=2), ("lin", "pw", "conv")),
    "boft-3-factors": (_boft(boft_block_size=2, boft_n_butterfly_factor=3), ("lin", "pw", "conv")),
    "ia3-normal": (_ia3(feedforward_modules=[]), ("lin", "ff", "pw", "conv", "square")),
    "ia3-feedforward": (_ia3(feedforward_modules=["ff", "conv", "square"]), ("lin", "ff", "pw", "conv", "square")),
}


def make_adapter(variant_id, dtype=torch.float32):
    """(PeftModel, state dict, {layer: (W, W_merged − W)}) for one variant, seeded. The adapter's tensors are
    rounded to `dtype` (the state dict is in `dtype`); the model and PEFT's merge stay fp32."""
    config, layers = VARIANTS[variant_id]
    torch.manual_seed(sum(map(ord, variant_id)))
    base = Net()
    weights = {name: getattr(base, name).weight.detach().clone() for name in layers}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns that no CUDA kernel was found
        model = peft.get_peft_model(base, copy.deepcopy(config))
        state = {k: v.detach().to(dtype, copy=True) for k, v in peft.get_peft_model_state_dict(model).items()}
        peft.set_peft_model_state_dict(model, {k: v.float() for k, v in state.items()})
        merged = copy.deepcopy(model).merge_and_unload()
    truth = {name: (weights[name], getattr(merged, name).weight.detach() - weights[name]) for name in layers}
    return model, state, truth


@pytest.fixture(autouse=True)
def fake_butterfly_kernel(monkeypatch):
    monkeypatch.setattr(boft_layer, "_FBD_CUDA", FakeBlockDiagKernel())


def _config_json(config):
    return json.dumps(config.to_dict(), default=sorted)


def save_metadata_file(variant_id, directory):
    """get_peft_model_state_dict saved with the config in `lora_adapter_metadata`, as diffusers does."""
    model, state, truth = make_adapter(variant_id)
    path = directory / f"{variant_id}.safetensors"
    save_file(state, str(path), metadata={"lora_adapter_metadata": _config_json(model.peft_config["default"])})
    return path, state, truth


def _with_options(state, variant_id):
    """The state dict grouped and given each module's PEFT options as option_entries makes them (what the loader
    adds from the file's config)."""
    options = json.loads(_config_json(VARIANTS[variant_id][0]))
    out = dict(state)
    groups = {}
    for key, tensor in state.items():
        prefix, suffix = split_key(key)
        groups.setdefault(prefix, {})[suffix] = tensor
    for prefix, group in groups.items():
        for algorithm in detect(group):  # (IA)3: the weight and the bias part read the same options
            for suffix, tensor in option_entries(algorithm, options, prefix.removeprefix(PREFIX)).items():
                out[f"{prefix}.{suffix}"] = tensor
    return out


def _relative_error(got, want):
    return float((got - want).norm() / want.norm())


def _check_merge(lfile, truth, strength):
    for name, (weight, change) in truth.items():
        module = lfile.modules[f"{PREFIX}{name}.weight"]
        plan = module.plan_for(tuple(weight.shape))
        patched = apply(plan, module.tensors, weight.clone(), strength)
        error = _relative_error(patched - weight, strength * change)
        assert error <= TOLERANCE, f"{name} at strength {strength}: {error:.2e} of the change"


@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("variant_id", sorted(VARIANTS))
def test_merge_equals_peft_merge(variant_id, strength):
    _, state, truth = make_adapter(variant_id)
    lfile = parse_state_dict(_with_options(state, variant_id), variant_id)
    assert not lfile.unused
    _check_merge(lfile, truth, strength)


@pytest.mark.parametrize("variant_id", ["oft-neumann-default", "oft-block-share", "boft-1-factor", "boft-2-factors",
                                        "ia3-normal"])
@pytest.mark.parametrize("strength", STRENGTHS)
def test_file_with_default_options_applies(tmp_path, variant_id, strength):
    """Files whose options are PEFT's defaults (or told by the shapes) need nothing from the config."""
    path, _, truth = save_metadata_file(variant_id, tmp_path)
    lfile = load(path)
    assert not lfile.unused
    _check_merge(lfile, {k: v for k, v in truth.items() if k != "square"}, strength)


@pytest.mark.parametrize("variant_id", ["oft-neumann-default", "boft-2-factors", "ia3-feedforward"])
def test_save_pretrained_file_applies(tmp_path, variant_id):
    model, _, truth = make_adapter(variant_id)
    model.save_pretrained(str(tmp_path))
    lfile = load(tmp_path / "adapter_model.safetensors")
    assert not lfile.unused
    # square conv: its side is only in the config (the loader's part); the Linear and the other convs tell by shape
    _check_merge(lfile, {k: v for k, v in truth.items() if k != "square"}, 1.0)


@pytest.mark.parametrize("variant_id", sorted(VARIANTS))
def test_file_options_reach_the_algorithm(tmp_path, variant_id):
    """Every option in the saved config is applied when the file is loaded: the loader hands each module its
    options (peft_config + option_entries). Square convs included: their (IA)³ side is only in the config."""
    path, _, truth = save_metadata_file(variant_id, tmp_path)
    _check_merge(load(path), truth, 1.0)


@pytest.mark.parametrize("strength", STRENGTHS)
@pytest.mark.parametrize("variant_id", ["oft-neumann-default", "oft-exact-cayley", "oft-block-share", "oft-coft",
                                        "boft-2-factors", "boft-3-factors", "ia3-normal", "ia3-feedforward"])
def test_bypass_equals_merge(variant_id, strength):
    _, state, truth = make_adapter(variant_id)
    lfile = parse_state_dict(_with_options(state, variant_id), variant_id)
    torch.manual_seed(1)
    for name, (weight, change) in truth.items():
        module = lfile.modules[f"{PREFIX}{name}.weight"]
        plan = module.plan_for(tuple(weight.shape))
        op, x = LAYERS[name], torch.randn(INPUTS[name])
        y = layer_output(x, lambda xi, w=weight, o=op: o(xi, w), op, [Contribution(plan, module.tensors, strength)], weight)
        want = op(x, strength * change)
        error = _relative_error(y - op(x, weight), want)
        assert error <= TOLERANCE, f"{name} at strength {strength}: {error:.2e} of the change"


def test_peft_algorithms_are_told_apart_from_lycoris():
    for variant_id, labels in [("oft-neumann-default", {"OFT (PEFT)"}), ("boft-1-factor", {"BOFT (PEFT)"}),
                               ("ia3-normal", {"(IA)³ (PEFT)", "(IA)³ (PEFT, bias)"})]:
        _, state, _ = make_adapter(variant_id)
        assert {m.label for m in parse_state_dict(state, variant_id).modules.values()} == labels


def test_square_conv_ia3_without_config_assumes_output_side():
    """A conv's ia3_l (1, n, 1, 1) does not say which side; with in = out and no config, PEFT's default (not
    feed-forward) is taken and listed as assumed; with the config's feedforward_modules, the input side."""
    _, state, truth = make_adapter("ia3-feedforward")
    weight, _ = truth["square"]
    bare = parse_state_dict(state, "bare").modules[f"{PREFIX}square.weight"].plan_for(tuple(weight.shape))
    assert bare.layout.axis == 0 and bare.layout.assumed == ("is_feedforward=False",)
    told = parse_state_dict(_with_options(state, "ia3-feedforward"), "told")
    plan = told.modules[f"{PREFIX}square.weight"].plan_for(tuple(weight.shape))
    assert plan.layout.axis == 1 and plan.layout.assumed == ()
    # the non-square conv needs no config: only its input count fits
    conv_weight, _ = truth["conv"]
    conv = parse_state_dict(state, "bare").modules[f"{PREFIX}conv.weight"].plan_for(tuple(conv_weight.shape))
    assert conv.layout.axis == 1


def test_square_conv_ia3_side_assumed_at_apply_time_is_said():
    """The square conv's side is only decided against the model's weight, so the loader's report (logged, and shown
    in the panel) says it, once per file; the Linear and the non-square conv, whose shapes tell, are not named, and
    with the config nothing is said."""
    from patcher_util import lycoris_patches

    _, state, truth = make_adapter("ia3-feedforward")
    net = _comfy_net({name: weight for name, (weight, _) in truth.items()})
    key_map = {f"{PREFIX}{name}": f"{name}.weight" for name in truth}
    _, report = lycoris_patches(state, net, key_map, name="bare.safetensors")
    (warning,) = report.warnings
    assert warning.startswith("bare.safetensors: 1 (IA)³ (PEFT) modules (e.g. 'base_model.model.square')")
    assert "is_feedforward=False" in warning and "feedforward_modules" in warning
    _, told = lycoris_patches(_with_options(state, "ia3-feedforward"), net, key_map)
    assert told.warnings == [] and len(told.applied) == len(report.applied)


def test_oft_options_missing_from_the_file_are_listed():
    _, state, _ = make_adapter("oft-neumann-default")
    module = parse_state_dict(state, "bare").modules[f"{PREFIX}lin.weight"]
    assert set(module.layout.assumed) == {"use_cayley_neumann=True", "num_cayley_neumann_terms=5", "coft=False",
                                          "eps=6e-05", "series_before_0_18=False"}
    told = parse_state_dict(_with_options(state, "oft-neumann-default"), "told").modules[f"{PREFIX}lin.weight"]
    assert told.layout.assumed == ()


@pytest.mark.parametrize("variant_id", ["oft-coft", "oft-exact-cayley"])
def test_oft_file_without_its_config_says_which_options_it_assumed(tmp_path, variant_id):
    """Saved without its config (as diffusers' save_lora_weights without metadata writes it), a trainer's COFT or
    exact Cayley is not in the file: PEFT's defaults are applied, which is not PEFT's merge of this adapter, so the
    file says which options it assumed: one warning in the loaded file (the loader logs it, the report and the panel
    show it) and in the Info summary. With the config beside it, no warning."""
    _, state, truth = make_adapter(variant_id)
    (tmp_path / "bare").mkdir()
    path = tmp_path / "bare" / f"{variant_id}.safetensors"
    save_file(state, str(path))
    lfile = load(path)
    weight, change = truth["lin"]
    plan = lfile.modules[f"{PREFIX}lin.weight"].plan_for(tuple(weight.shape))
    assert _relative_error(apply(plan, lfile.modules[f"{PREFIX}lin.weight"].tensors, weight.clone(), 1.0) - weight,
                           change) > 100 * TOLERANCE  # the defaults are not what the trainer used
    (warning,) = lfile.warnings
    assert "3 OFT (PEFT) modules" in warning and "use_cayley_neumann=True" in warning and "coft=False" in warning
    assert summarize(path).warnings == lfile.warnings
    with_config, _, _ = save_metadata_file(variant_id, tmp_path)
    assert load(with_config).warnings == [] and summarize(with_config).warnings == []


def test_shapes_that_do_not_fit_are_refused_at_plan_time():
    from lycoris_nodes.lycoris_core import LycorisError

    _, state, _ = make_adapter("oft-neumann-default")
    lfile = parse_state_dict(state, "oft")
    with pytest.raises(LycorisError, match="OFT rotates"):
        lfile.modules[f"{PREFIX}lin.weight"].plan_for((12, 30))
    _, state, _ = make_adapter("boft-1-factor")
    with pytest.raises(LycorisError):
        parse_state_dict(state, "boft").modules[f"{PREFIX}lin.weight"].plan_for((12, 30))


def test_conv_bypass_reference_is_the_real_conv():
    """The bypass truth op(x, W + ΔW) is F.conv2d itself (guards the LayerOp geometry used above)."""
    weight = torch.randn(6, 8, 3, 3)
    x = torch.randn(2, 8, 5, 5)
    assert torch.allclose(LAYERS["conv"](x, weight), F.conv2d(x, weight, padding=1))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("variant_id", ["oft-neumann-default", "boft-2-factors", "ia3-normal"])
def test_half_precision_files(tmp_path, variant_id, dtype):
    """A file stored in fp16/bf16 is computed in fp32 from its values as stored, as PEFT merges them upcast."""
    _, state, truth = make_adapter(variant_id, dtype)
    path = tmp_path / "half.safetensors"
    save_file(state, str(path))
    _check_merge(load(path), {k: v for k, v in truth.items() if k != "square"}, 0.5)


def test_ia3_normal_layer_bias_is_scaled_like_peft_merge():
    """PEFT's (IA)³ merge also scales a normal layer's bias (b' = l·b): a bias module of its own, from the same
    ia3_l, at the same linear strength."""
    model, state, _ = make_adapter("ia3-normal")
    bias = model.base_model.model.lin.base_layer.bias.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged_bias = copy.deepcopy(model).merge_and_unload().lin.bias.detach()
    assert not torch.equal(merged_bias, bias)
    module = parse_state_dict(state, "ia3").modules[f"{PREFIX}lin.bias"]
    for strength in STRENGTHS:
        patched = apply(module.plan_for(tuple(bias.shape)), module.tensors, bias.clone(), strength)
        assert _relative_error(patched - bias, strength * (merged_bias - bias)) <= TOLERANCE


def test_ia3_bias_part_only_where_peft_merge_changes_the_bias():
    """A feed-forward layer's bias is left as it is (PEFT scales its inputs): no bias module, whether the side is
    told by the shape (Linear) or the config (conv); a conv without config whose ia3_l fits the bias scales it (PEFT's
    default side), one that fits only the inputs is resolved to no change."""
    _, state, _ = make_adapter("ia3-feedforward")
    told = parse_state_dict(_with_options(state, "ia3-feedforward"), "told").modules
    assert {key for key in told if key.endswith(".bias")} == {f"{PREFIX}lin.bias", f"{PREFIX}pw.bias"}
    bare = parse_state_dict(state, "bare").modules
    assert f"{PREFIX}ff.bias" not in bare  # a Linear's (1, in) says feed-forward
    square = bare[f"{PREFIX}square.bias"].plan_for((6,))  # (1, 6, 1, 1) on 6 -> 6: PEFT's default, the output side
    assert square.layout.scales
    conv = bare[f"{PREFIX}conv.bias"].plan_for((6,))  # (1, 8, 1, 1) on 8 -> 6: the inputs, so the bias stays
    bias = torch.randn(6)
    assert not conv.layout.scales and torch.equal(apply(conv, bare[f"{PREFIX}conv.bias"].tensors, bias.clone(), 1.0),
                                                  bias)


def _comfy_net(weights):
    """Net's adapted layers as the comfy.ops layers ComfyUI holds an fp32 model in, holding `weights`."""
    import comfy.ops

    ops, template, net = comfy.ops.disable_weight_init, Net(), nn.Module()
    for name, weight in weights.items():
        layer = getattr(template, name)
        if isinstance(layer, nn.Linear):
            made = ops.Linear(layer.in_features, layer.out_features, bias=False)
        else:
            made = ops.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, padding=layer.padding,
                              bias=False)
        made.weight = nn.Parameter(weight.clone(), requires_grad=False)
        net.add_module(name, made)
    return net


@pytest.mark.parametrize("strength", (1.0, -1.0))
@pytest.mark.parametrize("variant_id", ["oft-coft", "boft-2-factors", "ia3-feedforward"])
def test_comfy_patcher_full_and_offloaded_load(variant_id, strength):
    """Through ComfyUI's own ModelPatcher: merged at a full load, and as LowVramPatch at an offloaded forward."""
    from patcher_util import forward_params, full_load, lowvram_patched, lycoris_patches, offload, patcher

    _, state, truth = make_adapter(variant_id)
    net = _comfy_net({name: weight for name, (weight, _) in truth.items()})
    key_map = {f"{PREFIX}{name}": f"{name}.weight" for name in truth}
    patches, report = lycoris_patches(_with_options(state, variant_id), net, key_map)
    assert not report.problems and len(report.applied) == len(truth)
    mp = patcher(net)
    mp.add_patches(patches, strength)
    full_load(mp)
    for name, (weight, change) in truth.items():
        error = _relative_error(getattr(net, name).weight - weight, strength * change)
        assert error <= TOLERANCE, f"full load, {name}: {error:.2e} of the change"
    mp.unpatch_model(torch.device("cpu"))
    offload(mp)
    for name, (weight, change) in truth.items():
        layer = getattr(net, name)
        assert lowvram_patched(layer)
        seen, _ = forward_params(layer, torch.randn(INPUTS[name]))
        error = _relative_error(seen - weight, strength * change)
        assert error <= TOLERANCE, f"offloaded, {name}: {error:.2e} of the change"
    mp.unpatch_model(torch.device("cpu"))


def _cayley_batch_peft_0_17(self, Q, block_size, use_cayley_neumann=True, num_neumann_terms=5):
    """PEFT 0.16/0.17's OFTRotationModule._cayley_batch (read from peft's git history, v0.17.1): the truncated
    series I + 2Q + 2Q² + … + 2Q^(n−1); PEFT 0.18 changed it (and began storing peft_version in the config)."""
    q_skew = self._pytorch_skew_symmetric(Q, block_size)
    if not use_cayley_neumann:
        eye = torch.eye(block_size, dtype=Q.dtype).expand_as(q_skew)
        return torch.linalg.solve(eye + q_skew, eye - q_skew, left=False)
    rotation = torch.eye(block_size, dtype=Q.dtype).repeat(Q.shape[0], 1, 1)
    power = torch.eye(block_size, dtype=Q.dtype).repeat(Q.shape[0], 1, 1)
    for _ in range(1, num_neumann_terms):
        power = torch.bmm(power, q_skew)
        rotation = rotation + 2 * power
    return rotation


@pytest.mark.parametrize("variant_id", ["oft-neumann-default", "oft-neumann-3-terms", "oft-block-share"])
def test_oft_file_from_peft_before_0_18_is_merged_with_its_own_series(tmp_path, variant_id, monkeypatch):
    """PEFT 0.16/0.17 wrote the same oft_R layout, with a config that has no peft_version, and evaluated the
    Cayley–Neumann series differently. Such a file is applied with its own series: truth is PEFT's merge with its
    series swapped for 0.17's; the same file with the config's peft_version (0.18+) keeps today's."""
    model, state, today = make_adapter(variant_id)
    config = json.loads(_config_json(model.peft_config["default"]))
    del config["peft_version"]
    monkeypatch.setattr(peft.tuners.oft.layer.OFTRotationModule, "_cayley_batch", _cayley_batch_peft_0_17)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = copy.deepcopy(model).merge_and_unload()
    old = {name: (weight, getattr(merged, name).weight.detach() - weight) for name, (weight, _) in today.items()}
    assert max(_relative_error(old[n][1], today[n][1]) for n in today) > 1e-3  # the two series differ here
    path = tmp_path / "oft-0.17.safetensors"
    save_file(state, str(path), metadata={"lora_adapter_metadata": json.dumps(config)})
    lfile = load(path)
    assert lfile.modules[f"{PREFIX}lin.weight"].layout.series_before_0_18
    _check_merge(lfile, old, 1.0)
    _check_merge(lfile, old, 0.5)


@pytest.mark.parametrize("with_scale", [False, True])
def test_oft_file_from_peft_before_0_16_is_refused_with_the_reason(tmp_path, with_scale):
    """PEFT ≤ 0.13 saved OFT as `oft_r` (r, b, b), 0.14/0.15 added `oft_s` (out, 1) (their OFTLayer in peft's git
    history; those PEFTs are not installable next to 0.21, so the keys are written here in their layout). PEFT
    itself no longer loads them: the file is refused with that reason, naming the file and the key."""
    from lycoris_nodes.lycoris_core import LycorisError

    state = {f"{PREFIX}lin.oft_r": torch.randn(4, 8, 8)}
    if with_scale:
        state[f"{PREFIX}lin.oft_s"] = torch.ones(12, 1)
    path = tmp_path / "oft-0.15.safetensors"
    save_file(state, str(path))
    with pytest.raises(LycorisError, match="before PEFT 0.16") as raised:
        load(path)
    assert raised.value.key == f"{PREFIX}lin.oft_r" and raised.value.file is not None
