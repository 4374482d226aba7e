"""Issue #5: ComfyUI's built-in LoRA path and ours on identical files and weights, in one process and one run.

    python bench/run.py            # everything (SD1.5 and SDXL sizes), about 20 minutes on 2 cores
    python bench/run.py --quick    # SD1.5 sizes, 10 layers, a smaller file: under 5 minutes on 2 cores
    python bench/run.py --rows 1,5 # only some rows
    python bench/run.py --rows 4 --repeats 5

Every row prints one line ending in `ours=<v ±x%> builtin=<v ±x%> ratio=<ours/builtin> [<min>-<max>] goal=<goal>`
(seconds, or bytes for memory; medians over the repetitions, ±: half their range; [min-max]: the range of the
per-repetition ratios), preceded by MET / MISSED, "(within noise)" when the goal lies inside that range, REPORT for
rows without a goal. The table goes to bench/results.md (bench/results-quick.md for --quick). Not a test:
`make test` never runs it.
"""

import argparse
import gc
import json
import logging
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from harness import ADAPTER_ERRORS, BENCH, Row, median, table, timed  # isort: skip (first: it sets up ComfyUI in CPU mode)

import adapter_files as files
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.sd
import comfy.supported_models
import torch
import unet_shapes
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.glue.apply import apply_file, build_patches

ALL_ROWS = "1,2,3,4,5,6"
CPU = torch.device("cpu")
FP16 = torch.float16
SETTINGS = {
    # merge models and every how many-th of their weights, repeats, layers of the small model, tokens per forward,
    # model and LoCon rank of the load file, fresh processes per loader
    "full": {"merge_models": ("sd15", "sdxl"), "merge_stride": 1, "repeats": 3, "layers": 50, "tokens": 256,
             "load_model": "sdxl", "load_rank": 160, "load_repeats": 3},
    "quick": {"merge_models": ("sd15",), "merge_stride": 4, "repeats": 3, "layers": 10, "tokens": 64,
              "load_model": "sd15", "load_rank": 128, "load_repeats": 3},
}


def log(message: str) -> None:
    print(message, flush=True)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (user + system, all threads)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextmanager
def section(name: str, spent: dict):
    """Log a part's wall and CPU time, and the load average: this machine may be shared, which slows every path."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    yield
    spent[name] = (time.perf_counter() - wall, cpu_seconds() - cpu)
    log(f"[{name}: {spent[name][0]:.0f} s wall, {spent[name][1]:.0f} s CPU, "
        f"1-min load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs]")


def our_patches(sd: dict, name: str, key_map: dict, shapes: dict) -> dict:
    patches, report = build_patches(parse_state_dict(sd, name), key_map, {"model": shapes}, reference=False)
    if report.problems or report.unused_keys:
        raise RuntimeError(f"{name}: not fully applied: {report.details()}")
    return patches["model"]


def builtin_patches(sd: dict, key_map: dict) -> dict:
    return comfy.lora.load_lora(sd, key_map)


class Weights:
    """Random fp16 weights: every weight is a view of the start of one shared random pool (its values do not change
    the work), so an SDXL-size model costs one layer's memory."""

    def __init__(self, shapes, seed: int = 1):
        largest = max(math.prod(s) for s in shapes)
        gen = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(largest, generator=gen) * 0.02).to(FP16)

    def original(self, shape) -> torch.Tensor:
        return self.pool[: math.prod(shape)].view(shape)


# ---- machine floor ----------------------------------------------------------------------------------------------

class Machine:
    """This machine's copy bandwidth (bytes read + written per second, 256 MB fp32) and fp32 matmul throughput
    (3072², the size of ComfyUI's large layers): the best of every measurement so far, since load from other
    processes can only lower them (the floor is what the machine can do, not what it did while shared)."""

    def __init__(self):
        self.bandwidth, self.flops, self.count = 0.0, 0.0, 0
        self.measure()

    def measure(self) -> None:
        src = torch.randn(64 * 2**20)
        dst = torch.empty_like(src)
        dst.copy_(src)
        copy_s = median(timed(lambda: dst.copy_(src)) for _ in range(7))
        n = 3072
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        mm_s = median(timed(lambda: a @ b) for _ in range(5))
        self.bandwidth = max(self.bandwidth, 2 * src.numel() * 4 / copy_s)
        self.flops = max(self.flops, 2 * n**3 / mm_s)
        self.count += 1

    def floor(self, work: list[tuple[int, int]]) -> float:
        """Σ over weights of max(bytes / bandwidth, FLOPs / throughput)."""
        return sum(max(moved / self.bandwidth, flops / self.flops) for moved, flops in work)

    def line(self) -> str:
        return (f"copy {self.bandwidth / 1e9:.1f} GB/s (read+write), fp32 matmul {self.flops / 1e9:.0f} GFLOP/s "
                f"(best of {self.count} measurements)")


# ---- row 1: merge ------------------------------------------------------------------------------------------------

def calc(patch, weight: torch.Tensor, key: str) -> torch.Tensor:
    """The per-key work of ModelPatcher.patch_weight_to_device: calculate_weight on ComfyUI's fp32 copy."""
    return comfy.lora.calculate_weight([(1.0, patch, 1.0, None, None)], weight, key)


def merge_times(patch_sets: dict[str, dict], shapes: dict, weights: Weights, repeats: int
                ) -> dict[str, list[float]]:
    """The summed per-key time of each patch set in each of `repeats` passes. The sets take turns key by key
    (first one, then the other, swapped every pass), so a burst of load from another process hits both alike."""
    totals = {name: [0.0] * repeats for name in patch_sets}
    for rep in range(repeats):
        order = list(patch_sets) if rep % 2 == 0 else list(reversed(patch_sets))
        for key, shape in shapes.items():
            for name in order:
                temp = weights.original(shape).to(torch.float32, copy=True)  # fresh fp32 copy, not timed
                start = time.perf_counter()
                calc(patch_sets[name][key], temp, key)
                totals[name][rep] += time.perf_counter() - start
    return totals


def agreement(builtin: dict, ours: dict, shapes: dict, weights: Weights) -> tuple[float, int]:
    """(largest ‖ours − builtin‖/‖ours − W‖ over a sample of keys, keys the built-in left unchanged)."""
    keys = list(shapes)
    sample = set(keys[:: max(1, len(keys) // 16)]) | {max(keys, key=lambda k: math.prod(shapes[k]))}
    worst, unchanged = 0.0, 0
    for key in sample:
        w = weights.original(shapes[key]).float()
        b = calc(builtin[key], w.clone(), key)
        o = calc(ours[key], w.clone(), key)
        unchanged += int(torch.equal(b, w))
        worst = max(worst, float((o - b).norm() / (o - w).norm()))
    return worst, unchanged


def failure_note(errors: int, unchanged: int = 0) -> str:
    if not (errors or unchanged):
        return ""
    return (f"; NOT COMPARABLE: the built-in logged {errors} adapter errors and left {unchanged} checked weights "
            f"unpatched (e.g. '{ADAPTER_ERRORS.last[:120]}')")


def by_prefix(sd: dict) -> dict[str, dict]:
    groups: dict[str, dict] = {}
    for key, tensor in sd.items():
        prefix, suffix = key.split(".", 1)
        groups.setdefault(prefix, {})[suffix] = tensor
    return groups


def without_builtin(algo: str, sd: dict, key_map: dict) -> None:
    """A format ComfyUI has no adapter for: check that load_lora really reads none of it (its "lora key not loaded"
    warning per key is kept off the console)."""
    logging.disable(logging.WARNING)
    try:
        assert not builtin_patches(sd, key_map), f"the built-in now reads {algo}: take it out of NO_BUILTIN"
    finally:
        logging.disable(logging.NOTSET)


NO_BUILTIN_NOTE = "ComfyUI has no adapter for this format (load_lora leaves its keys unloaded)"


# BOFT's merge does log2(n)+1 block rotations of the whole weight (10 on SDXL's 10240-row layers): 5-10× the time of
# the others; every 4th weight keeps its rows within the full run's budget (the ratio is per weight alike).
MERGE_THINNING = {"boft_r32": 4}


def merge_rows(model: str, stride: int, repeats: int) -> list[tuple[Row, list[tuple[int, int]]]]:
    """(row, per-weight work) for each algorithm; the floor part is filled in by `finish_merge_rows`."""
    every = unet_shapes.unet_weights(model)
    all_shapes = {k: every[k] for k in list(every)[::stride]}
    weights = Weights(all_shapes.values())
    rows = []
    for i, algo in enumerate(files.ALGORITHMS):
        thinned = MERGE_THINNING.get(algo, 1)
        shapes = {k: all_shapes[k] for k in list(all_shapes)[::thinned]}
        key_map = unet_shapes.key_map(shapes)
        sd = files.state_dict(algo, shapes, key_map, seed=i)
        ours = our_patches(sd, f"{algo}.safetensors", key_map, shapes)
        subset = "" if stride * thinned == 1 else f" of {len(every)}"
        note = f"{len(shapes)}{subset} weights, file {files.file_bytes(sd) / 1e6:.0f} MB, "
        if algo in files.NO_BUILTIN:
            without_builtin(algo, sd, key_map)
            times = merge_times({"ours": ours}, shapes, weights, repeats)
            times["builtin"] = None
            note += NO_BUILTIN_NOTE
            errors = unchanged = 0
        else:
            builtin = builtin_patches(sd, key_map)
            assert set(builtin) == set(ours) == set(shapes), "both loaders must patch every weight"
            errors = ADAPTER_ERRORS.count
            times = merge_times({"builtin": builtin, "ours": ours}, shapes, weights, repeats)
            worst, unchanged = agreement(builtin, ours, shapes, weights)
            errors = ADAPTER_ERRORS.count - errors
            note += (f"ours vs builtin rel.diff {worst:.1e}"
                     + (" (expected: ComfyUI's DoRA divides by the norm of W, not W+dW)" if "dora" in algo else "")
                     + failure_note(errors, unchanged))
            del builtin
        work = [files.work(algo, shapes[key_map[prefix]], tensors) for prefix, tensors in by_prefix(sd).items()]
        goal, limit = ("<=2xfloor", None) if times["builtin"] is None else ("<=0.5,<=2xfloor", 0.5)
        row = Row(f"merge {model} {algo}", times["ours"], times["builtin"], goal, limit, note=note,
                  comparable=not (errors or unchanged))
        rows.append((row, work))
        log(f"[merge {model} {algo}: ours {row.cell(row.ours_runs)} s, builtin {row.cell(row.builtin_runs)} s; "
            "its line follows row 1, with the floor]")
        del sd, ours
        gc.collect()
    return rows


def finish_merge_rows(pending: list[tuple[Row, list[tuple[int, int]]]], machine: Machine) -> list[Row]:
    rows = []
    for row, work in pending:
        floor = machine.floor(work)
        row.note = f"floor={floor:.4g}s ours/floor={row.ours / floor:.2f}, {row.note}"
        row.ours_limit = 2 * floor
        log(row.line())
        rows.append(row)
    return rows


# ---- the small model of SDXL-size layers (rows 2-4) -------------------------------------------------------------

def sdxl_layers(count: int) -> dict[str, tuple[int, ...]]:
    """The first `count` Linear weights of SDXL's middle-block transformer (10 per transformer block)."""
    shapes = unet_shapes.unet_weights("sdxl")
    keys = [k for k in shapes if k.startswith("diffusion_model.middle_block.1.transformer_blocks.")
            and len(shapes[k]) == 2][:count]
    assert len(keys) == count, f"SDXL has only {len(keys)} such layers"
    return {k: shapes[k] for k in keys}


def layer_model(shapes: dict, weights: Weights) -> torch.nn.Module:
    """comfy.ops Linear layers (fp16) under their SDXL key names, with an SDXL model_config so ComfyUI's own
    model_lora_keys_unet (and so load_lora_for_models and our apply_file) work on it as on a real SDXL."""
    root = torch.nn.Module()
    for key, (out, inp) in shapes.items():
        *path, leaf = key.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        layer = comfy.ops.disable_weight_init.Linear(inp, out, bias=True, dtype=FP16)
        layer.weight = torch.nn.Parameter(weights.original((out, inp)).clone(), requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(out, dtype=FP16), requires_grad=False)
        parent.add_module(leaf, layer)
    root.model_config = comfy.supported_models.SDXL(unet_shapes.unet_config("sdxl"))
    return root.requires_grad_(False)


def make_inputs(shapes: dict, tokens: int) -> dict[int, torch.Tensor]:
    """`tokens` rows of fp16 input (like the weights) for each input width."""
    gen = torch.Generator().manual_seed(2)
    return {n: torch.randn(tokens, n, generator=gen).to(FP16) for n in sorted({s[1] for s in shapes.values()})}


class Forward:
    """One forward pass through every layer of a model."""

    def __init__(self, root: torch.nn.Module, shapes: dict, inputs: dict[int, torch.Tensor]):
        self.layers = [root.get_submodule(k.removesuffix(".weight")) for k in shapes]
        self.inputs = inputs

    def __call__(self) -> None:
        with torch.no_grad():
            for layer in self.layers:
                layer(self.inputs[layer.in_features])

    def outputs(self, tokens: int = 32) -> list[torch.Tensor]:
        """Every layer's output (fp32) on the first `tokens` rows of its input."""
        with torch.no_grad():
            return [layer(self.inputs[layer.in_features][:tokens]).float() for layer in self.layers]


def exact_outputs(model: "Model", patches: dict, tokens: int = 32) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(unpatched, patched) outputs of every layer in fp32 on fp32 weights, the patched weight W' from our merge
    path on an fp32 copy of W (that path is checked against lycoris-lora and PEFT by the tests): the truth both the
    fp16 merged model and the bypassed one approximate."""
    base, patched = [], []
    for key, layer in zip(model.shapes, model.forward.layers):
        x = model.forward.inputs[layer.in_features][:tokens].float()
        w = model.weights.original(model.shapes[key]).float()
        bias = layer.bias.float()
        base.append(torch.nn.functional.linear(x, w, bias))
        patched.append(torch.nn.functional.linear(x, calc(patches[key], w.clone(), key), bias))
    return base, patched


def output_diff(got: list[torch.Tensor], want: list[torch.Tensor], base: list[torch.Tensor]) -> float:
    """‖got − want‖ / ‖want − base‖ over all layers: the difference relative to the change the patches make."""
    diff = sum(float((g - w).square().sum()) for g, w in zip(got, want))
    change = sum(float((w - b).square().sum()) for w, b in zip(want, base))
    return math.sqrt(diff / change)


class Model:
    """One copy of the small model with its ModelPatcher. Each compared path gets its own copy, so their
    measurements can alternate: load from other processes on a shared machine then hits both alike."""

    def __init__(self, shapes: dict, weights: Weights, inputs: dict[int, torch.Tensor]):
        self.shapes, self.weights = shapes, weights
        self.root = layer_model(shapes, weights)
        self.base = comfy.model_patcher.ModelPatcher(self.root, load_device=CPU, offload_device=CPU)
        self.forward = Forward(self.root, shapes, inputs)

    def weights_unchanged(self) -> bool:
        return all(torch.equal(self.root.get_parameter(k), self.weights.original(s)) for k, s in self.shapes.items())

    def output_changed(self) -> bool:
        """The first layer's forward differs from the plain linear of its stored weight: a bypass hook or an
        offloaded (LowVramPatch) patch is at work."""
        layer = self.forward.layers[0]
        x = self.forward.inputs[layer.in_features][:4]
        with torch.no_grad():
            return not torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def alternating(calls: dict, repeats: int) -> dict[str, list[float]]:
    """Each call's time in each of `repeats` rounds, the calls taking turns (the order swapped every round), after
    one untimed warm-up each (first-call allocations and lazy set-up are not the steady state)."""
    for call in calls.values():
        call()
    samples = {name: [] for name in calls}
    for rep in range(repeats):
        for name in (list(calls) if rep % 2 == 0 else list(reversed(calls))):
            samples[name].append(timed(calls[name]))
    return samples


def our_bypass(lfile, base, strength: float):
    new, _, report = apply_file(lfile, base, None, strength, 0.0, reference=False, block_weights=None,
                                apply_mode="bypass", injection_key="bench")
    assert report.bypassed == len(report.applied), f"only {report.bypassed}/{len(report.applied)} layers bypassed"
    return new


# ---- row 2: strength change --------------------------------------------------------------------------------------

def strength_rows(shapes, key_map, weights: Weights, inputs, repeats: int) -> list[Row]:
    """Time from a new strength to a patched model, as a re-executed loader node and the next sampler's
    load_models_gpu do it (the previous clone detached, its weights restored, all re-patched)."""
    sd = files.state_dict("locon_r32", shapes, key_map, seed=10)
    lfile = parse_state_dict(sd, "locon_r32.safetensors")
    load = comfy.model_management.load_models_gpu

    def builtin(base, s):  # LoraLoader with its cached state dict
        new, _ = comfy.sd.load_lora_for_models(base, None, sd, s, 0.0)
        load([new])
        return new

    def merge(base, s):  # our loader with its cached parsed file
        new, _, _ = apply_file(lfile, base, None, s, 0.0, reference=False)
        load([new])
        return new

    def bypass(base, s):
        new = our_bypass(lfile, base, s)
        load([new])
        return new

    changes = {"builtin": builtin, "merge": merge, "bypass": bypass}
    models = {name: Model(shapes, weights, inputs) for name in changes}
    # The loader's previous output stays alive until the new one is loaded (ComfyUI's LoadedModel holds only a weak
    # reference; the node output cache holds the patcher), as when a user changes the strength and queues again.
    current = {name: change(models[name].base, 0.75) for name, change in changes.items()}
    elapsed = {name: [] for name in changes}
    for s in [0.9, 1.0, 0.8, 0.6, 1.1, 0.7, 0.5, 0.95, 0.85, 0.65, 1.05, 0.55][:max(repeats, 3)]:
        for name, change in changes.items():
            start = time.perf_counter()
            new = change(models[name].base, s)
            elapsed[name].append(time.perf_counter() - start)
            current[name] = new
    assert models["bypass"].weights_unchanged(), "bypass mode changed a weight"
    assert models["bypass"].output_changed(), "bypass mode installed no hooks"
    assert not models["builtin"].weights_unchanged() and not models["merge"].weights_unchanged(), "merge did nothing"
    comfy.model_management.unload_all_models()  # while the patchers live: unloading restores every weight
    assert all(m.weights_unchanged() for m in models.values()), "unloading must restore the weights"
    del current
    times = elapsed
    label = f"sdxl {len(shapes)} layers locon_r32"
    rows = [Row(f"strength merge {label}", times["merge"], times["builtin"], "<=0.5", 0.5,
                note="loader node work + load_models_gpu"),
            Row(f"strength bypass {label}", times["bypass"], times["builtin"], "<=0.01", 0.01,
                note="ours=bypass (weights checked unchanged), builtin=built-in merge")]
    for row in rows:
        log(row.line())
    return rows


# ---- rows 3 and 4: offloaded forward, bypass cost -----------------------------------------------------------------

# Row 4's goals: bypassed forward ÷ merged forward (issue #13); LoHa's factored form costs more (rank r² change).
BYPASS_LIMITS = {"loha_r16": 1.3}
BYPASS_LIMIT = 1.15
BYPASS_TOLERANCE = 0.05  # ‖bypass − exact‖ / ‖exact − unpatched‖ above which the row is not a valid comparison


def offloaded_row(algo: str, label: str, a: Model, b: Model, builtin: dict | None, ours: dict, repeats: int,
                  shapes: dict) -> Row:
    """Row 3: the built-in's patches on a, ours on b, every layer offloaded (LowVramPatch at each forward)."""
    patchers = []
    for model, patches in ((a, builtin), (b, ours)):
        if patches is None:
            continue
        p = model.base.clone()
        p.add_patches(patches, 1.0)
        p.patch_model(device_to=CPU, lowvram_model_memory=1)
        assert model.root.lowvram_patch_counter == len(shapes), "every layer must be patched at forward time"
        patchers.append(p)
    errors = ADAPTER_ERRORS.count  # only the built-in logs them: our adapter raises instead
    calls = {"ours": b.forward} if builtin is None else {"builtin": a.forward, "ours": b.forward}
    t = alternating(calls, repeats)
    errors = ADAPTER_ERRORS.count - errors
    assert b.output_changed(), f"{algo}: our offloaded patch did not change the output"
    unpatched = 0 if builtin is None or a.output_changed() else 1
    for p in patchers:
        p.unpatch_model(device_to=CPU)
    note = NO_BUILTIN_NOTE if builtin is None else failure_note(errors, unpatched).removeprefix("; ")
    return Row(f"offloaded-forward {label} {algo}", t["ours"], t.get("builtin"), "<=1.0", 1.0, note=note,
               comparable=not (errors or unpatched))


def bypass_row(algo: str, label: str, lfile, ours: dict, a: Model, b: Model, repeats: int) -> Row:
    """Row 4, what a user gets from the loader node: our file merged into a (apply_mode merge) and bypassed on b
    (apply_mode bypass: nodes/glue/bypass.py's injection), both loaded by ComfyUI's load_models_gpu; the same inputs
    through both. Both outputs are compared with the exact fp32 ones (`exact_outputs`)."""
    base, exact = exact_outputs(a, ours)
    merged, _, _ = apply_file(lfile, a.base, None, 1.0, 0.0, reference=False)
    bypassed = our_bypass(lfile, b.base, 1.0)
    comfy.model_management.load_models_gpu([merged, bypassed])
    assert not a.weights_unchanged(), "merge mode must patch the weights"
    assert b.output_changed() and b.weights_unchanged(), "bypass mode must hook the forward, not the weights"
    diffs = {name: output_diff(model.forward.outputs(), exact, base) for name, model in (("bypass", b), ("merged", a))}
    t = alternating({"merged": a.forward, "bypass": b.forward}, repeats)
    comfy.model_management.unload_all_models()  # while the patchers live: unloading restores every weight
    assert a.weights_unchanged() and not b.output_changed(), "unloading must restore the weights and the forward"
    del merged, bypassed
    limit = BYPASS_LIMITS.get(algo, BYPASS_LIMIT)
    # fp16 storage puts the merged model within ~1e-2 of the exact change; a wrong bypass is off by ~1
    wrong = diffs["bypass"] > max(BYPASS_TOLERANCE, 2 * diffs["merged"])
    return Row(f"bypass-cost {label} {algo}", t["bypass"], t["merged"], f"<={limit}", limit, comparable=not wrong,
               note=("BYPASS OUTPUT WRONG; " if wrong else "") + f"ours=bypass forward, builtin=forward on merged weights; outputs vs exact fp32, ‖y − exact‖/"
                    f"‖exact − unpatched‖: bypass {diffs['bypass']:.1e}, merged {diffs['merged']:.1e}")


def forward_rows(shapes, key_map, weights: Weights, inputs, repeats: int) -> tuple[list[Row], list[Row]]:
    a, b = Model(shapes, weights, inputs), Model(shapes, weights, inputs)
    label = f"sdxl {len(shapes)} layers x {next(iter(inputs.values())).shape[0]} tokens"
    offloaded, bypass_cost = [], []
    for i, algo in enumerate(files.ALGORITHMS):
        sd = files.state_dict(algo, shapes, key_map, seed=20 + i)
        lfile = parse_state_dict(sd, f"{algo}.safetensors")
        ours = our_patches(sd, algo, key_map, shapes)
        if algo in files.NO_BUILTIN:
            without_builtin(algo, sd, key_map)
            builtin = None
        else:
            builtin = builtin_patches(sd, key_map)
        offloaded.append(offloaded_row(algo, label, a, b, builtin, ours, repeats, shapes))
        log(offloaded[-1].line())
        bypass_cost.append(bypass_row(algo, label, lfile, ours, a, b, repeats))
        log(bypass_cost[-1].line())
        del sd, lfile, builtin, ours
        gc.collect()
    return offloaded, bypass_cost


# ---- row 6: under torch.compile ----------------------------------------------------------------------------------

def compiled_path(change, model: Model, repeats: int) -> dict:
    """One path under torch.compile (inductor) on its own model copy: graphs dynamo compiles and seconds of the
    first run (compiling), of a re-run (ComfyUI ejects and re-injects around every sampling run; then one compiled
    forward) and of a strength change (the loader again, load_models_gpu, one compiled forward)."""
    layers, inputs = model.forward.layers, model.forward.inputs

    def forward():  # returns the outputs: a compiled function whose results go unused computes nothing
        return [layer(inputs[layer.in_features]) for layer in layers]

    step = torch.compile(forward, backend="inductor")
    graphs = torch._dynamo.utils.counters["stats"]
    state = {"p": change(model.base, 1.0)}
    forward()  # uncompiled once: the layers learn their input's dtype, as a real model's get_dtype tells them

    def rerun():
        state["p"].eject_model()
        state["p"].inject_model()
        step()

    strengths = iter([0.5, 0.8] * (repeats + 2))

    def strength():
        state["p"] = change(model.base, next(strengths))
        step()

    out = {}
    for name, fn, n in (("first", step, 1), ("rerun", rerun, repeats), ("strength", strength, repeats)):
        before = graphs["unique_graphs"]
        out[name] = [timed(fn) for _ in range(n)]
        out[f"{name} graphs"] = graphs["unique_graphs"] - before
    out["changed"] = model.output_changed() or not model.weights_unchanged()
    comfy.model_management.unload_all_models()
    state.clear()
    return out


def compiled_rows(shapes, key_map, weights: Weights, inputs, repeats: int) -> list[Row]:
    """Row 6: our bypass under torch.compile against ComfyUI's compiled merge (and ComfyUI's own bypass where it
    has one), same file and inputs: graphs per run and the time of a re-run and of a strength change."""
    sd = files.state_dict("locon_r32", shapes, key_map, seed=10)
    lfile = parse_state_dict(sd, "locon_r32.safetensors")
    load = comfy.model_management.load_models_gpu

    def loaded(new):
        load([new])
        return new

    paths = {"ours bypass": lambda base, s: loaded(our_bypass(lfile, base, s)),
             "ComfyUI merge": lambda base, s: loaded(comfy.sd.load_lora_for_models(base, None, sd, s, 0.0)[0])}
    core_bypass = getattr(comfy.sd, "load_bypass_lora_for_models", None)  # ComfyUI 0.33 on
    if core_bypass is not None:
        paths["ComfyUI bypass"] = lambda base, s: loaded(core_bypass(base, None, sd, s, 0.0)[0])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):  # every path compiled, none falls back to eager
        runs = {name: compiled_path(change, Model(shapes, weights, inputs), repeats) for name, change in paths.items()}
    torch._dynamo.reset()
    ours = runs["ours bypass"]
    assert all(r["changed"] for r in runs.values()), "a compiled path left the model unchanged"
    label = f"sdxl {len(shapes)} layers locon_r32, inductor"
    rows = []
    for other, r in runs.items():
        if other == "ours bypass":
            continue
        graphs = "; ".join(f"{n}: graphs first/re-run/strength {x['first graphs']}/{x['rerun graphs']}/"
                           f"{x['strength graphs']}, first run {x['first'][0]:.2f} s" for n, x in
                           (("ours", ours), (other, r)))
        for run, what in (("rerun", "re-run (eject, re-inject, forward)"),
                          ("strength", "strength change (loader, load, forward)")):
            rows.append(Row(f"compiled {what} {label}, ours bypass vs {other}", ours[run], r[run], "report",
                            note=graphs))
    for row in rows:
        log(row.line())
    return rows


# ---- row 5: loading ----------------------------------------------------------------------------------------------

def write_file(path: str, model: str, rank: int) -> int:
    from safetensors.torch import save_file

    shapes = unet_shapes.unet_weights(model)
    sd = files.state_dict(f"locon_r{rank}", shapes, unet_shapes.key_map(shapes), seed=30)
    save_file(sd, path)
    del sd
    gc.collect()
    return os.path.getsize(path)


def child(mode: str, path: str, model: str) -> dict:
    result = subprocess.run([sys.executable, str(BENCH / "load_child.py"), mode, path, model],
                            check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def load_rows(model: str, rank: int, repeats: int) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="lycoris_bench_") as tmp:
        path = os.path.join(tmp, f"locon_r{rank}.safetensors")
        size = write_file(path, model, rank)
        runs = {"builtin": [], "ours": []}
        for _ in range(repeats):  # alternating, each in a fresh process
            for mode, results in runs.items():
                results.append(child(mode, path, model))
    label = f"{model} locon_r{rank} {size / 1e9:.2f} GB"
    anon = {m: median(r["rss_anon_after"] for r in runs[m]) / 1e6 for m in runs}
    rows = [
        Row(f"load-time {label}", [r["seconds"] for r in runs["ours"]], [r["seconds"] for r in runs["builtin"]],
            "report", note="load + build patches"),
        Row(f"load-peak-memory {label}", [r["peak_extra"] for r in runs["ours"]],
            [r["peak_extra"] for r in runs["builtin"]], "<=0.5", 0.5, unit="B",
            note=f"peak RSS over the post-import baseline (file-backed pages count); anonymous RSS after: "
                 f"ours {anon['ours']:.0f} MB, builtin {anon['builtin']:.0f} MB"),
    ]
    for row in rows:
        log(row.line())
    return rows


# ---- output ------------------------------------------------------------------------------------------------------

def write_table(rows: list[Row], opts, machine: Machine, spent: tuple[float, float], load: tuple[float, float]) -> str:
    quick = opts.quick
    path = BENCH / ("results-quick.md" if quick else "results.md")
    rows_arg = "" if opts.rows == ALL_ROWS else f" --rows {opts.rows}"
    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor())
    repeats_arg = "" if opts.repeats is None else f" --repeats {opts.repeats}"
    command = f"python bench/run.py{' --quick' if quick else ''}{rows_arg}{repeats_arg}"
    header = (f"`{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__} ({torch.get_num_threads()} threads), "
              f"ComfyUI {comfy_version()}, Python {platform.python_version()}; {spent[0] / 60:.1f} min in all, "
              f"{spent[1] / 60:.1f} CPU-min. 1-min load average {load[0]:.1f} before the run (other processes) and "
              f"{load[1]:.1f} at its end (this run included). "
              f"Machine floor from {machine.line()}.")
    lines = [
        f"# Benchmark results{' (--quick)' if quick else ''}{' (some rows only)' if rows_arg else ''}",
        "",
        header,
        "",
        ("Seconds, or bytes for memory: medians over the repetitions (n), ± half their range; ratio = ours/built-in "
         "of the medians, range = the lowest and highest ratio of one repetition (the two sides measured in turn). "
         "'within noise': the goal lies inside that range."),
        "",
    ]
    lines += table(rows, "built-in")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def comfy_version() -> str:
    import comfyui_version

    return comfyui_version.__version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller version, under 5 minutes on 2 cores")
    parser.add_argument("--rows", default=ALL_ROWS, help="comma-separated rows to run (default: all)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repetitions per row, at least 3 (default: 3, fresh processes for row 5 as set)")
    opts = parser.parse_args(argv)
    which = {int(x) for x in opts.rows.split(",")}
    cfg = dict(SETTINGS["quick" if opts.quick else "full"])
    if opts.repeats is not None:
        if opts.repeats < 3:
            parser.error("--repeats: a spread needs at least 3 repetitions")
        cfg["repeats"] = cfg["load_repeats"] = opts.repeats
    torch.set_grad_enabled(False)
    spent: dict[str, tuple[float, float]] = {}
    load_before = os.getloadavg()[0]
    rows: list[Row] = []
    with section("all", spent):
        machine = Machine()
        log(f"machine: {machine.line()}, {torch.get_num_threads()} threads, load average {load_before:.1f}; "
            f"{'quick' if opts.quick else 'full'}: {cfg}")
        if 1 in which:
            with section("row 1", spent):
                pending = []
                for model in cfg["merge_models"]:
                    machine.measure()
                    pending += merge_rows(model, cfg["merge_stride"], cfg["repeats"])
                machine.measure()
                log(f"floor from {machine.line()}")
                rows += finish_merge_rows(pending, machine)
        if which & {2, 3, 4, 6}:
            shapes = sdxl_layers(cfg["layers"])
            key_map = unet_shapes.key_map(shapes)
            weights = Weights(shapes.values(), seed=3)
            inputs = make_inputs(shapes, cfg["tokens"])
            if 2 in which:
                with section("row 2", spent):
                    rows += strength_rows(shapes, key_map, weights, inputs, cfg["repeats"])
                gc.collect()
            if which & {3, 4}:
                with section("rows 3-4", spent):
                    offloaded, bypass_cost = forward_rows(shapes, key_map, weights, inputs, cfg["repeats"])
                rows += (offloaded if 3 in which else []) + (bypass_cost if 4 in which else [])
                gc.collect()
            if 6 in which:
                with section("row 6", spent):
                    rows += compiled_rows(shapes, key_map, weights, inputs, cfg["repeats"])
                gc.collect()
        if 5 in which:
            with section("row 5", spent):
                rows += load_rows(cfg["load_model"], cfg["load_rank"], cfg["load_repeats"])
    table = write_table(rows, opts, machine, spent["all"], (load_before, os.getloadavg()[0]))
    log(f"table written to {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
