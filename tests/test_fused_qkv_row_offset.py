"""Fused-qkv LoKr split per projection with a row window (`row_offset`), as ComfyUI 0.38's converter writes it.

SimpleTuner/LyCORIS save a Krea2-style attention as one fused `…attn.to_qkv` adapter while ComfyUI's model keeps
to_q/to_k/to_v separate. `comfy.lora_convert.convert_fused_qkv_lora` (ComfyUI 0.38, called by `convert_lora`, which
our loader calls) splits it per projection: the query keeps the input width, key and value share the rest; LoRA
up/DoRA rows are split, down/alpha/W₂ repeated, and the LoKr outer factor W₁ is split by rows only when W₂'s row
count divides both sizes. Otherwise W₁ is repeated whole and `{base}{p}.row_offset` (0, q, q + kv) says which rows of
the fused kron(W₁, W₂) the projection takes.

Files: real LoKr files made by the reference (lycoris-lora 4.1.3) on one fused qkv Linear [in + 2·kv, in], with
seeded factors (as `reference.lycoris_factory` makes them). Truth: rows of the reference's own fused W'(m) − W, read
from its forward pass (the layer's output on the identity). Applied through lycoris_core (plan + patch: in place,
through a ComfyUI-style function, the change alone), through a real ComfyUI `ModelPatcher` holding three separate
q/k/v layers (full load, offloaded LowVramPatch, bypass), and summarised. fp32: ‖error‖ ≤ 1e-4·‖change‖.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import comfy.lora
import comfy.lora_convert
import comfy.ops
import pytest
import torch
import torch.nn.functional as F
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.lycoris_core import LycorisError, apply, change_norms, parse_state_dict
from lycoris_nodes.lycoris_core.bypass import Contribution, reads_weight
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.glue.apply import patched_clone
from patcher_util import (
    CPU,
    assert_bit_identical,
    forward_params,
    full_load,
    lowvram_patched,
    lycoris_patches,
    offload,
    patcher,
    set_param,
    snapshot,
)
from reference.lycoris_factory import SEED, Lazy, _class_presets_restored, _randomise
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: thread hand-offs cost more than the maths

IN = 64  # the query's width; key and value get `kv` rows each
PREFIX = "lycoris_transformer_blocks_0_attn_to_"  # what create_lycoris names transformer_blocks.0.attn.to_qkv
STRENGTHS = (1.0, 0.5, -1.0)
REFERENCE_STRENGTHS = (0.5, 0.0)  # DoRA under LyCORIS' own multiplier (at 0 it keeps W + ΔW)
CHANGE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
NOISE = 1e-6  # float32 forward noise, relative to ‖y_base‖


@dataclass(frozen=True)
class Case:
    kv: int
    kwargs: dict  # create_lycoris keyword arguments (algo lokr)
    row_window: bool  # W₂'s rows do not divide the q/k/v sizes: W₁ repeated whole, `row_offset` written
    dora: bool = False
    # 0.38's converter reads W₂'s row count only when lokr_w2 is whole or W₁ is decomposed too, and leaves a
    # whole lokr_w1 with a decomposed W₂ fused; the contract (and our reader) covers that form all the same, so
    # this case is always split by `contract_convert`
    contract_only: bool = False

    @property
    def rows(self) -> dict[str, tuple[int, int]]:
        """Projection -> (first row in the fused weight, row count)."""
        return {"q": (0, IN), "k": (IN, self.kv), "v": (IN + self.kv, self.kv)}


LOKR = {"linear_dim": 2, "linear_alpha": 1.5}
CASES = {
    # 144 = 12·12: W₂ has 12 rows, which divide neither 64 nor 40. Every span kind occurs: q = blocks 0–4 + 4 rows
    # of block 5; k = 8 rows of block 5, blocks 6–7, 8 rows of block 8; v = 4 rows of block 8, blocks 9–11.
    "window": Case(40, dict(LOKR, decompose_both=True), row_window=True),
    "window_full_matrix": Case(40, {"linear_dim": 8, "linear_alpha": 4.0, "full_matrix": True}, row_window=True),
    "window_w1_1x1": Case(40, dict(LOKR, factor=1), row_window=True, contract_only=True),  # W₁ (1, 1), W₂ = A @ B
    "window_dora": Case(40, dict(LOKR, decompose_both=True, dora_wd=True, wd_on_output=True), row_window=True,
                        dora=True),
    # 128 = 8·16: W₂'s 16 rows divide 64 and 32, so W₁'s rows are split (4, 2, 2) and no row_offset is written
    "outer_split": Case(32, dict(LOKR, decompose_both=True), row_window=False),
}


# ---------------------------------------------------------------------------------------------- the conversion

FUSED_KEY = re.compile(r"^(?P<base>.*attn[._]to_)qkv\.(?P<suffix>.+)$")
SHARED = ("lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "lokr_w1_b", "alpha", "lora_A.weight", "lora_down.weight",
          "lora_mid.weight")
OUTPUT = ("dora_scale", "lora_B.weight", "lora_up.weight")  # split by rows (q, kv, kv)
OUTER = ("lokr_w1", "lokr_w1_a")  # split by rows / W₂'s row count when it divides, else repeated + row_offset


def _fused_sizes(parts: dict[str, torch.Tensor]) -> tuple[int, int, int | None]:
    """(rows, input width, W₂'s row count or None for LoRA) of one fused adapter."""
    if not any(name in parts for name in OUTER):
        up = parts["lora_up.weight"] if "lora_up.weight" in parts else parts["lora_B.weight"]
        down = parts["lora_down.weight"] if "lora_down.weight" in parts else parts["lora_A.weight"]
        return up.shape[0], down.shape[1], None
    w1_rows = parts["lokr_w1"].shape[0] if "lokr_w1" in parts else parts["lokr_w1_a"].shape[0]
    w1_cols = parts["lokr_w1"].shape[1] if "lokr_w1" in parts else parts["lokr_w1_b"].shape[1]
    w2_rows = parts["lokr_w2"].shape[0] if "lokr_w2" in parts else parts["lokr_w2_a"].shape[0]
    w2_cols = parts["lokr_w2"].shape[1] if "lokr_w2" in parts else parts["lokr_w2_b"].shape[1]
    return w1_rows * w2_rows, w1_cols * w2_cols, w2_rows


def contract_convert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused to_qkv split of ComfyUI 0.38's `comfy.lora_convert.convert_fused_qkv_lora`, written from its
    contract (module docstring) because neither installed ComfyUI has it; same output keys, shapes and
    `row_offset` scalars. (0.38 also drops empty per-projection entries written next to a fused adapter: these
    files have none.)"""
    out, fused = {}, {}
    for key, tensor in sd.items():
        match = FUSED_KEY.match(key)
        if match is None:
            out[key] = tensor
        else:
            fused.setdefault(match["base"], {})[match["suffix"]] = tensor
    for base, parts in fused.items():
        rows, width, inner = _fused_sizes(parts)
        q, kv = width, (rows - width) // 2
        assert kv > 0 and q + 2 * kv == rows, f"{base}qkv: {rows} rows do not split as q = {q} + 2·kv"
        sizes = (q, kv, kv)
        outer_split = inner is not None and q % inner == 0 and kv % inner == 0
        for suffix, tensor in parts.items():
            if suffix in SHARED:
                pieces = (tensor,) * 3
            elif suffix in OUTPUT:
                pieces = tensor.split(sizes)
            else:
                assert suffix in OUTER, f"no conversion rule for {suffix}"
                pieces = tensor.split([size // inner for size in sizes]) if outer_split else (tensor,) * 3
            out.update({f"{base}{p}.{suffix}": piece for p, piece in zip("qkv", pieces)})
        if not outer_split and any(name in parts for name in OUTER):
            out.update({f"{base}{p}.row_offset": torch.tensor(start) for p, start in zip("qkv", (0, q, q + kv))})
    return out


REAL_CONVERT = getattr(comfy.lora_convert, "convert_fused_qkv_lora", None)  # ComfyUI ≥ 0.38


def convert(case: Case, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The running ComfyUI's own converter when it has one, else the contract above."""
    return (contract_convert if REAL_CONVERT is None or case.contract_only else REAL_CONVERT)(sd)


# --------------------------------------------------------------------------------------------- reference files

class FusedModel(torch.nn.Module):
    """transformer_blocks.0.attn.to_qkv: one fused Linear [in + 2·kv, in] with seeded float32 values (in float64)."""

    def __init__(self, kv: int):
        super().__init__()
        attn = torch.nn.Module()
        attn.add_module("to_qkv", torch.nn.Linear(IN, IN + 2 * kv, bias=False))
        block = torch.nn.Module()
        block.add_module("attn", attn)
        self.transformer_blocks = torch.nn.ModuleList([block])
        with torch.random.fork_rng():
            torch.manual_seed(SEED + kv)
            attn.to_qkv.weight.data = torch.randn(IN + 2 * kv, IN).div(IN ** 0.5).float().double()
        self.requires_grad_(False)

    @property
    def qkv(self) -> torch.nn.Linear:
        return self.transformer_blocks[0].attn.to_qkv


@dataclass
class FusedFile:
    case: Case
    path: Path  # the fused file as the reference saved it
    weight: torch.Tensor  # the fused W, float64
    changes: dict[tuple[float, bool], torch.Tensor] = field(repr=False)  # (m, reference) -> W'(m) − W, float64

    def truth(self, projection: str, strength: float, reference: bool) -> torch.Tensor:
        """Rows of the fused change for one projection: W'(m) − W (reference semantics) or m·(W'(1) − W)."""
        start, length = self.case.rows[projection]
        fused = self.changes[(strength, True)] if reference else strength * self.changes[(1.0, True)]
        return fused.narrow(0, start, length)

    def base(self, projection: str) -> torch.Tensor:
        return self.weight.narrow(0, *self.case.rows[projection])

    def converted(self) -> dict[str, torch.Tensor]:
        return convert(self.case, load_file(str(self.path)))


@torch.no_grad()
def make_fused_file(case_id: str, directory: Path) -> FusedFile:
    case = CASES[case_id]
    model = FusedModel(case.kv)
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [],
                                     "name_algo_map": {r"transformer_blocks\.0\.attn\.to_qkv$": {}}})
        net = create_lycoris(model, 1.0, warn_on_unmatched=False, algo="lokr", **case.kwargs)
    assert [lora.lora_name for lora in net.loras] == [f"{PREFIX}qkv"]
    for lora in net.loras:
        lora.to(torch.float64)
    _randomise(net, torch.Generator().manual_seed(SEED + sum(map(ord, case_id))))
    weight = model.qkv.weight.detach().clone()
    net.apply_to()
    path = directory / f"{case_id}.safetensors"
    net.save_weights(str(path), torch.float32, {})
    eye = torch.eye(IN, dtype=torch.float64)
    changes = {}
    for m in (1.0,) + (REFERENCE_STRENGTHS if case.dora else ()):
        net.set_multiplier(m)
        changes[(m, True)] = model.qkv(eye).T - weight  # the layer's output on I is W'(m)ᵀ
    return FusedFile(case, path, weight, changes)


@pytest.fixture(scope="module")
def fused_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fused_qkv")
    return Lazy(lambda case_id: make_fused_file(case_id, directory))


def semantics_strengths(case: Case) -> list[tuple[bool, float]]:
    linear = [(False, m) for m in STRENGTHS]
    return linear + ([(True, m) for m in REFERENCE_STRENGTHS] if case.dora else [])


def assert_change(actual: torch.Tensor, truth: torch.Tensor, what: str, dtype: torch.dtype = torch.float32) -> None:
    error, allowed = float((actual.double() - truth).norm()), CHANGE_TOLERANCE[dtype] * float(truth.norm())
    assert float(truth.norm()) > 0.1 * float(truth.abs().max()), f"{what}: the truth is empty"
    assert error <= allowed, f"{what}: ‖error‖ {error:.3g} > {allowed:.3g} (‖change‖ {float(truth.norm()):.3g})"


# --------------------------------------------------------------------------------------------- the converted file

@pytest.mark.parametrize("case_id", CASES)
def test_conversion_writes_row_offset_only_when_w2_rows_do_not_divide(fused_files, case_id):
    """The files carry the layout each case is about (a check of the files, not of our code)."""
    fused = fused_files[case_id]
    case, sd = fused.case, fused.converted()
    offsets = {p: sd.get(f"{PREFIX}{p}.row_offset") for p in "qkv"}
    assert not any(key.startswith(f"{PREFIX}qkv.") for key in sd)
    if case.row_window:
        assert {p: int(o) for p, o in offsets.items()} == {p: start for p, (start, _) in case.rows.items()}
    else:
        assert offsets == {"q": None, "k": None, "v": None}
        assert [sd[f"{PREFIX}{p}.lokr_w1_a"].shape[0] for p in "qkv"] == [4, 2, 2]
    if case.dora:
        assert [tuple(sd[f"{PREFIX}{p}.dora_scale"].shape) for p in "qkv"] == [(IN, 1), (case.kv, 1), (case.kv, 1)]


# ------------------------------------------------------------------------------------------------------ the core

@pytest.mark.parametrize("case_id", CASES)
def test_core_patches_the_projection_rows_of_the_fused_change(fused_files, case_id):
    """plan + patch, every way the core computes a change, against the rows of the reference's fused change."""
    fused = fused_files[case_id]
    lfile = parse_state_dict(fused.converted(), "fused.safetensors")
    assert set(lfile.modules) == {f"{PREFIX}{p}.weight" for p in "qkv"} and not lfile.unused
    for p in "qkv":
        module, w = lfile.modules[f"{PREFIX}{p}.weight"], fused.base(p)
        assert module.label == ("LoKr+DoRA" if fused.case.dora else "LoKr")
        for reference, m in semantics_strengths(fused.case):
            what = f"{p} m={m:+g} {'reference' if reference else 'linear'}"
            truth = fused.truth(p, m, reference)
            plan = module.plan_for(tuple(w.shape), reference=reference, file=lfile.name)
            patched = w.float().clone()
            apply(plan, module.tensors, patched, m)
            assert_change(patched.double() - w, truth, f"{what} in place")
            exact = w.clone()  # float64 weight and intermediate: only float64 rounding is left
            apply(plan, module.tensors, exact, m, intermediate_dtype=torch.float64)
            assert_change(exact - w, truth, f"{what} float64", torch.float64)
            halved = w.float().clone()  # ComfyUI hands a function: W + f(W'(m) − W), the change formed first
            apply(plan, module.tensors, halved, m, function=lambda d: d * 0.5)
            assert_change(halved.double() - w, 0.5 * truth, f"{what} through a function")
            contribution = Contribution(plan, module.tensors, m)
            alone = (contribution.change(w.float()) if reads_weight(plan)
                     else contribution.change_from_factors(tuple(w.shape), CPU))  # bypass: W only lends its shape
            assert_change(alone, truth, f"{what} change alone")
            squared, _ = change_norms(plan, module.tensors, w.float(), m)
            assert abs(squared ** 0.5 - float(truth.norm())) <= 1e-4 * float(truth.norm()), what


# ---------------------------------------------------------------------------------------- through real ComfyUI

KEY_MAP = {f"{PREFIX}{p}": f"{p}.weight" for p in "qkv"}


def qkv_model(fused: FusedFile) -> torch.nn.Module:
    """Three separate fp32 q/k/v layers, as ComfyUI's model holds the fused attention, with the fused W's rows."""
    net = torch.nn.Module()
    for p, (_, rows) in fused.case.rows.items():
        layer = comfy.ops.disable_weight_init.Linear(IN, rows, bias=False, dtype=torch.float32)
        set_param(layer, "weight", fused.base(p), torch.float32)
        net.add_module(p, layer)
    return net.requires_grad_(False)


def read_through_loader(fused: FusedFile, monkeypatch):
    """The file as our loader reads it: `convert_lora` first (0.38's own, or the contract's split in its place)."""
    if REAL_CONVERT is None or fused.case.contract_only:
        monkeypatch.setattr(comfy.lora_convert, "convert_lora", contract_convert)
    return cache.read(fused.path)


@pytest.mark.parametrize("case_id", CASES)
def test_model_patcher_full_load_and_offload(fused_files, case_id, monkeypatch):
    fused = fused_files[case_id]
    lfile = read_through_loader(fused, monkeypatch)
    net = qkv_model(fused)
    saved, base = snapshot(net), patcher(net)
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(SEED))
    for reference, m in semantics_strengths(fused.case):
        patches, report = lycoris_patches(lfile, net, KEY_MAP, reference=reference)
        assert not report.problems and len(report.applied) == 3, report.details()
        for path in ("full", "offload"):
            what = f"m={m:+g} {'reference' if reference else 'linear'} {path}"
            clone = base.clone()
            assert set(clone.add_patches(patches, m)) == set(patches)
            (full_load if path == "full" else offload)(clone)
            for p in "qkv":
                layer = getattr(net, p)
                assert lowvram_patched(layer) == (path == "offload"), what
                weight, _ = forward_params(layer, x)
                assert_change(weight.double() - fused.base(p), fused.truth(p, m, reference), f"{what} {p}")
            clone.unpatch_model(CPU)
            assert_bit_identical(net, saved)


def assert_bypassed(net: torch.nn.Module, fused: FusedFile, x: torch.Tensor, m: float, reference: bool,
                    what: str) -> None:
    """Each of the q/k/v layers' outputs is its base output plus its rows of the fused change, applied to x."""
    for p in "qkv":
        y_base, y = F.linear(x.double(), fused.base(p)), getattr(net, p)(x).double()
        change = F.linear(x.double(), fused.truth(p, m, reference))
        error = float((y - y_base - change).norm())
        assert error <= 1e-4 * float(change.norm()) + NOISE * float(y_base.norm()), f"{what} {p}: {error:.3g}"


@pytest.mark.parametrize("case_id", CASES)
def test_bypass_through_model_patcher(fused_files, case_id, monkeypatch):
    fused = fused_files[case_id]
    net = qkv_model(fused)
    saved, base = snapshot(net), patcher(net)
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(SEED))
    for reference, m in semantics_strengths(fused.case):
        what = f"m={m:+g} {'reference' if reference else 'linear'}"
        patches, _ = lycoris_patches(read_through_loader(fused, monkeypatch), net, KEY_MAP, reference=reference)
        clone, bypassed = patched_clone(base, patches, m, apply_mode="bypass", key="test")
        assert bypassed == 3, what
        full_load(clone)
        assert_bit_identical(net, saved)
        assert_bypassed(net, fused, x, m, reference, what)
        clone.detach()
        assert all("_lycoris_bypass" not in vars(getattr(net, p)) for p in "qkv")


def rebuilt(adapter):
    """The adapter as dynamic VRAM's prefetch rebuilds it (0.33: `comfy.lora.prefetch_prepared_value`, which keeps
    only `loaded_keys` and `weights`; core's LoKr loses its row_offset attribute there). 0.3.75 has no such
    rebuild: the same constructor call stands in for it."""
    prefetch = getattr(comfy.lora, "prefetch_prepared_value", None)
    if prefetch is None:
        return type(adapter)(adapter.loaded_keys, adapter.weights)
    return prefetch(adapter, [0], None, None, False)


@pytest.mark.parametrize("case_id", ["window", "window_dora"])
def test_row_window_survives_the_adapter_rebuild(fused_files, case_id, monkeypatch):
    """The window lives in the plan inside `weights`, so a rebuilt adapter patches the same rows."""
    fused = fused_files[case_id]
    net = qkv_model(fused)
    patches, _ = lycoris_patches(read_through_loader(fused, monkeypatch), net, KEY_MAP)
    for p in "qkv":
        adapter = rebuilt(patches[f"{p}.weight"])
        assert adapter is not patches[f"{p}.weight"]
        weight = comfy.lora.calculate_weight([(0.5, adapter, 1.0, None, None)], fused.base(p).float(), f"{p}.weight")
        assert_change(weight.double() - fused.base(p), fused.truth(p, 0.5, False), p)


# ------------------------------------------------------------------------------------------- bad row offsets

BAD_OFFSETS = {
    "negative": torch.tensor(-40),
    "past_the_fused_rows": torch.tensor(144),
    "not_integer": torch.tensor(64.5),
    "not_scalar": torch.tensor([64, 104]),
}


@pytest.mark.parametrize("bad", BAD_OFFSETS)
def test_bad_row_offset_is_refused_at_load_naming_file_and_key(fused_files, bad):
    sd = fused_files["window"].converted()
    sd[f"{PREFIX}k.row_offset"] = BAD_OFFSETS[bad]
    with pytest.raises(LycorisError) as raised:
        parse_state_dict(sd, "bad.safetensors")
    error = raised.value
    assert (error.file, error.key) == ("bad.safetensors", f"{PREFIX}k.row_offset")
    assert "row_offset" in error.reason and str(error).startswith(f"bad.safetensors: {PREFIX}k.row_offset: ")


def test_whole_float_row_offset_reads_as_that_integer(fused_files):
    fused = fused_files["window"]
    sd = fused.converted()
    sd[f"{PREFIX}k.row_offset"] = torch.tensor(float(IN))
    module = parse_state_dict(sd, "float.safetensors").modules[f"{PREFIX}k.weight"]
    w = fused.base("k")
    patched = w.float().clone()
    apply(module.plan_for(tuple(w.shape)), module.tensors, patched, 1.0)
    assert_change(patched.double() - w, fused.truth("k", 1.0, False), "k")


def test_row_window_past_the_target_is_refused_before_patching(fused_files):
    """An offset valid for the fused change but too large for its target (or a target of another input width)
    refuses that module with the file and key named, and only that module: nothing of it reaches the patcher."""
    fused = fused_files["window"]
    sd = fused.converted()
    sd[f"{PREFIX}k.row_offset"] = torch.tensor(110)  # 110 + 40 rows > 144
    lfile = parse_state_dict(sd, "late.safetensors")
    module = lfile.modules[f"{PREFIX}k.weight"]
    with pytest.raises(LycorisError) as raised:
        module.plan_for((fused.case.kv, IN), file=lfile.name)
    assert (raised.value.file, raised.value.key) == ("late.safetensors", f"{PREFIX}k.row_offset")
    assert "110" in raised.value.reason and "144" in raised.value.reason
    with pytest.raises(LycorisError) as raised:
        lfile.modules[f"{PREFIX}q.weight"].plan_for((IN, IN + 1), file=lfile.name)
    assert raised.value.key.startswith(f"{PREFIX}q") and "65" in raised.value.reason
    patches, report = lycoris_patches(lfile, qkv_model(fused), KEY_MAP, name="late.safetensors")
    assert set(patches) == {"q.weight", "v.weight"}
    assert [key for key, _ in report.problems] == [f"{PREFIX}k.weight"]
    assert "row_offset" in report.problems[0][1]


# ------------------------------------------------------------------------------------------------- the summary

@pytest.mark.parametrize("case_id", ["window", "window_dora"])
def test_summary_reads_a_converted_file(fused_files, case_id, tmp_path):
    fused = fused_files[case_id]
    path = tmp_path / "converted.safetensors"
    save_file({k: v.contiguous().clone() for k, v in fused.converted().items()}, str(path))
    summary = summarize(path)
    label = "LoKr+DoRA" if fused.case.dora else "LoKr"
    assert (summary.module_count, summary.algorithms, summary.unused_keys) == (3, {label: 3}, 0)
    assert summary.rank == {"min": 2, "max": 2} and summary.alpha == {"min": 1.5, "max": 1.5}


# ------------------------------------------------------------------------------------ the fused file unconverted

@pytest.mark.parametrize("case_id", CASES)
def test_unconverted_fused_file_is_split_onto_q_k_v_by_rows(fused_files, case_id):
    """The fused to_qkv file itself (no converter: 0.3.75 and 0.33 have none) on the three separate layers: the
    loader splits the one module by rows (Module.rows, tests/test_fused_split.py), one patch per projection, the
    same rows of the fused change in full load, offload and bypass."""
    fused = fused_files[case_id]
    lfile = parse_state_dict(load_file(str(fused.path)), "fused.safetensors")
    net = qkv_model(fused)
    saved, base = snapshot(net), patcher(net)
    x = torch.randn(8, IN, generator=torch.Generator().manual_seed(SEED))
    for reference, m in semantics_strengths(fused.case):
        what = f"m={m:+g} {'reference' if reference else 'linear'}"
        patches, report = lycoris_patches(lfile, net, KEY_MAP, reference=reference)
        assert not report.problems and list(report.applied) == [f"{PREFIX}qkv.weight"], report.details()
        assert set(patches) == {f"{p}.weight" for p in "qkv"}
        for path in ("full", "offload"):
            clone = base.clone()
            clone.add_patches(patches, m)
            (full_load if path == "full" else offload)(clone)
            for p in "qkv":
                weight, _ = forward_params(getattr(net, p), x)
                assert_change(weight.double() - fused.base(p), fused.truth(p, m, reference), f"{what} {path} {p}")
            clone.unpatch_model(CPU)
            assert_bit_identical(net, saved)
        clone, bypassed = patched_clone(base, patches, m, apply_mode="bypass", key="test")
        assert bypassed == 3, what
        full_load(clone)
        assert_bypassed(net, fused, x, m, reference, f"{what} bypass")
        clone.detach()
