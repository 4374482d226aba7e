"""The per-block report (‖ΔW‖/‖W‖ per block, on the loader panels, LyCORIS Info and Block Info) measures against
the weights as loaded, whatever an earlier run left in the shared nn.Module.

ComfyUI keeps the last loaded clone's patches in the module until another clone loads (clones share the module and
its `backup` of the original weights); forced hooks (a CLIP with Set CLIP Hooks) stay patched in it while it is
loaded, with the original in `hook_backup`. A report read from the module itself then measured a patched weight:
a user saw `input_blocks.1` read 0.30 on a fresh server, 0.2375 after a strength-1 run and 0.2751 after a
strength-3 run, for the same file, strength and checkpoint.

Truth: ‖s·ΔW‖/‖W₀‖ per block in float64 from the file's tensors and the checkpoint's weights; and the report on the
same fresh model before anything was loaded (the same computation on the same weights, so bitwise equal).
"""

import math

import comfy.model_management
import comfy.model_patcher
import comfy.utils
import execution
import pytest
import test_nodes
import torch
from comfy_extras.nodes_hooks import SetClipHooks
from lycoris_nodes.nodes.inspection.block_info import LycorisBlockInfo
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.scheduling.schedule import LycorisHook
from node_runner import map_node
from patcher_util import CPU
from test_nodes import PROJ_IN, PROJ_IN_KEY, TE_Q, TE_Q_KEY, TO_Q, TO_Q_KEY, rand, write

sd15 = test_nodes.sd15  # fixtures: the tiny SD1.5 (model, clip) from ComfyUI's checkpoint loader, a loras folder
loras = test_nodes.loras

MID_V = "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_v"
MID_V_KEY = "diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_v.weight"
# module prefix -> (weight key, block, (out, in) features); the alpha makes ‖ΔW‖/‖W‖ about 0.3, like the user's file,
# so a report against W + ΔW is visibly off (a small change would move the denominator by its square only)
MODULES = {TO_Q: (TO_Q_KEY, "input_blocks.1", (320, 320)), PROJ_IN: (PROJ_IN_KEY, "input_blocks.1", (320, 320)),
           MID_V: (MID_V_KEY, "middle_block.1", (320, 768)), TE_Q: (TE_Q_KEY, "te.clip_l.layers.0", (768, 768))}
RANK, ALPHA = 4, 16.0


def strong_lora(prefix, out, inn, seed):
    shape = (1, 1) if prefix == PROJ_IN else ()  # proj_in is a 1×1 conv in SD1.5
    return {f"{prefix}.lora_up.weight": rand(out, RANK, *shape, seed=seed),
            f"{prefix}.lora_down.weight": rand(RANK, inn, *shape, seed=seed + 1),
            f"{prefix}.alpha": torch.tensor(ALPHA)}


def file_tensors() -> dict[str, torch.Tensor]:
    sd = {}
    for i, (prefix, (_key, _block, (out, inn))) in enumerate(MODULES.items()):
        sd.update(strong_lora(prefix, out, inn, seed=40 + 2 * i))
    return sd


def run(cls, **inputs):
    """(outputs, ui) of a node run the way ComfyUI's executor runs it."""
    results = map_node(cls, inputs)
    _output, ui, _ = execution.get_output_from_returns(results, cls)
    (result,) = results
    return result.result, ui


def blocks_of(ui) -> dict[str, float]:
    (payload,) = ui["lycoris"]
    assert payload["blocks"] is not None, "the report was not measured"
    return {b["name"]: b["change"] for b in payload["blocks"]}


def loader(model, clip, name, strength):
    """LyCORIS Loader at `strength` on both sides: ((model, clip), its per-block report)."""
    outputs, ui = run(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=strength,
                      strength_clip=strength, strength_mode="linear", apply_mode="merge")
    return outputs, blocks_of(ui)


def every_report(model, clip, name, strength) -> dict[str, dict[str, float]]:
    """The per-block report of each node that draws one, at `strength`."""
    _outputs, from_loader = loader(model, clip, name, strength)
    _o, info = run(LycorisInfo, lycoris_name=name, model=model, clip=clip, strength=strength)
    _o, block_info = run(LycorisBlockInfo, lycoris_name=name, model=model, clip=clip, strength=strength,
                         block_weights="default=1")
    return {"LycorisLoader": from_loader, "LycorisInfo": blocks_of(info), "LycorisBlockInfo": blocks_of(block_info)}


def weight(patcher, key) -> torch.Tensor:
    return comfy.utils.get_attr(patcher.model, key).detach().clone()


@pytest.fixture()
def setup(sd15, loras):
    """(model, clip, file name, W₀ per key, the fresh reports at strengths 1 and 3, float64 truth at strength 1)."""
    model, clip = sd15
    comfy.model_management.unload_all_models()  # fresh: nothing an earlier test loaded stays patched in the module
    sd = file_tensors()
    name = write(loras, "strong.safetensors", sd)
    patchers = {"model": model, "clip": clip.patcher}
    w0 = {key: weight(patchers["clip" if prefix == TE_Q else "model"], key)
          for prefix, (key, _b, _s) in MODULES.items()}
    fresh = {s: every_report(model, clip, name, s) for s in (1.0, 3.0)}
    return model, clip, name, w0, fresh, truth(sd, w0)


def truth(sd, w0) -> dict[str, float]:
    """‖ΔW‖/‖W₀‖ per block at strength 1, in float64."""
    sums: dict[str, list[float]] = {}
    for prefix, (key, block, _shape) in MODULES.items():
        up, down = sd[f"{prefix}.lora_up.weight"].double(), sd[f"{prefix}.lora_down.weight"].double()
        delta = (up.flatten(1) @ down.flatten(1)) * ALPHA / RANK
        entry = sums.setdefault(block, [0.0, 0.0])
        entry[0] += float(delta.square().sum())
        entry[1] += float(w0[key].double().square().sum())
    return {block: math.sqrt(c / w) for block, (c, w) in sums.items()}


def test_fresh_reports_are_the_truth(setup):
    """The baseline the other tests compare with: on a fresh model every node reports the float64 truth, and
    strength 3 reads 3 × strength 1 (LoRA is linear in the strength)."""
    _model, _clip, _name, _w0, fresh, expected = setup
    for strength in (1.0, 3.0):
        for node, got in fresh[strength].items():
            assert got == pytest.approx({b: strength * v for b, v in expected.items()}, rel=1e-5), (node, strength)
    assert expected["input_blocks.1"] == pytest.approx(0.3, abs=0.1)  # a change as large as the user's


def test_after_a_full_load_of_another_strength(setup):
    """The user's case: a strength-1 run is loaded as sampling loads it (load_models_gpu, full load: the module holds
    W + ΔW, the original in the shared backup), then the nodes report at strength 3 on the same model."""
    model, clip, name, w0, fresh, _expected = setup
    (patched_model, patched_clip), _ = loader(model, clip, name, 1.0)
    comfy.model_management.load_models_gpu([patched_model, patched_clip.patcher])
    assert not torch.equal(weight(model, TO_Q_KEY), w0[TO_Q_KEY]), "the module must hold the strength-1 weights"
    assert not torch.equal(weight(clip.patcher, TE_Q_KEY), w0[TE_Q_KEY])
    assert torch.equal(model.backup[TO_Q_KEY].weight, w0[TO_Q_KEY])  # clones share the backup of the original
    for strength in (3.0, 1.0):
        reports = every_report(model, clip, name, strength)
        for node, got in reports.items():
            assert got == fresh[strength][node], f"{node} at {strength} after a loaded run: {got}"
    # and on the patched clones themselves (a node downstream of the loader)
    assert every_report(patched_model, patched_clip, name, 3.0) == fresh[3.0]


@pytest.mark.parametrize("forced", [False, True], ids=["LowVramPatch", "force_patch_weights"])
def test_after_a_lowvram_load(setup, forced):
    """Offloaded: ComfyUI either leaves the stored weight alone and patches in the forward (LowVramPatch), or,
    forced, patches the stored weight with the original in backup. Both report as fresh."""
    model, clip, name, w0, fresh, _expected = setup
    (patched_model, _c), _ = loader(model, clip, name, 1.0)
    patched_model.patch_model(device_to=CPU, lowvram_model_memory=1, force_patch_weights=forced)
    try:
        assert torch.equal(weight(model, TO_Q_KEY), w0[TO_Q_KEY]) != forced
        got = every_report(model, clip, name, 3.0)
    finally:
        patched_model.unpatch_model(CPU)
    for node, blocks in got.items():
        assert blocks == fresh[3.0][node], node


def test_while_forced_clip_hooks_are_patched(setup):
    """A CLIP with Set CLIP Hooks gets its hooks patched into the module when loaded (forced hooks, original in
    `hook_backup`), and they stay while it is loaded: the reports on that CLIP still measure against W₀."""
    model, clip, name, w0, fresh, _expected = setup
    (hooks,), _ = run(LycorisHook, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    (hooked,) = SetClipHooks().apply_hooks(clip, schedule_clip=False, apply_to_conds=False, hooks=hooks)
    patcher = hooked.patcher
    patcher.patch_hooks(patcher.forced_hooks)
    try:
        assert not torch.equal(weight(clip.patcher, TE_Q_KEY), w0[TE_Q_KEY]), "the hook must be patched in"
        assert TE_Q_KEY in clip.patcher.hook_backup
        got = every_report(model, clip, name, 3.0)
    finally:
        patcher.clean_hooks()
    for node, blocks in got.items():
        assert blocks == fresh[3.0][node], node


def test_dynamic_models_are_measured_on_request_only(setup):
    """Under 0.33's dynamic VRAM loading the weights stay on the offload device or in the checkpoint's mmap: the
    loaders do not pull them through RAM on every run for a chart (blocks None, the reason given), while LyCORIS
    Info and Block Info, run to be asked, still measure, against W₀. 0.3.75 has no dynamic loading: its loaders
    always measure (within the size budget)."""
    model, clip, name, _w0, fresh, _expected = setup
    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        assert not hasattr(model, "is_dynamic")
        assert loader(model, clip, name, 3.0)[1] == fresh[3.0]["LycorisLoader"]
        return
    dynamic = model.clone()
    dynamic.is_dynamic = lambda: True  # on a CPU, ModelPatcherDynamic reroutes to ModelPatcher: the contract only
    _outputs, ui = run(LycorisLoader, model=dynamic, clip=clip, lycoris_name=name, strength_model=3.0,
                       strength_clip=3.0, strength_mode="linear", apply_mode="merge")
    (payload,) = ui["lycoris"]
    assert payload["blocks"] is None and payload["applied"] == len(MODULES)
    assert payload["not_measured"] == "weights offloaded by dynamic VRAM loading"
    _o, info = run(LycorisInfo, lycoris_name=name, model=dynamic, clip=clip, strength=3.0)
    _o, block_info = run(LycorisBlockInfo, lycoris_name=name, model=dynamic, clip=clip, strength=3.0,
                         block_weights="default=1")
    assert blocks_of(info) == fresh[3.0]["LycorisInfo"]
    assert blocks_of(block_info) == fresh[3.0]["LycorisBlockInfo"]
