"""Save LyCORIS on the tiny real SD1.5: what a stacked MODEL/CLIP carries, written as one file.

Truth never comes from the save code:
* the files stacked are written by lycoris-lora 4.1.3 itself (networks built on float copies of the tiny SD1.5's own
  layers, seeded parameters, `save_weights`), one stack also through ComfyUI's core LoraLoader;
* the stacked weights are what ComfyUI's own loading makes of the stack (full load of the patched clones; a bypassed
  file's weights are those of the same file merged, which tests/test_bypass_nodes.py proves equal);
* the saved file is read back by our loader and by ComfyUI's core LoRA loader (comfy.sd.load_lora_for_models) on the
  base model at strength 1; its weights are compared with the stacked ones (fp32: ≤ 1e-4 of the change);
* `lora` mode: the error the report states is compared with the error measured on the reloaded weights, and the rank
  an error target picks with the one the singular values of the stacked change give.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
import numpy as np
import pytest
import test_nodes
import torch
from comfy_env import REPO_ROOT, find_comfyui
from lycoris import LycorisNetwork, create_lycoris
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.tools import writer
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.glue import report as panel_report
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.scheduling.schedule import LycorisHook
from lycoris_nodes.nodes.scheduling.stack import LycorisApplyStack, LycorisStack
from lycoris_nodes.nodes.tools import cli as lycoris_tools_cli
from lycoris_nodes.nodes.tools.save import LycorisSave, Settings, our_injections, save
from node_runner import execute
from patcher_util import CPU
from reference.lycoris_factory import _class_presets_restored, _randomise, attach, plain_copy
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15 = test_nodes.sd15  # fixture

UNET_LAYERS = (
    "input_blocks.0.0",  # 3x3 conv 4 -> 320, bias
    "input_blocks.1.1.transformer_blocks.0.attn1.to_q",  # Linear 320 -> 320, no bias
    "input_blocks.1.1.proj_in",  # 1x1 conv, bias
    "output_blocks.0.1.transformer_blocks.0.attn1.to_out.0",  # Linear, bias
)
TE_LAYERS = ("text_model.encoder.layers.0.self_attn.q_proj",)
DIMS = {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 4, "conv_alpha": 1.5}
FILES = {  # name -> (lycoris algo, kwargs)
    "locon_a": ("lora", DIMS),
    "locon_b": ("lora", DIMS),
    "loha": ("loha", DIMS),
    "lokr_dora": ("lokr", {"linear_dim": 2, "linear_alpha": 1.5, "conv_dim": 2, "conv_alpha": 1.0,
                           "dora_wd": True, "wd_on_output": True}),
    "oft": ("diag-oft", {"linear_dim": 4, "conv_dim": 4}),
    "full": ("full", {}),
}


def model_key(side: str, path: str, param: str = "weight") -> str:
    return f"diffusion_model.{path}.{param}" if side == "unet" else f"clip_l.transformer.{path}.{param}"


def real_file(algo: str, kwargs: dict, sd15, folder, name: str, seed: int) -> str:
    """A lycoris-lora 4.1.3 file for the tiny SD1.5's layers, its modules renamed to the kohya names ComfyUI maps
    (lycoris_unet_* -> lora_unet_*, lycoris_te_* -> lora_te_*; tensors untouched)."""
    model, clip = sd15
    root = torch.nn.Module()
    sources = [("unet", model.model.diffusion_model, model.model.state_dict(), p) for p in UNET_LAYERS]
    sources += [("te", clip.cond_stage_model.clip_l.transformer, clip.cond_stage_model.state_dict(), p)
                for p in TE_LAYERS]
    paths = []
    for side, owner, sd, path in sources:
        key = model_key(side, path)
        layer = plain_copy(comfy.utils.get_attr(owner, path), sd[key], sd.get(model_key(side, path, "bias")),
                           torch.float32)
        attach(root, f"{side}.{path}", layer)
        paths.append(f"{side}.{path}")
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [],
                                     "name_algo_map": {re.escape(p) + "$": {} for p in paths}})
        net = create_lycoris(root, 1.0, warn_on_unmatched=False, algo=algo, **kwargs)
    assert len(net.loras) == len(paths)
    for module in net.loras:
        module.to(torch.float32)
    _randomise(net, torch.Generator().manual_seed(seed))
    net.apply_to()
    raw = folder / f"{name}.raw.safetensors"
    net.save_weights(str(raw), torch.float32, {})
    renamed = {k.replace("lycoris_unet_", "lora_unet_", 1).replace("lycoris_te_", "lora_te_", 1): v
               for k, v in load_file(str(raw)).items()}
    raw.unlink()
    save_file(renamed, str(folder / f"{name}.safetensors"))
    return f"{name}.safetensors"


@pytest.fixture(scope="module")
def loras(sd15, tmp_path_factory, one_thread):
    """A loras folder holding every file of FILES (made once for the module), listed by folder_paths."""
    folder = tmp_path_factory.mktemp("save_loras")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(folder_paths.folder_names_and_paths, "loras", ([str(folder)], folder_paths.supported_pt_extensions))
        mp.setattr(folder_paths, "filename_list_cache", {})
        mp.setattr(panel_report, "LOADER_MEASURE_BUDGET", -1)  # the panel's chart: not read here
        for i, (name, (algo, kwargs)) in enumerate(FILES.items()):
            real_file(algo, kwargs, sd15, folder, name, 20251125 + 17 * i)
        cache.clear()
        yield folder
        cache.clear()
        comfy.model_management.unload_all_models()


def patched_weights(patcher, keys) -> dict[str, torch.Tensor]:
    """The weights ComfyUI loads a patched clone with (float64 copies): full load, read, unpatch."""
    comfy.model_management.unload_all_models()
    patcher.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        sd = patcher.model.state_dict()
        return {k: sd[k].detach().to(torch.float64).clone() for k in keys if k in sd}
    finally:
        patcher.unpatch_model(CPU)


def both_weights(model, clip, keys) -> dict[str, torch.Tensor]:
    return {**patched_weights(model, keys), **patched_weights(clip.patcher, keys)}


@pytest.fixture(scope="module")
def originals(sd15):
    model, clip = sd15
    return {**{k: v.detach().to(torch.float64).clone() for k, v in model.model.state_dict().items()},
            **{k: v.detach().to(torch.float64).clone() for k, v in clip.cond_stage_model.state_dict().items()}}


@pytest.fixture(scope="module")
def comfy_names(sd15) -> dict[str, str]:
    """Module name -> weight key, by ComfyUI's own LoRA key maps (what its core loader reads)."""
    model, clip = sd15
    return {**comfy.lora.model_lora_keys_unet(model.model, {}), **comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})}


ALL_KEYS = [model_key("unet", p, param) for p in UNET_LAYERS for param in ("weight", "bias")] + \
    [model_key("te", p, param) for p in TE_LAYERS for param in ("weight", "bias")]


def stack(sd15, steps, merge_bypassed=False):
    """Apply `steps` [(file, strength_model, strength_clip, how)] in order; how: "merge", "bypass", "core"
    (ComfyUI's own LoraLoader) or "blocks:<block weights text>". `merge_bypassed`: the same stack with every
    bypassed file merged instead (the truth for a bypassed stack's weights)."""
    model, clip = sd15
    for name, sm, sc, how in steps:
        if how == "core":
            model, clip = comfy_nodes.LoraLoader().load_lora(model, clip, name, sm, sc)
        elif how.startswith("blocks:"):
            model, clip = execute(LycorisBlockWeights, model=model, clip=clip, lycoris_name=name, strength_model=sm,
                                  strength_clip=sc, block_weights=how[len("blocks:"):], preset="custom",
                                  apply_mode="merge").result
        else:
            mode = "merge" if merge_bypassed else how
            model, clip = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=sm,
                                  strength_clip=sc, apply_mode=mode).result
    return model, clip


def relative_errors(got: dict, truth: dict, originals: dict) -> dict[str, float]:
    """‖got − truth‖ / ‖truth − W₀‖ per key the stack changes."""
    errors = {}
    for key, value in truth.items():
        change = float((value - originals[key]).norm())
        if change > 0:
            errors[key] = float((got[key] - value).norm()) / change
    return errors


def reloaded(sd15, loras, name, core=False):
    """The base model with the saved file applied at strength 1: by our loader, or ComfyUI's core loader."""
    model, clip = sd15
    if core:
        sd = comfy.utils.load_torch_file(str(loras / name))
        return comfy.sd.load_lora_for_models(model, clip, sd, 1.0, 1.0)
    return execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                   strength_clip=1.0, apply_mode="merge").result


def run_save(model, clip, output, **settings):
    inputs = {"mode": "exact", "rank": 32, "max_error": 0.0, "dtype": "fp32", **settings}
    output_node = execute(LycorisSave, model=model, clip=clip, output_name=output, **inputs)
    file, text = output_node.result
    return file, text


def metadata(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def modules_of(path) -> dict:
    return json.loads(metadata(path)["lycoris_nodes.modules"])


# --- exact mode ------------------------------------------------------------------------------------------------------

EXACT = {  # id -> (steps, forms every module must have (None: any), core loader reads it)
    "lora+lora": ([("locon_a.safetensors", 0.7, 0.7, "merge"), ("locon_b.safetensors", -0.3, -0.3, "merge")],
                  {"lora"}, True),
    "oft kept": ([("oft.safetensors", 1.0, 1.0, "merge")], {"kept"}, False),
    "lokr_dora kept": ([("lokr_dora.safetensors", 1.0, 1.0, "merge")], {"kept"}, False),
    "loha merged, dora bypassed": ([("loha.safetensors", 1.0, 1.0, "merge"),
                                    ("lokr_dora.safetensors", 0.8, 0.8, "bypass")], {"full"}, True),
    "loha+lokr_dora, block weights": ([("loha.safetensors", 0.8, 0.5, "merge"),
                                       ("lokr_dora.safetensors", 1.0, 1.0, "blocks:input_blocks=0.5; te=2")],
                                      None, False),
    "full with biases": ([("full.safetensors", 1.0, 1.0, "merge")], {"kept"}, False),
    "full at 0.5 + lora, as diffs": ([("full.safetensors", 0.5, 0.5, "merge"),
                                      ("locon_a.safetensors", 1.0, 1.0, "merge")], {"full"}, True),
    "merged + bypassed": ([("locon_a.safetensors", 0.7, 0.7, "merge"), ("locon_b.safetensors", 0.4, 0.4, "bypass"),
                           ("loha.safetensors", 1.0, 1.0, "bypass")], None, False),
    "core LoraLoader + ours": ([("locon_a.safetensors", 0.5, 0.5, "core"), ("locon_b.safetensors", 1.0, 1.0, "merge")],
                               {"full"}, True),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_exact_save_reproduces_the_stack(case, sd15, loras, originals):
    steps, forms, core = EXACT[case]
    model, clip = stack(sd15, steps)
    if any(how == "bypass" for *_, how in steps):  # the bypassed files are in the layers' forward, not the patches
        assert our_injections(model) and our_injections(clip.patcher)
    truth = both_weights(*stack(sd15, steps, merge_bypassed=True), ALL_KEYS)
    output = f"exact_{re.sub(r'[^a-z]+', '_', case)}"
    file, text = run_save(model, clip, output)
    assert file == f"{output}.safetensors" and (loras / file).is_file()
    records = modules_of(loras / file)
    assert records and all(r["error"] <= 1e-5 for r in records.values()), text
    if forms is not None:
        assert {r["form"].split(" ")[0] for r in records.values()} == forms, records
    # every changed weight is in the file, and our loader reproduces it
    changed = relative_errors(originals, truth, originals)
    assert len(records) == len(changed), (sorted(records), sorted(changed))
    got = both_weights(*reloaded(sd15, loras, file), ALL_KEYS)
    errors = relative_errors(got, truth, originals)
    assert max(errors.values()) <= 1e-4, errors
    if core:
        got = both_weights(*reloaded(sd15, loras, file, core=True), ALL_KEYS)
        errors = relative_errors(got, truth, originals)
        assert max(errors.values()) <= 1e-4, errors


def test_lora_plus_lora_concatenates_ranks_and_records_sources(sd15, loras, comfy_names):
    """0.7·A + (−0.3)·B is one LoRA of rank 4 + 4, and the metadata says what was stacked."""
    steps = EXACT["lora+lora"][0]
    model, clip = stack(sd15, steps)
    file, text = run_save(model, clip, "lora_lora_meta", dtype="fp16")
    meta = metadata(loras / file)
    records = json.loads(meta["lycoris_nodes.modules"])
    assert {(r["form"], r["rank"]) for r in records.values()} == {("lora", 8)}
    assert all(0 < r["error"] < 1e-3 for r in records.values())  # fp16 rounding, measured
    assert {comfy_names[name] for name in records} == {model_key("unet", p) for p in UNET_LAYERS} | \
        {model_key("te", p) for p in TE_LAYERS}
    sources = json.loads(meta["lycoris_nodes.sources"])
    assert [(s["file"], s["strength_model"], s["strength_clip"], s["apply_mode"], s["block_weights"])
            for s in sources] == [("locon_a.safetensors", 0.7, 0.7, "merge", ""),
                                  ("locon_b.safetensors", -0.3, -0.3, "merge", "")]
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "8"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert json.loads(meta["lycoris_nodes.settings"]) == {"mode": "exact", "dtype": "fp16"}
    tensors = load_file(str(loras / file))
    assert {t.dtype for k, t in tensors.items() if not k.endswith("alpha")} == {torch.float16}
    assert "lora, rank 8" in text


def test_block_weights_and_other_patches_are_recorded(sd15, loras):
    steps = [("locon_a.safetensors", 0.5, 0.5, "core"),
             ("lokr_dora.safetensors", 1.0, 0.25, "blocks:input_blocks.1=0.5; te=2")]
    file, text = run_save(*stack(sd15, steps), "sources_recorded")
    sources = json.loads(metadata(loras / file)["lycoris_nodes.sources"])
    assert sources[0]["file"] == "lokr_dora.safetensors"
    assert sources[0]["block_weights"] == "input_blocks.1=0.5; te=2"
    assert sources[0]["strength_clip"] == 0.25 and sources[0]["strength_mode"] == "linear"
    assert sources[-1]["file"] == "other patches"
    assert "other patches" in text


def test_stack_node_sources_in_order(sd15, loras):
    rows = execute(LycorisStack, stack="loha.safetensors | 0.5\nlocon_a.safetensors | 1 | 0 | output_blocks=0").result[0]
    model, clip = execute(LycorisApplyStack, model=sd15[0], clip=sd15[1], lora_stack=rows, apply_mode="merge").result
    file, _text = run_save(model, clip, "from_stack")
    sources = json.loads(metadata(loras / file)["lycoris_nodes.sources"])
    assert [(s["file"], s["strength_model"], s["strength_clip"], s["block_weights"]) for s in sources] == \
        [("loha.safetensors", 0.5, 0.5, ""), ("locon_a.safetensors", 1.0, 0.0, "output_blocks=0")]


# --- lora mode -------------------------------------------------------------------------------------------------------

# LoHa + LoCon: factored on every layer (the SVD of the factors); the full diff on the text encoder only (a dense
# SVD, and biases, which have no LoRA form)
LORA_STEPS = [("loha.safetensors", 1.0, 1.0, "merge"), ("locon_a.safetensors", 0.5, 0.5, "merge"),
              ("full.safetensors", 0.5, 0.5, "blocks:default=0; te=1")]


@pytest.fixture(scope="module")
def lora_stack(sd15, loras, originals):
    model, clip = stack(sd15, LORA_STEPS)
    return model, clip, both_weights(model, clip, ALL_KEYS)


def measured_errors(sd15, loras, file, truth, originals, comfy_names) -> dict[str, float]:
    """Per saved weight module (by ComfyUI's key map), ‖reloaded − stacked‖ / ‖stacked − W₀‖ (biases: full diffs)."""
    got = both_weights(*reloaded(sd15, loras, file), ALL_KEYS)
    errors = relative_errors(got, truth, originals)
    return {name: errors[comfy_names[name]] for name in modules_of(loras / file) if not name.endswith(".bias")}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_lora_mode_reports_the_error_it_makes_and_it_falls_with_rank(dtype, sd15, loras, lora_stack, originals,
                                                                     comfy_names):
    model, clip, truth = lora_stack
    reported = {}
    for rank in (2, 12) if dtype == "fp32" else (3,):
        # called directly: the report keeps full precision (the metadata rounds errors to 3 digits)
        report = save(model, clip, f"lora_mode_r{rank}_{dtype}", Settings("lora", rank, 0.0, dtype))
        file, records = report.file, modules_of(loras / report.file)
        weights = {k: r for k, r in report.modules.items() if not k.endswith(".bias")}
        assert {r.form for r in weights.values()} == {"lora"} and {r.rank for r in weights.values()} == {rank}
        assert {k: (r.form, r.rank, float(f"{r.error:.3g}")) for k, r in report.modules.items()} == \
            {k: (r["form"], r["rank"], r["error"]) for k, r in records.items()}
        biases = {k: r for k, r in report.modules.items() if k.endswith(".bias")}
        assert biases and all(r.form == "full" for r in biases.values())
        assert metadata(loras / file)["ss_network_module"] == "networks.lora"  # bias diffs ride along
        assert f"{len(biases)} biases/norm weights have no LoRA form" in report.text()
        measured = measured_errors(sd15, loras, file, truth, originals, comfy_names)
        assert set(measured) == set(weights)
        for name, error in measured.items():
            assert weights[name].error == pytest.approx(error, rel=1e-4, abs=1e-6), name
        reported[rank] = {k: r.error for k, r in weights.items()}
        if rank == 2 and dtype == "fp32":  # the core loader reads it the same way
            core = both_weights(*reloaded(sd15, loras, file, core=True), ALL_KEYS)
            ours = both_weights(*reloaded(sd15, loras, file), ALL_KEYS)
            assert max(relative_errors(core, ours, originals).values()) <= 1e-5
    if dtype == "fp32":
        assert all(reported[12][k] < reported[2][k] for k in reported[2]), reported


def test_lora_mode_error_target_picks_the_smallest_rank(sd15, loras, lora_stack, originals, comfy_names):
    model, clip, truth = lora_stack
    target = 0.35
    file, _text = run_save(model, clip, "lora_target", mode="lora", rank=64, max_error=target)
    records = modules_of(loras / file)
    for name, record in records.items():
        if name.endswith(".bias"):
            continue
        key = comfy_names[name]
        change = (truth[key] - originals[key]).reshape(truth[key].shape[0], -1)
        s = torch.linalg.svdvals(change).numpy()  # float64, one thread (numpy's BLAS would take every core)
        tail = np.sqrt(np.maximum(np.sum(s ** 2) - np.cumsum(s ** 2), 0)) / float(change.norm())
        expected = min(int(np.argmax(tail <= target)) + 1 if (tail <= target).any() else 64, 64)
        assert record["rank"] == expected, name
        assert record["error"] == pytest.approx(tail[expected - 1], rel=5e-3, abs=1e-6), name  # 3 digits kept
        assert record["error"] <= target or record["rank"] == 64
    assert any(r["rank"] < 64 for k, r in records.items() if not k.endswith(".bias"))  # the target chose


# --- what is not written, refusals -----------------------------------------------------------------------------------

def test_hook_patches_are_listed_as_not_written(sd15, loras):
    model, clip = stack(sd15, [("locon_a.safetensors", 1.0, 0.0, "merge")])
    hooks = execute(LycorisHook, lycoris_name="locon_b.safetensors", strength_model=1.0, strength_clip=1.0).result[0]
    from comfy_extras.nodes_hooks import SetClipHooks

    (hooked_clip,) = SetClipHooks().apply_hooks(clip, True, False, hooks)
    assert hooked_clip.patcher.hook_patches
    report = save(model, hooked_clip, "with_hooks", Settings(dtype="fp32"))
    te_key = model_key("te", TE_LAYERS[0])
    assert any(key == te_key and "hook" in reason for key, reason in report.not_written), report.not_written
    assert "not written" in report.text()
    with pytest.raises(LycorisError, match="nothing to save.*only hooks"):
        save(None, hooked_clip, "only_hooks", Settings())


def test_refusals(sd15, loras):
    model, clip = stack(sd15, [("locon_a.safetensors", 1.0, 1.0, "merge")])
    file, _ = run_save(model, clip, "taken")
    before = (loras / file).read_bytes()
    with pytest.raises(LycorisError, match="exists"):
        save(model, clip, "taken", Settings())
    assert (loras / file).read_bytes() == before
    with pytest.raises(LycorisError, match="inside the loras folder"):
        save(model, clip, "../escaped", Settings())
    assert not (loras.parent / "escaped.safetensors").exists()
    with pytest.raises(LycorisError, match="nothing to save: this model carries no patches"):
        save(*sd15, "plain", Settings())
    with pytest.raises(LycorisError, match="connect a MODEL or a CLIP"):
        save(None, None, "nothing", Settings())
    file, _ = run_save(model, clip, "taken", overwrite=True)
    assert (loras / file).is_file()


def test_a_failed_write_leaves_no_file(sd15, loras, monkeypatch):
    model, clip = stack(sd15, [("locon_a.safetensors", 1.0, 1.0, "merge")])

    def failing_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(writer, "save_file", failing_save)
    before = sorted(p.name for p in loras.iterdir())
    with pytest.raises(OSError, match="disk full"):
        save(model, clip, "failed", Settings())
    assert sorted(p.name for p in loras.iterdir()) == before


# --- command line ----------------------------------------------------------------------------------------------------

def test_command_line(loras, tmp_path, capsys):
    base = tmp_path / "base"
    (base / "models" / "loras").mkdir(parents=True)
    for name in ("locon_a.safetensors", "loha.safetensors"):
        shutil.copy(loras / name, base / "models" / "loras" / name)
    checkpoint = REPO_ROOT / ".deps" / "test-assets" / "tiny_sd15.safetensors"
    command = [sys.executable, str(REPO_ROOT / "lycoris_tools.py"), "--comfyui", str(find_comfyui()),
               "--base-directory", str(base), "--cpu", "save", "--checkpoint", str(checkpoint),
               "--lora", "locon_a.safetensors:0.7", "--lora", "loha.safetensors:0.5:0.25",
               "--block-weights", "output_blocks=0", "--dtype", "fp32", "-o", "cli/saved"]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny tensors: thread hand-offs cost more than the maths
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240, env=one_thread)
    assert done.returncode == 0, done.stderr[-3000:]
    written = base / "models" / "loras" / "cli" / "saved.safetensors"
    assert "Save LyCORIS: cli/saved.safetensors" in done.stdout
    sources = json.loads(metadata(written)["lycoris_nodes.sources"])
    assert [(s["file"], s["strength_model"], s["strength_clip"], s["block_weights"]) for s in sources] == \
        [("locon_a.safetensors", 0.7, 0.7, "output_blocks=0"), ("loha.safetensors", 0.5, 0.25, "output_blocks=0")]
    assert not any(k.startswith("lora_unet_output_blocks") for k in load_file(str(written)))

    # a refusal ends the run with exit code 2 and the reason (in-process: another ComfyUI start costs seconds)
    spec = importlib.util.spec_from_file_location("lycoris_tools", REPO_ROOT / "lycoris_tools.py")
    lycoris_tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lycoris_tools)
    code = lycoris_tools_cli.main(["save", "--checkpoint", str(checkpoint), "--lora", "locon_a.safetensors",
                                   "-o", "cli_refused/../../outside"], lycoris_tools.bootstrap_parser())
    assert code == 2 and "inside the loras folder" in capsys.readouterr().err


# --- fused weights: modules on row windows ---------------------------------------------------------------------------

def test_modules_on_row_windows_of_a_fused_weight_concatenate_in_their_rows(tmp_path):
    """Three lycoris-lora LoRAs made for separate q/k/v Linears, patched onto the rows of one fused qkv weight (as
    ComfyUI maps separate q/k/v files onto Flux/SD3's fused weights): q and k merged at 0.7, v bypassed at −0.4. The
    truth is ComfyUI's full load of the same three merged; the saved module is one LoRA of rank 3·4 whose rows
    reproduce it."""
    from lycoris_nodes.lycoris_core.tools.combine import reproduced
    from lycoris_nodes.nodes.glue.apply import patched_clone
    from lycoris_nodes.nodes.tools.save import applied_change, base_weight, chains_of, module_for
    from patcher_util import full_load, lycoris_patches, patcher

    width = 32  # rank 12 on 96 x 32: smaller than the diff
    separate = torch.nn.Module()
    for name in "qkv":
        separate.add_module(name, torch.nn.Linear(width, width, bias=False))
    with _class_presets_restored():
        LycorisNetwork.apply_preset({"target_module": [], "target_name": [],
                                     "name_algo_map": {f"{n}$": {} for n in "qkv"}})
        net = create_lycoris(separate, 1.0, warn_on_unmatched=False, algo="lora", **DIMS)
    _randomise(net, torch.Generator().manual_seed(7))
    net.apply_to()
    net.save_weights(str(tmp_path / "qkv.safetensors"), torch.float32, {})
    state = load_file(str(tmp_path / "qkv.safetensors"))

    fused = torch.nn.Module()
    fused.add_module("qkv", torch.nn.Linear(width, 3 * width, bias=False))
    with torch.no_grad():
        fused.qkv.weight.copy_(torch.randn(3 * width, width, generator=torch.Generator().manual_seed(3)) * 0.1)
    key_map = {f"lycoris_{n}": ("qkv.weight", (0, i * width, width)) for i, n in enumerate("qkv")}
    patches, report = lycoris_patches(state, fused, key_map)
    assert len(report.applied) == 3
    by_name = {n: {k: a for k, a in patches.items() if k[1][1] == i * width} for i, n in enumerate("qkv")}
    base = patcher(fused)
    w0 = fused.qkv.weight.detach().double().clone()
    merged_q, _ = patched_clone(base, by_name["q"], 0.7)
    merged_qk, _ = patched_clone(merged_q, by_name["k"], 0.7)
    with_bypass, bypassed = patched_clone(merged_qk, by_name["v"], -0.4, apply_mode="bypass")
    assert bypassed == 1
    truth_patcher, _ = patched_clone(merged_qk, by_name["v"], -0.4)
    full_load(truth_patcher)
    truth = fused.qkv.weight.detach().double().clone() - w0
    truth_patcher.unpatch_model(CPU)
    assert all(float(truth[i * width:(i + 1) * width].norm()) > 0 for i in range(3))

    (chain,) = chains_of(with_bypass).values()
    assert len(chain.merged) == 2 and len(chain.bypassed) == 1
    start = base_weight(with_bypass, chain.key, CPU)
    written = module_for(chain, start, applied_change(chain, start), Settings(dtype="fp32"))
    assert (written.record.form, written.record.rank) == ("lora", 12)
    error = float((reproduced(written.tensors, start).double() - truth).norm() / truth.norm())
    assert error <= 1e-6 and written.record.error <= 1e-6


def test_a_loaded_model_saves_the_same_file(sd15, loras):
    """After sampling, ComfyUI keeps the clone loaded with its patches merged into the shared weights (the originals
    in the patcher's backup): Save must still measure the change from the original weights. A DoRA change reads the
    weight (an additive one would come out the same from either)."""
    model, clip = stack(sd15, [("lokr_dora.safetensors", 0.8, 0.8, "merge")])
    unloaded = save(model, clip, "while_unloaded", Settings(dtype="fp32"))
    comfy.model_management.unload_all_models()
    model.patch_model(device_to=CPU, lowvram_model_memory=0)
    try:
        assert model.backup  # the shared weights now hold W0 + dW
        loaded = save(model, clip, "while_loaded", Settings(dtype="fp32"))
    finally:
        model.unpatch_model(CPU)
    first, second = load_file(str(loras / unloaded.file)), load_file(str(loras / loaded.file))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
