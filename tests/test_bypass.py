"""Bypass mode against the reference, layer by layer, through a REAL ComfyUI `ModelPatcher` and its injections.

Files and truth come from `reference.lycoris_factory` (lycoris-lora 4.1.3 files; truth = its forward pass on the
same rounded base weights). The factory's tiny model is rebuilt from `comfy.ops` layers holding the base weights in
each dtype (fp32, bf16, and fp8 as ComfyUI's scaled-fp8 Linear / plain fp8 conv), patched with
`patched_clone(..., apply_mode="bypass")` and loaded with `patch_model` (which injects).

Checked for every variant, dtype and strength:
* every Linear/Conv weight target is bypassed, and every weight stays bit-identical while bypass is active;
* each layer's real forward on the fp32 probe equals the reference within fp32 error: ‖y − truth‖ ≤ 1e-4·‖change‖
  plus float32 noise. Bypass keeps the stored weight exact and adds the change in fp32, so even on bf16/fp8 storage it
  is as exact as fp32 (a merge would round W' to the storage dtype). Only merged biases (Full's diff_b) add their
  own rounding, bounded separately;
* fp32: bypass equals a fp32 merge of the same patches;
* ejecting (detach) gives every layer its own forward back, outputs bit-identical to the unpatched layer.
And: ComfyUI's own quantized layer (mixed_precision_ops, QuantizedTensor fp8) bypassed equals merging into a float
copy; bf16 activations (as on a GPU) stay within the error a bf16 merge has; auto picks bypass only off plain floats.
"""

import os

import comfy.ops
import pytest
import torch
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.apply import patched_clone
from patcher_util import (
    FACTORY_KEY_MAP,
    assert_bit_identical,
    factory_model,
    forward_params,
    full_load,
    lycoris_patches,
    offload,
    patcher,
    quantized_linear,
    snapshot,
    stored,
    variant_dtype_params,
)
from reference.lycoris_factory import LAYER, VARIANTS, chain_truth, functional_forward, probe

# Bypass never rounds the stored weight, so one 16-bit and one fp8 storage dtype cover the cast paths (fp16 and e5m2
# differ from bf16 and e4m3 only in the values the stored weight can hold, which the truth already reflects).
BASE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
STRENGTHS = (1.0, 0.5, -1.0)
REFERENCE_STRENGTHS = (0.5, 0.0)
CHANGE_TOLERANCE = 1e-4  # ‖error‖ / ‖truth − y_base‖, as for fp32 merges in test_comfy_patching.py
NOISE = 1e-6  # float32 forward noise, relative to ‖y_base‖
SUBSET = ("locon", "locon_tucker", "loha_tucker", "lokr_tucker", "locon_dora_out", "loha_dora_in", "glora",
          "ia3_on_input", "oft_rescaled", "boft_constraint", "full", "norm")
TABLE = list(SUBSET) if os.environ.get("LYCORIS_TABLE") == "subset" else [v.id for v in VARIANTS]


def weight_layers(variant) -> list[str]:
    return [name for name in variant.layers if LAYER[name].kind != "norm"]


def bias_rounding(layer, x: torch.Tensor, patched_bias: bool) -> float:
    """The largest output error a merged bias can add: half an ulp of the bias in its storage dtype."""
    if not patched_bias or layer.bias is None or layer.bias.dtype == torch.float32:
        return 0.0
    _, bias = forward_params(layer, x)
    return float(bias.abs().max()) * torch.finfo(layer.bias.dtype).eps


def assert_close_to_truth(y: torch.Tensor, truth: torch.Tensor, y_base: torch.Tensor, slack: float, what: str):
    error = float((y - truth).norm())
    allowed = CHANGE_TOLERANCE * float((truth - y_base).norm()) + NOISE * float(y_base.norm()) + slack * y.numel() ** .5
    assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g}"


@pytest.mark.parametrize("variant_id,dtype", variant_dtype_params(TABLE, BASE_DTYPES))
def test_bypass_matches_reference(reference_files, bases, variant_id, dtype):
    generated = reference_files[variant_id]
    variant = generated.variant
    lfile = load(generated.path)
    net = factory_model(bases[dtype], dtype)
    saved = snapshot(net)
    base = patcher(net)
    own = {name: getattr(net, name)(probe(name).float()) for name in weight_layers(variant)}
    for semantics in ("linear", "reference") if variant.reference_semantics else ("linear",):
        reference = semantics == "reference"
        patches, report = lycoris_patches(lfile, net, FACTORY_KEY_MAP, reference=reference)
        assert not report.problems, report.details()
        weight_targets = {k for k in patches if k.endswith(".weight") and LAYER[k.split(".")[0]].kind != "norm"}
        # a bias change is bypassed where merging would round it: into an fp8 bias (of a Linear/Conv)
        fp8_biases = {k for k in patches if k.endswith(".bias") and LAYER[k.split(".")[0]].kind != "norm"
                      and getattr(net, k.split(".")[0]).bias.dtype.itemsize == 1}
        for strength in REFERENCE_STRENGTHS if reference else STRENGTHS:
            what = f"{semantics} m={strength:+g}"
            merged = merged_outputs(base, patches, strength, weight_layers(variant)) if dtype == torch.float32 else {}
            clone, bypassed = patched_clone(base, patches, strength, apply_mode="bypass", key="test")
            assert bypassed == len(weight_targets) + len(fp8_biases), what
            full_load(clone)
            for name in weight_layers(variant):
                layer = getattr(net, name)
                assert torch.equal(stored(layer.weight).view(torch.uint8), saved[f"{name}.weight"].view(torch.uint8)), name
                x = probe(name).float()
                y = layer(x).double()
                slack = bias_rounding(layer, x, f"{name}.bias" in patches and f"{name}.bias" not in fp8_biases)
                truth = generated.truth(dtype, strength, reference)[name]
                assert_close_to_truth(y, truth, generated.y_base[dtype][name], slack, f"{what} {name}")
                if name in merged:
                    assert_close_to_truth(y, merged[name], generated.y_base[dtype][name], 0.0, f"{what} {name} vs merge")
            clone.detach()
            for name, y_own in own.items():
                layer = getattr(net, name)
                assert "forward" not in vars(layer) and "_lycoris_bypass" not in vars(layer), name
                assert torch.equal(layer(probe(name).float()), y_own), f"{name} not restored"
            assert_bit_identical(net, saved)


def merged_outputs(base, patches, strength, names) -> dict[str, torch.Tensor]:
    """Each layer's output on its probe, in float64, with the parameters a fp32 merge of the same patches gives."""
    clone, bypassed = patched_clone(base, patches, strength, apply_mode="merge")
    assert bypassed == 0
    full_load(clone)
    outputs = {}
    for name in names:
        x = probe(name).float()
        weight, bias = (None if t is None else t.double() for t in forward_params(getattr(base.model, name), x))
        outputs[name] = functional_forward(name, x.double(), weight, bias)
    clone.unpatch_model(base.offload_device)
    return outputs


def test_offloaded_bypass_matches_reference(reference_files, bases):
    """Weights kept offloaded (LowVramPatch path for merged biases) and bypassed weights: same truth."""
    generated = reference_files["full"]  # weight diffs bypassed, diff_b merged through LowVramPatch
    net = factory_model(bases[torch.float32], torch.float32)
    patches, _ = lycoris_patches(load(generated.path), net, FACTORY_KEY_MAP)
    clone, bypassed = patched_clone(patcher(net), patches, 0.5, apply_mode="bypass")
    assert bypassed > 0
    offload(clone)
    for name in weight_layers(generated.variant):
        y = getattr(net, name)(probe(name).float()).double()
        assert_close_to_truth(y, generated.truth(torch.float32, 0.5, False)[name],
                              generated.y_base[torch.float32][name], 0.0, name)
    clone.detach()


@pytest.mark.parametrize("variant_id", ["locon", "loha", "lokr", "locon_dora_out", "glora", "oft_rescaled"])
def test_bf16_activations_within_bf16_merge_error(reference_files, bases, variant_id):
    """With bf16 activations (a GPU run), bypass computes in bf16 like the layer; its error stays within a small
    multiple of what a bf16 merge (LowVramPatch computes in the activation dtype) already has."""
    generated = reference_files[variant_id]
    net = factory_model(bases[torch.bfloat16], torch.bfloat16)
    base = patcher(net)
    patches, _ = lycoris_patches(load(generated.path), net, FACTORY_KEY_MAP)
    truth = generated.truth(torch.bfloat16, 1.0, False)
    errors = {}
    for mode, load_with in (("bypass", full_load), ("merge", offload)):
        clone, _ = patched_clone(base, patches, 1.0, apply_mode=mode)
        load_with(clone)
        errors[mode] = {name: float((getattr(net, name)(probe(name).bfloat16()).double() - truth[name]).norm())
                        for name in weight_layers(generated.variant)}
        clone.detach()
        clone.unpatch_model(base.offload_device)
    for name, bypass_error in errors["bypass"].items():
        scale = float(truth[name].norm())
        assert bypass_error <= 3 * errors["merge"][name] + 1e-3 * scale, (name, bypass_error, errors["merge"][name])


def quantized_net(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    """A model whose `linear_b` is ComfyUI's own quantized Linear (mixed_precision_ops: a QuantizedTensor in an fp8
    layout, scale 1, so it dequantizes to the fp8 base weights exactly)."""
    net = torch.nn.Module()
    net.add_module("linear_b", quantized_linear(weight, bias, torch.float8_e4m3fn))
    return net.requires_grad_(False)


@pytest.mark.parametrize("variant_id", ["locon", "loha", "lokr", "locon_dora_out", "glora", "ia3_on_input",
                                        "oft_rescaled", "boft_constraint"])
@pytest.mark.parametrize("mode", ["bypass", "auto"])
def test_comfy_quantized_layer(reference_files, bases, variant_id, mode):
    """On a QuantizedTensor weight, bypass (chosen by auto too) equals merging into a float copy of that weight."""
    generated = reference_files[variant_id]
    if "linear_b" not in generated.variant.layers:
        pytest.skip(f"{variant_id} has no linear_b layer")
    params = bases[torch.float8_e4m3fn]["linear_b"]
    net = quantized_net(params["weight"], params["bias"])
    assert isinstance(net.linear_b.weight, QuantizedTensor)
    patches, _ = lycoris_patches(load(generated.path), net, {k: v for k, v in FACTORY_KEY_MAP.items()
                                                            if v == "linear_b.weight"})
    clone, bypassed = patched_clone(patcher(net), patches, 0.5, apply_mode=mode)
    assert bypassed == 1
    full_load(clone)
    x = probe("linear_b").float()
    y = net.linear_b(x).double()
    assert isinstance(net.linear_b.weight, QuantizedTensor)  # untouched: still the quantized tensor
    # merging into a float copy: the same file on a plain fp32 Linear holding the dequantized weight
    float_net = torch.nn.Module()
    float_net.add_module("linear_b", comfy.ops.disable_weight_init.Linear(64, 96, dtype=torch.float32))
    float_net.linear_b.weight = torch.nn.Parameter(params["weight"].float(), requires_grad=False)
    float_net.linear_b.bias = torch.nn.Parameter(params["bias"].float(), requires_grad=False)
    float_patches, _ = lycoris_patches(load(generated.path), float_net, {k: v for k, v in FACTORY_KEY_MAP.items()
                                                                        if v == "linear_b.weight"})
    merged, _ = patched_clone(patcher(float_net), float_patches, 0.5, apply_mode="merge")
    full_load(merged)
    y_merge = float_net.linear_b(x).double()
    truth = generated.truth(torch.float8_e4m3fn, 0.5, False)["linear_b"]
    y_base = generated.y_base[torch.float8_e4m3fn]["linear_b"]
    assert_close_to_truth(y, y_merge, y_base, 0.0, "bypass vs float merge")
    assert_close_to_truth(y, truth, y_base, 0.0, "bypass vs reference")
    clone.detach()


@pytest.mark.parametrize("dtype,expected", [(torch.float32, False), (torch.bfloat16, False),
                                            (torch.float8_e4m3fn, True)])
def test_auto_bypasses_only_non_float_weights(reference_files, bases, dtype, expected):
    generated = reference_files["locon"]
    net = factory_model(bases[dtype], dtype)
    patches, _ = lycoris_patches(load(generated.path), net, FACTORY_KEY_MAP)
    clone, bypassed = patched_clone(patcher(net), patches, 1.0, apply_mode="auto")
    targets = len(weight_layers(generated.variant))
    assert (bypassed, len(clone.patches)) == ((targets, 0) if expected else (0, targets))


def chained_outputs(reference_files, bases, modes: tuple[str, str], files: tuple[str, str] = ("locon", "glora")
                    ) -> tuple[dict, list[str], list[int]]:
    """LoCon at 1 then GLoRA (whose change reads W) at 0.5 on the same layers (or the other `files`), applied in
    `modes`: the layers' outputs, those layers, and how many of the second file's patches ran in bypass."""
    first, second = reference_files[files[0]], reference_files[files[1]]
    net = factory_model(bases[torch.float32], torch.float32)
    base = patcher(net)
    p1, _ = lycoris_patches(load(first.path), net, FACTORY_KEY_MAP)
    p2, _ = lycoris_patches(load(second.path), net, FACTORY_KEY_MAP)
    layers = [n for n in weight_layers(second.variant) if n in first.variant.layers]
    one, _ = patched_clone(base, p1, 1.0, apply_mode=modes[0], key="one")
    two, bypassed = patched_clone(one, p2, 0.5, apply_mode=modes[1], key="two")
    full_load(two)
    outputs = {n: getattr(net, n)(probe(n).float()).double() for n in layers}
    two.detach()
    two.unpatch_model(base.offload_device)
    return outputs, layers, bypassed


def test_stacked_bypass_in_order_equals_chained_merge(reference_files, bases):
    """Two files on the same layers, each with its own key: bypass applies them in order like chained merges do,
    including a change that depends on W (GLoRA after LoCon sees W + ΔW_locon)."""
    merged, layers, _ = chained_outputs(reference_files, bases, ("merge", "merge"))
    bypassed, _, _ = chained_outputs(reference_files, bases, ("bypass", "bypass"))
    for n in layers:
        y_base = reference_files["glora"].y_base[torch.float32][n]
        assert not torch.allclose(merged[n], y_base)
        assert_close_to_truth(bypassed[n], merged[n], y_base, 0.0, n)


# Pairs on the same layers mixing every kind of form: additive, output-side maps (OFT/BOFT/(IA)³), input-side ones
# ((IA)³ on the input, DoRA on the input axis), readers prepared from W (GLoRA, DoRA), in both orders.
CHAINS = [("ia3_on_input", "locon"), ("locon", "ia3_on_input"), ("oft_rescaled", "loha_dora_in"),
          ("loha_dora_in", "glora"), ("boft_constraint", "ia3_on_input"), ("lokr", "locon_dora_out"),
          ("glora", "boft"), ("ia3", "lokr_dora_in"), ("loha", "oft")]


@pytest.mark.parametrize("files", CHAINS, ids=["+".join(pair) for pair in CHAINS])
def test_bypass_chains_equal_chained_merges(reference_files, bases, files):
    """Any two forms on one layer, bypassed in order, equal the two merges in that order."""
    merged, layers, _ = chained_outputs(reference_files, bases, ("merge", "merge"), files)
    bypassed, _, count = chained_outputs(reference_files, bases, ("bypass", "bypass"), files)
    assert count == len(weight_layers(reference_files[files[1]].variant))
    for n in layers:
        assert_close_to_truth(bypassed[n], merged[n], reference_files[files[1]].y_base[torch.float32][n], 0.0, n)


# Every pair chained above, and test_stacked_bypass_in_order_equals_chained_merge's
REFERENCE_CHAINS = [("locon", "glora"), *CHAINS]


@pytest.mark.parametrize("mode", ["merge", "bypass"])
@pytest.mark.parametrize("files", REFERENCE_CHAINS, ids=["+".join(pair) for pair in REFERENCE_CHAINS])
def test_chains_equal_the_reference_applied_in_turn(reference_files, bases, files, mode, tmp_path):
    """File A at 1 then file B at 0.5 on one layer, merged or bypassed, against the reference alone: the weight and
    bias A gives are read off reference network A's forward, reference network B is built on a layer holding them,
    and its forward is the truth (`chain_truth`), so the pack's own chained merge is not the only judge."""
    first, second = reference_files[files[0]], reference_files[files[1]]
    ours, layers, _ = chained_outputs(reference_files, bases, (mode, mode), files)
    assert layers
    truth = chain_truth(first, second, layers, 0.5, tmp_path)
    for n in layers:
        assert_close_to_truth(ours[n], truth[n], first.y_base[torch.float32][n], 0.0, f"{'+'.join(files)} {n}")


def test_weight_reader_merged_after_a_bypassed_file_runs_after_it(reference_files, bases):
    """A file whose change reads W, merged after a bypassed file on the same layers, could not see that file's change
    in the weight; it is bypassed too (kept in order), so the result is still the two chained merges."""
    merged, layers, none = chained_outputs(reference_files, bases, ("merge", "merge"))
    mixed, _, moved = chained_outputs(reference_files, bases, ("bypass", "merge"))
    assert (none, moved) == (0, len(layers))
    for n in layers:
        assert_close_to_truth(mixed[n], merged[n], reference_files["glora"].y_base[torch.float32][n], 0.0, n)


@pytest.mark.parametrize("reader", ["glora", "locon_dora_out", "oft_rescaled"])
def test_file_merged_after_a_bypassed_weight_reader_runs_after_it(reference_files, bases, reader):
    """The other way round: a LoRA merged after a bypassed file whose change reads W would be in the weight that
    file reads, i.e. applied before it; it is bypassed too, so the result is the two merges in workflow order."""
    files = (reader, "locon")
    merged, layers, none = chained_outputs(reference_files, bases, ("merge", "merge"), files)
    mixed, _, moved = chained_outputs(reference_files, bases, ("bypass", "merge"), files)
    assert (none, moved) == (0, len(layers))
    for n in layers:
        assert_close_to_truth(mixed[n], merged[n], reference_files[reader].y_base[torch.float32][n], 0.0, n)


@pytest.mark.parametrize("reader", ["glora", "locon_dora_out", "oft_rescaled"])
def test_prepared_forms_follow_a_hook_changing_the_weight(reference_files, bases, reader):
    """Forms prepared from W (DoRA's norm, GLoRA's W·A, an output map's bias) are made again when ComfyUI changes
    the weight of a loaded model: a weight hook (a LoCon) patched in between two forwards gives the reader applied
    on the hooked weight, as chained merges do. (ComfyUI patches hooks with the injections ejected.)"""
    import comfy.hooks

    hooked, second = reference_files["locon"], reference_files[reader]
    net = factory_model(bases[torch.float32], torch.float32)
    base = patcher(net)
    reader_patches, _ = lycoris_patches(load(second.path), net, FACTORY_KEY_MAP)
    hook = comfy.hooks.WeightHook()
    hook.weights, hook.need_weight_init = lycoris_patches(load(hooked.path), net, FACTORY_KEY_MAP)[0], False
    group = comfy.hooks.HookGroup()
    group.add(hook)
    clone, _ = patched_clone(base, reader_patches, 0.5, apply_mode="bypass")
    clone.register_all_hook_patches(group, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model))
    full_load(clone)
    layers = [n for n in weight_layers(second.variant) if n in hooked.variant.layers]
    before = {n: getattr(net, n)(probe(n).float()).double() for n in layers}
    clone.patch_hooks(group)
    after = {n: getattr(net, n)(probe(n).float()).double() for n in layers}
    clone.patch_hooks(None)
    clone.detach()
    clone.unpatch_model(base.offload_device)
    truth, _, _ = chained_outputs(reference_files, bases, ("merge", "merge"), ("locon", reader))
    for n in layers:
        assert not torch.allclose(before[n], after[n]), f"{n}: the hook changed nothing"
        assert_close_to_truth(after[n], truth[n], second.y_base[torch.float32][n], 0.0, n)


class PackedTensor(torch.Tensor):
    """Stands for a weight type only its own ops can decode (GGUF's GGMLTensor)."""


@pytest.mark.parametrize("variant_id,expected", [("locon", True), ("locon_dora_out", False), ("oft_rescaled", False)])
def test_unreadable_weight_bypasses_only_what_needs_no_weight(reference_files, bases, variant_id, expected):
    from lycoris_nodes.nodes.glue.bypass import patch_route
    from lycoris_nodes.nodes.glue.patch_key import PatchKey

    generated = reference_files[variant_id]
    net = factory_model(bases[torch.float32], torch.float32)
    patches, _ = lycoris_patches(load(generated.path), net, FACTORY_KEY_MAP)
    net.linear_b.weight = torch.nn.Parameter(net.linear_b.weight.data.as_subclass(PackedTensor), requires_grad=False)
    key, plan = PatchKey("linear_b.weight"), patches["linear_b.weight"].plan
    assert patch_route("auto", net.linear_b, key, plan).bypassed is expected
    assert patch_route("bypass", net.linear_b, key, plan).bypassed is expected
