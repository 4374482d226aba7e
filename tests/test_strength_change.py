"""A strength change on the loader nodes costs ComfyUI's re-patch, not one more pass over every weight for the panel.

The loader panel's per-block chart is ‖s·ΔW‖/‖W₀‖ per block, which in linear strength mode is |s| times its value at
strength 1 (every algorithm's change is linear in the strength there). It used to be measured again on every run (one
patch pass over each touched weight: 0.25 s on one SDXL transformer block, six times the re-patching itself,
bench/README.md); now a strength change rescales the chart measured once for that model and file.

Truth: the chart measured from scratch at the new strength (nodes/glue/report.py: block_changes, which
test_report_unpatched checks against float64 norms). Under LyCORIS semantics (strength_mode "lycoris") DoRA and OFT
are not linear in the strength, so the chart is measured at every run there.
"""

import pytest
import test_nodes
import torch
from lycoris_nodes.nodes.glue import report
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.glue.apply import map_file
from lycoris_nodes.nodes.glue.cache import load_cached
from lycoris_nodes.nodes.loading import loaders
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from test_nodes import PROJ_IN, TE_Q, TO_Q, lora, rand, run_node, write
from test_report_unpatched import run

sd15 = test_nodes.sd15  # fixtures: the tiny SD1.5 (model, clip) from ComfyUI's checkpoint loader, a loras folder
loras = test_nodes.loras


@pytest.fixture()
def measured(monkeypatch):
    """How many weights the panel measured (calls of glue/report.py: change_norms, the per-weight patch pass)."""
    calls = []
    original = report.change_norms

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(report, "change_norms", counting)
    return calls


def lora_file(loras) -> str:
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(PROJ_IN, 320, 320, seed=3, kernel=(1, 1)),
          **lora(TE_Q, 768, 768, seed=5)}
    return write(loras, "linear.safetensors", sd)


def blocks_of(ui) -> list[dict]:
    (payload,) = ui["lycoris"]
    assert payload["blocks"] is not None, "the report was not measured"
    return payload["blocks"]


def from_scratch(name, model, clip, strengths: dict, reference: bool = False) -> list[dict]:
    path = loaders.lycoris_path(name)
    _patches, rep = map_file(load_cached(path), model, clip, reference)
    return report.block_changes(rep, report.patchers_of(model, clip), strengths)


def assert_same_blocks(got: list[dict], want: list[dict]) -> None:
    assert [(b["name"], b["modules"]) for b in got] == [(b["name"], b["modules"]) for b in want]
    assert [b["change"] for b in got] == pytest.approx([b["change"] for b in want], rel=1e-6)


def test_a_strength_change_rescales_the_chart(sd15, loras, measured):
    model, clip = sd15
    name = lora_file(loras)
    _out, ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0,
                   strength_mode="linear", apply_mode="merge")
    assert len(measured) == 3, "the first run measures every applied weight once"
    for sm, sc in ((0.5, 2.0), (-1.5, 0.75), (3.0, 0.0)):
        measured.clear()
        _out, ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=sm,
                       strength_clip=sc, strength_mode="linear", apply_mode="merge")
        assert not measured, f"strength ({sm}, {sc}) measured {len(measured)} weights again"
        assert_same_blocks(blocks_of(ui), from_scratch(name, model, clip, {"model": sm, "clip": sc}))
    # the model-only node and bypass mode draw the same chart from the same measurement
    measured.clear()
    (_model,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=0.25,
                        strength_mode="linear", apply_mode="bypass")
    assert not measured
    assert_same_blocks(blocks_of(ui), from_scratch(name, model, None, {"model": 0.25}))


def test_a_rewritten_file_is_measured_again(sd15, loras, measured):
    model, clip = sd15
    name = lora_file(loras)
    run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    sd = {**lora(TO_Q, 320, 320, seed=11), f"{TO_Q}.lora_up.weight": rand(320, 4, seed=12, s=0.5)}
    write(loras, name, sd)  # same name, new content (a retrained file)
    measured.clear()
    _out, ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.5, strength_clip=0.5,
                   strength_mode="linear", apply_mode="merge")
    assert len(measured) == 1
    assert_same_blocks(blocks_of(ui), from_scratch(name, model, clip, {"model": 0.5, "clip": 0.5}))


def test_lycoris_semantics_are_measured_at_every_strength(sd15, loras, measured):
    """DoRA under LyCORIS semantics keeps W + ΔW at strength 0: not linear in the strength, so no rescaling."""
    model, _clip = sd15
    sd = {**lora(TO_Q, 320, 320, seed=1), f"{TO_Q}.dora_scale": 1 + rand(320, 1, seed=2, s=0.1)}
    name = write(loras, "dora.safetensors", sd)
    for strength in (1.0, 0.5):
        measured.clear()
        (_model,), ui = run(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=strength,
                            strength_mode="lycoris", apply_mode="merge")
        assert len(measured) == 1
        want = from_scratch(name, model, None, {"model": strength}, reference=True)
        assert_same_blocks(blocks_of(ui), want)
    assert blocks_of(ui)[0]["change"] != pytest.approx(0.5 * from_scratch(
        name, model, None, {"model": 1.0}, reference=True)[0]["change"], rel=1e-3), "DoRA here is not linear in m"


def test_the_cached_chart_holds_numbers_only(sd15, loras):
    """The cached chart holds numbers only, no tensor of the model (it lives as long as the model object)."""
    model, clip = sd15
    name = lora_file(loras)
    run_node(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    cached = panel_report._charts[model.model]
    values = [v for chart in cached.values() for block in chart for v in block.values()]
    assert values and not any(isinstance(v, torch.Tensor) for v in values)
