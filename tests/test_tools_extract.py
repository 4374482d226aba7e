"""Extract LyCORIS: the core (lycoris_core/tools/extract.py) against lycoris-lora 4.1.3's own extractor
(lycoris.utils.extract_linear / extract_conv: same mode, same rank, same error, the same full-diff fallback) and
its factorization rule; LoKr's nearest Kronecker product against changes of known structure; and the node / command
line on the tiny real SD1.5, where a lycoris-lora LoCon applied by our loader (or ComfyUI's core loader) is the
tuned model and the extracted file must load back (our loader and ComfyUI's) to the tuned weights within the
reported error."""

import argparse
import json
import math
import os
import subprocess
import sys

import folder_paths
import pytest
import test_nodes
import torch
from comfy_env import REPO_ROOT, find_comfyui
from lycoris.functional.general import factorization as lycoris_factorization
from lycoris.utils import extract_conv, extract_linear
from lycoris_nodes.lycoris_core import LycorisError, load
from lycoris_nodes.lycoris_core.tools.extract import (
    extract_weight,
    factorization,
    rank_rule,
    rebuild_lokr,
)
from lycoris_nodes.nodes.glue.patched import patched_weight
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.tools.extract import LycorisExtract
from node_runner import execute
from safetensors import safe_open
from test_block_weights import make_reference, model_key

import nodes as comfy_nodes  # ComfyUI's nodes.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny SVDs: two threads on two busy cores cost 10-100x
sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras
CPU = torch.device("cpu")
F32 = torch.float32


def seeded(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def low_rank_change(out, inn, rank, seed, kernel=(), noise=0.02):
    """A change of decaying spectrum: rank `rank` plus a little full-rank noise (so every rule has work to do)."""
    left, right = seeded(out, rank, seed=seed), seeded(rank, inn * math.prod(kernel), seed=seed + 1)
    decay = torch.logspace(0, -1.5, rank)
    return ((left * decay) @ right + noise * seeded(out, inn * math.prod(kernel), seed=seed + 2)).reshape(
        out, inn, *kernel)


# --- Core against lycoris-lora's extractor -------------------------------------------------------------------------

CASES = [  # (mode, value) on a linear 96x64, a conv 40x32x3x3 and a 1x1 conv change of rank 12 + noise
    ("fixed", 5), ("fixed", 20), ("fixed", 48), ("threshold", 4.0), ("threshold", 0.5), ("ratio", 0.2),
    ("ratio", 0.01), ("quantile", 0.5), ("quantile", 0.9),
]


@pytest.mark.parametrize("kind", ["linear", "conv", "conv1x1"])
def test_rank_and_error_equal_lycoris_extractor(kind):
    shape = {"linear": (96, 64), "conv": (40, 32, 3, 3), "conv1x1": (72, 40, 1, 1)}[kind]
    delta = low_rank_change(shape[0], shape[1], 12, seed=len(kind), kernel=shape[2:])
    base = seeded(*shape, seed=7)
    fallbacks = 0
    for mode, value in CASES:
        ours = extract_weight(base, base + delta, rank_rule(mode, value), dtype=F32)
        reference = (extract_linear if kind == "linear" else extract_conv)(delta, mode, value)
        if reference[1] == "full":
            fallbacks += 1
            assert ours.form == "full" and ours.error == 0.0, (mode, value)
            continue
        down, _up, residual = reference[0]
        assert ours.form == "locon" and ours.rank == down.shape[0], (mode, value, ours.rank, down.shape[0])
        assert ours.error == pytest.approx(float(residual.norm() / delta.norm()), rel=1e-4, abs=1e-6), (mode, value)
    assert 0 < fallbacks < len(CASES)  # both branches of LyCORIS' rank >= out/2 rule were taken


def test_energy_rule_keeps_the_frobenius_share():
    delta = low_rank_change(96, 64, 16, seed=3)
    base = seeded(96, 64, seed=4)
    for share in (0.5, 0.8, 0.95, 0.99):
        module = extract_weight(base, base + delta, rank_rule("energy", share), dtype=F32)
        if module.form == "locon":
            assert math.sqrt(max(1 - module.error ** 2, 0)) >= share - 1e-6
    assert extract_weight(base, base + delta, rank_rule("energy", 0.5, max_rank=2), dtype=F32).rank == 2


def test_factorization_is_lycoris():
    for dimension in (1, 7, 127, 128, 250, 320, 360, 512, 640, 768, 1024, 1280, 2304):
        for factor in (-1, 2, 4, 8, 16):
            assert factorization(dimension, factor) == lycoris_factorization(dimension, factor)


def test_reported_error_is_measured_in_the_stored_dtype():
    delta = low_rank_change(96, 64, 12, seed=5)
    base = seeded(96, 64, seed=6)
    fp32 = extract_weight(base, base + delta, rank_rule("fixed", 12), dtype=F32)
    fp16 = extract_weight(base, base + delta, rank_rule("fixed", 12), dtype=torch.float16)
    rebuilt = (fp16.tensors["lora_up.weight"].double() @ fp16.tensors["lora_down.weight"].double())
    measured = float((rebuilt - delta.double()).norm() / delta.double().norm())
    assert fp16.error == pytest.approx(measured, rel=1e-3)
    assert fp16.error > fp32.error  # the rounding is in it


# --- LoKr ----------------------------------------------------------------------------------------------------------

def params(tensors):
    return sum(t.numel() for k, t in tensors.items() if k != "alpha")


@pytest.mark.parametrize("kernel", [(), (3, 3)])
def test_lokr_recovers_a_kronecker_change_where_locon_cannot(kernel):
    """ΔW = A ⊗ B in LyCORIS' layout (w1 the smaller factor): the fit is exact, and LoCon with at least as many
    parameters is far off (A ⊗ B has rank rank(A)·rank(B) = 8·12 here)."""
    assert factorization(96) == (8, 12) and factorization(48) == (6, 8)
    w1, w2 = seeded(8, 6, seed=1), seeded(12, 8, *kernel, seed=2)
    delta = torch.einsum("il,jq...->ijlq...", w1, w2).reshape(96, 48, *kernel)
    base = seeded(96, 48, *kernel, seed=3)
    lokr = extract_weight(base, base + delta, rank_rule("fixed", 12), algo="lokr", dtype=F32)
    assert set(lokr.tensors) == {"lokr_w1", "lokr_w2"} and lokr.fit_error < 1e-5 and lokr.error < 1e-5
    same_size = max(1, params(lokr.tensors) // (96 + 48 * math.prod(kernel)))
    locon = extract_weight(base, base + delta, rank_rule("fixed", same_size), dtype=F32)
    assert params(locon.tensors) <= params(lokr.tensors) * 1.1 and locon.error > 0.5


def test_lokr_error_on_a_low_rank_change_is_reported_and_worse_than_locon():
    """A generic low-rank change: the nearest Kronecker product is coarse, and its reported error is the one the
    written tensors have; LoCon at no more parameters does better (what the docs tell users)."""
    delta = low_rank_change(96, 64, 4, seed=9, noise=0.0)
    base = seeded(96, 64, seed=10)
    lokr = extract_weight(base, base + delta, rank_rule("fixed", 8), algo="lokr", dtype=F32)
    rebuilt = rebuild_lokr(lokr.tensors, (96, 64)).double()
    assert lokr.error == pytest.approx(float((rebuilt - delta.double()).norm() / delta.norm()), rel=1e-5)
    assert lokr.error >= lokr.fit_error - 1e-6
    locon = extract_weight(base, base + delta, rank_rule("fixed", 1), dtype=F32)
    assert params(locon.tensors) <= params(lokr.tensors) and locon.error < lokr.error


def test_lokr_decomposed_w2_follows_lycoris_rule():
    delta = low_rank_change(128, 128, 30, seed=11)
    base = seeded(128, 128, seed=12)
    small = extract_weight(base, base + delta, rank_rule("fixed", 3), algo="lokr", dtype=F32)
    assert {"lokr_w2_a", "lokr_w2_b", "alpha"} <= set(small.tensors) and small.rank == 3
    whole = extract_weight(base, base + delta, rank_rule("fixed", 8), algo="lokr", dtype=F32)  # 8 >= max(b, d)/2
    assert "lokr_w2" in whole.tensors and whole.rank is None


# --- skip, unchanged, bias -----------------------------------------------------------------------------------------

def test_skip_unchanged_and_bias():
    base = seeded(64, 32, seed=13)
    delta = 1e-3 * low_rank_change(64, 32, 4, seed=14)
    change = float(delta.norm() / base.norm())
    skipped = extract_weight(base, base + delta, rank_rule("fixed", 4), skip_below=change * 1.01)
    assert skipped.form == "skipped" and not skipped.written and skipped.change == pytest.approx(change, rel=1e-4)
    kept = extract_weight(base, base + delta, rank_rule("fixed", 4), skip_below=change * 0.99)
    assert kept.form == "locon"
    bias0, bias1 = seeded(64, seed=15), seeded(64, seed=16)
    unchanged = extract_weight(base, base.clone(), rank_rule("fixed", 4), base_bias=bias0, tuned_bias=bias0.clone())
    assert unchanged.form == "unchanged" and not unchanged.written
    bias_only = extract_weight(base, base.clone(), rank_rule("fixed", 4), dtype=F32, base_bias=bias0,
                               tuned_bias=bias1)
    assert bias_only.form == "bias" and torch.equal(bias_only.tensors["diff_b"], bias1 - bias0)


def test_bad_rules_are_refused():
    for mode, value in (("ratio", 1.5), ("quantile", -0.1), ("threshold", -1.0), ("fixed", 0), ("nope", 1)):
        with pytest.raises(ValueError):
            rank_rule(mode, value)


# --- The node on the tiny SD1.5 ------------------------------------------------------------------------------------

NAMES = {  # layer -> the module name written for it (kohya's, as ComfyUI's key map names it)
    "unet.input_blocks.0.0": "lora_unet_conv_in",
    "unet.input_blocks.1.1.transformer_blocks.0.attn1.to_q": "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q",
    "unet.input_blocks.1.1.proj_in": "lora_unet_input_blocks_1_1_proj_in",
    "te.text_model.encoder.layers.0.self_attn.q_proj": "lora_te_text_model_encoder_layers_0_self_attn_q_proj",
}
LAYERS = tuple(NAMES)


@pytest.fixture(scope="module")
def locon_file(sd15, tmp_path_factory):
    """A real lycoris-lora LoCon (rank 4) over ten layers of the tiny SD1.5, UNet and text encoder."""
    return make_reference("locon", *sd15, tmp_path_factory.mktemp("extract_reference"))


@pytest.fixture()
def tuned(sd15, loras, locon_file):
    """The base with the LoCon applied by our loader: the tuned MODEL and CLIP, carrying patches."""
    model, clip = sd15
    name = locon_file.install(loras, "locon.safetensors")
    tuned_model, tuned_clip = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                                      strength_clip=1.0).result
    return tuned_model, tuned_clip


def side(key):
    return "clip" if key.startswith("clip_l.") else "model"


def measured_error(loaded, tuned, base, key) -> float:
    """‖W_loaded − W_tuned‖ / ‖W_tuned − W_base‖ (fp32 patched weights, in float64): the relative error of the
    change the written file makes, reloaded, against the change it was extracted from."""
    got, want, w0 = (patched_weight(m[side(key)], key, CPU).double() for m in (loaded, tuned, base))
    return float((got - want).norm() / (want - w0).norm())


def assert_reproduces(loaded, tuned, base, keys, bound):
    """Every key: measured_error ≤ bound."""
    for key in keys:
        assert measured_error(loaded, tuned, base, key) <= bound, key


def assert_close_to_measured(reported: float, measured: float, name: str):
    """A reported error is the one measured on the reloaded file, to the 3 significant digits the metadata keeps
    (and 1e-7: fp32's rounding of the patched weights, about the error of an exact file)."""
    assert abs(reported - measured) <= 1e-3 * measured + 1e-7, f"{name}: reported {reported:.3e}, measured {measured:.3e}"


def patchers(model, clip):
    return {"model": model, "clip": clip.patcher}


def test_node_model_and_model_reloads_in_both_loaders(sd15, loras, tuned):
    model, clip = sd15
    file, report = execute(LycorisExtract, model=tuned[0], clip=tuned[1], model_base=model, clip_base=clip,
                           mode="fixed", mode_param=4.0, max_rank=0, algo="locon", skip_below=0.0,
                           dtype="fp32", output_name="extracted/from_models").result
    assert file == "extracted/from_models.safetensors"
    keys = [model_key(layer) for layer in LAYERS]
    with safe_open(str(loras / file), "pt") as f:
        names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in list(f.keys())}
        metadata = f.metadata()
    assert len(names) == 10 and all(n.startswith(("lora_unet_", "lora_te_")) for n in names), names
    assert "lycoris_nodes.modules" in metadata and "locon" in report and "10 modules" in report
    lfile = load(str(loras / file))
    errors = [m["error"] for m in json.loads(metadata["lycoris_nodes.modules"]).values()]
    assert max(errors) < 1e-5 and len(lfile.modules) == 10  # rank-4 changes at rank 4 in fp32: exact
    ours = execute(LycorisLoader, model=model, clip=clip, lycoris_name=file, strength_model=1.0,
                   strength_clip=1.0).result
    recorded = json.loads(metadata["lycoris_nodes.modules"])
    for layer, key in zip(LAYERS, keys, strict=True):
        measured = measured_error(patchers(*ours), patchers(*tuned), patchers(model, clip), key)
        assert_close_to_measured(recorded[NAMES[layer]]["error"], measured, NAMES[layer])
    core = comfy_nodes.LoraLoader().load_lora(model, clip, file, 1.0, 1.0)
    base = patchers(model, clip)
    assert_reproduces(patchers(*ours), patchers(*tuned), base, keys, 1e-5)
    assert_reproduces(patchers(*core), patchers(*tuned), base, keys, 1e-5)


@pytest.mark.parametrize("how", ["core LoraLoader", "our loader, bypass"])
def test_node_counts_patches_of_any_loader(sd15, loras, locon_file, how):
    """The tuned MODEL/CLIP patched by ComfyUI's own LoraLoader (its adapters), or by our loader in bypass mode
    (injections, nothing merged): the change extracted is the file's, exactly (rank 4 in fp32)."""
    model, clip = sd15
    name = locon_file.install(loras, "locon.safetensors")
    if how == "core LoraLoader":
        tuned = comfy_nodes.LoraLoader().load_lora(model, clip, name, 1.0, 1.0)
    else:
        tuned = execute(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0,
                        strength_clip=1.0, apply_mode="bypass").result
        assert not tuned[0].patches.get(model_key(LAYERS[1]))  # bypassed: nothing merged on this Linear
    _file, report = execute(LycorisExtract, model=tuned[0], clip=tuned[1], model_base=model, clip_base=clip,
                            mode="fixed", mode_param=4.0, max_rank=0, algo="locon", skip_below=0.0,
                            dtype="fp32", output_name="any_loader").result
    first = report.splitlines()[0]  # "Extract LyCORIS: any_loader.safetensors: 10 modules, rank r, largest relative …"
    assert ": 10 modules, rank" in first and ", largest relative error " in first and float(first.rsplit(" ", 1)[1]) < 1e-5, report


def test_node_lokr_and_bias_load_alike_in_both_loaders(sd15, loras, tuned):
    """LoKr output with a bias change (added to the tuned MODEL through ComfyUI's own add_patches, a "diff" on the
    bias): our loader and ComfyUI's core loader give the same weights, within the reported error of the tuned ones,
    and the bias exactly."""
    model, _clip = sd15
    bias_key = "diffusion_model.input_blocks.1.1.proj_in.bias"
    bias_change = seeded(*model.model.state_dict()[bias_key].shape, seed=30) * 0.01
    patched = tuned[0].clone()
    patched.add_patches({bias_key: ("diff", (bias_change,))}, 1.0)
    file, report = execute(LycorisExtract, model=patched, model_base=model, mode="fixed", mode_param=4.0,
                           max_rank=0, algo="lokr", skip_below=0.0, dtype="fp32", output_name="lokr").result
    with safe_open(str(loras / file), "pt") as f:
        keys = list(f.keys())
        recorded = json.loads(f.metadata()["lycoris_nodes.modules"])
    assert any(k.endswith(".lokr_w1") for k in keys) and "lora_unet_input_blocks_1_1_proj_in.diff_b" in keys
    assert not [k for k in keys if ".bias." in k]  # the bias only as its weight's diff_b, never a module of its own
    assert "nearest Kronecker product" in report
    ours = execute(LycorisLoader, model=model, clip=_clip, lycoris_name=file, strength_model=1.0,
                   strength_clip=0.0).result[0]
    core = comfy_nodes.LoraLoader().load_lora(model, None, file, 1.0, 0.0)[0]
    for layer in LAYERS[:3]:
        key = model_key(layer)
        assert torch.allclose(patched_weight(ours, key, CPU), patched_weight(core, key, CPU), rtol=1e-5, atol=1e-6)
        assert_reproduces({"model": ours}, {"model": patched}, {"model": model}, [key],
                          recorded[NAMES[layer]]["error"] * 1.001 + 1e-6)
    for loaded in (ours, core):
        got = patched_weight(loaded, bias_key, CPU) - patched_weight(model, bias_key, CPU)
        assert torch.allclose(got, bias_change, atol=1e-7)


def test_node_model_and_checkpoint_lower_rank_within_reported_error(sd15, loras, tuned, tmp_path, monkeypatch):
    """Base as the checkpoint file; rank 2 of rank-4 changes in fp16, skip_below listing what it skipped: each
    written module's reported error is the one measured between the tuned change and the change of the written file,
    reloaded by our loader."""
    model, clip = sd15
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "tiny.safetensors").symlink_to(test_nodes._tiny_sd15_path())
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "checkpoints",
                        ([str(checkpoints)], folder_paths.supported_pt_extensions))
    base = patchers(model, clip)
    keys = [model_key(layer) for layer in LAYERS]
    changes = {k: float((patched_weight(patchers(*tuned)[side(k)], k, CPU) - patched_weight(base[side(k)], k, CPU))
                        .norm() / patched_weight(base[side(k)], k, CPU).norm()) for k in keys}
    threshold = sorted(changes.values())[1] * 1.0001  # the two smallest of these four are skipped (at least)
    file, report = execute(LycorisExtract, model=tuned[0], clip=tuned[1], base_checkpoint="tiny.safetensors",
                           mode="fixed", mode_param=2.0, max_rank=0, algo="locon", skip_below=threshold,
                           dtype="fp16", output_name="from_checkpoint").result
    lfile = load(str(loras / file))
    with safe_open(str(loras / file), "pt") as f:
        recorded = json.loads(f.metadata()["lycoris_nodes.modules"])
    assert report.count("not written:") >= 2 and "below skip_below" in report
    ours = execute(LycorisLoader, model=model, clip=clip, lycoris_name=file, strength_model=1.0,
                   strength_clip=1.0).result
    written = [(layer, model_key(layer)) for layer in LAYERS if changes[model_key(layer)] >= threshold]
    assert written and len(lfile.modules) == len(recorded)
    for layer, key in written:
        name = NAMES[layer]
        measured = measured_error(patchers(*ours), patchers(*tuned), base, key)
        assert recorded[name]["rank"] == 2 and measured > 1e-3  # rank 2 of a rank-4 change
        assert_close_to_measured(recorded[name]["error"], measured, name)


def test_node_refusals(sd15, loras, tuned):
    model, _clip = sd15
    common = {"mode": "fixed", "mode_param": 4.0, "max_rank": 0, "algo": "locon", "skip_below": 0.0,
              "dtype": "fp16"}
    with pytest.raises(LycorisError, match="exactly one base"):
        execute(LycorisExtract, model=tuned[0], output_name="x", **common)
    with pytest.raises(LycorisError, match="clip_base"):
        execute(LycorisExtract, model=tuned[0], clip=tuned[1], model_base=model, output_name="x", **common)
    (loras / "taken.safetensors").write_bytes(b"keep me")
    with pytest.raises(LycorisError, match="exists"):
        execute(LycorisExtract, model=tuned[0], model_base=model, output_name="taken", **common)
    assert (loras / "taken.safetensors").read_bytes() == b"keep me"
    with pytest.raises(LycorisError, match="nothing to write"):
        execute(LycorisExtract, model=model, model_base=model, output_name="same", **common)
    assert sorted(p.name for p in loras.iterdir()) == ["locon.safetensors", "taken.safetensors"]


def test_two_bases_refused(sd15, loras, tuned, tmp_path, monkeypatch):
    model, _clip = sd15
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "tiny.safetensors").symlink_to(test_nodes._tiny_sd15_path())
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "checkpoints",
                        ([str(checkpoints)], folder_paths.supported_pt_extensions))
    with pytest.raises(LycorisError, match="not both"):
        execute(LycorisExtract, model=tuned[0], model_base=model, base_checkpoint="tiny.safetensors",
                mode="fixed", mode_param=4.0, max_rank=0, algo="locon", skip_below=0.0, dtype="fp16",
                output_name="x")


# --- Command line --------------------------------------------------------------------------------------------------

def test_cli_extracts_from_two_checkpoints(tmp_path, loras, capsys):
    """A tuned checkpoint = the tiny SD1.5 with a rank-3 change on one UNet and one text-encoder weight; the CLI
    (a separate process, ComfyUI as a library) finds those two and writes them at rank 3 under kohya's names."""
    from safetensors.torch import load_file, save_file

    source = test_nodes._tiny_sd15_path()
    sd = load_file(str(source))
    unet = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    text = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    for i, key in enumerate((unet, text)):
        out, inn = sd[key].shape
        sd[key] = (sd[key].float() + 0.1 * low_rank_change(out, inn, 3, seed=20 + i, noise=0.0)).to(sd[key].dtype)
    (tmp_path / "models" / "checkpoints").mkdir(parents=True)
    (tmp_path / "models" / "loras").mkdir(parents=True)
    tuned = tmp_path / "models" / "checkpoints" / "tuned.safetensors"
    save_file(sd, str(tuned))
    command = [sys.executable, str(REPO_ROOT / "lycoris_tools.py"), "--comfyui", str(find_comfyui()),
               "--base-directory", str(tmp_path), "--cpu", "extract", "--tuned", "tuned.safetensors",
               "--base", str(source), "--rank", "3", "--dtype", "fp32", "-o", "cli_out"]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the one_thread fixture: tiny SVDs on busy cores
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=one_thread)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(str(tmp_path / "models" / "loras" / "cli_out.safetensors"), "pt") as f:
        names = {k.rsplit(".", 2)[0] for k in list(f.keys()) if k.endswith("weight")}
    assert {"lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q",
            "lora_te_text_model_encoder_layers_0_self_attn_q_proj"} <= names, names
    assert "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q: locon, rank 3" in done.stdout
    assert not any("text_projection" in n for n in names)  # ComfyUI never loads SD1's: garbage at each load

    # a taken name is refused before any checkpoint is read (in-process: another ComfyUI start costs seconds)
    from lycoris_nodes.nodes.tools import cli

    (loras / "taken.safetensors").write_bytes(b"keep me")
    bootstrap = argparse.ArgumentParser(add_help=False)
    code = cli.main(["extract", "--tuned", str(tuned), "--base", str(source), "-o", "taken"], bootstrap)
    assert code == 2 and "exists" in capsys.readouterr().err
    assert (loras / "taken.safetensors").read_bytes() == b"keep me"
