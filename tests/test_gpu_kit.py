"""The GPU evidence kit (issue #26): it builds, its dry run passes, and its checks fail when the pack is wrong.

The kit carries ComfyUI 0.33, so these run on 0.33 only. The dry run is the kit's own CPU mode (tiny shapes, a fake
cuda:0 where a second device is needed, ModelPatcherDynamic's CPU fallback); the real run needs an NVIDIA GPU.
"""

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import comfy.model_patcher
import pytest
import torch
from comfy_env import REPO_ROOT, find_comfyui

pytestmark = pytest.mark.skipif(not hasattr(comfy.model_patcher, "ModelPatcherDynamic"),
                                reason="the kit carries ComfyUI 0.33 (dynamic VRAM); this is an older ComfyUI")

if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))  # after ComfyUI's folder: the repo's nodes/ must not shadow ComfyUI's nodes.py

from lycoris_nodes.nodes.glue import apply as glue_apply
from lycoris_nodes.nodes.glue.adapter import LycorisAdapter

from gpu_kit import build, exact, models, report, seeds, truth


class Context:
    dry_run, device = True, torch.device("cpu")

    def __init__(self, work: Path):
        self.work = str(work)


def variant(variant_id: str):
    return next(v for v in truth.variants() if v.id == variant_id)


# ---- the truth the checks use ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["linear_b", "linear_nb", "conv2d", "conv2d_1x1", "groupnorm", "layernorm"])
def test_effective_params_read_back_a_plain_layers_own_parameters(kind):
    """What the truth reads off a layer's forward is that layer's weight and bias (float64, to rounding)."""
    spec = next(s for s in models.layer_specs("sdxl", tiny=True) if s.kind == kind)
    params = truth.stored_params([spec], models.master_weights([spec], seed=4), torch.float32)
    layer = truth.reference_model([spec], params, torch.float64, torch.device("cpu")).get_submodule(spec.path)
    has_bias = params[spec.path]["bias"] is not None
    read = truth.effective_params(spec, layer, torch.float64, torch.device("cpu"), has_bias)
    for name in ("weight", "bias"):
        want = params[spec.path][name]
        if want is None:
            assert read[name] is None
        else:
            assert torch.allclose(read[name], want, rtol=0, atol=1e-12), name


def test_judge_passes_one_rounding_and_fails_a_missing_or_scaled_change():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    truth_y = base + 0.1 * torch.randn(64, 32, generator=gen, dtype=torch.float64)
    ideal = truth_y.to(torch.bfloat16)
    assert truth.judge(ideal, truth_y, ideal, base)["ok"]
    assert not truth.judge(base.to(torch.bfloat16), truth_y, ideal, base)["ok"]  # the change lost
    scaled = (base + 0.9 * (truth_y - base)).to(torch.bfloat16)  # the strength off by 10 %
    assert not truth.judge(scaled, truth_y, ideal, base)["ok"]
    assert truth.judge(ideal, truth_y, ideal, base)["conclusive"]
    tiny = base + 1e-4 * (truth_y - base)  # a change inside one bf16 rounding: losing it would pass, and it says so
    verdict = truth.judge(base.to(torch.bfloat16), tiny, tiny.to(torch.bfloat16), base)
    assert verdict["ok"] and not verdict["conclusive"]


# ---- the checks fail when the pack is wrong -------------------------------------------------------------------------

@pytest.fixture
def bench(tmp_path):
    return exact.Bench(Context(tmp_path), tmp_path, dynamic=False)


@pytest.mark.parametrize("mode", ["merge", "bypass"])
@pytest.mark.parametrize("variant_id", ["locon", "loha_dora_out", "glora"])
def test_an_exactness_case_passes_as_shipped(bench, variant_id, mode):
    case = exact.run_case(bench, variant(variant_id), "flux", "bf16", "lowvram", mode)
    assert case.status == "pass", case
    assert case.numbers["applied"] == case.numbers["layers"] > 0
    assert case.numbers["change"] > 10 * case.numbers["ideal_error"]  # the change is far above one rounding


def test_an_exactness_case_fails_when_merged_patches_scale_wrong(bench, monkeypatch):
    original = LycorisAdapter.calculate_weight

    def off(self, weight, key, strength, *args, **kwargs):
        return original(self, weight, key, strength * 0.9, *args, **kwargs)

    monkeypatch.setattr(LycorisAdapter, "calculate_weight", off)
    for load in ("full", "lowvram"):
        case = exact.run_case(bench, variant("locon"), "sdxl", "fp16", load, "merge")
        assert case.status == "fail" and "off the truth" in case.detail, case


def test_an_exactness_case_fails_when_bypassed_changes_scale_wrong(bench, monkeypatch):
    original = glue_apply.contribution
    monkeypatch.setattr(glue_apply, "contribution",
                        lambda adapter, key, strength: original(adapter, key, strength * 0.9))
    case = exact.run_case(bench, variant("lokr"), "flux", "fp16", "full", "bypass")
    assert case.numbers["bypassed"] > 0
    assert case.status == "fail" and "off the truth" in case.detail, case


def test_an_exactness_case_fails_when_a_module_is_not_applied(bench, monkeypatch):
    original = glue_apply.build_patches

    def dropping(*args, **kwargs):
        patches, report_ = original(*args, **kwargs)
        dropped = next(iter(patches["model"]))
        del patches["model"][dropped]
        report_.applied.pop(next(k for k, v in report_.applied.items() if v == dropped), None)
        return patches, report_

    monkeypatch.setattr(glue_apply, "build_patches", dropping)
    case = exact.run_case(bench, variant("locon"), "sdxl", "bf16", "full", "merge")
    assert case.status == "fail", case


def test_only_the_reference_own_refusal_makes_a_skip(bench, monkeypatch):
    """BOFT cannot factor SDXL's widths: a skip naming the reason. Any other failure while making the truth (the
    kit's code, torch on the device) is raised, so the case is an error, never a quiet skip."""
    case = exact.run_case(bench, variant("boft"), "sdxl", "fp16", "full", "merge")
    assert case.status == "skip" and "decompose" in case.detail, case

    def broken(*args, **kwargs):
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(truth, "make", broken)
    with pytest.raises(RuntimeError, match="same device"):
        exact.run_case(bench, variant("locon"), "flux", "bf16", "full", "merge")


def test_the_fake_cuda_forward_raises_on_a_layer_left_on_the_cpu():
    """The dry run's device check can fail: a plain layer (weights on the CPU, nothing casting them) fed a cuda:0
    input raises torch's own device-mismatch error, as on a GPU."""
    layer = torch.nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="same device|device"):
        exact.fake_cuda_forward(layer, torch.randn(2, 8))


def test_the_dry_run_plan_covers_every_variant_and_combination():
    plan = exact.plan(True, ("full", "lowvram"))
    assert {item[0].id for item in plan} == {v.id for v in truth.variants()}
    combos = {item[2:] for item in plan}
    assert len(combos) == len(exact.STORAGES) * 2 * len(exact.MODES)
    real = exact.plan(False, ("full", "lowvram"))
    assert len(real) == len(truth.variants()) * len(models.SETS) * len(combos)


# ---- the seeds show their failure modes ------------------------------------------------------------------------------

def test_the_seeds_reproduce_the_reported_conditions_and_pass(tmp_path):
    ctx = Context(tmp_path)
    glora = seeds.glora_bf16(seeds.Scene(ctx, tmp_path, torch.bfloat16))
    assert all(c.status == "pass" for c in glora), glora
    assert all("same dtype" in c.numbers["historic_error"] for c in glora)
    dora = seeds.dora_scale_elsewhere(seeds.Scene(ctx, tmp_path, torch.bfloat16))
    fake = next(c for c in dora if c.id.endswith("fake-cuda"))
    assert fake.status == "pass" and "same device" in fake.numbers["historic_error"], fake
    assert fake.numbers["out"] == "cuda:0 torch.bfloat16"


def test_a_seed_fails_when_the_strength_change_is_lost(tmp_path, monkeypatch):
    """Strength changed between runs: a pack that kept the first strength's weights fails the second run."""
    original = LycorisAdapter.calculate_weight
    monkeypatch.setattr(LycorisAdapter, "calculate_weight",
                        lambda self, weight, key, strength, *a, **k: original(self, weight, key, 1.0, *a, **k))
    cases = seeds.strength_change(seeds.Scene(Context(tmp_path), tmp_path, torch.bfloat16), "lowvram")
    by_run = {c.id.split("/")[-1]: c.status for c in cases}
    assert by_run["run1-m1.0"] == "pass" and by_run["run2-m0.5"] == "fail", by_run


# ---- the kit as shipped: it builds, and run.sh --dry-run passes -----------------------------------------------------

def _record_ok(wheel: Path) -> bool:
    """Every file of a (rewritten) wheel hashes to its RECORD line: pip installs it as the original."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        for line in z.read(record).decode("utf-8").splitlines():
            name, digest, _size = line.rsplit(",", 2)
            if not digest:
                continue
            algo, want = digest.split("=", 1)
            got = base64.urlsafe_b64encode(hashlib.new(algo, z.read(name)).digest()).rstrip(b"=").decode()
            if got != want:
                return False
    return True


def test_the_kit_builds_under_its_size_limit_and_its_dry_run_passes(tmp_path):
    kit = tmp_path / "gpu-kit"
    subprocess.run([sys.executable, str(REPO_ROOT / "gpu_kit" / "build.py"), "--out", str(kit)], check=True,
                   timeout=600)
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size < build.SIZE_LIMIT
    manifest = json.loads((kit / "manifest.json").read_text(encoding="utf-8"))
    pins = build.lock_pins()
    assert (kit / "requirements.txt").read_text(encoding="utf-8").split() == pins
    assert {"torch", "torchvision"} <= set(manifest["left_to_the_image"])
    assert (kit / manifest["comfyui"]["file"]).is_file() and (kit / "pack" / "__init__.py").is_file()
    assert (kit / "checks" / "reference" / "lycoris_factory.py").is_file()

    wheels = tmp_path / "unpacked"
    with tarfile.open(kit / "wheels.tar.xz") as tar:
        tar.extractall(wheels, filter="data")
    files = sorted((wheels / "wheels").glob("*.whl"))
    assert len(files) == len(pins) == len(manifest["wheels"])
    assert all(zipfile.ZipFile(f).infolist()[0].compress_type == zipfile.ZIP_STORED for f in files)
    assert all(_record_ok(f) for f in files)

    out = tmp_path / "out"
    # The real installation: a venv of the kit's own seeing this Python's packages, pip offline on the kit's wheels
    # (all of them already satisfied here: the lock is what this venv has, test_the_lock_is_what_the_suite_runs).
    env = {**os.environ, "PYTHON": sys.executable, "KIT_WORK": str(tmp_path / "work")}
    env.pop("KIT_NO_INSTALL", None)
    if sys.pycache_prefix:  # the bytecode this venv cached (scripts/setup.sh): the kit's venv reads it too
        env["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    proc = subprocess.run(["bash", str(kit / "run.sh"), "--dry-run", "--out", str(out)], env=env, timeout=900,
                          check=False,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((tmp_path / "work" / "venv").rglob("gpu_kit_image.pth"))
    data = json.loads((out / "gpu-report.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "pass" and data["dry_run"] and data["commit"] == manifest["commit"]
    sections = {s["name"]: s for s in data["sections"]}
    assert list(sections) == ["seeds", "exact", "dynamic", "speed"]
    assert all(s["status"] == "pass" for s in sections.values())
    assert sections["seeds"]["counts"]["pass"] >= 20 and sections["exact"]["counts"]["pass"] >= 50
    assert {r["row"].split(" ")[0] for r in sections["speed"]["rows"]} >= {"merge", "strength", "bypass"}
    md = (out / "gpu-report.md").read_text(encoding="utf-8")
    assert md.startswith("# GPU evidence: PASS") and "## 1. The reported failures (seeds): PASS" in md


def test_the_lock_is_what_the_suite_runs():
    """The kit installs the versions this ComfyUI 0.33 suite ran with: every pin of gpu_kit/wheels.lock is the
    version installed here (re-lock, or update the venv, when they part)."""
    from importlib.metadata import version

    differ = [pin for pin in build.lock_pins() if version(pin.split("==")[0]) != pin.split("==")[1]]
    assert not differ, differ


def test_a_spent_budget_makes_the_run_incomplete_not_passed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
    comfyui = find_comfyui()
    proc = subprocess.run([sys.executable, "-m", "gpu_kit", "--comfyui", str(comfyui), "--pack", str(REPO_ROOT),
                           "--work", str(tmp_path / "work"), "--out", str(tmp_path), "--dry-run", "--only", "exact",
                           "--budget-scale", "0"], env=env, timeout=300, capture_output=True, text=True, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "gpu-report.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "incomplete"
    assert data["sections"][0]["counts"]["not-run"] == len(exact.plan(True, ("full", "lowvram")))
    assert report.section_status(data["sections"][0]["cases"]) == "incomplete"
