"""The reference table through a REAL ComfyUI `ModelPatcher` on real `comfy.ops` layers.

Files and truth come from `reference.lycoris_factory` (real files written by lycoris-lora 4.1.3; truth = the
reference's own forward pass on the same rounded base weights). For each variant × base dtype, the factory's tiny
model is rebuilt from `comfy.ops` layers holding the base weights in that dtype:

* fp32: `comfy.ops.disable_weight_init` layers (ComfyUI's choice when weight and compute dtype agree);
* fp16 / bf16: `comfy.ops.manual_cast` layers;
* float8_e4m3fn / float8_e5m2: scaled-fp8 Linear layers (stored weight = W / scale): `comfy.ops.scaled_fp8_ops()` on
  0.3.75, a `comfy_quant` QuantizedTensor on 0.33, so patching goes through ComfyUI's dequantise and stochastic
  requantise (`convert_weight`/`set_weight`; 0.33 recalculates the scale);
  conv and norm layers are plain fp8 `manual_cast` layers (stochastic rounding in `patch_weight_to_device`).

The file is turned into patches by `build_patches` and added with `ModelPatcher.add_patches(patches, m)` for m in
1, 0.5, 0, −1, then loaded on two paths: full load (`patch_model(lowvram_model_memory=0)`, weights patched in place)
and offload (`lowvram_model_memory=1`, the patch computed by `LowVramPatch` inside the layer's forward).

What is compared: the weight and bias each layer's forward actually uses (ComfyUI's `cast_bias_weight`, times
`scale_weight` for scaled fp8) are put through the layer's float64 forward and compared with the truth
(linear semantics: y_base + m·(y_ref(1) − y_base); for DoRA/OFT/BOFT also LyCORIS' own y_ref(m), at m = 0.5, 0). The allowed error
per output element is what rounding the patched parameters once to the dtype they are held in implies (half an ulp
for round-to-nearest, a full ulp for fp8's stochastic rounding) plus float32 compute error; for fp32 also
‖error‖ < 1e-4·‖y_truth − y_base‖. The layer's real forward must agree with that float64 forward. Linear strength 0
leaves every weight bit-identical, and `unpatch_model` restores the original weights bit-exactly after every load.

Every variant of the factory runs (about 30 s on 2 idle cores); `LYCORIS_TABLE=subset` runs a representative
subset (every algorithm and special layout, about 6 s) for quick iterations.
"""

import os

import pytest
import torch
from lycoris_nodes.lycoris_core import load
from patcher_util import (
    CPU,
    FACTORY_KEY_MAP,
    FP8,
    assert_bit_identical,
    factory_model,
    forward_params,
    full_load,
    lowvram_patched,
    lycoris_patches,
    offload,
    patcher,
    snapshot,
    storage_dtype,
    variant_dtype_params,
)
from reference.lycoris_factory import (
    BY_ID,
    LAYERS,
    STRENGTHS,
    VARIANTS,
    functional_forward,
    magnitude_forward,
    probe,
)

BASE_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + FP8
COMPUTE_SLACK = 3e-5  # float32 maths (ours; the reference's for OFT/BOFT), relative to |W| + |ΔW|
FP32_CHANGE_TOLERANCE = 1e-4
NO_CHANGE = 1e-5  # below this ‖y_truth − y_base‖/‖y_base‖ the truth is the reference's own float32 noise
# What the ComfyUI paths can treat differently: plain additive deltas on every layer kind (locon), file tensors in
# bf16 (locon_bf16_file), N-D Kronecker factors on Conv1d/3d (lokr_tucker), changes that depend on W itself
# (DoRA both axes, GLoRA, IA3 on the input axis), whole-weight rewrites (Diag-OFT with rescale, BOFT with an active
# constraint), bias patches (full's diff_b) and norm layers (w_norm/b_norm). The maths of every variant is checked
# by test_core_reference.py. LYCORIS_TABLE=subset runs only these (~6 s instead of ~30 s).
SUBSET = ("locon", "locon_bf16_file", "lokr_tucker", "locon_dora_out", "loha_dora_in", "glora", "ia3_on_input",
          "oft_rescaled", "boft_constraint", "full", "norm")
# LyCORIS' own multiplier semantics (DoRA/OFT/BOFT variants): the ComfyUI path is the same, so two strengths suffice
# (0 matters: DoRA keeps W + ΔW, OFT/BOFT keep the rescale)
REFERENCE_STRENGTHS = (0.5, 0.0)
TABLE = list(SUBSET) if os.environ.get("LYCORIS_TABLE") == "subset" else [v.id for v in VARIANTS]




def _rounding(dtype: torch.dtype, stochastic: bool) -> tuple[float, float]:
    """(relative, absolute) error of rounding a value once to `dtype`."""
    info = torch.finfo(dtype)
    subnormal = info.smallest_normal * info.eps
    return (info.eps, subnormal) if stochastic else (info.eps / 2, subnormal / 2)


def check_layer(name, layer, truth, y_base, before, compute_dtype, held_in, what, seen: dict) -> list[str]:
    """Compare what `layer`'s forward uses with the truth; `held_in`: param -> (dtype, stochastic) of its rounding.

    `seen` caches the float64 comparison per (truth, parameters, rounding): full load and offload often hand the
    forward bit-identical parameters, and the float64 convolutions are the expensive part.
    """
    x = probe(name)
    x_in = x.to(compute_dtype)
    weight, bias = forward_params(layer, x_in)
    scale = float(layer.scale_weight) if hasattr(layer, "scale_weight") else 1.0
    after = {"weight": weight.double() * scale}
    if bias is not None:
        after["bias"] = bias.double()
    key = (name, id(truth), tuple(sorted(held_in.items())),
           *(t.numpy().tobytes() for t in (after["weight"], after.get("bias", torch.empty(0)))))
    if key not in seen:
        y = functional_forward(name, x, after["weight"], after.get("bias"))

        def param_error(param):
            old, new = before[param].double(), after[param]
            rel, tiny = _rounding(*held_in[param])
            return rel * (1 + 2 * rel) * new.abs() + tiny + COMPUTE_SLACK * (old.abs() + (new - old).abs())

        bound = magnitude_forward(name, x, param_error("weight"), param_error("bias") if "bias" in after else None)
        error = (y - truth).abs()
        change = float((truth - y_base).norm())
        relative = float(error.norm()) / change if change > NO_CHANGE * float(y_base.norm()) else 0.0
        seen[key] = (y, float((error / bound).max()), relative)
    y, ratio, relative = seen[key]
    failures = []
    if ratio > 1:
        failures.append(f"{what} {name}: max error/bound {ratio:.3g}")
    if held_in["weight"][0] == torch.float32 and relative > FP32_CHANGE_TOLERANCE:
        failures.append(f"{what} {name}: ‖error‖/‖change‖ {relative:.3g}")
    # the layer's own forward (ComfyUI's cast + weight_function chain, in compute_dtype) uses those same parameters
    real = layer(x_in).double()
    if not torch.allclose(real, y, rtol=0, atol=5 * torch.finfo(compute_dtype).eps * float(y.abs().max()) + 1e-6):
        failures.append(f"{what} {name}: real forward differs from its own parameters by "
                        f"{float((real - y).abs().max()):.3g}")
    return failures


@pytest.mark.parametrize("variant_id,dtype", variant_dtype_params(TABLE, BASE_DTYPES))
def test_reference_table_through_model_patcher(reference_files, bases, variant_id, dtype):
    generated = reference_files[variant_id]
    variant = generated.variant
    lfile = load(generated.path)
    net = factory_model(bases[dtype], dtype)
    saved = snapshot(net)
    base = patcher(net)
    y_base = generated.y_base[dtype]
    failures, seen = [], {}
    for semantics in ("linear", "reference") if variant.reference_semantics else ("linear",):
        reference = semantics == "reference"
        patches, report = lycoris_patches(lfile, net, FACTORY_KEY_MAP, reference=reference, name=generated.path.name)
        assert not report.problems and not report.unused_keys, report.details()
        patched = {}
        for key in patches:
            layer_name, param = key.rsplit(".", 1)
            patched.setdefault(layer_name, set()).add(param)
        assert set(patched) == set(variant.layers)
        for strength in REFERENCE_STRENGTHS if reference else STRENGTHS:
            truth = generated.truth(dtype, strength, reference)
            clone = base.clone()
            assert set(clone.add_patches(patches, strength)) == set(patches)
            for path in ("full", "offload"):
                what = f"{semantics} m={strength:+g} {path}"
                (full_load if path == "full" else offload)(clone)
                for name in variant.layers:
                    layer = getattr(net, name)
                    before = saved_params(saved, name)
                    if path == "full":
                        assert not lowvram_patched(layer)
                        held = {p: (storage_dtype(getattr(layer, p)), storage_dtype(getattr(layer, p)) in FP8)
                                for p in before}
                        # fp8: ComfyUI re-rounds every patched weight with comfy.float.stochastic_rounding, even
                        # when the patch changes nothing; it adds its random offset in fp16, which moves ~0.2% of
                        # exactly representable values one ulp up (upstream, not ours). The bound below covers it.
                        if strength == 0 and not reference and dtype not in FP8:
                            for p in before:
                                if not _same_bits(getattr(layer, p), saved[f"{name}.{p}"]):
                                    failures.append(f"{what} {name}: strength 0 changed {p}")
                        computes = (torch.float32,)
                    else:
                        assert lowvram_patched(layer) or lowvram_patched(layer, "bias")
                        computes = (torch.float32,) if dtype in (torch.float32,) + FP8 else (torch.float32, dtype)
                    for compute in computes:
                        if path == "offload":  # patched in LowVramPatch in the compute dtype; scaled fp8 requantises
                            held = {p: (dtype, True) if (p == "weight" and hasattr(layer, "scale_weight"))
                                    else (compute, False) for p in before}
                        failures += check_layer(name, layer, truth[name], y_base[name], before, compute, held,
                                                f"{what} (compute {str(compute).removeprefix('torch.')})", seen)
                clone.unpatch_model(CPU)
                assert_bit_identical(net, saved)
                assert not any(lowvram_patched(getattr(net, n)) for n in variant.layers)
    assert not failures, "\n".join(failures[:30]) + (f"\n… {len(failures) - 30} more" if len(failures) > 30 else "")


def saved_params(saved: dict, name: str) -> dict[str, torch.Tensor]:
    """The layer's original parameters as the forward sees them (scaled fp8 weights dequantised by the caller)."""
    out = {p: saved[f"{name}.{p}"] for p in ("weight", "bias") if f"{name}.{p}" in saved}
    for scale in ("scale_weight", "weight_scale"):  # 0.3.75's scaled_fp8_ops, 0.33's comfy_quant layers
        if f"{name}.{scale}" in saved:
            out["weight"] = out["weight"].double() * float(saved[f"{name}.{scale}"])
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.detach().flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def test_subset_covers_every_algorithm_and_layer():
    """The quick subset still exercises every algorithm of the factory and every layer kind."""
    assert {BY_ID[v].algo for v in SUBSET} >= {v.algo for v in VARIANTS} - {"dylora"}  # DyLoRA files are LoRA files
    assert {layer for v in SUBSET for layer in BY_ID[v].layers} == {layer.name for layer in LAYERS}
