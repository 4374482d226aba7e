"""Memory of a patch: `apply` writes W'(m) into W with at most one weight-sized temporary and never casts a whole
adapter tensor (issue #5).

Counted independently of the implementation, by a TorchDispatchMode that sees every aten op `apply` runs:

* made: op outputs at least as large as the weight (numel) whose storage is neither the weight's nor one of the op's
  inputs (in-place results and views are not new memory);
* mixed: ops other than explicit casts that read a weight-sized tensor in another dtype than they write. On CPU torch
  first converts such an input into a hidden full-size copy, which `made` cannot see.

Budget (`budget`): 0 temporaries when W is contiguous and already in the compute dtype (fp32, or float64 with a
float64 intermediate), except linear-semantics DoRA (V = W + ΔW needs a buffer of its own next to W); 1 otherwise (the
fp32 copy of a bf16/fp16/fp8 W, or of a non-contiguous view). Never any `mixed` op.

Every counted patch is also checked: the float64 patch against the reference's forward pass (lycoris-lora 4.1.3 files
and truth from reference.lycoris_factory, as in test_core_reference.py), and each lower-precision patch elementwise
against the float64 one (one rounding to W's dtype plus float32 compute error), so the counts are those of correct
patches. The stored adapter tensors must come out bit-identical.
"""

import math

import pytest
import torch
from comfy.lora import calculate_weight
from lycoris_nodes.lycoris_core import apply, casting, change, load, parse_state_dict
from lycoris_nodes.nodes.glue.adapter import LycorisAdapter
from reference.lycoris_factory import LAYER, VARIANTS, Lazy, functional_forward, layer_of, magnitude_forward, probe
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float64)  # fp16 takes bf16's path
BASE_OF = {torch.float64: torch.float32}  # float64 weights hold the float32 base values
STRENGTHS = (0.5, -1.0)
COMPUTE_SLACK = 2e-6  # float32 maths: ~17 ulps of |W| + |ΔW| (as in test_core_reference.py)
TRUTH_TOLERANCE = {False: 1e-10, True: 1e-4}  # ‖y64 − y_truth‖ / ‖y_truth − y_base‖; True: the truth is float32
EXPLICIT_CASTS = ("aten._to_copy", "aten.copy_")


class Temporaries(TorchDispatchMode):
    """Records what the ops run under it allocate, measured against one weight."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.numel = weight.numel()
        self.weight_storage = weight.untyped_storage().data_ptr()
        self.made: list[tuple[str, torch.dtype, tuple[int, ...], set[int]]] = []  # op, dtype, shape, input storages
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in outputs:
            ptr = t.untyped_storage().data_ptr()
            if t.numel() >= self.numel and ptr != self.weight_storage and ptr not in storages:
                self.made.append((str(func), t.dtype, tuple(t.shape), storages))
        name = str(func)
        if outputs and not name.startswith(EXPLICIT_CASTS):
            written = outputs[0].dtype
            if any(t.numel() >= self.numel and t.dtype != written for t in inputs):
                self.mixed.append(f"{name}: {[(t.dtype, tuple(t.shape)) for t in inputs]} -> {written}")
        return out


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths


def counted_apply(plan, tensors, weight, strength, function=None, intermediate_dtype=None) -> Temporaries:
    with Temporaries(weight) as seen:
        result = apply(plan, tensors, weight, strength, function, intermediate_dtype)
    assert result is weight
    return seen


def budget(plan, weight: torch.Tensor, intermediate_dtype=None) -> int:
    if weight.dtype != casting.compute_dtype(intermediate_dtype) or not weight.is_contiguous():
        return 1
    if plan.dora_axis is not None and not plan.reference:
        return 1
    return 0


def assert_within_budget(seen: Temporaries, allowed: int, what: str):
    made = [entry[:3] for entry in seen.made]
    assert len(made) <= allowed, f"{what}: {len(made)} weight-sized temporaries (budget {allowed}): {made}"
    assert not seen.mixed, f"{what}: mixed-dtype ops on weight-sized tensors (hidden copies): {seen.mixed}"


def error_ratio(ours: torch.Tensor, exact: torch.Tensor, before: torch.Tensor, layer: str | None = None) -> float:
    """max |ours − exact| / bound, bound = one rounding to ours' dtype + float32 compute error (≤ 1 passes).

    With a `layer`, for its weight, both go through the layer on its probe as magnitudes, like test_core_reference
    does: float32 sums with cancellation inside ΔW may miss single elements by more than a few ulps of |W| + |ΔW|,
    never what the layer computes from them."""
    info = torch.finfo(ours.dtype)
    u = info.eps / 2
    ours, before = ours.double(), before.double()
    bound = (u * (1 + 2 * u) * exact.abs() + info.smallest_normal * info.eps / 2
             + COMPUTE_SLACK * (before.abs() + (exact - before).abs()))
    error = (ours - exact).abs()
    if layer is not None:
        x = probe(layer)
        error, bound = magnitude_forward(layer, x, error, None), magnitude_forward(layer, x, bound, None)
    return float((error / bound).max())


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def assert_untouched(tensors: dict[str, torch.Tensor], before: dict[str, torch.Tensor], what: str):
    for name, t in tensors.items():
        same = t.dtype == before[name].dtype and torch.equal(t.flatten().view(torch.uint8),
                                                             before[name].flatten().view(torch.uint8))
        assert same, f"{what}: the stored tensor {name} was modified"


def modules_by_layer(lycoris_file) -> dict[str, list]:
    out: dict[str, list] = {}
    for module in lycoris_file.modules.values():
        out.setdefault(layer_of(module.prefix), []).append(module)
    return out


@pytest.fixture(scope="module")
def loaded(reference_files):
    return Lazy(lambda variant_id: load(reference_files[variant_id].path))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("variant_id", [variant.id for variant in VARIANTS])
def test_patch_temporaries_and_result(reference_files, loaded, bases, variant_id, dtype):
    generated, lycoris_file = reference_files[variant_id], loaded[variant_id]
    variant = generated.variant
    base_dtype = BASE_OF.get(dtype, dtype)
    intermediate = torch.float64 if dtype == torch.float64 else None
    failures = []
    for strength in STRENGTHS:
        for reference in (False, True) if variant.reference_semantics else (False,):
            truth = generated.truth(base_dtype, strength, reference)
            for layer, modules in sorted(modules_by_layer(lycoris_file).items()):
                base = {name: t for name, t in bases[base_dtype][layer].items() if t is not None}  # float64
                exact = {name: t.clone() for name, t in base.items()}
                ours = {name: t.to(torch.float32).to(dtype) for name, t in base.items()}
                for module in modules:
                    what = f"{layer}.{module.param} m={strength:+g} {'reference' if reference else 'linear'}"
                    stored = snapshot(module.tensors)
                    plan = module.plan_for(tuple(base[module.param].shape), reference=reference)
                    apply(plan, module.tensors, exact[module.param], strength, intermediate_dtype=torch.float64)
                    seen = counted_apply(plan, module.tensors, ours[module.param], strength,
                                         intermediate_dtype=intermediate)
                    assert_within_budget(seen, budget(plan, base[module.param].to(dtype), intermediate), what)
                    assert_untouched(module.tensors, stored, what)
                    if dtype != torch.float64:
                        ratio = error_ratio(ours[module.param], exact[module.param], base[module.param],
                                            layer if module.param == "weight" else None)
                        if ratio > 1:
                            failures.append(f"{what}: error/bound {ratio:.3g} against the float64 patch")
                x = probe(layer)
                y_exact = functional_forward(layer, x, exact["weight"], exact.get("bias"))
                y_base = generated.y_base[base_dtype][layer]
                error = float((y_exact - truth[layer]).norm()) / float((truth[layer] - y_base).norm())
                if error > TRUTH_TOLERANCE[variant.fp32_only]:
                    failures.append(f"{layer} m={strength:+g}: float64 patch off the reference by {error:.3g}")
    assert not failures, "\n".join(failures)


# --- the same through ComfyUI, with a real function, on views, and for a Full diff of another dtype -------------------

FUNCTION_VARIANTS = ("locon", "locon_tucker", "loha_tucker", "lokr_tucker", "lokr_decompose_both", "glora", "ia3",
                     "full", "locon_dora_out", "loha_dora_in", "oft_rescaled", "boft")


def _first_weight_module(lycoris_file, bases, dtype: torch.dtype, want_kernel: bool = False):
    """A module patching a weight (a conv's, with `want_kernel`) and that weight rounded to `dtype` (in float64)."""
    for module in lycoris_file.modules.values():
        layer = layer_of(module.prefix)
        if module.param == "weight" and (not want_kernel or LAYER[layer].kind == "conv"):
            return module, bases[dtype][layer]["weight"]
    raise AssertionError("no weight module")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_name)
@pytest.mark.parametrize("variant_id", FUNCTION_VARIANTS)
def test_comfyui_identity_function_patches_in_place(loaded, bases, variant_id, dtype):
    """ComfyUI hands every adapter `lambda a: a` when a patch has no function: that must take the in-place path,
    through comfy.lora.calculate_weight and our adapter, with the same result as no function."""
    module, base = _first_weight_module(loaded[variant_id], bases, dtype, want_kernel=True)
    plan = module.plan_for(tuple(base.shape))
    adapter = LycorisAdapter.from_module(module, plan)
    through_comfy, direct = base.to(torch.float32).to(dtype), base.to(torch.float32).to(dtype)
    with Temporaries(through_comfy) as seen:
        calculate_weight([(0.5, adapter, 1.0, None, None)], through_comfy, "key")
    apply(plan, module.tensors, direct, 0.5)
    assert_within_budget(seen, budget(plan, direct), variant_id)
    assert torch.equal(through_comfy, direct)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_name)
@pytest.mark.parametrize("variant_id", FUNCTION_VARIANTS)
def test_real_function_sees_the_change(loaded, bases, variant_id, dtype):
    """A function that is not the identity gets ΔW(m) itself: doubling it is strength 2m (every algorithm is linear in
    m under linear semantics). ΔW is the one temporary beyond the working copy of W."""
    module, base = _first_weight_module(loaded[variant_id], bases, dtype)
    plan = module.plan_for(tuple(base.shape))
    exact, ours = base.clone(), base.to(torch.float32).to(dtype)
    apply(plan, module.tensors, exact, 1.0, intermediate_dtype=torch.float64)
    seen = counted_apply(plan, module.tensors, ours, 0.5, function=lambda delta: delta.mul_(2))
    assert_within_budget(seen, budget(plan, base.to(dtype)) + 1, variant_id)
    assert error_ratio(ours, exact, base, layer_of(module.prefix)) <= 1


def _locon(out: int, flat_in: int, rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"m.lora_up.weight": torch.randn(out, rank, generator=gen) / rank ** .5,
            "m.lora_down.weight": torch.randn(rank, flat_in, generator=gen) / flat_in ** .5,
            "m.alpha": torch.tensor(2.0)}


def _loha(out: int, flat_in: int, rank: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"m.hada_w{i}_{ab}": torch.randn(*shape, generator=gen) / 2
            for i in (1, 2) for ab, shape in (("a", (out, rank)), ("b", (rank, flat_in)))}


@pytest.mark.parametrize("make", (_locon, _loha), ids=("locon", "loha"))
def test_views_of_fused_weights(make):
    """ComfyUI narrows fused weights (qkv) by offsets on dim 0: patched in place, no temporary. A view along another
    dim is not contiguous: patched through one contiguous copy. Both equal patching a contiguous copy of the slice,
    and nothing outside the slice changes."""
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(48, 40, generator=gen)
    for dim, start, length, allowed in ((0, 16, 16, 0), (1, 8, 24, 1)):
        weight = fused.clone()
        view = weight.narrow(dim, start, length)
        (module,) = parse_state_dict(make(view.shape[0], view.shape[1]), "x.safetensors").modules.values()
        plan = module.plan_for(tuple(view.shape))
        alone = view.clone()
        apply(plan, module.tensors, alone, 0.7)
        seen = counted_apply(plan, module.tensors, view, 0.7)
        assert_within_budget(seen, allowed, f"narrow({dim})")
        assert torch.equal(view, alone)
        outside = torch.ones_like(weight, dtype=torch.bool)
        outside.narrow(dim, start, length).fill_(False)
        assert torch.equal(weight[outside], fused[outside])


@pytest.mark.parametrize("shape,tucker", [((24, 10), False), ((24, 10, 3, 3), False), ((24, 10, 3, 3), True)],
                         ids=("linear", "conv", "conv-tucker"))
def test_lokr_with_a_1x1_first_factor(shape, tucker):
    """LoKr with W₁ 1×1 (factor 1) is W₁ times a low-rank W₂ as large as W: added by addmm_, not formed."""
    gen = torch.Generator().manual_seed(9)
    rank, kernel = 3, shape[2:]

    def randn(*dims):
        return torch.randn(*dims, generator=gen, dtype=torch.float64)

    sd = {"m.lokr_w1": randn(1, 1), "m.alpha": torch.tensor(1.5)}
    if tucker:
        sd.update({"m.lokr_w2_a": randn(rank, shape[0]), "m.lokr_w2_b": randn(rank, shape[1]),
                   "m.lokr_t2": randn(rank, rank, *kernel)})
        w2 = torch.einsum("ij...,ip,jr->pr...", sd["m.lokr_t2"], sd["m.lokr_w2_a"], sd["m.lokr_w2_b"])
    else:
        sd.update({"m.lokr_w2_a": randn(shape[0], rank), "m.lokr_w2_b": randn(rank, math.prod(shape[1:]))})
        w2 = (sd["m.lokr_w2_a"] @ sd["m.lokr_w2_b"]).reshape(shape)
    (module,) = parse_state_dict(sd, "lokr.safetensors").modules.values()
    plan = module.plan_for(shape)
    weight = randn(*shape).float()
    before = weight.clone()
    seen = counted_apply(plan, module.tensors, weight, 0.7)
    assert_within_budget(seen, 0, "LoKr 1×1")
    exact = before.double() + 0.7 * (1.5 / rank) * float(sd["m.lokr_w1"]) * w2
    assert error_ratio(weight, exact, before) <= 1


@pytest.mark.parametrize("weight_dtype", (torch.float32, torch.bfloat16), ids=_name)
@pytest.mark.parametrize("diff_dtype", (torch.float16, torch.bfloat16, torch.float32), ids=_name)
def test_full_diff_is_never_cast_whole(weight_dtype, diff_dtype, monkeypatch):
    """Full: W + m·diff with the diff read as stored, piece by piece: no op makes a weight-sized tensor from the diff
    (fp32 or otherwise), and no op mixes the whole diff with fp32. Pieces are made small here so there are many."""
    monkeypatch.setattr(casting, "PIECE_BYTES", 4096)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(64, 48, 3, 3, generator=gen, dtype=torch.float64) / 20
    diff = (torch.randn(64, 48, 3, 3, generator=gen, dtype=torch.float64) / 200).to(diff_dtype)
    lycoris_file = parse_state_dict({"m.diff": diff, "m.diff_b": diff[:, 0, 0, 0].clone()}, "full.safetensors")
    module = next(m for m in lycoris_file.modules.values() if m.param == "weight")
    plan = module.plan_for(tuple(base.shape))
    stored = module.tensors["diff"]
    ours = base.to(torch.float32).to(weight_dtype)
    before = ours.clone()
    seen = counted_apply(plan, module.tensors, ours, -0.75)
    assert_within_budget(seen, budget(plan, ours), "Full")
    from_diff = [entry[:3] for entry in seen.made if stored.untyped_storage().data_ptr() in entry[3]]
    assert not from_diff, f"weight-sized tensors made from the diff: {from_diff}"
    exact = before.double() - 0.75 * stored.double()
    assert error_ratio(ours, exact, before) <= 1


@pytest.mark.parametrize("variant_id", ("loha", "loha_tucker", "oft_rescaled", "boft_constraint", "locon_dora_in",
                                        "lokr_dora_out"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_name)
def test_small_pieces_give_the_same_patch(loaded, bases, variant_id, dtype, monkeypatch):
    """With pieces of a row or column or two, the piecewise kernels (LoHa rows, OFT/BOFT columns, DoRA's W read back
    from a bf16 weight) still give the float64 patch, at every layer."""
    monkeypatch.setattr(casting, "PIECE_BYTES", 256)
    for module in loaded[variant_id].modules.values():
        base = bases[dtype][layer_of(module.prefix)][module.param]  # rounded to dtype, in float64
        for reference in (False, True):
            plan = module.plan_for(tuple(base.shape), reference=reference)
            exact, ours = base.clone(), base.to(torch.float32).to(dtype)
            apply(plan, module.tensors, exact, -1.0, intermediate_dtype=torch.float64)
            seen = counted_apply(plan, module.tensors, ours, -1.0)
            assert_within_budget(seen, budget(plan, base.to(dtype)), f"{module.prefix} reference={reference}")
            layer = layer_of(module.prefix) if module.param == "weight" else None
            assert error_ratio(ours, exact, base, layer) <= 1, f"{module.prefix} reference={reference}"


@pytest.mark.parametrize("variant_id", ("locon", "locon_tucker", "loha", "loha_tucker", "lokr", "lokr_tucker",
                                        "lokr_full_matrix", "full"))
def test_change_needs_only_the_weights_shape(loaded, bases, variant_id):
    """Bypass computes ΔW of algorithms that do not read W from a meta tensor lending its shape: same as from W."""
    for module in loaded[variant_id].modules.values():
        base = bases[torch.float32][layer_of(module.prefix)][module.param].float()
        plan = module.plan_for(tuple(base.shape))
        t = casting.cast_all(module.tensors, base.device, torch.float32)
        from_weight = change(plan, t, base, 0.5)
        from_shape = change(plan, t, torch.empty(base.shape, device="meta"), 0.5)
        assert from_shape.device == base.device and torch.equal(from_shape, from_weight)
        assert math.isclose(float(from_weight.norm()), 0.5 * float(change(plan, t, base, 1.0).norm()), rel_tol=1e-5)

