"""Soak: a real ComfyUI server's memory over many prompts, the pack's loaders against core's LoraLoader (issue #23).

    .venv/bin/python bench/soak.py                      # ComfyUI 0.33, 300 prompts per side, 40 files
    .venv/bin/python bench/soak.py --comfy 0.3.75 --prompts 60
    .venv/bin/python bench/soak.py --sides pack,core,pack:trim   # + a pack server trimmed at every sample

Not a test (pytest never collects it: bench/ is outside tests/). Any interpreter runs this script (stdlib only); the
files are made by `.venv`'s Python (lycoris-lora 4.1.3, the tests' reference code, on the tiny SD1.5 checkpoint),
cached in .deps/test-assets/soak/, and each side gets its own server process in the chosen ComfyUI's venv.

The prompts come from one seeded RNG: 1-3 files per prompt, chained, with random strengths, apply modes, strength
modes and (one loader in three) block weights; the core side runs the same prompts with core's LoraLoader on the
files core can load (the others are left out of its chain) and the same sampler seeds. Every `--every` prompts the
server process is sampled from /proc: RSS, RssAnon, open fds, deleted-file mappings (the pack's snapshots are
unlinked copies: they show there, not in the temp folder's size), ComfyUI's temp folder size, and the pack's cache
stats (GET /lycoris/info?cache=1). The table per 100 prompts and the verdict go to bench/results-soak.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "scripts"))

from comfy_server import ComfyServer

ASSETS = REPO / ".deps" / "test-assets"
SOAK_DIR = ASSETS / "soak"
CHECKPOINT = ASSETS / "tiny_sd15.safetensors"
MANIFEST = SOAK_DIR / "manifest.json"
FILES_VERSION = "1"  # bump when the files change
COMFY = {  # version -> (ComfyUI folder, the venv holding its requirements)
    "0.33": (REPO / ".deps" / "ComfyUI-0.33", REPO / ".venv-0.33" / "bin" / "python"),
    "0.3.75": (REPO / ".deps" / "ComfyUI", REPO / ".venv" / "bin" / "python"),
}
GENERATOR_PYTHON = REPO / ".venv" / "bin" / "python"
DEFAULT_WARM_UP = 50  # prompts before growth is judged (models loaded, caches filled)
WARM_UP = DEFAULT_WARM_UP  # --warm-up
WINDOW = 50  # prompts per window: the spread of the windows' growth rates is the noise
PAGE = os.sysconf("SC_PAGE_SIZE")
MB = 1024 * 1024

# --------------------------------------------------------------------------------------------------- the files

# (algorithm, create_lycoris kwargs); file i uses ALGOS[i % len(ALGOS)] with its own seed and targets.
ALGOS = (
    ("locon", {"algo": "lora", "linear_dim": 8, "linear_alpha": 4, "conv_dim": 4, "conv_alpha": 2}),
    ("loha", {"algo": "loha", "linear_dim": 4, "linear_alpha": 2, "conv_dim": 4, "conv_alpha": 2}),
    ("lokr", {"algo": "lokr", "linear_dim": 4, "linear_alpha": 2, "factor": 8}),
    ("dora", {"algo": "lora", "linear_dim": 8, "linear_alpha": 4, "dora_wd": True}),
    ("oft", {"algo": "diag-oft", "linear_dim": 16, "conv_dim": 16}),
    ("boft", {"algo": "boft", "linear_dim": 16, "conv_dim": 16}),
    ("glora", {"algo": "glora", "linear_dim": 4, "linear_alpha": 2}),
    ("lora", {"algo": "lora", "linear_dim": 16, "linear_alpha": 8}),
    ("full", {"algo": "full"}),
    ("lokr_dora", {"algo": "lokr", "linear_dim": 4, "linear_alpha": 2, "factor": 4, "dora_wd": True}),
)
# ComfyUI's ldm class names: attention-only (the usual LoRA) or every Linear/Conv of the UNet
UNET_TARGETS = {"attn": ["CrossAttention"], "unet": ["SpatialTransformer", "ResBlock"]}
TE_PRESET = {"enable_conv": False, "target_module": ["CLIPAttention", "CLIPMLP"], "target_name": [],
             "lora_prefix": "lora_te"}


def file_plan(count: int) -> list[dict]:
    """What each file is: algorithm, kwargs, UNet targets, with or without the text encoder. A full-weight file
    covers attention only (every Linear/Conv would be 50 MB a file)."""
    plan = []
    for i in range(count):
        name, kwargs = ALGOS[i % len(ALGOS)]
        targets = "attn" if name == "full" or (i // len(ALGOS)) % 2 else "unet"
        plan.append({"name": f"soak_{i:02d}_{name}_{targets}.safetensors", "algo": name, "kwargs": kwargs,
                     "targets": targets, "te": i % 3 == 0 and name != "full", "seed": 7000 + i})
    return plan


def make_files(count: int) -> None:
    """(Runs in .venv's Python.) Writes the planned files with lycoris-lora and records which ones core loads."""
    sys.path.insert(0, str(REPO / "tests"))
    from comfy_env import setup_comfy

    setup_comfy()  # ComfyUI on sys.path, CPU mode, before anything imports comfy
    import comfy.lora
    import make_demo_lycoris
    import make_tiny_sd15
    import torch
    from reference.lycoris_factory import _randomise

    make_tiny_sd15.write_tiny_sd15(CHECKPOINT)
    model, clip = make_demo_lycoris._load_models(CHECKPOINT, with_clip=True)
    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, comfy.lora.model_lora_keys_unet(model, {}))
    SOAK_DIR.mkdir(parents=True, exist_ok=True)
    entries = []
    for spec in file_plan(count):
        preset = {**make_demo_lycoris.PRESET, "target_module": UNET_TARGETS[spec["targets"]]}
        nets = [make_demo_lycoris._create_network(model.diffusion_model, preset, spec["kwargs"])]
        if spec["te"]:
            nets.append(make_demo_lycoris._create_network(clip.cond_stage_model.clip_l.transformer, TE_PRESET,
                                                          spec["kwargs"]))
        for net in nets:
            _randomise(net, torch.Generator().manual_seed(spec["seed"]))
        path = SOAK_DIR / spec["name"]
        make_demo_lycoris._save(nets, path, {"ss_network_module": "lycoris.kohya"})
        for net in nets:
            net.restore()  # apply_to hooked the shared model (algo=full even removes its weights)
        entries.append({**spec, "core_loads": core_loads(path, key_map, comfy.lora)})
        print(f"{path.name}: {path.stat().st_size / MB:.1f} MB, core loads it: {entries[-1]['core_loads']}")
    MANIFEST.write_text(json.dumps({"version": FILES_VERSION, "count": count, "files": entries}, indent=1))


def core_loads(path: Path, key_map: dict, comfy_lora) -> bool:
    """Core's load_lora leaves no key of the file unloaded (it logs each one it leaves)."""
    import logging

    import comfy.utils
    from make_demo_lycoris import _LogCollector

    lora = comfy.utils.load_torch_file(str(path), safe_load=True)
    warnings = _LogCollector()
    logging.getLogger().addHandler(warnings)
    try:
        patches = comfy_lora.load_lora(lora, key_map)
    finally:
        logging.getLogger().removeHandler(warnings)
    return bool(patches) and not any("not loaded" in m.lower() for m in warnings.messages)


def files(count: int) -> list[dict]:
    """The manifest's entries, made first (in .venv's Python) if missing or of another version or count."""
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {}
    if manifest.get("version") != FILES_VERSION or manifest.get("count") != count:
        subprocess.run([str(GENERATOR_PYTHON), __file__, "--make-files", str(count)], check=True)
        manifest = json.loads(MANIFEST.read_text())
    return manifest["files"]


# --------------------------------------------------------------------------------------------------- the prompts

APPLY_MODES = ("auto", "merge", "bypass")
STRENGTH_MODES = ("linear", "lycoris")
BLOCK_NAMES = ("input_blocks.*", "middle_block.*", "output_blocks.*", "input_blocks.1-2", "output_blocks.0-1", "te")


@dataclass
class Use:
    """One file in a prompt's chain."""
    file: str
    strength_model: float
    strength_clip: float
    apply_mode: str
    strength_mode: str
    block_weights: str | None  # None: the plain loader


@dataclass
class PromptSpec:
    seed: int
    uses: list[Use] = field(default_factory=list)


def random_block_weights(rng: random.Random) -> str:
    rules = [f"default={rng.choice((1, 0.5, 0.8))}"]
    rules += [f"{name}={rng.randint(0, 12) / 10}" for name in rng.sample(BLOCK_NAMES, rng.randint(1, 3))]
    return "; ".join(rules)


def prompt_specs(count: int, file_entries: list[dict], seed: int) -> list[PromptSpec]:
    rng = random.Random(seed)
    specs = []
    for _ in range(count):
        spec = PromptSpec(seed=rng.randrange(2**31))
        for entry in rng.sample(file_entries, rng.randint(1, 3)):
            spec.uses.append(Use(entry["name"], round(rng.uniform(-1, 1.5), 2), round(rng.uniform(0, 1.2), 2),
                                 rng.choice(APPLY_MODES), rng.choice(STRENGTH_MODES),
                                 random_block_weights(rng) if rng.random() < 1 / 3 else None))
        specs.append(spec)
    return specs


def pack_loader(use: Use, model: list, clip: list) -> dict:
    inputs = {"model": model, "clip": clip, "lycoris_name": use.file, "strength_model": use.strength_model,
              "strength_clip": use.strength_clip, "strength_mode": use.strength_mode, "apply_mode": use.apply_mode}
    if use.block_weights is None:
        return {"class_type": "LycorisLoader", "inputs": inputs}
    return {"class_type": "LycorisBlockWeights", "inputs": {**inputs, "block_weights": use.block_weights}}


def core_loader(use: Use, model: list, clip: list) -> dict:
    return {"class_type": "LoraLoader", "inputs": {"model": model, "clip": clip, "lora_name": use.file,
                                                   "strength_model": use.strength_model,
                                                   "strength_clip": use.strength_clip}}


def api_prompt(spec: PromptSpec, side: str, core_files: set[str]) -> dict:
    """Checkpoint -> the chain of loaders -> text encode -> KSampler (64x64, 1 step, cfg 1: one encoding serves as
    both conditionings) -> decode -> save."""
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT.name}}}
    model, clip = ["1", 0], ["1", 1]
    uses = spec.uses if side == "pack" else [u for u in spec.uses if u.file in core_files]
    for i, use in enumerate(uses):
        node_id = str(10 + i)  # stable ids: ComfyUI's cache and the bypass injection keys see the same nodes
        prompt[node_id] = (pack_loader if side == "pack" else core_loader)(use, model, clip)
        model, clip = [node_id, 0], [node_id, 1]
    prompt.update({
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": "a soak test"}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": model, "positive": ["2", 0], "negative": ["2", 0], "latent_image": ["4", 0], "seed": spec.seed,
            "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": f"soak_{side}"}},
    })
    return prompt


# --------------------------------------------------------------------------------------------------- measuring

@dataclass
class Sample:
    prompts: int
    seconds: float
    rss: int
    anon: int
    fds: int
    deleted_maps: int  # bytes mapped from deleted files (the pack's unlinked snapshots)
    temp_bytes: int
    cache_files: int | None = None
    cache_mapped: int | None = None
    cache_private: int | None = None
    history_bytes: int = 0  # the JSON of the last prompt's /history entry (what ComfyUI keeps per prompt)
    probe: dict | None = None
    anon_trimmed: int | None = None  # RssAnon right after gc + malloc_trim(0) (a ":trim" side): live memory


def status_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def deleted_mapping_bytes(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text(encoding="utf-8").splitlines():
        if line.endswith("(deleted)"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            total += end - start
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def sample(server: ComfyServer, prompts: int, start: float, any_file: str, history_bytes: int, probe: bool) -> Sample:
    """The process as it is; with `probe`, then the probe's object counts and RssAnon after gc + malloc_trim."""
    pid = server.proc.pid
    status = status_kb(pid)
    cache = server.get_json(f"lycoris/info?{urllib.parse.urlencode({'name': any_file, 'cache': 1})}").get("cache", {})
    result = Sample(prompts, time.monotonic() - start, status["VmRSS"], status["RssAnon"],
                    len(os.listdir(f"/proc/{pid}/fd")), deleted_mapping_bytes(pid),
                    folder_bytes(server.base_dir / "temp"), cache.get("files"), cache.get("mapped"),
                    cache.get("private"), history_bytes)
    if probe:
        result.probe = server.get_json("soak_probe/state")
        result.anon_trimmed = server.get_json("soak_probe/trim")["after"]
    return result


# --------------------------------------------------------------------------------------------------- the probe

# A debug-only custom node (no nodes, two routes), written into a ":trim" side's own base dir: never part
# of the pack. /state: gc, then object counts and tensor bytes by kind; /trim: glibc malloc_trim(0), RssAnon before
# and after (what trimming gives back is free memory the allocator kept: fragmentation, not a leak).
PROBE_SOURCE = '''
import ctypes, gc, sys
from collections import Counter
import torch
from aiohttp import web
from server import PromptServer

NODE_CLASS_MAPPINGS = {}
_libc = ctypes.CDLL("libc.so.6")


def _anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024


def _tensor_bytes():
    seen, cpu = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                cpu += storage.nbytes()
    return len(seen), cpu


@PromptServer.instance.routes.get("/soak_probe/state")
async def state(request):
    gc.collect()
    types = Counter(type(o).__name__ for o in gc.get_objects())
    storages, tensor_bytes = _tensor_bytes()
    watched = ("ModelPatcher", "LycorisFile", "BypassLayer", "WeightChange", "LycorisAdapter", "Prepared",
               "ApplyReport", "CLIP", "dict", "list", "function", "cell", "tuple")
    return web.json_response({"anon": _anon(), "objects": len(gc.get_objects()), "storages": storages,
                              "tensor_bytes": tensor_bytes, "types": {k: types.get(k, 0) for k in watched},
                              "top": types.most_common(12)})


@PromptServer.instance.routes.get("/soak_probe/trim")
async def trim(request):
    before = _anon()
    gc.collect()
    _libc.malloc_trim(0)
    return web.json_response({"before": before, "after": _anon()})
'''


def install_probe(base_dir: Path) -> None:
    folder = base_dir / "custom_nodes" / "soak_probe"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text(PROBE_SOURCE)


# --------------------------------------------------------------------------------------------------- one side

@dataclass
class SideRun:
    side: str
    samples: list[Sample]
    prompts: int
    seconds: float


def make_base_dir(base: Path, file_entries: list[dict], probe: bool) -> Path:
    for sub in ("models/checkpoints", "models/loras", "custom_nodes"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "models" / "checkpoints" / CHECKPOINT.name).symlink_to(CHECKPOINT)
    for entry in file_entries:
        (base / "models" / "loras" / entry["name"]).symlink_to(SOAK_DIR / entry["name"])
    if probe:
        install_probe(base)
    return base


def run_side(side: str, specs: list[PromptSpec], file_entries: list[dict], opts, base: Path) -> SideRun:
    """One server, all prompts in turn. `side` is "pack" or "core", with ":trim" the probe is installed and every
    sample ends with gc + malloc_trim(0) (so that side's RSS is not what a user sees, but its trimmed RssAnon is the
    memory actually in use)."""
    loaders, _, mode = side.partition(":")
    probe = mode == "trim"
    comfy_dir, python = COMFY[opts.comfy]
    core_files = {e["name"] for e in file_entries if e["core_loads"]}
    samples = []
    deadline = time.monotonic() + opts.max_minutes * 60
    start = time.monotonic()
    server = ComfyServer(make_base_dir(base, file_entries, probe), comfy_dir=comfy_dir, python=str(python),
                         startup_timeout=180)
    with server_environment(opts.server_env), server:
        history_bytes, done = 0, 0
        samples.append(sample(server, 0, start, file_entries[0]["name"], 0, probe))
        for done, spec in enumerate(specs, 1):
            prompt_id = server.queue(api_prompt(spec, loaders, core_files))
            history_bytes = len(json.dumps(server.wait(prompt_id, timeout=600)))
            if done % opts.every == 0:
                samples.append(sample(server, done, start, file_entries[0]["name"], history_bytes, probe))
                print(f"[{side}] {progress_line(samples[-1])}", flush=True)
            if time.monotonic() > deadline:
                print(f"[{side}] stopped at {done} prompts: --max-minutes {opts.max_minutes} reached")
                break
    return SideRun(side, samples, samples[-1].prompts, time.monotonic() - start)


@contextlib.contextmanager
def server_environment(assignments: list[str]):
    """NAME=VALUE pairs (MALLOC_ARENA_MAX=2, ...) in os.environ while a server starts (it inherits them)."""
    saved = dict(os.environ)
    os.environ.update(dict(item.split("=", 1) for item in assignments))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def progress_line(s: Sample) -> str:
    cache = "" if s.cache_files is None else (f" cache {s.cache_files} files {s.cache_mapped / MB:.0f} MB mapped "
                                              f"{s.cache_private / MB:.0f} MB private")
    probe = "" if not s.probe else (f" | trimmed anon {s.anon_trimmed / MB:.0f} MB objects {s.probe['objects']} "
                                    f"tensors {s.probe['storages']} "
                                    f"{s.probe['tensor_bytes'] / MB:.0f} MB {s.probe['types']}")
    return (f"{s.prompts:4d} prompts {s.seconds:6.0f} s: RSS {s.rss / MB:.0f} MB anon {s.anon / MB:.0f} MB "
            f"fds {s.fds} deleted maps {s.deleted_maps / MB:.0f} MB temp {s.temp_bytes / MB:.1f} MB "
            f"history {s.history_bytes / 1024:.0f} kB{cache}{probe}")


# --------------------------------------------------------------------------------------------------- the verdict

def per_100(samples: list[Sample], attr: str, after: int | None = None) -> float | None:
    """Growth of `attr` per 100 prompts after the warm-up: the median slope over all pairs of samples (Theil-Sen), so
    one sample taken while a prompt's temporaries were still alive does not tilt it."""
    after = WARM_UP if after is None else after
    points = [(s.prompts, getattr(s, attr)) for s in samples if s.prompts >= after]
    if len(points) < 3:
        return None
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:]]
    return statistics.median(slopes) * 100


def window_slopes(samples: list[Sample], attr: str, window: int = WINDOW, after: int | None = None) -> list[float]:
    """The growth per 100 prompts of each successive window of `window` prompts after the warm-up: their spread is
    the noise a whole-run slope is judged against."""
    slopes = []
    after = WARM_UP if after is None else after
    points = [s for s in samples if s.prompts >= after]
    for first in range(len(points)):
        window_points = [s for s in points if points[first].prompts <= s.prompts <= points[first].prompts + window]
        if window_points[-1].prompts - points[first].prompts < window:
            break
        if (points[first].prompts - after) % window == 0:
            slopes.append((getattr(window_points[-1], attr) - getattr(window_points[0], attr)) * 100 / window)
    return slopes


def table_rows(run: SideRun) -> list[str]:
    """One row per 100 prompts (and the start and the end): the sample there and the change since the row above."""
    marks = [s for s in run.samples if s.prompts % 100 == 0 or s is run.samples[-1] or s.prompts == WARM_UP]
    rows, previous = [], None
    for s in marks:
        def delta(attr: str, previous=previous, s=s) -> str:
            return "" if previous is None else f" ({(getattr(s, attr) - getattr(previous, attr)) / MB:+.0f})"
        trimmed = "" if s.anon_trimmed is None else f"{s.anon_trimmed / MB:.0f}{delta('anon_trimmed')}"
        cache = "n/a" if s.cache_files is None else (f"{s.cache_files} / {s.cache_mapped / MB:.0f} / "
                                                     f"{s.cache_private / MB:.0f}")
        rows.append(f"| {run.side} | {s.prompts} | {s.seconds:.0f} | {s.rss / MB:.0f}{delta('rss')} | "
                    f"{s.anon / MB:.0f}{delta('anon')} | {s.fds} | {s.deleted_maps / MB:.0f} | "
                    f"{s.temp_bytes / MB:.1f} | {cache} | {s.history_bytes / 1024:.0f} | {trimmed} |")
        previous = s
    return rows


def side_line(side: str, run: SideRun, attr: str, what: str) -> str:
    slope, windows = per_100(run.samples, attr), window_slopes(run.samples, attr)
    spread = f"{min(windows) / MB:+.0f} to {max(windows) / MB:+.0f}" if windows else "n/a (run too short)"
    return (f"- {side}: {what} {_mb_or_na(slope)} MB per 100 prompts after the first {WARM_UP} (per "
            f"{WINDOW}-prompt window: {spread} MB per 100)")


def compare(runs: dict[str, SideRun], pack: str, core: str, attr: str, what: str, core_attr: str = "") -> str | None:
    """pack − core growth of `attr` (`core_attr` on the core side, if another), judged against the spread of both
    sides' window slopes."""
    core_attr = core_attr or attr
    if not {pack, core} <= runs.keys():
        return None
    ours, theirs = per_100(runs[pack].samples, attr), per_100(runs[core].samples, core_attr)
    if ours is None or theirs is None:
        return None
    noise = window_slopes(runs[pack].samples, attr) + window_slopes(runs[core].samples, core_attr)
    span = max(noise) - min(noise) if len(noise) > 1 else None
    judged = "n/a" if span is None else ("GROWS beyond noise" if ours - theirs > span else "within noise")
    return (f"- **verdict ({what})**: {pack} − {core} = {(ours - theirs) / MB:+.0f} MB per 100 prompts; spread of "
            f"the windows {_mb_or_na(span)} MB: {judged}")


def verdict(runs: dict[str, SideRun]) -> list[str]:
    lines = []
    for side, run in runs.items():
        lines.append(side_line(side, run, "anon", "anonymous memory"))
        lines.append(side_line(side, run, "rss", "RSS"))
        if run.samples[-1].anon_trimmed is not None:
            lines.append(side_line(side, run, "anon_trimmed", "anonymous memory after gc + malloc_trim"))
    lines.append(compare(runs, "pack", "core", "anon", "anonymous memory"))
    lines.append(compare(runs, "pack:trim", "core:trim", "anon_trimmed", "after malloc_trim"))
    lines.append(compare(runs, "pack:trim", "core", "anon_trimmed", "pack after malloc_trim vs core untrimmed",
                         "anon"))
    return [line for line in lines if line]


def _mb_or_na(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MB:+.0f}"


def write_results(runs: dict[str, SideRun], opts, started: str, path: Path) -> None:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"# Soak: {opts.prompts} prompts per side, {opts.files} files (bench/soak.py)", "",
             (f"{started} UTC, ComfyUI {opts.comfy}, {platform.machine()} {os.cpu_count()} cores, seed {opts.seed}, "
              f"server env {' '.join(opts.server_env) or '(default)'}; load average at the end {load}."), "",
             ("Per row: the sample at that prompt count, (change since the row above) in MB. cache = the pack's "
              "files / mapped MB / private MB; deleted maps = MB mapped from unlinked files; history = kB of the "
              "last prompt's /history entry; anon after trim = RssAnon after gc + malloc_trim(0) (':trim' sides only)."), "",
             ("| side | prompts | s | RSS MB | anon MB | fds | deleted maps MB | temp MB | cache | history kB "
              "| anon after trim MB |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs.values():
        lines += table_rows(run)
    lines += ["", *verdict(runs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


def save_samples(runs: dict[str, SideRun], path: Path) -> None:
    """Every sample as JSON, for a closer look than the table."""
    samples = {side: [asdict(s) for s in run.samples] for side, run in runs.items()}
    path.write_text(json.dumps(samples, indent=1), encoding="utf-8")


def load_samples(path: Path) -> dict[str, SideRun]:
    saved = json.loads(path.read_text(encoding="utf-8"))
    return {side: SideRun(side, [Sample(**s) for s in samples], samples[-1]["prompts"], samples[-1]["seconds"])
            for side, samples in saved.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfy", choices=sorted(COMFY), default="0.33")
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="sample every N prompts")
    parser.add_argument("--warm-up", type=int, default=DEFAULT_WARM_UP, help="prompts before growth is judged")
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--sides", default="pack,core",
                        help="pack, core, and either with ':trim' (gc + malloc_trim(0) and object counts at every "
                             "sample, through a debug-only probe node: tells freed-but-kept memory from live memory)")
    parser.add_argument("--max-minutes", type=float, default=60, help="per side")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for the servers, e.g. MALLOC_ARENA_MAX=2")
    parser.add_argument("--sequential", action="store_true",
                        help="one server at a time (default: every side's server at once; each is its own process, "
                             "so their memory is measured apart, but they share the CPU)")
    parser.add_argument("--out", type=Path, default=BENCH / "results-soak.md")
    parser.add_argument("--samples", type=Path, help="also every sample (with the probe's object counts) as JSON")
    parser.add_argument("--render", type=Path, help="only write the table again from a --samples file")
    parser.add_argument("--render-started", default="(from saved samples)", help=argparse.SUPPRESS)
    parser.add_argument("--make-files", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    global WARM_UP
    WARM_UP = opts.warm_up
    if opts.make_files:
        make_files(opts.make_files)
        return 0
    if opts.render:
        write_results(load_samples(opts.render), opts, opts.render_started, opts.out)
        return 0
    if opts.prompts > 2000 or opts.every < 1:
        parser.error("--prompts at most 2000, --every at least 1")
    import tempfile

    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    file_entries = files(opts.files)
    specs = prompt_specs(opts.prompts, file_entries, opts.seed)
    sides = opts.sides.split(",")
    with tempfile.TemporaryDirectory(prefix="lycoris-soak-") as work:
        def run(side: str) -> SideRun:
            return run_side(side, specs, file_entries, opts, Path(work) / side.replace(":", "-"))

        with ThreadPoolExecutor(1 if opts.sequential else len(sides)) as pool:
            runs = dict(zip(sides, pool.map(run, sides)))
    if opts.samples:
        save_samples(runs, opts.samples)  # first: nothing is lost if the table fails
    write_results(runs, opts, started, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
