"""Section 2 (and the dynamic VRAM half of it): every LyCORIS algorithm variant × fp16/bf16/fp8 bases × a load
(full, lowvram, dynamic VRAM) × merge/bypass, on an SDXL-size and a Flux-size layer set, against the reference.

Each case applies the reference's file through the loader's code path (`apply_file`: key map, coverage, patches,
bypass injections), loads the patched model the way ComfyUI does for that load, runs every targeted layer on the
device and judges its output with `truth.judge`. The case passes when every layer does.
"""

import itertools
import time
from pathlib import Path

import comfy.model_management
import comfy.model_patcher
import torch
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.apply import apply_file

from . import models, truth
from .models import FP8
from .part import TRUTHS
from .report import Case

STORAGES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8_e4m3fn": FP8}
MODES = ("merge", "bypass")
STRENGTH = 0.75  # linear strength: every algorithm scaled, not just switched on
TOKENS = 64


def make_patcher(root: torch.nn.Module, device, dynamic: bool):
    cls = comfy.model_patcher.ModelPatcherDynamic if dynamic else comfy.model_patcher.ModelPatcher
    return cls(root, load_device=device, offload_device=torch.device("cpu"))


def load_patched(patched, device, load: str) -> None:
    """Load as ComfyUI does: everything on the device (full), every layer left offloaded and patched as it is cast
    (lowvram: LowVramPatch; the budget forced to nothing, as a GPU too small for the model has), or dynamic VRAM
    through ComfyUI's own model management (load_models_gpu, which loads a ModelPatcherDynamic with comfy-aimdo)."""
    if load == "full":
        patched.patch_model(device_to=device, lowvram_model_memory=0)
    elif load == "lowvram":
        patched.patch_model(device_to=device, lowvram_model_memory=1)
    else:
        comfy.model_management.load_models_gpu([patched])


def unload(patched, load: str) -> None:
    if load == "dynamic":
        comfy.model_management.unload_all_models()
    else:
        patched.unpatch_model(device_to=torch.device("cpu"))


def plan(dry_run: bool, loads: tuple[str, ...]) -> list[tuple]:
    """(variant, set, storage, load, mode) in the order they run: per variant, per set and storage (one reference
    file and truth), every load and mode. A budget cut thus leaves whole variants untested, named in the report.
    A dry run: each variant once per set, the combinations taken in turn so that every one of them runs."""
    combos = list(itertools.product(STORAGES, loads, MODES))
    variants = truth.variants()
    if dry_run:
        return [(v, s, *combos[(i + j) % len(combos)]) for i, v in enumerate(variants)
                for j, s in enumerate(models.SETS)]
    return [(v, s, storage, load, mode) for v in variants for s in models.SETS for storage in STORAGES
            for load in loads for mode in MODES]


class Bench:
    """Per (set, storage): the specs, the stored parameters (float64), the patcher of the stored model and the probe
    inputs, made on first use. Per (variant, set, storage): the reference's file and each layer's expected outputs,
    only the latest kept (the plan uses each one for consecutive cases)."""

    def __init__(self, env, directory: Path, dynamic: bool):
        self.env, self.directory, self.dynamic = env, directory, dynamic
        self._sets: dict = {}
        self._expected: tuple = (None, None)

    def set(self, name: str, storage):
        key = (name, storage)
        if key not in self._sets:
            specs = models.layer_specs(name, tiny=self.env.dry_run)
            master = models.master_weights(specs, seed=sum(map(ord, name)))
            root = models.layer_set(name, specs, master, storage, self.env.device)
            compute = models.compute_dtype(storage)
            inputs = {s.path: models.probe_input(s, TOKENS, compute, self.env.device) for s in specs}
            self._sets[key] = (specs, truth.stored_params(specs, master, storage, self.env.device),
                               make_patcher(root, self.env.device, self.dynamic), inputs)
        return self._sets[key]

    def expected(self, variant, name: str, storage) -> "Expected":
        key = (variant.id, name, storage)
        if self._expected[0] != key:
            self._expected = (None, None)  # the previous one's device memory goes first
            saved = self.directory / f"{variant.id}-{name}-{str(storage).removeprefix('torch.')}.pt"
            if saved.is_file():  # made by the section before (exact, then dynamic): the same seeds, inputs, truth
                made = Expected(**torch.load(saved, map_location=self.env.device, weights_only=True))
            else:
                made = self._make(variant, name, storage)
                torch.save(vars(made), saved)
            self._expected = (key, made)
        return self._expected[1]

    def _make(self, variant, name: str, storage) -> "Expected":
        """The reference's file for the variant's layers of the set, and per layer (y*, y°, y of the base) at
        STRENGTH. When the reference cannot make the network for all of them (BOFT factors only some widths),
        each layer is tried alone and those it cannot do are left out, with the reason."""
        specs, base, _, inputs = self.set(name, storage)
        chosen = truth.targets(variant, specs)
        seed = truth.factory.SEED + sum(map(ord, variant.id))

        files = self.directory / f"{name}-{str(storage).removeprefix('torch.')}"  # one file name per variant
        files.mkdir(exist_ok=True)

        def make(layers):
            return truth.make(variant, layers, base, self.env.device, files, seed)

        left_out = {}
        if not chosen:
            return Expected(None, {}, left_out)
        try:
            made = make(chosen)
        except Exception as e:  # re-raised unless the reference itself refused
            if not truth.raised_by_reference(e):
                raise
            for spec in chosen:
                try:
                    make([spec])
                except Exception as e:  # re-raised unless the reference itself refused
                    if not truth.raised_by_reference(e):
                        raise
                    left_out[spec.path] = f"{type(e).__name__}: {e}"
            chosen = [s for s in chosen if s.path not in left_out]
            made = make(chosen) if chosen else None
        outputs = {}
        for spec in chosen:
            x, params = inputs[spec.path], made.params(spec.path, STRENGTH)
            outputs[spec.path] = (truth.true_output(spec, x, params), truth.ideal_output(spec, x, params, storage),
                                  truth.true_output(spec, x, made.base[spec.path]))
        return Expected(str(made.path) if made else None, outputs, left_out)


def fake_cuda_forward(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """A dry run's GPU half: the offloaded layer (weights, patches and adapters on the CPU) run on a FakeTensor
    cuda:0 input, as a GPU runs it. Anything left on the wrong device raises torch's real device-mismatch error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        y = layer(torch.empty(x.shape, dtype=x.dtype, device="cuda:0"))
        return y.device == torch.device("cuda:0") and y.dtype == x.dtype


class Expected:
    """A reference file (its path) and per layer (y*, y°, y of the base); the layers left out, with why."""

    def __init__(self, path: str | None, outputs: dict, left_out: dict):
        self.path, self.outputs, self.left_out = path, outputs, left_out


def run_case(bench: Bench, variant, set_name: str, storage_name: str, load_kind: str, mode: str) -> Case:
    storage = STORAGES[storage_name]
    case_id = f"{set_name}/{variant.id}/{storage_name}/{load_kind}/{mode}"
    _, _, base, inputs = bench.set(set_name, storage)
    expected = bench.expected(variant, set_name, storage)
    if expected.path is None:
        why = next(iter(expected.left_out.values()), "the reference makes this variant for none of the set's layers")
        return Case(case_id, "skip", detail=f"the reference cannot make it: {why}" if expected.left_out else why)
    patched, _, report = apply_file(load(expected.path), base, None, STRENGTH, 0.0, False, None, mode)
    started = time.perf_counter()
    load_patched(patched, bench.env.device, load_kind)
    layers = {}
    try:
        with torch.no_grad():
            for path, (y_true, y_ideal, y_base) in expected.outputs.items():
                layer = patched.model.get_submodule(f"diffusion_model.{path}")
                y = layer(inputs[path])
                layers[path] = truth.judge(y, y_true, y_ideal, y_base)
                if bench.env.dry_run and load_kind == "lowvram":
                    layers[path]["ok"] &= fake_cuda_forward(layer, inputs[path])
    finally:
        unload(patched, load_kind)
    seconds = time.perf_counter() - started
    worst = max(layers.values(), key=lambda v: v["ratio"])
    ok = all(v["ok"] for v in layers.values()) and len(report.applied) == report.total
    numbers = {"layers": len(layers), "applied": len(report.applied), "bypassed": report.bypassed,
               "worst_ratio": worst["ratio"], "worst_error": worst["error"], "ideal_error": worst["ideal_error"],
               "change": min(v["change"] for v in layers.values()),
               "inconclusive": sum(not v["conclusive"] for v in layers.values()), "seconds": seconds}
    failed = [p for p, v in layers.items() if not v["ok"]]
    problem = "" if ok else (f"layers off the truth: {failed}" if failed
                             else f"not every module applied: {report.line()}")
    left_out = expected.left_out
    skipped = f"the reference cannot make {sorted(left_out)}: {next(iter(left_out.values()))}" if left_out else ""
    return Case(case_id, "pass" if ok else "fail", numbers, "; ".join(part for part in (problem, skipped) if part))


def run(env, clock, loads: tuple[str, ...]) -> list[Case]:
    """The cases of `plan`. The reference's files and expected outputs go to <work>/truths, where the next section
    of the same run finds them (main.py empties the folder when a run starts)."""
    truths = Path(env.work) / TRUTHS
    truths.mkdir(parents=True, exist_ok=True)
    bench = Bench(env, truths, dynamic=loads == ("dynamic",))
    cases = []
    for item in plan(env.dry_run, loads):
        case_id = "/".join((item[1], item[0].id, *item[2:]))
        if clock.out():
            cases.append(Case(case_id, "not-run", detail="time budget spent"))
            continue
        try:
            cases.append(run_case(bench, *item))
        except Exception as e:  # noqa: BLE001 - one case's crash is its failure, reported with the traceback
            cases.append(Case(case_id, "error", detail=f"{type(e).__name__}: {e}", trace=True))
    return cases
