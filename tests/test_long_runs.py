"""A ComfyUI session runs for days: what the pack keeps between prompts must stay bounded (issue #23).

bench/soak.py measures a real server over hundreds of prompts; these are the regression tests for what it found,
each on the tiny SD1.5 through the nodes as ComfyUI's executor runs them.
"""

import gc
import weakref

import comfy.model_management
import test_nodes
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from test_nodes import PROJ_IN, TE_Q, TO_Q, lora, write
from test_report_unpatched import run

sd15 = test_nodes.sd15  # fixtures: the tiny SD1.5 (model, clip) from ComfyUI's checkpoint loader, a loras folder
loras = test_nodes.loras


def lora_file(loras) -> str:
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora(PROJ_IN, 320, 320, seed=3, kernel=(1, 1)),
          **lora(TE_Q, 768, 768, seed=5)}
    return write(loras, "long_run.safetensors", sd)


def block_weights_run(model, clip, name: str, text: str, apply_mode: str = "merge"):
    return run(LycorisBlockWeights, model=model, clip=clip, lycoris_name=name, strength_model=0.7,
               strength_clip=0.4, block_weights=text, preset="custom", strength_mode="linear", apply_mode=apply_mode)


def test_panel_charts_stay_bounded_over_many_block_weights(sd15, loras):
    """The panel's chart is kept per (model, file, side, block weights); the checkpoint's model lives for the whole
    session, so a sweep of block weights (an XY plot, a random search) added one chart per run without end."""
    model, clip = sd15
    name = lora_file(loras)
    bound = panel_report.CHARTS_PER_MODEL
    for i in range(bound + 16):
        block_weights_run(model, clip, name, f"default=1; input_blocks.*={i / 100:.2f}")
    assert len(panel_report._charts[model.model]) <= bound
    assert len(panel_report._charts[clip.cond_stage_model]) <= bound


def test_a_kept_chart_is_still_reused(sd15, loras, monkeypatch):
    """The bound drops the least recently used chart, not the one a strength change is about to reuse."""
    model, clip = sd15
    name = lora_file(loras)
    monkeypatch.setattr(panel_report, "CHARTS_PER_MODEL", 2)
    measured = []
    original = panel_report.block_changes
    monkeypatch.setattr(panel_report, "block_changes", lambda *a, **k: measured.append(1) or original(*a, **k))
    block_weights_run(model, clip, name, "input_blocks.*=0.5")
    block_weights_run(model, clip, name, "input_blocks.*=0.6")
    block_weights_run(model, clip, name, "input_blocks.*=0.5")  # used again: now the most recent
    block_weights_run(model, clip, name, "input_blocks.*=0.7")  # drops 0.6
    measured.clear()
    block_weights_run(model, clip, name, "input_blocks.*=0.5")
    assert not measured, "a chart still within the bound was measured again"


def test_nothing_of_a_prompt_outlives_its_outputs(sd15, loras):
    """Once a prompt's outputs are dropped and its models unloaded, its patched clones (and through them the
    adapters and bypass forms) are garbage, in every apply mode."""
    model, clip = sd15
    name = lora_file(loras)
    for mode in ("merge", "bypass", "auto"):
        (new_model, new_clip), _ui = block_weights_run(model, clip, name, "default=1", apply_mode=mode)
        comfy.model_management.load_models_gpu([new_model])
        clones = [weakref.ref(new_model), weakref.ref(new_clip.patcher)]
        del new_model, new_clip
        comfy.model_management.unload_all_models()
        gc.collect()
        assert all(ref() is None for ref in clones), f"{mode}: a patched clone is still referenced"
