"""The coverage report (what a file did to this model) on the tiny real SD1.5 checkpoint, through the nodes as ComfyUI's
executor runs them: applied/not applied with reasons, parameter share, family verdict, per-block ‖ΔW‖/‖W‖ and the
`ui` payload the loaders and LyCORIS Info send to the panel.

Truth is computed here: ΔW = up·down·alpha/r in float64 from the tensors written, W from the checkpoint as loaded,
parameter counts from the tensors written.
"""

import contextlib
import json
import logging
import math
import signal

import execution
import pytest
import test_nodes
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import read
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from node_runner import map_node
from test_nodes import LOGGER, PROJ_IN, PROJ_IN_KEY, TE_Q, TE_Q_KEY, TO_Q, TO_Q_KEY, lora, lora_delta64, write

# test_nodes' fixtures: the tiny SD1.5 (model, clip) and an empty loras folder that ComfyUI lists
sd15 = test_nodes.sd15
loras = test_nodes.loras

MID_V = "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_v"
MID_V_KEY = "diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_v.weight"
OUT_CONV = "lora_unet_output_blocks_1_0_in_layers_2"
OUT_CONV_KEY = "diffusion_model.output_blocks.1.0.in_layers.2.weight"
TE_FC1 = "lora_te_text_model_encoder_layers_1_mlp_fc1"
TE_FC1_KEY = "clip_l.transformer.text_model.encoder.layers.1.mlp.fc1.weight"
TO_K = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k"
TO_V = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_v"

# module prefix -> (model key, block, side)
TARGETS = {
    TO_Q: (TO_Q_KEY, "input_blocks.1", "model"),
    PROJ_IN: (PROJ_IN_KEY, "input_blocks.1", "model"),
    MID_V: (MID_V_KEY, "middle_block.1", "model"),
    OUT_CONV: (OUT_CONV_KEY, "output_blocks.1", "model"),
    TE_Q: (TE_Q_KEY, "te.clip_l.layers.0", "clip"),
    TE_FC1: (TE_FC1_KEY, "te.clip_l.layers.1", "clip"),
}


def full_file():
    return {**lora(TO_Q, 320, 320, seed=1), **lora(PROJ_IN, 320, 320, seed=3, kernel=(1, 1)),
            **lora(MID_V, 320, 768, seed=5, alpha=8.0), **lora(OUT_CONV, 320, 640, seed=7, rank=2, kernel=(3, 3)),
            **lora(TE_Q, 768, 768, seed=9), **lora(TE_FC1, 3072, 768, seed=11, rank=8, alpha=1.0)}


def run(cls, **inputs):
    """(outputs, ui) of a node run the way ComfyUI's executor runs it, ui merged as the executor merges it."""
    results = map_node(cls, inputs)
    _output, ui, _ = execution.get_output_from_returns(results, cls)
    (result,) = results
    # the server sends ui over the websocket and keeps it in /history as JSON: it must be strict JSON
    return result.result, json.loads(json.dumps(ui, allow_nan=False))


def panel(ui) -> dict:
    (payload,) = ui["lycoris"]
    return payload


def params(sd, prefixes) -> int:
    return sum(t.numel() for k, t in sd.items() if k.rsplit(".", 2)[0] in prefixes and not k.endswith(".alpha"))


@pytest.fixture(scope="module")
def weights(sd15):
    """The untouched weights the modules target, as float64."""
    model, clip = sd15
    msd, csd = model.model.state_dict(), clip.cond_stage_model.state_dict()
    return {key: (msd[key] if side == "model" else csd[key]).double().clone() for key, _b, side in TARGETS.values()}


def expected_blocks(sd, weights, strengths, prefixes) -> dict[str, tuple[float, int]]:
    """{block: (‖ΔW‖/‖W‖ over the block, modules)} by hand, in float64."""
    sums: dict[str, list] = {}
    for prefix in prefixes:
        key, block, side = TARGETS[prefix]
        entry = sums.setdefault(block, [0.0, 0.0, 0])
        entry[0] += float((strengths[side] * lora_delta64(sd, prefix)).square().sum())
        entry[1] += float(weights[key].square().sum())
        entry[2] += 1
    return {block: (math.sqrt(c / w), n) for block, (c, w, n) in sums.items()}


def assert_blocks(got: list[dict], expected: dict[str, tuple[float, int]]):
    assert {b["name"]: b["modules"] for b in got} == {name: n for name, (_c, n) in expected.items()}
    for b in got:
        assert b["change"] == pytest.approx(expected[b["name"]][0], rel=1e-5, abs=1e-12), b["name"]


def lycoris_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(LOGGER)]


# --- (a) a file that fits entirely -----------------------------------------------------------------------------------

def test_full_match_report_and_per_block_change(sd15, weights, loras, caplog):
    model, clip = sd15
    sd = full_file()
    name = write(loras, "full.safetensors", sd)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        (_m, _c), ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                           strength_clip=0.5, strength_mode="linear")
    assert not lycoris_warnings(caplog)
    p = panel(ui)
    assert (p["applied"], p["total"], p["verdict"], p["problems"], p["unused_keys"]) == (6, 6, "", [], [])
    assert p["params_applied"] == p["params_total"] == params(sd, TARGETS)
    # LoRA where the layer has no kernel wider than 1 (Linear, 1×1 conv), LoCon on the 3×3 conv
    assert p["algorithms"] == {"LoRA": 5, "LoCon": 1}
    assert p["line"] == f"{name}: 6/6 modules applied (LoRA 5, LoCon 1, 100% of parameters)"
    assert any(r.getMessage() == f"LyCORIS {p['line']}" for r in caplog.records)  # the same line as the log
    # each side at its own strength: model blocks at 1, text-encoder blocks at 0.5
    assert_blocks(p["blocks"], expected_blocks(sd, weights, {"model": 1.0, "clip": 0.5}, TARGETS))
    assert p["summary"] == summarize(loras / name).to_json()

    # LyCORIS Info at 0.5 measures both sides at 0.5, patches nothing, and reports the same coverage
    (summary_text, triggers, coverage), info_ui = run(LycorisInfo, lycoris_name=name, model=model, clip=clip,
                                                      strength=0.5)
    cov = json.loads(coverage)
    assert cov["line"] == p["line"] and cov["verdict"] == "" and cov["applied"] == 6
    assert_blocks(cov["blocks"], expected_blocks(sd, weights, {"model": 0.5, "clip": 0.5}, TARGETS))
    assert panel(info_ui)["blocks"] == cov["blocks"] and panel(info_ui)["summary"] == p["summary"]
    assert summary_text.startswith(f"{name}: 6 modules (LoRA ×5, LoCon ×1), rank 2–8, alpha 1–8") and triggers == ""
    assert model.patches == {} and clip.patcher.patches == {}


def test_strength_half_halves_every_block(sd15, weights, loras):
    model, clip = sd15
    sd = full_file()
    name = write(loras, "half.safetensors", sd)
    _out, full = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    _out, half = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.5, strength_clip=0.5)
    assert_blocks(panel(full)["blocks"], expected_blocks(sd, weights, {"model": 1.0, "clip": 1.0}, TARGETS))
    assert_blocks(panel(half)["blocks"], expected_blocks(sd, weights, {"model": 0.5, "clip": 0.5}, TARGETS))
    for b_full, b_half in zip(panel(full)["blocks"], panel(half)["blocks"], strict=True):
        assert b_half["change"] == pytest.approx(b_full["change"] / 2, rel=1e-6)


def test_info_without_model_is_the_summary_only(loras):
    sd = full_file()
    name = write(loras, "alone.safetensors", sd, {"modelspec.trigger_phrase": "zzz, yy",
                                                   "ss_base_model_version": "sd_v1"})
    (text, triggers, coverage), ui = run(LycorisInfo, lycoris_name=name)
    assert coverage == "{}" and triggers == "zzz, yy"
    assert panel(ui) == {"summary": summarize(loras / name).to_json(), "line": None, "blocks": None, "problems": []}
    # no attn2.to_k in the file: a UNet, which one the names alone cannot say
    assert "base model: sd_v1 (declared), SD (UNet) (from key names)" in text


# --- (b) a file for another architecture -----------------------------------------------------------------------------

def sdxl_file():
    """SDXL kohya names: CLIP-G (lora_te2_, 1280 wide) and input_blocks 7/8 transformers (SD1.5 has neither)."""
    sd = {}
    for layer in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            sd.update(lora(f"lora_te2_text_model_encoder_layers_{layer}_self_attn_{proj}", 1280, 1280, seed=layer,
                           rank=2))
    for block in (7, 8):
        for t in range(2):
            base = f"lora_unet_input_blocks_{block}_1_transformer_blocks_{t}_"
            sd.update(lora(base + "attn1_to_q", 1280, 1280, seed=t, rank=2))
            sd.update(lora(base + "attn2_to_k", 1280, 2048, seed=t, rank=2))
    return sd


SDXL_META = {"ss_base_model_version": "sdxl_base_v1-0"}
VERDICT = "This file looks made for sdxl_base_v1-0 / SDXL, not for this SD15."


def test_file_for_sdxl_is_one_error_through_the_loader(sd15, loras, caplog):
    model, clip = sd15
    sd = sdxl_file()
    name = write(loras, "sdxl_style.safetensors", sd, SDXL_META)
    with caplog.at_level(logging.DEBUG), pytest.raises(LycorisError) as err:
        run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    message = str(err.value)
    assert message.startswith(f"{name}: none of its 16 modules fit this model.")
    assert message.count(VERDICT) == 1
    assert "\n" not in message and len(message) < 600  # one line, not a list of every key
    assert len(lycoris_warnings(caplog)) <= 1
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage().lower()]
    assert model.patches == {} and clip.patcher.patches == {}


def test_file_for_sdxl_through_info_gives_the_verdict(sd15, loras):
    model, clip = sd15
    name = write(loras, "sdxl_info.safetensors", sdxl_file(), SDXL_META)
    (text, _t, coverage), ui = run(LycorisInfo, lycoris_name=name, model=model, clip=clip)
    cov = json.loads(coverage)
    assert cov["verdict"] == VERDICT and cov["applied"] == 0 and cov["total"] == 16
    assert cov["line"] == f"{name}: 0/16 modules applied. {VERDICT}"
    # says so and stops (issue #12: 63 lines of JSON for 12 modules, thousands for a real Flux file) ...
    assert list(cov)[:2] == ["line", "verdict"] and "problems" not in cov and "blocks" not in cov
    assert cov["not_listed"].startswith("16 modules and 0 unused keys") and len(coverage.splitlines()) <= 20
    assert panel(ui)["verdict"] == VERDICT and len(panel(ui)["problems"]) == 16  # ... the full list is kept
    assert "base model: sdxl_base_v1-0 (declared), SDXL (from key names)" in text
    assert model.patches == {} and clip.patcher.patches == {}


# --- (c) text-encoder modules with no CLIP connected ----------------------------------------------------------------

def test_model_only_reports_text_encoder_modules(sd15, weights, loras, caplog):
    model, _clip = sd15
    sd = full_file()
    unet = [TO_Q, PROJ_IN, MID_V, OUT_CONV]
    name = write(loras, "mixed.safetensors", sd)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (new_model,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0)
    assert set(new_model.patches) == {TARGETS[p][0] for p in unet}
    p = panel(ui)
    assert p["applied"] == 4 and p["total"] == 6 and p["verdict"] == ""
    # missing by design (no CLIP connected): harmless, listed apart from the failures (issue #34)
    assert p["problems"] == []
    assert sorted(p["harmless"]) == [[f"{TE_Q}.weight", "text-encoder module, but no CLIP is connected"],
                                     [f"{TE_FC1}.weight", "text-encoder module, but no CLIP is connected"]]
    share = params(sd, unet) / params(sd, TARGETS)
    assert 0 < share < 1 and p["params_applied"] / p["params_total"] == pytest.approx(share, rel=1e-12)
    assert (p["params_applied"], p["params_total"]) == (params(sd, unet), params(sd, TARGETS))
    assert p["line"].endswith(f"4/6 modules applied (LoRA 3, LoCon 1, {100 * share:.0f}% of parameters), 2 not in "
                              "this model (harmless: text-encoder modules with no CLIP connected)")
    assert_blocks(p["blocks"], expected_blocks(sd, weights, {"model": 1.0}, unet))
    assert lycoris_warnings(caplog) == []  # the line, at info level, says it all


# --- (d) one damaged module, one misspelled name ---------------------------------------------------------------------

def test_shape_mismatch_and_nearest_name(sd15, loras, caplog):
    model, clip = sd15
    misspelled = TO_V.replace("attn1_to_v", "attn1_to_vv")
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(MID_V, 320, 768, seed=2), **lora(TE_Q, 768, 768, seed=3),
          **lora(TO_K, 320, 64, seed=4),  # to_k reads 320 features, this lora_down 64
          **lora(misspelled, 320, 320, seed=5)}
    name = write(loras, "damaged.safetensors", sd)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        (new_model, new_clip), ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                                        strength_clip=1.0)
    assert set(new_model.patches) == {TO_Q_KEY, MID_V_KEY} and set(new_clip.patcher.patches) == {TE_Q_KEY}
    p = panel(ui)
    assert p["applied"] == 3 and p["total"] == 5 and p["verdict"] == ""
    problems = dict(p["problems"])
    assert set(problems) == {f"{TO_K}.weight", f"{misspelled}.weight"}
    assert problems[f"{TO_K}.weight"] == "module is for a weight of shape [320, 64], the model's is [320, 320]"
    assert problems[f"{misspelled}.weight"] == ("no weight of this model has this name; "
                                                f"nearest name in this model: {TO_V}")
    (warning,) = lycoris_warnings(caplog)
    assert warning.startswith(f"LyCORIS {p['line']}; not applied:")
    for key, reason in problems.items():
        assert f"{key}: {reason}" in warning
    assert {b["name"] for b in p["blocks"]} == {"input_blocks.1", "middle_block.1", "te.clip_l.layers.0"}

    # the panel's payload is the Info node's coverage for the same model and strength
    (_s, _t, coverage), _ui = run(LycorisInfo, lycoris_name=name, model=model, clip=clip, strength=1.0)
    cov = json.loads(coverage)
    for field in ("line", "applied", "total", "problems", "unused_keys", "params_applied", "params_total", "verdict"):
        assert cov[field] == p[field], field
    assert [b["name"] for b in cov["blocks"]] == [b["name"] for b in p["blocks"]]
    for a, b in zip(cov["blocks"], p["blocks"], strict=True):
        assert a["change"] == pytest.approx(b["change"], rel=1e-6)
    assert p["summary"] == summarize(loras / name).to_json()
    assert p["summary"]["module_count"] == 5  # the summary reads names and shapes, not the model


# --- regressions (found while writing these tests, fixed in 3219eca) ------------------------------------------------

@pytest.mark.parametrize("case", ["te-heavy-model-only", "half-misspelled"])
def test_verdict_does_not_blame_a_file_made_for_this_family(case, sd15, loras):
    """The verdict used to fire whenever at most half the modules applied, and named whatever family the file declared
    or looked like, even the model's own: an SD1.5 file with a trained text encoder through the Model Only node, or a
    2-module file with one typo, got 'This file looks made for sd_v1 / SD1.x, not for this SD15.'"""
    model, clip = sd15
    if case == "te-heavy-model-only":
        sd = {**lora(TO_Q, 320, 320, seed=1), **lora(MID_V, 320, 768, seed=2)}
        for layer in range(2):
            for proj in ("q_proj", "k_proj", "v_proj"):
                sd.update(lora(f"lora_te_text_model_encoder_layers_{layer}_self_attn_{proj}", 768, 768, seed=layer))
        metadata, clip = {"ss_base_model_version": "sd_v1"}, None
    else:
        sd = {**lora(TO_Q, 320, 320, seed=1), **lora(TO_V.replace("attn1", "atn1"), 320, 320, seed=2)}
        metadata = {}
    name = write(loras, f"{case}.safetensors", sd, metadata)
    _patches, report = map_file(read(loras / name), model, clip, reference=False)
    assert (len(report.applied), report.total) == ((2, 8) if case == "te-heavy-model-only" else (1, 2))
    assert report.verdict == ""
    if case == "half-misspelled":  # with no verdict, the typo gets its hint
        (problem,) = report.problems
        assert problem[1].endswith(f"nearest name in this model: {TO_V}")


def test_blocks_are_in_model_order(sd15, loras):
    """block_changes promises model order (the panel draws the blocks as given); it used to keep the file's order,
    which safetensors writes sorted by name: input, out, output, time_embed."""
    model, clip = sd15
    sd = {**lora("lora_unet_time_embed_0", 1280, 320, seed=1), **lora(TO_Q, 320, 320, seed=2),
          **lora("lora_unet_out_2", 4, 320, seed=3, kernel=(3, 3)), **lora(MID_V, 320, 768, seed=4),
          **lora("lora_unet_output_blocks_0_1_proj_out", 320, 320, seed=5, kernel=(1, 1)), **lora(TE_Q, 768, 768, seed=6)}
    name = write(loras, "order.safetensors", sd)
    _out, ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    assert [b["name"] for b in panel(ui)["blocks"]] == \
        ["time_embed.0", "input_blocks.1", "middle_block.1", "output_blocks.0", "out.2", "te.clip_l.layers.0"]


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (without a traceback through the interrupted code) when the block takes longer than `seconds`."""
    def interrupt(_signum, _frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    timed_out = False
    try:
        yield
    except TimeoutError:
        timed_out = True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if timed_out:
        pytest.fail(f"took more than {seconds} s", pytrace=False)


@pytest.mark.timeout(0)  # pytest-timeout's SIGALRM would clash with time_limit's
@pytest.mark.parametrize("case", ["sdxl-file", "near-misses"])
def test_unmatched_modules_are_reported_quickly(case, sd15, loras):
    """find_target used to run difflib over the whole key map for every module that matched nothing, ~0.06 s a module
    on this tiny model's 1,001-key map: this 204-module SDXL file took 12 s, the UNet and CLIP-G part of an ordinary
    SDXL LoRA (914 modules) 37 s before the 'none of its modules fit' error."""
    model, clip = sd15
    sd = {}
    if case == "sdxl-file":
        for block in (7, 8):  # SDXL's ten-deep transformers (small tensors: the names are what costs)
            base = f"lora_unet_input_blocks_{block}_1_"
            for t in range(10):
                for target in ("attn1_to_q", "attn1_to_k", "attn1_to_v", "attn1_to_out_0", "attn2_to_q",
                               "attn2_to_k", "attn2_to_v", "attn2_to_out_0", "ff_net_0_proj", "ff_net_2"):
                    sd.update(lora(f"{base}transformer_blocks_{t}_{target}", 64, 64, seed=t, rank=1))
            sd.update({**lora(base + "proj_in", 64, 64, seed=1, rank=1), **lora(base + "proj_out", 64, 64, seed=2,
                                                                                  rank=1)})
        metadata = SDXL_META
    else:  # a file of this family whose names are all slightly off: no verdict, so nearest names are searched
        for i in range(204):
            sd.update(lora(f"{TO_Q}{i}", 320, 320, seed=i, rank=1))
        metadata = {"ss_base_model_version": "sd_v1"}
    name = write(loras, f"{case}.safetensors", sd, metadata)
    lfile = read(loras / name)
    with time_limit(3.0):
        _patches, report = map_file(lfile, model, clip, reference=False)
    assert report.total == 204 and not report.applied and len(report.problems) == 204
    hints = [reason for _key, reason in report.problems if "nearest name" in reason]
    if case == "sdxl-file":
        assert report.verdict == VERDICT and not hints  # a file for another model has no useful nearest name
    else:
        assert report.verdict == "" and 1 <= len(hints) <= 20  # hints for the rows the warning lists
        assert all(h.endswith(f"nearest name in this model: {TO_Q}") for h in hints)


def test_strength_zero_reports_what_would_fit(sd15, loras):
    """At strength 0 nothing is patched, but the panel gets the coverage (no per-block change) instead of a stale one."""
    model, clip = sd15
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2), **lora(TO_K, 320, 64, seed=3)}
    name = write(loras, "off.safetensors", sd)
    (new_model, new_clip), ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.0,
                                    strength_clip=0.0)
    assert new_model is model and new_clip is clip and model.patches == {}
    p = panel(ui)
    assert p["line"] == f"{name}: strength 0, nothing applied (2/3 modules fit)"
    assert p["blocks"] is None and [k for k, _r in p["problems"]] == [f"{TO_K}.weight"]
    (only,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=0.0)
    assert only is model
    assert panel(ui)["line"] == f"{name}: strength 0, nothing applied (1/3 modules fit)"


def test_info_with_clip_only_does_not_blame_the_file(sd15, loras):
    """LyCORIS Info with only `clip` connected (to check the text-encoder part of an SD1.5 file): the UNet modules get
    'no weight of this model has this name' and, being the majority, a verdict 'This file looks made for sd_v1 / SD
    (UNet), not for this model.' — the mirror image of the 'no CLIP is connected' case fixed in 3219eca.

    Proposed fix (nodes/glue/apply.py): in find_target, when "model" is not in `shapes` and the prefix is not a
    text-encoder prefix, return 'diffusion-model module, but no MODEL is connected'; family_verdict leaves those out
    like the 'no CLIP is connected' ones."""
    _model, clip = sd15
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(MID_V, 320, 768, seed=2), **lora(TE_Q, 768, 768, seed=3)}
    name = write(loras, "sd1_clip_only.safetensors", sd, {"ss_base_model_version": "sd_v1"})
    (_s, _t, coverage), _ui = run(LycorisInfo, lycoris_name=name, clip=clip)
    cov = json.loads(coverage)
    assert cov["applied"] == 1 and cov["total"] == 3
    assert cov["verdict"] == ""
    assert all("no MODEL is connected" in reason for _key, reason in cov["problems"])
