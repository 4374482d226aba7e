"""lycoris_core against the LyCORIS reference (lycoris-lora 4.1.3), on real files made by the reference itself.

For every variant of `reference.lycoris_factory.VARIANTS` × base weight dtype × strength × multiplier semantics, each
layer's weight (and bias) is patched by lycoris_core, and the layer's float64 output with the patched parameters is
compared with the reference's forward pass on the same (rounded) base weights:

* linear semantics: truth = y_base + m·(y_ref(1) − y_base) (outputs are affine in W);
* reference semantics (DoRA/OFT/BOFT variants only; for the others it equals linear): truth = y_ref(m).

Tolerance: the base weights the reference saw are exactly the rounded ones we patch, so the only error left is the
patched weight's single rounding to its dtype (plus float32 compute error). Each output element must be within the
bound that error implies, |y_ours − y_truth| ≤ |op|(|x|, u·|W'| + tiny + c·(|W| + |W' − W|)), u = eps(dtype)/2 and
tiny = half the subnormal spacing. float32: also ‖error‖ ≤ 1e-4·‖y_truth − y_base‖ (1e-10 for float64 weights patched
with a float64 intermediate). Strength 0 under linear semantics must leave the weight bit-identical.
"""

import sys

import pytest
import torch
from comfy_env import REPO_ROOT
from safetensors.torch import load_file

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # appended, not prepended: ComfyUI's own `nodes` must keep winning

from reference.lycoris_factory import (
    BY_ID,
    LAYER,
    STRENGTHS,
    VARIANTS,
    Lazy,
    functional_forward,
    layer_for,
    magnitude_forward,
    probe,
    reference_fails,
)

import lycoris_core

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# float64 weights hold the float32 base values (every base value is float32-representable), patched in float64
BASE_OF = {torch.float64: torch.float32}
COMPUTE_SLACK = 2e-6  # float32 maths (ours; the reference's too for OFT/BOFT): ~17 ulps of |W| + |ΔW|
EXACT_SLACK = 1e-12  # float64 maths on both sides
CHANGE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
CHANGE_RATIO_RANGE = (0.02, 3.0)  # ‖y_ref(1) − y_base‖ / ‖y_base‖: visible, not absurd
# Below this ‖y_truth − y_base‖/‖y_base‖ the "change" is only the truth's own float32 noise (OFT/BOFT at m = 0).
NO_CHANGE = 1e-5


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cases():
    for variant in VARIANTS:
        for dtype in DTYPES:
            for strength in STRENGTHS:
                for semantics in ("linear", "reference") if variant.reference_semantics else ("linear",):
                    yield pytest.param(variant.id, dtype, strength, semantics,
                                       id=f"{variant.id}-{_name(dtype)}-m{strength:+g}-{semantics}")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths




@pytest.fixture(scope="session")
def loaded(reference_files):
    return Lazy(lambda variant_id: lycoris_core.load(reference_files[variant_id].path))


def modules_by_layer(lycoris_file: lycoris_core.LycorisFile) -> dict[str, list]:
    out: dict[str, list] = {}
    for key, module in lycoris_file.modules.items():
        found = layer_for(module.prefix)
        assert found is not None, f"module {key} matches no layer of the base model"
        out.setdefault(found[0].name, []).append(module)
    return out


def patch_layer(modules, base: dict, dtype: torch.dtype, strength: float, reference: bool):
    """(parameters before, after) lycoris_core patched copies of the base parameters cast to `dtype`."""
    after = {name: t.to(torch.float32).to(dtype) for name, t in base.items() if t is not None}
    before = {name: t.clone() for name, t in after.items()}
    intermediate = torch.float64 if dtype == torch.float64 else None
    for module in modules:
        target = after[module.param]
        plan = module.plan_for(tuple(target.shape), reference=reference)
        lycoris_core.apply(plan, module.tensors, target, strength, intermediate_dtype=intermediate)
    return before, after


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))


def error_bound(layer: str, x: torch.Tensor, before: dict, after: dict, patched: set, dtype: torch.dtype,
                slack: float) -> torch.Tensor:
    """Elementwise bound on |y_ours − y_truth| from rounding each patched parameter once (see the module doc)."""
    info = torch.finfo(dtype)
    u = info.eps / 2
    half_subnormal = info.smallest_normal * info.eps / 2

    def param_error(name):
        if name not in patched:
            return None  # the base parameter itself: identical on both sides
        old, new = before[name].double(), after[name].double()
        return u * (1 + 2 * u) * new.abs() + half_subnormal + slack * (old.abs() + (new - old).abs())

    weight_error = param_error("weight")
    if weight_error is None:
        weight_error = torch.zeros_like(before["weight"], dtype=torch.float64)
    return magnitude_forward(layer, x, weight_error, param_error("bias"))


@pytest.mark.parametrize("variant_id,dtype,strength,semantics", list(_cases()))
def test_patch_matches_reference_forward(reference_files, loaded, bases, variant_id, dtype, strength, semantics):
    generated, lycoris_file = reference_files[variant_id], loaded[variant_id]
    variant = generated.variant
    reference = semantics == "reference"
    base_dtype = BASE_OF.get(dtype, dtype)
    truth = generated.truth(base_dtype, strength, reference)
    y_base = generated.y_base[base_dtype]
    exact = dtype == torch.float64 and not variant.fp32_only
    slack = EXACT_SLACK if exact else COMPUTE_SLACK
    change_tolerance = CHANGE_TOLERANCE.get(dtype)
    if dtype == torch.float64 and not exact:
        change_tolerance = CHANGE_TOLERANCE[torch.float32]  # the truth itself is float32 (OFT/BOFT)

    failures = []
    for layer, modules in sorted(modules_by_layer(lycoris_file).items()):
        before, after = patch_layer(modules, bases[base_dtype][layer], dtype, strength, reference)
        patched = {module.param for module in modules}
        if strength == 0 and not reference:
            changed = [name for name in after if not bit_identical(before[name], after[name])]
            if changed:
                failures.append(f"{layer}: strength 0 changed {changed}")
        x = probe(layer)
        y_ours = functional_forward(layer, x, after["weight"].double(),
                                    after["bias"].double() if "bias" in after else None)
        error = (y_ours - truth[layer]).abs()
        bound = error_bound(layer, x, before, after, patched, dtype, slack)
        ratio = float((error / bound).max())
        change = float((truth[layer] - y_base[layer]).norm())
        relative = float(error.norm()) / change if change > NO_CHANGE * float(y_base[layer].norm()) else 0.0
        if ratio > 1 or (change_tolerance is not None and relative > change_tolerance):
            failures.append(f"{layer} ({', '.join(sorted(patched))}): max error/bound {ratio:.3g}, "
                            f"‖error‖/‖y_truth − y_base‖ {relative:.3g} (limit {change_tolerance})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("variant_id", [variant.id for variant in VARIANTS])
def test_every_module_matches_a_layer(reference_files, loaded, bases, variant_id):
    """No silent skip: every module of the file fits its layer, every targeted layer has one, no key is unused."""
    generated, lycoris_file = reference_files[variant_id], loaded[variant_id]
    variant = generated.variant
    assert lycoris_file.unused == []
    by_layer = modules_by_layer(lycoris_file)
    assert sorted(by_layer) == sorted(variant.layers)
    for layer, modules in by_layer.items():
        base = bases[torch.float32][layer]
        for module in modules:
            assert base.get(module.param) is not None, f"{module.prefix} patches {module.param}, {layer} has none"
            module.plan_for(tuple(base[module.param].shape))  # raises LycorisError if it does not fit
            module.plan_for(tuple(base[module.param].shape), reference=True)
    suffixes = {key.split(".", 1)[1] for key in load_file(str(generated.path))}
    assert set(variant.expect) <= suffixes, f"the reference did not make the intended layout: {sorted(suffixes)}"
    assert not set(variant.absent) & suffixes, f"unexpected layout: {sorted(suffixes)}"


@pytest.mark.parametrize("variant_id", [variant.id for variant in VARIANTS])
def test_reference_files_are_sound(reference_files, loaded, variant_id):
    """The generator's own claims: ΔW visible everywhere, OFT/BOFT clamps both active and not, alpha as stored."""
    generated = reference_files[variant_id]
    variant = generated.variant
    low, high = CHANGE_RATIO_RANGE
    ratios = generated.change_ratio()
    assert all(low <= r <= high for r in ratios.values()), ratios
    if any("constraint" in kwargs for kwargs in variant.layer_kwargs.values()):
        assert set(generated.clamp_active.values()) == {True, False}, generated.clamp_active
    if variant.save_dtype != torch.float32:
        written = variant.kwargs["linear_alpha"]
        stored = float(torch.tensor(written, dtype=variant.save_dtype))
        assert stored != written
        assert {module.alpha for module in loaded[variant_id].modules.values()} == {stored}


SKIPS = [pytest.param(variant.id, layer, id=f"{variant.id}-{layer}")
         for variant in VARIANTS for layer in variant.skips]


@pytest.mark.parametrize("variant_id,layer", SKIPS)
def test_skipped_pair_fails_in_the_reference(tmp_path, variant_id, layer):
    """Every (variant, layer) pair the table skips is one the reference really cannot make."""
    variant = BY_ID[variant_id]
    assert layer in LAYER and layer not in variant.layers
    failure = reference_fails(variant, layer, tmp_path)
    assert failure is not None, f"the reference now makes {variant_id} for {layer}; test it instead of skipping"
