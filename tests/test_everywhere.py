"""Exact everywhere (issue #25): with the switch on, ComfyUI's own LoRA loaders apply files as LyCORIS Loader does.

The files are real: lycoris-lora 4.1.3 networks on the tiny SD1.5's own layers (test_gguf._make_file, every
algorithm), a PEFT file written by diffusers' save_lora_weights (test_peft_diffusers_names), a LoRA trained by
ComfyUI's own TrainLoraNode. Truths:
- switched on: LyCORIS Loader in `merge` mode on the same model, bit for bit (its own exactness against the LyCORIS
  reference and PEFT's merge is what the rest of the suite tests), and its error for a file it refuses;
- switched off: ComfyUI's own functions, the pack's wrappers taken out (`everywhere.uninstall()` puts back the very
  function objects ComfyUI had), bit for bit.
"""

import contextlib
import logging
from pathlib import Path

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils
import comfy.weight_adapter
import folder_paths
import pytest
import test_gguf
import test_nodes
import test_peft_diffusers_names as peft_names
import torch
from comfy.weight_adapter.base import WeightAdapterBase
from comfy_extras import nodes_train
from comfy_extras.nodes_hooks import CreateHookLora, SetClipHooks
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.nodes.glue import everywhere
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from node_runner import execute
from test_comfy_trainer_oft import train_and_save
from test_nodes import LOGGER, TE_Q, TO_Q, _corrupt, encode, lora, sample, weights_after_full_load, write

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15, loras, conds = test_nodes.sd15, test_nodes.loras, test_nodes.conds  # fixtures
twin = peft_names.twin
gguf_models = test_gguf.gguf_models

STRENGTH = 0.7
ALGOS = list(test_gguf.ALGOS)  # locon, loha, lokr, glora, locon_dora, oft, boft, ia3, full
# where ComfyUI's built-in adapters deviate from the reference (spec: comfyui-integration.md), or do not load at all
CORE_DEVIATES = {"locon_dora", "oft", "boft", "ia3"}


@pytest.fixture(autouse=True)
def no_panel_measurement(monkeypatch):
    monkeypatch.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)


@contextlib.contextmanager
def switched(on: bool):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(everywhere, "SWITCH", everywhere.Switch(on, everywhere.settings_path()))
        yield


@contextlib.contextmanager
def without_pack():
    """ComfyUI's own functions back in place, as in a ComfyUI that never loaded the pack."""
    everywhere.uninstall()
    try:
        yield
    finally:
        everywhere.install()


@pytest.fixture(scope="module")
def lycoris_files(sd15, tmp_path_factory):
    """algo id -> a lycoris-lora file on 12 layers of every kind of the tiny SD1.5 UNet (kohya names)."""
    folder = tmp_path_factory.mktemp("everywhere_files")
    with pytest.MonkeyPatch.context() as patch:  # the layers' own float weights, not GGUF ones to decode
        patch.setattr(test_gguf, "dequantized", lambda _layer, t: None if t is None else t.detach().double())
        return {algo: test_gguf._make_file(algo, sd15[0], folder).path for algo in ALGOS}


def install(path, folder) -> str:
    name = f"everywhere_{Path(path).name}"
    (folder / name).write_bytes(Path(path).read_bytes())
    return name


def core_model_only(model, name, strength=STRENGTH):
    return comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)[0]


def our_merge(model, name, strength=STRENGTH):
    return execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=strength,
                   apply_mode="merge").result[0]


def patched_weights(patcher) -> dict[str, torch.Tensor]:
    comfy.model_management.unload_all_models()
    return weights_after_full_load(patcher, [k if isinstance(k, str) else k[0] for k in patcher.patches])


def weight_differences(got, want) -> str:
    """How two patched models' weights differ after a full load ("" when bit-identical, the same keys patched)."""
    if set(got.patches) != set(want.patches):
        return f"different weights patched: {sorted(set(got.patches) ^ set(want.patches))[:2]}"
    got_w, want_w = patched_weights(got), patched_weights(want)
    different = [k for k in want_w if not torch.equal(got_w[k], want_w[k])]
    return f"{len(different)} weights differ, e.g. {different[:2]}" if different else ""


def assert_same_weights(got, want, what):
    differences = weight_differences(got, want)
    assert not differences, f"{what}: {differences}"


# --- the switch -----------------------------------------------------------------------------------------------------

def test_switch_is_the_environment_else_the_default_users_setting_read_at_each_queue(tmp_path, caplog):
    settings = tmp_path / "default" / everywhere.SETTINGS_FILE
    by_setting = everywhere.Switch(everywhere.environment_switch({}), settings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(everywhere, "SWITCH", by_setting)
        assert not everywhere.enabled()  # no settings file yet
        settings.parent.mkdir()
        settings.write_text('{"Comfy.UseNewMenu": "Top", "LycorisNodes.ExactEverywhere": true}', encoding="utf-8")
        assert not everywhere.enabled()  # a file load reads nothing: the setting is read when a prompt is queued
        assert everywhere.on_prompt({"prompt": {}}) == {"prompt": {}}
        assert everywhere.enabled()
    settings.write_text('{"LycorisNodes.ExactEverywhere": false}', encoding="utf-8")
    by_setting.reread()
    assert not by_setting.on
    settings.write_text('{"LycorisNodes.ExactEverywhere": true}', encoding="utf-8")
    for value, on in (("1", True), (" On ", True), ("yes", True), ("0", False), ("", False), ("off", False)):
        switch = everywhere.Switch(everywhere.environment_switch({everywhere.ENV: value}), settings)
        switch.reread()
        assert switch.on is on, value  # the environment wins over the setting
    for text in ('{"LycorisNodes.ExactEverywhere": tru', "[true]"):
        settings.write_text(text, encoding="utf-8")
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert not everywhere.Switch(None, settings).on
    assert caplog.text.count("cannot read") == 1 and str(settings) in caplog.text  # "[true]" is JSON, just not ours


def test_a_typo_in_the_variable_is_one_error_and_off_and_every_model_still_loads(tmp_path, monkeypatch, caplog,
                                                                                   loras):
    """LYCORIS_EXACT_EVERYWHERE=yes please: said once, at start-up, naming the variable; ComfyUI's loading of
    checkpoints and LoRAs goes on as without the pack (the wrapper of load_torch_file sees every file ComfyUI loads)."""
    checkpoint = tmp_path / "checkpoint.safetensors"
    comfy.utils.save_torch_file({"w": torch.arange(4.0)}, str(checkpoint))
    lora_name = write(loras, "typo_lora.safetensors", lora(TO_Q, 8, 8, seed=2))
    everywhere.uninstall()
    monkeypatch.setenv(everywhere.ENV, "yes please")
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            everywhere.install()  # what start-up does
            for _ in range(2):
                assert torch.equal(comfy.utils.load_torch_file(str(checkpoint))["w"], torch.arange(4.0))
                loaded = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", lora_name))
                assert not hasattr(loaded, "lycoris_file")  # off: ComfyUI's own state dict
                assert not everywhere.enabled()
    finally:
        everywhere.uninstall()
        monkeypatch.delenv(everywhere.ENV)
        everywhere.install()
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR, caplog.text
    assert "LYCORIS_EXACT_EVERYWHERE='yes please'" in errors[0].getMessage()


def test_install_wraps_each_function_once_and_uninstall_restores_comfys_own():
    wrapped = {name: getattr(module, name) for module, name, _ in everywhere.WRAPPED if hasattr(module, name)}
    assert all(getattr(f, everywhere.INSTALLED, False) for f in wrapped.values())
    everywhere.install()  # a second import of the pack
    assert {name: getattr(module, name) for module, name, _ in everywhere.WRAPPED if hasattr(module, name)} == wrapped
    with without_pack():
        for module, name, _ in everywhere.WRAPPED:
            if hasattr(module, name):
                assert getattr(module, name) is wrapped[name].__wrapped__
                assert getattr(module, name).__module__.startswith("comfy.")


# --- on: core's loaders give our loader's weights -----------------------------------------------------------------

@pytest.mark.parametrize("algo", ALGOS)
def test_core_load_lora_equals_our_merge(algo, sd15, loras, lycoris_files):
    model, _ = sd15
    name = install(lycoris_files[algo], loras)
    with switched(True):
        core = core_model_only(model, name)
        ours = our_merge(model, name)
    assert len([k for k in ours.patches if k.endswith(".weight")]) == len(test_gguf.LAYERS)
    assert_same_weights(core, ours, f"{algo}, switched on")
    with switched(False):
        off = core_model_only(model, name)
    if algo in CORE_DEVIATES:  # the switch is what makes the difference
        assert weight_differences(off, ours), f"{algo}: ComfyUI's own path already gives the reference's weights"


def test_peft_unet_file_core_cannot_map(twin, sd15, loras, caplog):
    """diffusers' save_lora_weights `unet.` names: ComfyUI's own key map lacks the attention layers' (their keys
    are "not loaded"); switched on, core's Load LoRA applies the file fully, as our loader does."""
    model, _ = sd15
    unet, _ = twin
    adapted = peft_names.adapted(unet, "lora", "save_lora_weights+metadata", seed=7)
    name = peft_names.save(adapted, "lora", "save_lora_weights+metadata", loras)
    with switched(False), caplog.at_level(logging.WARNING):
        off = core_model_only(model, name)
    assert "lora key not loaded: unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" in caplog.text
    caplog.clear()
    with switched(True), caplog.at_level(logging.INFO, logger=LOGGER):
        core = core_model_only(model, name)
        ours = our_merge(model, name)
    assert len(core.patches) == len(peft_names.merged_weights(adapted)) > len(off.patches)
    assert_same_weights(core, ours, "PEFT unet. names")
    assert "lora key not loaded" not in caplog.text
    assert f"LyCORIS (everywhere) {name}: {len(core.patches)}/{len(core.patches)} modules applied" in caplog.text


def test_a_workflow_of_core_nodes_makes_our_loaders_image(sd15, loras, conds):
    """Load LoRA (model and CLIP) → CLIP Text Encode → KSampler: the same latent, bit for bit, as with LyCORIS
    Loader in merge mode; and switched off, the same as ComfyUI without the pack."""
    model, clip = sd15
    name = write(loras, "everywhere_kohya.safetensors",
                 {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=3)})
    with switched(True):
        core_model, core_clip = comfy_nodes.LoraLoader().load_lora(model, clip, name, STRENGTH, 0.5)
        ours_model, ours_clip = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name,
                                        strength_model=STRENGTH, strength_clip=0.5, apply_mode="merge").result
        core_image, ours_image = sample(core_model, encode(core_clip)), sample(ours_model, encode(ours_clip))
    assert torch.equal(core_image, ours_image) and not torch.equal(core_image, sample(model, conds))
    with switched(False):
        off_model, off_clip = comfy_nodes.LoraLoader().load_lora(model, clip, name, STRENGTH, 0.5)
        off_image = sample(off_model, encode(off_clip))
    with without_pack():
        plain_model, plain_clip = comfy_nodes.LoraLoader().load_lora(model, clip, name, STRENGTH, 0.5)
        plain_image = sample(plain_model, encode(plain_clip))
    assert torch.equal(off_image, plain_image)


# --- off: ComfyUI's own, bit for bit -----------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["locon", "oft", "lokr"])
def test_switched_off_core_is_comfys_own(algo, sd15, loras, lycoris_files, caplog):
    model, _ = sd15
    name = install(lycoris_files[algo], loras)
    with switched(False):
        off = core_model_only(model, name)
    with without_pack():
        plain = core_model_only(model, name)
    assert not any(type(p).__module__.startswith("lycoris_nodes") for ps in off.patches.values() for p in ps)
    assert {k: [type(p) for p in v] for k, v in off.patches.items()} == \
        {k: [type(p) for p in v] for k, v in plain.patches.items()}
    assert_same_weights(off, plain, f"{algo}, switched off")


# --- refused files, the coverage line -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nan", "truncated", "pickle"])
def test_a_file_our_loader_refuses_gives_core_the_same_error(kind, sd15, loras):
    model, clip = sd15
    if kind == "pickle":
        name = "everywhere.pt"
        torch.save(lora(TO_Q, 320, 320, seed=1), loras / name)
    else:
        name = _corrupt(loras, kind)
    with pytest.raises(LycorisError) as ours:
        execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    with switched(True), pytest.raises(LycorisError) as core:
        comfy_nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
    assert str(core.value) == str(ours.value) and name in str(core.value)
    assert model.patches == {}
    if kind != "truncated":  # ComfyUI itself loads these
        with switched(False):
            assert comfy_nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)[0].patches


def test_keys_not_applied_are_our_coverage_line_not_comfys(sd15, loras, caplog):
    model, clip = sd15
    name = write(loras, "everywhere_partial.safetensors",
                 {**lora(TO_Q, 320, 320, seed=1), **lora("lora_unet_no_such_block", 320, 320, seed=3),
                  "lora_unet_x.unknown_thing": torch.ones(2)})
    with switched(True), caplog.at_level(logging.INFO):
        comfy_nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
    assert "lora key not loaded" not in caplog.text
    assert f"LyCORIS (everywhere) {name}: 1/2 modules applied" in caplog.text
    assert "lora_unet_no_such_block" in caplog.text and "lora_unet_x.unknown_thing" in caplog.text


# --- interplay --------------------------------------------------------------------------------------------------

class ToyScale(WeightAdapterBase):
    """Another pack's algorithm in ComfyUI's registry: `<name>.toy_scale` (a number) scales the weight."""

    name = "toy"

    def __init__(self, loaded_keys, weights):
        self.loaded_keys, self.weights = loaded_keys, weights

    @classmethod
    def load(cls, x, lora, alpha, dora_scale, loaded_keys=None):
        key = f"{x}.toy_scale"
        return cls({key}, (lora[key],)) if key in lora else None

    def calculate_weight(self, weight, key, strength, strength_model, offset, function, intermediate_dtype=torch.float32,
                         original_weight=None):
        return weight + strength * (float(self.weights[0]) - 1) * weight


def test_another_packs_registered_adapter_still_loads_its_keys(sd15, loras, monkeypatch):
    model, _ = sd15
    monkeypatch.setattr(comfy.weight_adapter, "adapters", [*comfy.weight_adapter.adapters, ToyScale])
    out = "lora_unet_output_blocks_1_1_proj_out"
    name = write(loras, "everywhere_toy.safetensors", {**lora(TO_Q, 320, 320, seed=1), f"{out}.toy_scale":
                                                       torch.tensor(1.5)})
    with switched(False):
        off = core_model_only(model, name)
    with switched(True):
        on = core_model_only(model, name)
    toy_key = "diffusion_model.output_blocks.1.1.proj_out.weight"
    assert isinstance(off.patches[toy_key][0][1], ToyScale) and isinstance(on.patches[toy_key][0][1], ToyScale)
    assert type(on.patches[test_nodes.TO_Q_KEY][0][1]).__name__ == "LycorisAdapter"
    weights = patched_weights(on)
    base = model.model.state_dict()[toy_key]
    assert torch.allclose(weights[toy_key], base * (1 + STRENGTH * 0.5))


def test_hook_lora_equals_the_merged_file(sd15, loras, conds):
    """Create Hook LoRA → Set CLIP Hooks: the hooked text encoder encodes with our adapters switched on, as the
    merged CLIP of our loader does; switched off, as ComfyUI without the pack does."""
    model, clip = sd15
    name = write(loras, "everywhere_hook.safetensors", {**lora(TE_Q, 768, 768, seed=3)})
    with switched(True):
        (hooks,) = CreateHookLora().create_hook(name, 0.0, 0.8)
        (hooked,) = SetClipHooks().apply_hooks(clip, False, False, hooks=hooks)
        hooked_cond = encode(hooked)[0][0][0]
        merged_clip = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=0.0,
                              strength_clip=0.8, apply_mode="merge").result[1]
        merged_cond = encode(merged_clip)[0][0][0]
    assert torch.equal(hooked_cond, merged_cond) and not torch.equal(merged_cond, conds[0][0][0])
    conds_off = []
    for context in (switched(False), without_pack()):
        with context:
            (hooks,) = CreateHookLora().create_hook(name, 0.0, 0.8)
            conds_off.append(encode(SetClipHooks().apply_hooks(clip, False, False, hooks=hooks)[0])[0][0][0])
    assert torch.equal(*conds_off)  # switched off: ComfyUI's own hooks, bit for bit


@pytest.mark.parametrize("qtype", ["Q8_0"])
def test_gguf_model_through_core_equals_our_merge(qtype, gguf_models, loras, lycoris_files, conds):
    model = gguf_models[qtype]
    name = install(lycoris_files["loha"], loras)
    with switched(True):
        core = core_model_only(model, name)
        ours = our_merge(model, name)
        assert torch.equal(sample(core, conds), sample(ours, conds))
    with switched(False):
        off = sample(core_model_only(model, name), conds)
    with without_pack():
        assert torch.equal(sample(core_model_only(model, name), conds), off)


def test_comfys_trainer_trains_switched_on_and_its_file_loads_either_way(loras, tmp_path, sd15):
    """TrainLoraNode trains and SaveLoRA writes with the switch on (they build ComfyUI's own adapters from its
    registry, which the switch leaves alone; test_comfy_trainer_oft trains with it off). The file loads through
    core's Load LoRA and, as the trained dict in memory, through LoraModelLoader: switched on, with our loader's
    weights; switched off, as ComfyUI without the pack loads it."""
    model, _ = sd15
    with switched(True):
        path = train_and_save(tmp_path, "LoRA", ".lora_up.weight", "everywhere_trained")
    name = path.name
    (loras / name).write_bytes(path.read_bytes())
    for on in (True, False):
        with switched(on):
            core = core_model_only(model, name, 1.0)
            (in_memory,) = nodes_train.LoraModelLoader.execute(model, comfy.utils.load_torch_file(str(path)), 1.0).result
        assert core.patches and set(in_memory.patches) == set(core.patches)
        assert_same_weights(in_memory, core, f"LoraModelLoader vs Load LoRA, switched {'on' if on else 'off'}")
        ours = all(type(p[1]).__name__ == "LycorisAdapter" for ps in in_memory.patches.values() for p in ps)
        assert ours is on
    with switched(True):
        assert_same_weights(core_model_only(model, name, 1.0), our_merge(model, name, 1.0), "trained LoRA, on")
    with switched(False), without_pack():
        assert_same_weights(core_model_only(model, name, 1.0), core, "trained LoRA, off vs without the pack")


@pytest.mark.skipif(not hasattr(comfy.sd, "load_bypass_lora_for_models"), reason="ComfyUI 0.3.75 has no bypass loader")
@pytest.mark.parametrize("algo", ["locon_dora", "oft"])
def test_core_bypass_loader_runs_our_bypass(algo, sd15, loras, lycoris_files, conds):
    """ComfyUI 0.33's Load LoRA (Bypass) runs adapters through their h()/g(), which see neither the weight nor the
    layer: switched on, it runs this pack's bypass, as LyCORIS Loader in bypass mode; the weights stay as stored."""
    from comfy_extras.nodes_lora_debug import LoraLoaderBypassModelOnly

    model, _ = sd15
    name = install(lycoris_files[algo], loras)
    stored = {k: v.clone() for k, v in model.model.state_dict().items() if k.endswith(".weight")}
    with switched(True):
        (core,) = LoraLoaderBypassModelOnly().load_lora_model_only(model, name, STRENGTH)
        ours = execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=STRENGTH,
                       apply_mode="bypass").result[0]
        assert torch.equal(sample(core, conds), sample(ours, conds))
    assert not torch.equal(sample(core, conds), sample(model, conds))
    comfy.model_management.unload_all_models()
    assert all(torch.equal(model.model.state_dict()[k], v) for k, v in stored.items())


def test_a_file_in_a_loras_folder_is_told_by_its_path_as_given_or_resolved(tmp_path, loras):
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(b"")
    (loras / "linked.safetensors").symlink_to(elsewhere)
    (tmp_path / "loras_link").symlink_to(loras)
    assert everywhere.in_loras_folder(loras / "linked.safetensors")  # a link in the folder to a file elsewhere
    assert everywhere.in_loras_folder(tmp_path / "loras_link" / "x.safetensors")  # the folder reached by a link
    assert not everywhere.in_loras_folder(elsewhere)
    assert not everywhere.in_loras_folder(tmp_path / "loras_other" / "x.safetensors")  # a name that only starts alike


def test_a_loader_editing_the_patches_in_place_gets_a_clear_error(sd15, loras):
    """KJNodes' DiT Block LoRA Loader and LTX2 LoRA Loader Advanced set `loaded[key].weights[2]` (the alpha of
    ComfyUI's own LoRAAdapter) per block, between comfy.lora.load_lora and add_patches. On this pack's adapters that
    would break the patch when it is computed; it is refused where it is made, with the way out. Moving the same
    tensors (ComfyUI's bypass manager does) is allowed."""
    model, _ = sd15
    name = write(loras, "everywhere_kj.safetensors", lora(TO_Q, 320, 320, seed=1))
    with switched(True):
        key_map = comfy.lora.model_lora_keys_unet(model.model, {})
        loaded = comfy.lora.load_lora(comfy.utils.load_torch_file(str(loras / name), safe_load=True), key_map)
    adapter = loaded[test_nodes.TO_Q_KEY]
    moved = tuple(w if i == 0 else w.clone() for i, w in enumerate(adapter.weights))
    adapter.weights = moved
    assert adapter.weights is moved
    weights = list(adapter.weights)
    weights[2] = 0.5  # as KJNodes writes a block's ratio
    with pytest.raises(LycorisError, match="switch the setting off for it"):
        adapter.weights = tuple(weights)
    assert adapter.weights is moved


def test_a_file_for_another_model_is_a_warning_that_says_so(sd15, loras, caplog):
    """Nothing fits: ComfyUI's Load LoRA goes on without it, as it always has (LyCORIS Loader refuses the file), and
    the one warning says which model the file looks made for."""
    model, clip = sd15
    name = write(loras, "everywhere_sdxl.safetensors",
                 lora("lora_unet_input_blocks_4_1_transformer_blocks_1_attn1_to_q", 640, 640, seed=1))
    with switched(True), caplog.at_level(logging.WARNING, logger=LOGGER):
        patched, _ = comfy_nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
    assert patched.patches == {}
    assert f"LyCORIS (everywhere) {name}: 0/1 modules applied. This file looks made for" in caplog.text


def test_merging_and_saving_a_core_loaded_model(sd15, loras, lycoris_files, tmp_path):
    """ModelMergeSimple with the LoRA'd model as model2 (its patches travel through get_key_patches) and Save
    Checkpoint (weights patched for saving): switched on, the same tensors as with our loader's model, bit for bit."""
    from comfy_extras.nodes_model_merging import ModelMergeSimple
    from safetensors.torch import load_file

    model, clip = sd15
    name = install(lycoris_files["locon_dora"], loras)
    with switched(True):
        core = core_model_only(model, name)
    ours = our_merge(model, name)
    (core_mix,) = ModelMergeSimple().merge(model, core, 0.6)
    (ours_mix,) = ModelMergeSimple().merge(model, ours, 0.6)
    assert_same_weights(core_mix, ours_mix, "ModelMergeSimple(base, LoRA'd model, 0.6)")
    saved = {}
    for label, patched in (("core", core), ("ours", ours)):
        comfy.model_management.unload_all_models()
        comfy.sd.save_checkpoint(str(tmp_path / f"{label}.safetensors"), patched, clip)
        saved[label] = load_file(str(tmp_path / f"{label}.safetensors"))
    comfy.model_management.unload_all_models()
    assert saved["core"].keys() == saved["ours"].keys()
    assert all(torch.equal(saved["core"][k], saved["ours"][k]) for k in saved["ours"])
    dora_layer = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    assert not torch.equal(saved["core"][dora_layer], model.model.state_dict()[dora_layer[len("model."):]])
