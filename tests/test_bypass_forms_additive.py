"""The bypass forms of LoKr, LoHa and DoRA (issue #13): used where claimed, and equal to a merge and to the reference.

Each case is a real file parsed by the pack (`parse_state_dict`) on a layer given as its fp32 weight, run through
`lycoris_core.bypass` (prepare once, then the forward) and checked:
* (a) the form is used where the algorithm file claims one (`prepare(...).forms[i]` is not None), and the dense path
  where it claims none (grouped conv, a LoHa whose rank r₁r₂ would cost more than the layer, an input-side DoRA on
  some rows of a fused weight);
* (b) the output equals the layer's forward with the merged weight (`bypass.changed_weight`, the merge path that
  test_core_reference checks against lycoris-lora and PEFT) within fp32 rounding; bf16 inputs stay within a small
  multiple of the dense path's own bf16 error;
* (c) on the reference factory's files, the output equals lycoris-lora 4.1.3's own forward pass;
* a formed forward builds no weight-sized change: the dense change functions raise once prepared.
Stacking: a LoCon before and after the case on the same layer, chained like merges (DoRA's norm then reads W + the
first LoCon's change).
"""

import math
from dataclasses import dataclass

import pytest
import torch
from lycoris_nodes.lycoris_core import bypass, load, parse_state_dict
from lycoris_nodes.lycoris_core.bypass import Contribution, LayerOp, changed_weight, forward, prepare
from reference.lycoris_factory import LAYER, base_params, probe

pytestmark = pytest.mark.usefixtures("one_thread")

LINEAR = LayerOp()
CONV = LayerOp(2, (2, 2), (1, 1), (1, 1))  # stride 2, padding 1
GROUPED = LayerOp(2, (1, 1), (1, 1), (1, 1), 2)
STRENGTHS = (1.0, 0.5, -1.0, 0.0)
CHANGE_TOLERANCE = 1e-5  # ‖y − merged‖ / ‖merged − y_base‖: fp32 rounding (measured ≤ 6e-7)
NOISE = 1e-6  # fp32 forward noise relative to ‖y_base‖


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Case:
    id: str
    tensors: dict  # suffix -> shape (alpha: a float)
    shape: tuple[int, ...]  # the layer's weight
    op: LayerOp
    formed: bool  # the algorithm file claims a form here
    form_class: str = ""


def _lokr(w2: dict, **more) -> dict:
    return {"lokr_w1": (4, 3), **w2, **more}


CASES = (
    Case("lokr_linear_full", _lokr({"lokr_w2": (12, 12)}), (48, 36), LINEAR, True, "Kronecker"),
    Case("lokr_linear_decomposed", _lokr({"lokr_w2_a": (12, 2), "lokr_w2_b": (2, 12)}, alpha=1.0), (48, 36),
         LINEAR, True, "Kronecker"),
    Case("lokr_linear_both", {"lokr_w1_a": (6, 1), "lokr_w1_b": (1, 2), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 18),
                              "alpha": 1.5}, (48, 36), LINEAR, True, "Kronecker"),
    Case("lokr_conv_full", _lokr({"lokr_w2": (12, 4, 3, 3)}), (48, 12, 3, 3), CONV, True, "Kronecker"),
    Case("lokr_conv_flat", _lokr({"lokr_w2_a": (12, 2), "lokr_w2_b": (2, 36)}, alpha=3.0), (48, 12, 3, 3), CONV,
         True, "Kronecker"),
    Case("lokr_conv_tucker", _lokr({"lokr_w2_a": (2, 12), "lokr_w2_b": (2, 4), "lokr_t2": (2, 2, 3, 3)}, alpha=3.0),
         (48, 12, 3, 3), CONV, True, "Kronecker"),
    Case("lokr_grouped", {"lokr_w1": (4, 2), "lokr_w2": (12, 3, 3, 3)}, (48, 6, 3, 3), GROUPED, False),
    Case("loha_linear", {"hada_w1_a": (48, 2), "hada_w1_b": (2, 36), "hada_w2_a": (48, 3), "hada_w2_b": (3, 36),
                         "alpha": 1.0}, (48, 36), LINEAR, True, "Hadamard"),
    Case("loha_conv", {"hada_w1_a": (48, 2), "hada_w1_b": (2, 108), "hada_w2_a": (48, 2), "hada_w2_b": (2, 108),
                       "alpha": 1.0}, (48, 12, 3, 3), CONV, True, "Hadamard"),
    Case("loha_conv_tucker", {"hada_w1_a": (2, 48), "hada_w1_b": (2, 12), "hada_t1": (2, 2, 3, 3),
                              "hada_w2_a": (2, 48), "hada_w2_b": (2, 12), "hada_t2": (2, 2, 3, 3), "alpha": 1.0},
         (48, 12, 3, 3), CONV, True, "Hadamard"),
    # r₁r₂ = 64: 64·(36 + 48) > 36·48, the factored form would cost more than the layer
    Case("loha_high_rank", {"hada_w1_a": (48, 8), "hada_w1_b": (8, 36), "hada_w2_a": (48, 8), "hada_w2_b": (8, 36),
                            "alpha": 4.0}, (48, 36), LINEAR, False),
    Case("loha_grouped", {"hada_w1_a": (48, 2), "hada_w1_b": (2, 54), "hada_w2_a": (48, 2), "hada_w2_b": (2, 54)},
         (48, 6, 3, 3), GROUPED, False),
    Case("locon_linear", {"lora_up.weight": (48, 3), "lora_down.weight": (3, 36), "alpha": 2.0}, (48, 36), LINEAR,
         True, "Factored"),
)
BY_ID = {case.id: case for case in CASES}
DORA_BASES = ("locon_linear", "loha_linear", "loha_conv_tucker", "lokr_linear_decomposed", "lokr_conv_flat",
              "lokr_conv_tucker")
DORA_AXES = ("out", "in", "peft")  # LyCORIS per-output rows, per-input columns; PEFT's per-output magnitude


def state_dict(case: Case, dora: str | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    sd = {}
    for i, (suffix, shape) in enumerate(sorted(case.tensors.items())):
        value = torch.tensor(shape) if isinstance(shape, float) else randn(*shape, seed=seed + i) / 2
        sd[f"lycoris_layer.{suffix}"] = value
    out, fan_in = case.shape[0], case.shape[1]
    ones = [1] * (len(case.shape) - 2)
    if dora == "out":
        sd["lycoris_layer.dora_scale"] = 3 + randn(out, 1, *ones, seed=seed + 90).abs()
    elif dora == "in":
        sd["lycoris_layer.dora_scale"] = 3 + randn(1, fan_in, *ones, seed=seed + 91).abs()
    return sd


def contribution(sd: dict, weight_shape: tuple[int, ...], strength: float, reference: bool = False,
                 rows: tuple[int, int] | None = None, peft: bool = False) -> Contribution:
    lfile = parse_state_dict(sd, "case.safetensors")
    (module,) = lfile.modules.values()
    if peft:  # PEFT's magnitude (lora_magnitude_vector): one value per output row, whatever its shape
        module = type(module)(**{**module.__dict__, "dora_per_output": True})
    plan = module.plan_for(weight_shape if rows is None else (rows[1], *weight_shape[1:]), reference=reference)
    return Contribution(plan, module.tensors, strength, rows)


def peft_case(case: Case) -> dict[str, torch.Tensor]:
    sd = state_dict(case)
    sd["lycoris_layer.dora_scale"] = 3 + randn(case.shape[0], seed=92).abs()  # (out,)
    return sd


def layer(case: Case, seed: int = 100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, b, x) for the case's layer."""
    weight = randn(*case.shape, seed=seed) / math.sqrt(math.prod(case.shape[1:]))
    bias = randn(case.shape[0], seed=seed + 1)
    channels = case.shape[1] * case.op.groups
    x = randn(5, channels, seed=seed + 2) if not case.op.conv_dims else randn(2, channels, 9, 9, seed=seed + 2)
    return weight, bias, x


def run(op: LayerOp, contributions: list[Contribution], weight: torch.Tensor, bias: torch.Tensor,
        x: torch.Tensor) -> tuple[torch.Tensor, bypass.Prepared]:
    """Prepare once, then the forward, for a layer whose own forward runs in x's dtype."""
    shape = tuple(weight.shape)

    def layer_forward(xi: torch.Tensor) -> torch.Tensor:
        return with_bias(op, op(xi, weight.to(xi.dtype)), bias.to(xi.dtype))

    prepared = prepare(contributions, op, shape, x, lambda: (weight, bias))
    return forward(x, layer_forward, op, prepared, lambda: weight, shape), prepared


def with_bias(op: LayerOp, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return y + (bias if not op.conv_dims else bias.reshape(-1, *op.point))


def merged(op: LayerOp, contributions: list[Contribution], weight: torch.Tensor, bias: torch.Tensor,
           x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with the merged weight, in float64."""
    w = changed_weight(weight, contributions).double()
    return with_bias(op, op(x.double(), w), bias.double())


def assert_close(y: torch.Tensor, want: torch.Tensor, y_base: torch.Tensor, what: str, tolerance=CHANGE_TOLERANCE):
    error = float((y.double() - want).norm())
    allowed = tolerance * float((want - y_base).norm()) + NOISE * float(y_base.norm())
    assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g}"


def assert_form(prepared: bypass.Prepared, index: int, case: Case, formed: bool, form_class: str = ""):
    form = prepared.forms[index]
    if formed:
        assert form is not None, f"{case.id}: no form (dense path), one was claimed"
        assert not form_class or type(form).__name__ == form_class, (case.id, type(form).__name__)
    else:
        assert form is None, f"{case.id}: {type(form).__name__} where the dense path was claimed"


# --- (a) + (b): forms used where claimed, equal to the merge ------------------------------------------------------

PLAIN = [(case.id, m) for case in CASES for m in STRENGTHS]


@pytest.mark.parametrize("case_id,strength", PLAIN)
def test_form_equals_merge(case_id, strength):
    case = BY_ID[case_id]
    weight, bias, x = layer(case)
    c = contribution(state_dict(case), case.shape, strength)
    y, prepared = run(case.op, [c], weight, bias, x)
    assert_form(prepared, 0, case, case.formed, case.form_class)
    y_base = with_bias(case.op, case.op(x.double(), weight.double()), bias.double())
    assert_close(y, merged(case.op, [c], weight, bias, x), y_base, f"{case_id} m={strength}")


DORA = [(base, axis, m, reference) for base in DORA_BASES for axis in DORA_AXES for m in STRENGTHS
        for reference in (False, True) if axis != "peft" or not reference]


@pytest.mark.parametrize("base_id,axis,strength,reference", DORA)
def test_dora_form_equals_merge(base_id, axis, strength, reference):
    case = BY_ID[base_id]
    weight, bias, x = layer(case)
    sd = peft_case(case) if axis == "peft" else state_dict(case, axis)
    c = contribution(sd, case.shape, strength, reference, peft=axis == "peft")
    assert c.plan.dora_axis == ("in" if axis == "in" else "out")
    y, prepared = run(case.op, [c], weight, bias, x)
    assert_form(prepared, 0, case, True, "InputGain" if axis == "in" else "OutputGain")
    y_base = with_bias(case.op, case.op(x.double(), weight.double()), bias.double())
    assert_close(y, merged(case.op, [c], weight, bias, x), y_base, f"{base_id} {axis} m={strength} ref={reference}")


@pytest.mark.parametrize("case_id,dora", [("lokr_conv_tucker", None), ("loha_conv", None), ("locon_linear", "out"),
                                          ("lokr_conv_flat", "in"), ("loha_conv_tucker", "in")])
def test_bf16_input_within_the_dense_paths_error(case_id, dora):
    """bf16 activations: the form computes in bf16 like the layer; its error stays within a small multiple of the
    dense path's (which adds F(x; ΔW) in bf16 too)."""
    case = BY_ID[case_id]
    weight, bias, x = layer(case)
    c = contribution(state_dict(case, dora), case.shape, 0.5)
    want = merged(case.op, [c], weight, bias, x.bfloat16().float())
    y, prepared = run(case.op, [c], weight, bias, x.bfloat16())
    assert prepared.forms[0] is not None and y.dtype == torch.bfloat16
    dense = bypass.Prepared(prepared.contributions, (None,), c.reads_weight)
    shape = tuple(weight.shape)
    y_dense = forward(x.bfloat16(), lambda xi: with_bias(case.op, case.op(xi, weight.bfloat16()), bias.bfloat16()),
                      case.op, dense, lambda: weight, shape)
    error, dense_error = (float((v.double() - want).norm()) for v in (y, y_dense))
    assert error <= 3 * dense_error + 1e-3 * float(want.norm()), (error, dense_error)


# --- fused rows, stacking ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case_id,dora,formed", [("lokr_linear_decomposed", None, True), ("loha_linear", None, True),
                                                 ("locon_linear", "out", True), ("lokr_linear_full", "out", True),
                                                 ("loha_linear", "in", False)])
def test_rows_of_a_fused_weight(case_id, dora, formed):
    """The case changes rows [48, 96) of a (144, in) fused weight (ComfyUI's qkv offsets): output-side forms run on
    those rows; an input-side DoRA cannot (it would scale every row's input) and takes the dense path."""
    case = BY_ID[case_id]
    weight, bias, x = layer(Case(case.id, {}, (144, *case.shape[1:]), case.op, False))
    c = contribution(state_dict(case, dora), weight.shape, 0.5, rows=(48, 48))
    y, prepared = run(case.op, [c], weight, bias, x)
    assert_form(prepared, 0, case, formed)
    y_base = with_bias(case.op, case.op(x.double(), weight.double()), bias.double())
    assert_close(y, merged(case.op, [c], weight, bias, x), y_base, case_id)


def _locon(case: Case, seed: int) -> dict[str, torch.Tensor]:
    out, fan = case.shape[0], math.prod(case.shape[1:])
    down = randn(3, *case.shape[1:], seed=seed) / math.sqrt(fan)
    return {"lycoris_layer.lora_up.weight": randn(out, 3, *[1] * (len(case.shape) - 2), seed=seed + 1),
            "lycoris_layer.lora_down.weight": down, "lycoris_layer.alpha": torch.tensor(3.0)}


@pytest.mark.parametrize("case_id,dora,reference", [("lokr_conv_full", None, False), ("loha_conv_tucker", None, False),
                                                    ("lokr_linear_both", "out", True), ("loha_conv", "in", False),
                                                    ("lokr_conv_tucker", "in", True), ("locon_linear", "out", False)])
def test_stacked_between_two_locons(case_id, dora, reference):
    """LoCon, the case, LoCon on one layer: like three chained merges, each form used."""
    case = BY_ID[case_id]
    weight, bias, x = layer(case)
    chain = [contribution(_locon(case, 7), case.shape, 1.0),
             contribution(state_dict(case, dora), case.shape, 0.5, reference),
             contribution(_locon(case, 9), case.shape, -0.5)]
    y, prepared = run(case.op, chain, weight, bias, x)
    assert all(form is not None for form in prepared.forms), prepared.forms
    y_base = with_bias(case.op, case.op(x.double(), weight.double()), bias.double())
    assert_close(y, merged(case.op, chain, weight, bias, x), y_base, case_id)


@pytest.mark.parametrize("case_id,dora", [("lokr_conv_tucker", None), ("loha_conv_tucker", None),
                                          ("lokr_linear_both", "out"), ("loha_conv", "in")])
def test_formed_forward_builds_no_change(monkeypatch, case_id, dora):
    """Once prepared, a formed forward never forms ΔW or W': every function that would raises."""
    case = BY_ID[case_id]
    weight, bias, x = layer(case)
    c = contribution(state_dict(case, dora), case.shape, 0.5)
    shape = tuple(weight.shape)
    prepared = prepare([c], case.op, shape, x, lambda: (weight, bias))

    def forbidden(*args, **kwargs):
        raise AssertionError("a weight-sized change was formed in the forward")

    for name in ("change", "change_from_factors"):
        monkeypatch.setattr(Contribution, name, forbidden)
    monkeypatch.setattr(bypass, "_change", forbidden)
    monkeypatch.setattr(bypass, "change", forbidden)

    def weight_read():
        raise AssertionError("the forward read W")

    y = forward(x, lambda xi: with_bias(case.op, case.op(xi, weight), bias), case.op, prepared, weight_read, shape)
    monkeypatch.undo()
    y_base = with_bias(case.op, case.op(x.double(), weight.double()), bias.double())
    assert_close(y, merged(case.op, [c], weight, bias, x), y_base, case_id)


# --- (c): lycoris-lora's own forward --------------------------------------------------------------------------------

REFERENCE_VARIANTS = ("loha", "loha_tucker", "lokr", "lokr_tucker", "lokr_decompose_both", "locon_dora_in",
                      "loha_dora_out", "lokr_dora_in", "lokr_dora_out")


def layer_op(name: str) -> LayerOp:
    module = LAYER[name].make()
    if LAYER[name].kind == "linear":
        return LayerOp()
    return LayerOp(len(module.kernel_size), tuple(module.stride), module.padding, tuple(module.dilation),
                   module.groups)


def claims_form(tensors: dict, shape: torch.Size, op: LayerOp) -> bool:
    """Where loha.py/lokr.py claim a form: any ungrouped layer, and for LoHa where rank r₁r₂ costs fewer
    multiplications per output position than the layer (the rule its docstring states)."""
    if op.groups != 1:
        return False
    if "hada_w1_a" not in tensors:
        return True
    out, channels, kernel = shape[0], shape[1], math.prod(shape[2:])
    rank = tensors["hada_w1_b"].shape[0] * tensors["hada_w2_b"].shape[0]
    if "hada_t1" in tensors:
        return rank * (channels + rank * kernel + out) < channels * kernel * out
    return rank * (channels * kernel + out) < channels * kernel * out


@pytest.mark.parametrize("variant_id", REFERENCE_VARIANTS)
def test_form_equals_lycoris_forward(reference_files, variant_id):
    generated = reference_files[variant_id]
    lfile = load(generated.path)
    params = base_params(torch.float32)
    reference = generated.variant.reference_semantics
    for name in generated.variant.layers:
        if LAYER[name].kind == "norm" or name in generated.variant.skips:
            continue
        module = lfile.modules[f"lycoris_{name}.weight"]
        weight, bias = (None if p is None else p.float() for p in (params[name]["weight"], params[name]["bias"]))
        bias = torch.zeros(weight.shape[0]) if bias is None else bias
        op, x = layer_op(name), probe(name).float()
        for semantics in (False, True) if reference else (False,):
            for m in (1.0, 0.5, 0.0, -1.0) if semantics else (1.0, 0.5, -1.0):
                plan = module.plan_for(tuple(weight.shape), reference=semantics)
                y, prepared = run(op, [Contribution(plan, module.tensors, m)], weight, bias, x)
                assert (prepared.forms[0] is not None) == claims_form(module.tensors, weight.shape, op), (variant_id,
                                                                                                       name)
                truth = generated.truth(torch.float32, m, semantics)[name]
                assert_close(y, truth, generated.y_base[torch.float32][name], f"{variant_id} {name} m={m}",
                             tolerance=1e-4)
