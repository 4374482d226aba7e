"""Merge or bypass, row by row (nodes/glue/routing.py `route`), and the facts it is given (weight_format, PatchKey).

Every expectation is written from the documented rule, not read off the function:
- README "apply_mode": `auto` bakes fp16/bf16 in; fp32 too, except where ComfyUI merges through a narrower copy
  (0.33's fp16 `lora_compute_dtype`), where its Linear/Conv weights and biases run in the forward; fp8 (plain or
  scaled) and ComfyUI's quantized layers (fp8, mxfp8, int8; nvfp4 is one of them) run their weight changes in the
  forward, and a bias change where the bias is stored in fp8; GGUF is baked, exactly. `merge` always bakes in.
  `bypass` never touches the weights (nor an fp8 bias).
- CONTRIBUTING "fp16 patch copies": norm layers and targets ComfyUI stores converted are still merged.
- nodes/glue/routing.py's module docstring: a change that reads W is merged where W cannot be read in the forward,
  and the order rules after an earlier file's bypass.
"""

import pytest
import torch
from comfy.quant_ops import QuantizedTensor
from lycoris_nodes.nodes.glue.keymap import lora_key_map
from lycoris_nodes.nodes.glue.patch_key import Offset, PatchKey
from lycoris_nodes.nodes.glue.routing import (
    BYPASS,
    MERGE,
    MODES,
    Earlier,
    LayerFacts,
    PatchFacts,
    Reason,
    Route,
    route,
)
from lycoris_nodes.nodes.glue.weight_format import WeightFormat, weight_format
from patcher_util import HAS_SCALED_FP8_OPS, comfy_quant_linear, quantized_linear, scaled_fp8_linear
from test_trainer_names import meta_models  # noqa: F401 (a fixture)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def rounded(name: str) -> WeightFormat:
    """fp8 or one of ComfyUI's quantized layouts: readable (dequantized), a merge re-rounds into it."""
    return WeightFormat(name, readable=True, merge_exact=False, merge_rounds=True, merged_copy=None)


def plain(dtype: torch.dtype) -> WeightFormat:
    return WeightFormat(None, readable=True, merge_exact=True, merge_rounds=False, merged_copy=dtype)


# Every storage a weight can have, as weight_format classifies it (checked on real tensors below where this CPU can
# build one).
FORMATS = {
    "fp32": plain(F32),
    "bf16": plain(BF16),
    "fp16": plain(F16),
    "fp8 e4m3fn": rounded("fp8 e4m3fn"),  # plain fp8 (manual cast), 0.3.75's scaled fp8, comfy_quant float8
    "fp8 e5m2": rounded("fp8 e5m2"),
    "int8": rounded("int8"),  # comfy_quant int8 tensorwise
    "mxfp8": rounded("mxfp8"),
    "nvfp4": rounded("nvfp4"),
    # GGUF: the GGUF pack merges into the decoded weight at every forward and never re-quantizes, and reads it
    "GGUF Q4_0": WeightFormat("GGUF Q4_0", readable=True, merge_exact=True, merge_rounds=False, merged_copy=None),
    "GGUF F16": WeightFormat(None, readable=True, merge_exact=True, merge_rounds=False, merged_copy=None),
    # a tensor type we do not know: not readable, and no merge is known to be exact
    "unreadable": WeightFormat(None, readable=False, merge_exact=False, merge_rounds=False, merged_copy=None),
}

# Outcome codes of the table below.
OUTCOMES = {
    "merge": Route(MERGE, Reason.MODE_MERGE),
    "bypass": Route(BYPASS, Reason.MODE_BYPASS),
    "exact": Route(MERGE, Reason.MERGE_EXACT),
    "rounds": Route(BYPASS, Reason.MERGE_NOT_EXACT),
    "narrow": Route(BYPASS, Reason.MERGED_NARROWER),
    "unread": Route(MERGE, Reason.UNREADABLE_WEIGHT),
}
# ComfyUI's compute dtype for merges: None (0.3.75 patches an fp32 copy) or fp16 (0.33 on most NVIDIA GPUs).
COMPUTE = {"fp32 copy": None, "fp16 copy": F16}

# A Linear/Conv weight change: format -> mode -> outcomes for
#   (change needs no W, fp32 copy), (no W, fp16 copy), (reads W, fp32 copy), (reads W, fp16 copy)
WEIGHT_TABLE = {
    # fp32: baked in, except through ComfyUI's fp16 copy, which would round W to fp16 first
    "fp32": {"merge": ("merge",) * 4, "bypass": ("bypass",) * 4, "auto": ("exact", "narrow", "exact", "narrow")},
    # fp16/bf16: baked in; an fp16 copy is no narrower
    "bf16": {"merge": ("merge",) * 4, "bypass": ("bypass",) * 4, "auto": ("exact",) * 4},
    "fp16": {"merge": ("merge",) * 4, "bypass": ("bypass",) * 4, "auto": ("exact",) * 4},
    # fp8 and ComfyUI's quantized layers: auto adds the change as the layer runs (a merge would round it away)
    **{name: {"merge": ("merge",) * 4, "bypass": ("bypass",) * 4, "auto": ("rounds",) * 4}
       for name in ("fp8 e4m3fn", "fp8 e5m2", "int8", "mxfp8", "nvfp4")},
    # GGUF: auto bakes it in, exactly; bypass reads it through the GGUF pack's own cast
    **{name: {"merge": ("merge",) * 4, "bypass": ("bypass",) * 4, "auto": ("exact",) * 4}
       for name in ("GGUF Q4_0", "GGUF F16")},
    # unknown tensor type: what needs no W runs in the forward in auto (no merge is exact); what reads W is merged by
    # ComfyUI's own patching, which alone can decode it, in every mode
    "unreadable": {"merge": ("merge", "merge", "unread", "unread"), "bypass": ("bypass", "bypass", "unread", "unread"),
                   "auto": ("rounds", "rounds", "unread", "unread")},
}
READS = {"needs no W": False, "reads W": True}


def weight_patch(reads_weight: bool = False, **changes) -> PatchFacts:
    facts = {"param": "weight", "output_rows_only": True, "bypassable": True, "reads_weight": reads_weight,
             "changes_bias": False, **changes}
    return PatchFacts(**facts)


def layer(weight: WeightFormat = FORMATS["fp32"], bias: WeightFormat | None = FORMATS["fp32"], **changes
          ) -> LayerFacts:
    facts = {"linear_or_conv": True, "skips_forward": False, "weight": weight, "bias": bias, **changes}
    return LayerFacts(**facts)


WEIGHT_ROWS = [pytest.param(mode, fmt, reads, compute, WEIGHT_TABLE[fmt][mode][2 * i + j],
                            id=f"{mode}-{fmt}-{reads}-{compute}")
               for fmt in FORMATS for mode in MODES for i, reads in enumerate(READS)
               for j, compute in enumerate(COMPUTE)]


def test_the_table_covers_every_mode_and_format():
    assert set(WEIGHT_TABLE) == set(FORMATS)
    assert all(set(row) == set(MODES) for row in WEIGHT_TABLE.values())


@pytest.mark.parametrize("mode,fmt,reads,compute,outcome", WEIGHT_ROWS)
def test_weight_change_route(mode, fmt, reads, compute, outcome):
    got = route(mode, weight_patch(READS[reads]), layer(FORMATS[fmt]), compute_dtype=COMPUTE[compute])
    assert got == OUTCOMES[outcome]


# A bias change (a bypassable plan that changes the bias, on the layer's `.bias`): bias format -> mode -> outcomes
# for (fp32 copy, fp16 copy). Bypass mode keeps biases merged unless a merge would round them (README: bypass never
# touches an fp8 bias); auto does the same.
BIAS_OUTCOMES = {
    "merge": Route(MERGE, Reason.MODE_MERGE),
    "exact": Route(MERGE, Reason.BIAS_MERGE_EXACT),
    "rounds": Route(BYPASS, Reason.BIAS_MERGE_ROUNDS),
    "narrow": Route(BYPASS, Reason.BIAS_MERGED_NARROWER),
    "no path": Route(MERGE, Reason.NO_BIAS_PATH),
}
BIAS_TABLE = {
    "fp32": {"merge": ("merge", "merge"), "bypass": ("exact", "narrow"), "auto": ("exact", "narrow")},
    "bf16": {"merge": ("merge", "merge"), "bypass": ("exact", "exact"), "auto": ("exact", "exact")},
    "fp16": {"merge": ("merge", "merge"), "bypass": ("exact", "exact"), "auto": ("exact", "exact")},
    "fp8 e4m3fn": {"merge": ("merge", "merge"), "bypass": ("rounds", "rounds"), "auto": ("rounds", "rounds")},
}
BIAS_ROWS = [pytest.param(mode, fmt, compute, BIAS_TABLE[fmt][mode][j], id=f"bias-{mode}-{fmt}-{compute}")
             for fmt in BIAS_TABLE for mode in MODES for j, compute in enumerate(COMPUTE)]
BIAS_PATCH = weight_patch(param="bias", changes_bias=True)


@pytest.mark.parametrize("mode,fmt,compute,outcome", BIAS_ROWS)
def test_bias_change_route(mode, fmt, compute, outcome):
    got = route(mode, BIAS_PATCH, layer(FORMATS["fp8 e4m3fn"], FORMATS[fmt]), compute_dtype=COMPUTE[compute])
    assert got == BIAS_OUTCOMES[outcome]


@pytest.mark.parametrize("mode", MODES)
def test_bias_change_without_a_bias_path_is_merged(mode):
    """A layer without a bias, or one ComfyUI runs without its forward (int8 tensorwise under 0.33's
    linear_input_act: its WeightChange takes only weight changes), merges a bias change, whatever the mode."""
    assert route(mode, BIAS_PATCH, layer(bias=None)) == BIAS_OUTCOMES["no path"]
    assert route(mode, BIAS_PATCH, layer(FORMATS["int8"], FORMATS["fp8 e4m3fn"], skips_forward=True),
                 compute_dtype=F16) == BIAS_OUTCOMES["no path"]


def test_weight_change_on_a_layer_run_without_its_forward_is_routed_by_its_format():
    """Its entries go into the weight's cast (WeightChange), so the weight change routes as anywhere else."""
    assert route("auto", weight_patch(), layer(FORMATS["int8"], skips_forward=True)) == OUTCOMES["rounds"]


# Patches no mode bypasses: they are merged whatever the weight's format.
NEVER_BYPASSED = {
    # ComfyUI's converter function maps a whole change; a part other than output rows maps onto no output channel
    "converted key": (weight_patch(output_rows_only=False), layer(), Reason.NOT_OUTPUT_ROWS),
    "norm or embedding layer": (weight_patch(), layer(linear_or_conv=False), Reason.NOT_LINEAR_OR_CONV),
    "layer not looked up": (weight_patch(), None, Reason.NOT_LINEAR_OR_CONV),
    "plan with no forward form": (weight_patch(bypassable=False), layer(), Reason.NOT_BYPASSABLE),
    "another parameter (diff_m)": (weight_patch(param=None), layer(), Reason.NOT_BYPASSABLE),
    "bias key of a weight-only plan": (weight_patch(param="bias"), layer(), Reason.NOT_BYPASSABLE),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", NEVER_BYPASSED)
def test_never_bypassed(case, mode):
    patch, facts, reason = NEVER_BYPASSED[case]
    for fmt in ("fp8 e4m3fn", "fp32"):
        if facts is not None:
            facts = LayerFacts(facts.linear_or_conv, facts.skips_forward, FORMATS[fmt], facts.bias)
        assert route(mode, patch, facts, compute_dtype=F16) == Route(MERGE, reason)


# After an earlier file's bypass on the same parameter: (patch, earlier) -> outcome in every mode (the order of
# chained merges is kept whatever this file's mode).
ORDER = {
    "reads W of a bypassed layer": (weight_patch(True), Earlier(bypassed=True), Route(BYPASS, Reason.READS_BYPASSED)),
    "after a bypassed reader": (weight_patch(), Earlier(True, True), Route(BYPASS, Reason.AFTER_BYPASSED_READER)),
    "bias after a bypassed bias": (BIAS_PATCH, Earlier(bypassed=True), Route(BYPASS, Reason.BIAS_AFTER_BYPASSED)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ORDER)
def test_order_after_an_earlier_bypass(case, mode):
    patch, earlier, expected = ORDER[case]
    assert route(mode, patch, layer(), earlier) == expected


def test_order_rules_need_what_they_name():
    """A change that needs no W merges after a bypassed change that does not read W (merge mode: the merge is
    exact and the bypassed change adds to the output, so the order does not matter); one that reads an unreadable W
    is merged even then (only ComfyUI can decode it)."""
    assert route("merge", weight_patch(), layer(), Earlier(bypassed=True)) == OUTCOMES["merge"]
    assert route("merge", weight_patch(True), layer(FORMATS["unreadable"]), Earlier(True, True)) == OUTCOMES["unread"]


# --- the facts: weight_format on real tensors --------------------------------------------------------------------

class PackedTensor(torch.Tensor):
    """Stands for a weight type only its own ops can decode."""


class GGMLType:
    def __init__(self, name: str):
        self.name = name


def gguf_tensor(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """A tensor carrying what the GGUF pack's GGMLTensor carries (its GGML type and logical shape)."""
    tensor = data.as_subclass(PackedTensor)
    tensor.tensor_type, tensor.tensor_shape = GGMLType(type_name), torch.Size((4, 8))
    return tensor


def _plain(dtype):
    return torch.zeros(4, 8).to(dtype)


REAL_WEIGHTS = {
    "fp32": lambda: _plain(F32),
    "bf16": lambda: _plain(BF16),
    "fp16": lambda: _plain(F16),
    "fp8 e4m3fn": lambda: _plain(torch.float8_e4m3fn),
    "fp8 e5m2": lambda: _plain(torch.float8_e5m2),
    "GGUF Q4_0": lambda: gguf_tensor(torch.zeros(4, 18, dtype=torch.uint8), "Q4_0"),
    "GGUF F16": lambda: gguf_tensor(torch.zeros(4, 8, dtype=F16), "F16"),
    "unreadable": lambda: torch.nn.Parameter(torch.zeros(4, 8).as_subclass(PackedTensor), requires_grad=False),
}


@pytest.mark.parametrize("fmt", REAL_WEIGHTS)
def test_weight_format_of_tensors(fmt):
    assert weight_format(REAL_WEIGHTS[fmt]()) == FORMATS[fmt]


def test_weight_format_of_comfyui_layers():
    """fp8 as ComfyUI's layers hold it: 0.3.75's scaled fp8 op (a plain fp8 weight) or 0.33's QuantizedTensor, and
    a QuantizedTensor fp8 layout; on 0.33 also the comfy_quant int8 and mxfp8 layouts (nvfp4 needs a GPU kernel)."""
    weight, bias = torch.randn(8, 32) * 0.1, torch.zeros(8)
    assert weight_format(scaled_fp8_linear(weight, bias, torch.float8_e4m3fn, 0.5).weight) == FORMATS["fp8 e4m3fn"]
    quantized = quantized_linear(weight, bias, torch.float8_e4m3fn).weight
    assert isinstance(quantized, QuantizedTensor) and weight_format(quantized) == FORMATS["fp8 e4m3fn"]
    if HAS_SCALED_FP8_OPS:
        return  # 0.3.75 has no int8 or mxfp8 layout
    for layout, fmt in (("int8_tensorwise", "int8"), ("mxfp8", "mxfp8")):
        assert weight_format(comfy_quant_linear(weight, bias, layout).weight) == FORMATS[fmt], layout


def test_narrowing_compares_the_stored_float_with_the_compute_dtype():
    assert FORMATS["fp32"].merged_narrower(F16) and FORMATS["fp32"].merged_narrower(BF16)
    assert not FORMATS["fp32"].merged_narrower(None) and not FORMATS["fp32"].merged_narrower(F32)
    assert not FORMATS["bf16"].merged_narrower(F16) and not FORMATS["GGUF F16"].merged_narrower(torch.float8_e4m3fn)


# --- PatchKey: ComfyUI's keys, read and given back -----------------------------------------------------------------

def test_patch_key_reads_each_form():
    swap = object()
    assert PatchKey.from_comfy("a.weight") == PatchKey("a.weight")
    assert PatchKey.from_comfy(("a.weight", (0, 4, 2))) == PatchKey("a.weight", Offset(0, 4, 2))
    assert PatchKey.from_comfy(("a.weight", None, swap)) == PatchKey("a.weight", None, swap)
    assert PatchKey("a.weight", Offset(0, 4, 2)).narrowed((8, 3)) == (2, 3)
    assert PatchKey("a.weight", Offset(1, 1, 2)).narrowed((8, 3)) == (8, 2)
    assert PatchKey("a.weight", Offset(0, 4, 2)).bias_twin() == PatchKey("a.bias", Offset(0, 4, 2))
    assert PatchKey("a.weight", Offset(1, 0, 2)).bias_twin() is None and PatchKey("a.scale").bias_twin() is None
    assert PatchKey("a.weight", None, swap).bias_twin() == PatchKey("a.bias", None, swap)
    assert [PatchKey("w", o, f).output_rows_only for o, f in
            ((None, None), (Offset(0, 1, 2), None), (Offset(1, 1, 2), None), (None, swap))] == [True, True, False, False]


def test_every_key_map_entry_goes_back_to_comfyui_as_it_came(meta_models):  # noqa: F811
    """ComfyUI gets exactly its own keys back: every value of the key maps (ComfyUI's and ours) of SDXL, Flux (row
    slices), HunyuanVideo and Mochi (converter functions), and two text encoders."""
    forms = set()
    for name in ("sdxl", "flux", "hunyuan_video", "mochi", "sdxl_clip", "flux_clip"):
        for target in lora_key_map(meta_models[name], is_clip=name.endswith("_clip")).values():
            key = PatchKey.from_comfy(target)
            assert key.as_comfy() == target and type(key.as_comfy()) is type(target), target
            forms.add("whole" if key.is_whole else "converted" if key.is_converted else "offset")
    assert forms == {"whole", "offset", "converted"}
