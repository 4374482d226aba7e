"""Bypass forms of the maps (issue #13): OFT (LyCORIS diag-OFT, its 2.0 `oft_diag`, kohya's), BOFT, PEFT's OFT and
BOFT, (IA)³ (LyCORIS and PEFT) and GLoRA run in the layer's forward without forming W'.

For every case the form must (a) be used where the algorithm claims one (`prepare(...).forms[0]` is not None) and
not where it claims the dense path (None), and (b) give the merged layer's output: y = W'(m)·x + b with W'(m) from
our own merge (`changed_weight`, itself checked against lycoris-lora and PEFT in test_core_reference.py and
test_peft_formats.py), within fp32 rounding, or bf16 rounding for bf16 inputs. (c) Against the independent truths:
lycoris-lora 4.1.3's forward on its own files (reference.lycoris_factory, both multiplier semantics) and PEFT's
merge_and_unload on files PEFT wrote (test_peft_formats.make_adapter).

Cases: Linear and a 3×3 conv with stride 2 and padding 1, with and without bias; strengths 1, 0.5, −1, 0; LyCORIS'
reference semantics; rescale; a BOFT constraint and a BOFT split into several runs of stages; the rows of a fused
weight; a LoCon on the same layer before and after.
"""

import pytest
import torch
from lycoris_nodes.lycoris_core import load, parse_state_dict
from lycoris_nodes.lycoris_core.algos import boft
from lycoris_nodes.lycoris_core.bypass import Contribution, LayerOp, changed_weight, layer_output, prepare

STRENGTHS = (1.0, 0.5, -1.0, 0.0)
FP32_TOLERANCE = 1e-5  # of ‖y − y_base‖ (the change), plus fp32 noise of ‖y_base‖
NOISE = 1e-6
BF16_TOLERANCE = 2e-2  # of ‖y − y_base‖ (the change): bf16 factors, against the exact merged output
BF16_ROUNDING = 2 ** -7  # of ‖y‖: the input's and the output's rounding to bf16 (≤ 2^-9 each), which no form avoids

# (op, weight shape, input shape): out = 32 = 4 blocks of 8 (OFT), 8 blocks of 4 in 4 stages (BOFT)
SITES = {
    "linear": (LayerOp(), (32, 24), (6, 24)),
    "conv": (LayerOp(2, (2, 2), (1, 1)), (32, 24, 3, 3), (2, 24, 9, 9)),
    "pointwise": (LayerOp(2, (1, 1), (0, 0)), (32, 24, 1, 1), (2, 24, 5, 5)),
}


def _rand(gen: torch.Generator, *shape: int, std: float = 0.1) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def _ones(site: str) -> tuple[int, ...]:
    return (1,) * (len(SITES[site][1]) - 2)


def oft(gen, site, alpha=0.0, rescale=False):
    sd = {"lora_unet_m.oft_blocks": _rand(gen, 4, 8, 8), "lora_unet_m.alpha": torch.tensor(alpha)}
    if rescale:
        sd["lora_unet_m.rescale"] = 1 + _rand(gen, 32, *_ones(site))
    return sd


def oft_v2(gen, site):
    q = _rand(gen, 4, 8, 8)
    return {"lora_unet_m.oft_diag": torch.linalg.matrix_exp(q - q.transpose(1, 2)) * (1 + _rand(gen, 4, 8, 1))}


def kohya_oft(gen, site):
    return {"oft_unet_m.oft_blocks": _rand(gen, 4, 8, 8), "oft_unet_m.alpha": torch.tensor(1e-2)}


def boft_file(gen, site, alpha=0.0, rescale=False):
    sd = {"lora_unet_m.oft_blocks": _rand(gen, 4, 8, 4, 4), "lora_unet_m.alpha": torch.tensor(alpha)}
    if rescale:
        sd["lora_unet_m.rescale"] = 1 + _rand(gen, 32, *_ones(site))
    return sd


def ia3(gen, site, on_input=False):
    n = 24 if on_input else 32
    weight = _rand(gen, n) if site == "linear" else _rand(gen, 1, n, *_ones(site))
    return {"lora_unet_m.weight": weight, "lora_unet_m.on_input": torch.tensor(int(on_input))}


def glora(gen, site, old=False):
    kernel = SITES[site][1][2:]
    ones = (1,) * len(kernel)
    if old:
        return {"lora_unet_m.a1.weight": _rand(gen, 4, 24, *ones), "lora_unet_m.a2.weight": _rand(gen, 24, 4, *ones),
                "lora_unet_m.b1.weight": _rand(gen, 4, 24, *ones), "lora_unet_m.b2.weight": _rand(gen, 32, 4, *ones),
                "lora_unet_m.alpha": torch.tensor(2.0)}
    return {"lora_unet_m.a1.weight": _rand(gen, 24, 4, *ones), "lora_unet_m.a2.weight": _rand(gen, 4, 24, *ones),
            "lora_unet_m.b1.weight": _rand(gen, 32, 4, *ones), "lora_unet_m.b2.weight": _rand(gen, 4, 24, *kernel),
            "lora_unet_m.alpha": torch.tensor(2.0)}


def locon(gen, site, shape=None):
    out, inp, *kernel = shape or SITES[site][1]
    return {"lora_unet_l.lora_up.weight": _rand(gen, out, 4, *(1,) * len(kernel)),
            "lora_unet_l.lora_down.weight": _rand(gen, 4, inp, *kernel), "lora_unet_l.alpha": torch.tensor(2.0)}


# id -> (file maker, sites, has LyCORIS' reference semantics); each has a form at every strength on these sites
CASES = {
    "oft": (oft, ("linear", "conv"), True),
    "oft_rescaled": (lambda g, s: oft(g, s, rescale=True), ("linear", "conv"), True),
    "oft_constraint": (lambda g, s: oft(g, s, alpha=1e-3, rescale=True), ("linear", "conv"), True),
    "oft_v2": (oft_v2, ("linear", "conv"), True),
    "kohya_oft": (kohya_oft, ("linear", "conv"), True),
    "boft": (boft_file, ("linear", "conv"), True),
    "boft_rescaled_constraint": (lambda g, s: boft_file(g, s, alpha=2e-3, rescale=True), ("linear", "conv"), True),
    "ia3": (ia3, ("linear", "conv"), False),
    "ia3_on_input": (lambda g, s: ia3(g, s, on_input=True), ("linear", "conv"), False),
    "glora": (glora, ("linear", "conv", "pointwise"), False),
    "glora_old": (lambda g, s: glora(g, s, old=True), ("linear", "pointwise"), False),
}
# BOFT's stages as one block map (the default at these sizes) and as a run per stage (gathers between runs)
PARAMS = [(case, site, runs) for case, (_, sites, _) in CASES.items() for site in sites
          for runs in ((False, True) if case.startswith("boft") else (False,))]


def contribution(sd: dict, shape: tuple[int, ...], strength: float, reference: bool = False,
                 rows: tuple[int, int] | None = None) -> Contribution:
    (module,) = parse_state_dict(sd, "maps.safetensors").modules.values()
    target = shape if rows is None else (rows[1], *shape[1:])
    return Contribution(module.plan_for(target, reference=reference), module.tensors, strength, rows)


def form_of(c: Contribution, op: LayerOp, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor):
    """The form `prepare` picks for a single contribution (None: the dense path)."""
    return prepare([c], op, tuple(weight.shape), x, lambda: (weight, bias)).forms[0]


def run(contributions: list[Contribution], site: str, weight: torch.Tensor, bias: torch.Tensor | None,
        dtype: torch.dtype = torch.float32, seed: int = 0):
    """(forms, bypassed output, merged output in float64, base output in float64) on a seeded input."""
    op, shape, x_shape = SITES[site]
    x = torch.randn(x_shape, generator=torch.Generator().manual_seed(seed))

    def add_bias(y, b):
        return y if b is None else y + (b if not op.conv_dims else b.reshape(-1, *op.point))

    def layer(xi):  # the layer's own forward on its stored (rounded) weight, in the input's dtype
        return add_bias(op(xi, weight.to(xi.dtype)), None if bias is None else bias.to(xi.dtype))

    forms = prepare(contributions, op, shape, x.to(dtype), lambda: (weight, bias)).forms
    y = layer_output(x.to(dtype), layer, op, contributions, weight, bias).double()
    merged = add_bias(op(x.double(), changed_weight(weight, contributions).double()), _double(bias))
    base = add_bias(op(x.double(), weight.double()), _double(bias))
    return forms, y, merged, base


def _double(t):
    return None if t is None else t.double()


def assert_close(y, want, base, dtype, what):
    """‖y − want‖ within a share of the change ‖want − base‖, plus the dtype's floor on the outputs themselves (fp32
    noise; bf16's rounding of input and output): a strength off by 40% fails in both."""
    error = float((y - want).norm())
    change = float((want - base).norm())
    if dtype == torch.float32:
        allowed = FP32_TOLERANCE * change + NOISE * float(base.norm())
    else:
        allowed = BF16_TOLERANCE * change + BF16_ROUNDING * float(want.norm())
    assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g}"


def base_layer(site: str, bias: bool, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = SITES[site][1]
    weight = (torch.randn(shape, generator=gen) * 0.2).to(dtype).float()  # values the stored dtype holds
    b = (torch.randn(shape[0], generator=gen) * 0.5).to(dtype).float() if bias else None
    return weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case,site,runs", PARAMS)
def test_form_equals_merge(case, site, runs, bias, dtype, monkeypatch):
    if runs:
        monkeypatch.setattr(boft, "GROUP_ROWS", 4)
    make, _, has_reference = CASES[case]
    sd = make(torch.Generator().manual_seed(sum(map(ord, case + site))), site)
    weight, b = base_layer(site, bias, dtype)
    for reference in (False, True) if has_reference else (False,):
        for m in STRENGTHS:
            what = f"{case} {site} {'reference' if reference else 'linear'} m={m:+g}"
            c = contribution(sd, tuple(weight.shape), m, reference)
            forms, y, merged, base = run([c], site, weight, b, dtype)
            assert forms[0] is not None, what
            assert_close(y, merged, base, dtype, what)


@pytest.mark.parametrize("case", ["oft_rescaled", "kohya_oft", "boft_rescaled_constraint", "ia3", "ia3_on_input",
                                  "glora"])
@pytest.mark.parametrize("site", ["linear", "conv"])
def test_stacked_with_locon_before_and_after(case, site):
    """LoCon, the map, LoCon on one layer: applied in order as chained merges (a map reads W with the first LoCon's
    change in it, and the second LoCon is not rotated or scaled)."""
    make, _, has_reference = CASES[case]
    gen = torch.Generator().manual_seed(7)
    weight, b = base_layer(site, True, torch.float32)
    shape = tuple(weight.shape)
    chain = [contribution(locon(gen, site), shape, 0.8), contribution(make(gen, site), shape, 0.5, has_reference),
             contribution(locon(gen, site), shape, -0.6)]
    forms, y, merged, base = run(chain, site, weight, b)
    assert all(form is not None for form in forms), case
    assert_close(y, merged, base, torch.float32, case)


# output-side maps take a fused weight's rows; an input-side map of some rows is no map of the layer's input
@pytest.mark.parametrize("case,form", [("oft_rescaled", True), ("kohya_oft", True), ("boft_rescaled_constraint", True),
                                       ("ia3", True), ("glora", True), ("ia3_on_input", False)])
@pytest.mark.parametrize("site", ["linear", "conv"])
def test_rows_of_a_fused_weight(case, form, site):
    make, _, has_reference = CASES[case]
    op, shape, x_shape = SITES[site]
    fused = (96, *shape[1:])
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(fused, generator=gen) * 0.2
    b = torch.randn(96, generator=gen) * 0.5
    sd = make(gen, site)
    x = torch.randn(x_shape, generator=gen)
    c = contribution(sd, fused, 0.5, has_reference, rows=(32, 32))

    def layer(xi):
        return op(xi, weight) + (b if not op.conv_dims else b.reshape(-1, *op.point))

    assert (form_of(c, op, weight, b, x) is not None) == form
    y = layer_output(x, layer, op, [c], weight, b).double()
    bb = b.double() if not op.conv_dims else b.double().reshape(-1, *op.point)
    merged = op(x.double(), changed_weight(weight, [c]).double()) + bb
    base = op(x.double(), weight.double()) + bb
    assert torch.equal(y.narrow(op.channel_dim, 0, 32), layer(x).double().narrow(op.channel_dim, 0, 32))
    assert_close(y, merged, base, torch.float32, case)


@pytest.mark.parametrize("groups", [4, 8])
def test_grouped_conv(groups):
    """A grouped conv applies row o of W' to the inputs of o's group: an output map has a form only if it mixes rows
    of one group (OFT's blocks of 8 in groups of 8 rows, not in groups of 4; BOFT mixes all 32 rows); the input
    scale of (IA)³ repeats per group; GLoRA's input factors would act per group: no form."""
    op, x = LayerOp(2, (1, 1), (1, 1), (1, 1), groups), torch.randn(2, 32, 6, 6)
    gen = torch.Generator().manual_seed(5)
    per_group = 32 // groups
    weight = torch.randn(32, per_group, 3, 3, generator=gen) * 0.2
    files = {"oft": (oft(gen, "conv", rescale=True), groups == 4),
             "boft": (boft_file(gen, "conv", rescale=True), False),
             "ia3": (ia3(gen, "conv"), True),
             "ia3_on_input": ({"lora_unet_m.weight": _rand(gen, 1, per_group, 1, 1),
                               "lora_unet_m.on_input": torch.tensor(1)}, True),
             "glora": ({"lora_unet_m.a1.weight": _rand(gen, per_group, 4, 1, 1),
                        "lora_unet_m.a2.weight": _rand(gen, 4, per_group, 1, 1),
                        "lora_unet_m.b1.weight": _rand(gen, 32, 4, 1, 1),
                        "lora_unet_m.b2.weight": _rand(gen, 4, per_group, 3, 3)}, False)}
    for name, (sd, form) in files.items():
        c = contribution(sd, tuple(weight.shape), 0.5)
        assert (form_of(c, op, weight, None, x) is not None) == form, name
        y = layer_output(x, lambda xi: op(xi, weight), op, [c], weight).double()
        merged, base = op(x.double(), changed_weight(weight, [c]).double()), op(x.double(), weight.double())
        assert_close(y, merged, base, torch.float32, name)


# --- (c) the independent truths ----------------------------------------------------------------------------------

REFERENCE_VARIANTS = ("oft", "oft_constraint", "oft_rescaled", "boft", "boft_constraint", "boft_rescaled", "ia3",
                      "ia3_on_input", "glora")


@pytest.mark.parametrize("variant_id", REFERENCE_VARIANTS)
def test_forms_equal_lycoris_forward(reference_files, bases, variant_id):
    """Each layer of lycoris-lora's own file, bypassed at the core (fp32 weights), against its forward pass."""
    from reference.lycoris_factory import LAYER, functional_forward, layer_of, probe

    generated = reference_files[variant_id]
    lfile = load(generated.path)
    checked = 0
    for key, module in lfile.modules.items():
        name = layer_of(key.removesuffix(".weight"))
        if name is None or LAYER[name].kind == "norm" or not key.endswith(".weight"):
            continue
        params = bases[torch.float32][name]
        weight = params["weight"].float()
        bias = None if params["bias"] is None else params["bias"].float()
        template = LAYER[name].make()
        op = (LayerOp() if isinstance(template, torch.nn.Linear) else
              LayerOp(len(template.kernel_size), tuple(template.stride), template.padding, tuple(template.dilation),
                      template.groups))
        x = probe(name).float()

        def layer(xi, weight=weight, bias=bias, name=name):
            return functional_forward(name, xi, weight, bias)

        y_base = generated.y_base[torch.float32][name]
        for reference in (False, True) if generated.variant.reference_semantics else (False,):
            for m in (0.5, 0.0) if reference else (1.0, 0.5, -1.0):
                c = Contribution(module.plan_for(tuple(weight.shape), reference=reference), module.tensors, m)
                # BOFT's butterfly mixes the rows of all four groups of the grouped conv: dense path there
                dense = variant_id.startswith("boft") and name == "conv2d_grouped"
                assert (form_of(c, op, weight, bias, x) is None) == dense, name
                y = layer_output(x, layer, op, [c], weight, bias).double()
                truth = generated.truth(torch.float32, m, reference)[name]
                error, change = float((y - truth).norm()), float((truth - y_base).norm())
                assert error <= 1e-4 * change + NOISE * float(y_base.norm()), (name, reference, m, error, change)
                checked += 1
    assert checked > 0


PEFT_FORMS = {  # variant -> which layers have a form at strength 1 and below 1 (PEFT's own Net in test_peft_formats)
    "oft-neumann-default": ({"lin", "pw"}, {"lin", "pw"}),
    "oft-block-share": ({"lin", "pw"}, {"lin", "pw"}),
    "oft-coft-exact": ({"lin", "pw"}, {"lin", "pw"}),
    "boft-1-factor": ({"lin", "pw"}, set()),  # W + m(s ⊙ W Mᵀ − W) needs two products with W below 1
    "boft-3-factors": ({"lin", "pw"}, set()),  # three factors: the gathers between them composed
    "ia3-normal": ({"lin", "ff", "pw", "conv", "square"},) * 2,
    "ia3-feedforward": ({"lin", "ff", "pw", "conv", "square"},) * 2,
}


@pytest.mark.parametrize("variant_id", sorted(PEFT_FORMS))
def test_forms_equal_peft_merge(variant_id):
    """Files PEFT wrote, bypassed with a bias, against PEFT's merge_and_unload (W + m·(W_PEFT − W))."""
    import test_peft_formats as peft_formats
    _, state, truth = peft_formats.make_adapter(variant_id)
    lfile = parse_state_dict(peft_formats._with_options(state, variant_id), variant_id)
    at_one, below_one = PEFT_FORMS[variant_id]
    gen = torch.Generator().manual_seed(11)
    for name, (weight, change) in truth.items():
        module = lfile.modules[f"{peft_formats.PREFIX}{name}.weight"]
        op, x = peft_formats.LAYERS[name], torch.randn(peft_formats.INPUTS[name], generator=gen)
        bias = torch.randn(weight.shape[0], generator=gen)
        bb = bias if not op.conv_dims else bias.reshape(-1, *op.point)
        for m in STRENGTHS:
            c = Contribution(module.plan_for(tuple(weight.shape)), module.tensors, m)
            assert (form_of(c, op, weight, bias, x) is not None) == (name in (at_one if m == 1 else below_one)), (name, m)
            y = layer_output(x, lambda xi, w=weight, o=op, bb=bb: o(xi, w) + bb, op, [c], weight, bias).double()
            want = op(x.double(), (weight + m * change).double()) + bb.double()
            base = op(x.double(), weight.double()) + bb.double()
            assert float((y - want).norm()) <= 1e-4 * float((want - base).norm()) + NOISE * float(base.norm()), (
                name, m)
