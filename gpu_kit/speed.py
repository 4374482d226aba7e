"""Section 3: speed against ComfyUI's own LoRA path on the same GPU in the same run, in bench/'s table layout.

Whole models with random weights of the real shapes (ComfyUI's SDXL UNet in fp16, its Flux transformer in bf16;
tiny configurations in a dry run) and one kohya LoCon file over every Linear/Conv weight. Rows:

- merge: ComfyUI's own `patch_weight_to_device` for every patched weight (copy, patch in fp32, round, store), with
  our adapters vs ComfyUI's LoRA adapters from `comfy.lora.load_lora`;
- strength change: a new strength on a loaded model, ours merged and ours bypassed (no weight is touched) vs
  ComfyUI merged;
- bypass forward: one denoising step at 1024² (4096 image tokens) with our bypass vs the merged model (the floor)
  and vs ComfyUI's own bypass where it has one;
- bypass staging: the device memory our bypass holds for the adapters (report only).

Times are CUDA-event medians after one warm-up (wall-clock on the CPU of a dry run); ratio = ours / ComfyUI's.
"""

import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import comfy.lora
import comfy.model_patcher
import comfy.ops
import comfy.sd
import comfy.supported_models
import torch
from comfy.ldm.flux.model import Flux
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
from lycoris_nodes.lycoris_core import load
from lycoris_nodes.nodes.glue.apply import apply_file
from safetensors.torch import save_file

from . import models
from .report import Case

RANK = 32


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000

    def runs(self, fn, repeats: int, before=None) -> list[float]:
        out = []
        for i in range(repeats + 1):  # the first is the warm-up
            if before is not None:
                before()
            t = self(fn)
            if i:
                out.append(t)
        return out


def sdxl_unet_config(tiny: bool) -> dict:
    config = models.sdxl_config()
    if tiny:
        config = {**config, "model_channels": 32, "context_dim": 64, "adm_in_channels": 64,
                  "transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
                  "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1], "num_head_channels": 16}
    return config


def sdxl_unet(tiny: bool, device) -> torch.nn.Module:
    config = sdxl_unet_config(tiny)
    unet = UNetModel(**config, dtype=torch.float16, device=device, operations=comfy.ops.disable_weight_init)
    return _random(unet, comfy.supported_models.SDXL(config))


def flux_transformer(tiny: bool, device) -> torch.nn.Module:
    """Flux.1's transformer (bf16, 24 GB): merging every Linear keeps the old weights as backups, about 60 GB in all.
    A GPU with less than 70 GB gets the first half of its blocks, and the rows say so."""
    config = models.flux_config(tiny)
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory < 70 * 2**30:
        config = {**config, "depth": config["depth"] // 2, "depth_single_blocks": config["depth_single_blocks"] // 2}
    kwargs = {k: v for k, v in config.items() if k != "image_model"}
    net = Flux(dtype=torch.bfloat16, device=device, operations=comfy.ops.disable_weight_init, txt_ids_dims=[],
               **kwargs)
    return _random(net, comfy.supported_models.Flux(config))


@torch.no_grad()
def _random(net: torch.nn.Module, config) -> torch.nn.Module:
    gen = torch.Generator(device=next(net.parameters()).device).manual_seed(0)
    for p in net.parameters():  # disable_weight_init leaves them uninitialised
        fan = p.shape[1:].numel() if p.ndim > 1 else 1
        p.normal_(0, fan ** -0.5 if p.ndim > 1 else 0.02, generator=gen)
    root = torch.nn.Module()
    root.add_module("diffusion_model", net)
    root.model_config = config
    return root.requires_grad_(False)


def locon_file(root: torch.nn.Module, path: Path) -> tuple[dict, int]:
    """A kohya LoCon (rank RANK) on every Linear/Conv weight, made here like a trainer saves one; its state dict
    and the number of weights it targets."""
    gen = torch.Generator().manual_seed(5)
    sd = {}
    for key, w in root.state_dict().items():
        if not key.endswith(".weight") or w.ndim < 2 or min(w.shape[:2]) < RANK:
            continue
        name = "lora_unet_" + key.removeprefix("diffusion_model.").removesuffix(".weight").replace(".", "_")
        rank_shape = (RANK, *w.shape[1:]) if w.ndim == 2 else (RANK, w.shape[1], *w.shape[2:])
        sd[f"{name}.lora_down.weight"] = torch.randn(rank_shape, generator=gen).to(torch.float16) * 0.02
        up = (w.shape[0], RANK) if w.ndim == 2 else (w.shape[0], RANK, *[1] * (w.ndim - 2))
        sd[f"{name}.lora_up.weight"] = torch.randn(up, generator=gen).to(torch.float16) * 0.02
        sd[f"{name}.alpha"] = torch.tensor(float(RANK // 2))
    save_file(sd, str(path))
    return sd, sum(k.endswith(".alpha") for k in sd)


def core_patched(base, sd: dict, strength: float):
    key_map = comfy.lora.model_lora_keys_unet(base.model, {})
    patches = comfy.lora.load_lora(sd, key_map, log_missing=False)
    patched = base.clone()
    patched.add_patches(patches, strength)
    return patched


def merge_all(patched, device) -> None:
    """ComfyUI's own per-weight patching (what a full load does for every patched weight)."""
    for key in patched.patches:
        patched.patch_weight_to_device(key, device_to=device)


def restore(patched) -> None:
    patched.unpatch_model(device_to=None, unpatch_weights=True)


def row(name: str, ours: list[float], core: list[float] | None, note: str = "", unit: str = "s") -> dict:
    o = statistics.median(ours)
    c = statistics.median(core) if core else None
    ratios = [a / b for a, b in zip(ours, core or []) if b]
    return {"row": name, "ours": o, "core": c if c is not None else "n/a",
            "ratio": (o / c) if c else "n/a", "range": f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "n/a",
            "n": len(ours), "unit": unit, "notes": note}


def merge_rows(label: str, base, path: Path, sd: dict, count: int, device, timer, repeats: int) -> list[dict]:
    ours, _, report = apply_file(load(path), base, None, 1.0, 0.0, False, None, "merge")
    core = core_patched(base, sd, 1.0)
    ours_t = timer.runs(lambda: merge_all(ours, device), repeats, before=lambda: restore(ours))
    restore(ours)
    core_t = timer.runs(lambda: merge_all(core, device), repeats, before=lambda: restore(core))
    restore(core)
    return [row(f"merge {label} locon_r{RANK}", ours_t, core_t, f"{len(report.applied)} of {count} weights")]


def strength_rows(label: str, base, path: Path, sd: dict, device, timer, repeats: int) -> list[dict]:
    lfile = load(path)
    strengths = iter([0.5, 0.8] * (repeats + 2))
    state = {}

    def ours(mode):
        def go():
            if "p" in state:
                restore(state.pop("p"))
            state["p"], _, _ = apply_file(lfile, base, None, next(strengths), 0.0, False, None, mode)
            state["p"].patch_model(device_to=device, lowvram_model_memory=0)
        return go

    def core():
        if "p" in state:
            restore(state.pop("p"))
        state["p"] = core_patched(base, sd, next(strengths))
        state["p"].patch_model(device_to=device, lowvram_model_memory=0)

    merged = timer.runs(ours("merge"), repeats)
    bypassed = timer.runs(ours("bypass"), repeats)
    core_t = timer.runs(core, repeats)
    restore(state.pop("p"))
    return [row(f"strength {label} merge", merged, core_t, "apply + full load"),
            row(f"strength {label} bypass", bypassed, core_t, "ours bypassed vs ComfyUI merged")]


def flux_inputs(base, tiny: bool, device):
    config = models.flux_config(tiny)
    side = 16 if tiny else 128  # latent side: 1024 px / 8
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(1, 16, side, side, generator=gen, device=device, dtype=torch.bfloat16)
    context = torch.randn(1, 64 if tiny else 512, config["context_in_dim"], generator=gen, device=device,
                          dtype=torch.bfloat16)
    y = torch.randn(1, config["vec_in_dim"], generator=gen, device=device, dtype=torch.bfloat16)
    return x, torch.tensor([0.5], device=device), context, y, torch.tensor([3.5], device=device)


def forward_rows(base, path: Path, sd: dict, device, timer, repeats: int, tiny: bool) -> list[dict]:
    x, t, context, y, guidance = flux_inputs(base, tiny, device)

    def step(patched):
        def go():
            with torch.no_grad():
                patched.model.diffusion_model(x, t, context, y=y, guidance=guidance)
        return go

    rows = []
    ours, _, report = apply_file(load(path), base, None, 1.0, 0.0, False, None, "bypass")
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ours.patch_model(device_to=device, lowvram_model_memory=0)
    staged = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else None
    ours_t = timer.runs(step(ours), repeats)
    restore(ours)
    merged = core_patched(base, sd, 1.0)
    merged.patch_model(device_to=device, lowvram_model_memory=0)
    floor = timer.runs(step(merged), repeats)
    restore(merged)
    tokens = x.shape[-1] * x.shape[-2] // 4
    rows.append(row(f"bypass forward flux {tokens} tokens", ours_t, floor,
                    f"{report.bypassed} layers bypassed vs ComfyUI merged (no per-step work: the floor)"))
    bypass_lora = getattr(comfy.sd, "load_bypass_lora_for_models", None)
    if bypass_lora is not None:
        core_bypass, _ = bypass_lora(base, None, sd, 1.0, 0.0)
        core_bypass.patch_model(device_to=device, lowvram_model_memory=0)
        core_t = timer.runs(step(core_bypass), repeats)
        restore(core_bypass)
        rows.append(row(f"bypass forward flux {tokens} tokens vs ComfyUI bypass", ours_t, core_t,
                        "ComfyUI's own bypass (load_bypass_lora_for_models)"))
    if staged is not None:
        file_bytes = sum(v.numel() * v.element_size() for v in sd.values())
        rows.append(row("bypass staging flux (device bytes)", [float(staged)], None,
                        f"adapter tensors held on the device; the file holds {file_bytes} bytes", unit="B"))
    return rows


def sdxl_inputs(tiny: bool, device):
    config = sdxl_unet_config(tiny)
    side = 16 if tiny else 128  # latent side: 1024 px / 8
    gen = torch.Generator(device=device).manual_seed(4)
    x = torch.randn(1, 4, side, side, generator=gen, device=device, dtype=torch.float16)
    context = torch.randn(1, 77, config["context_dim"], generator=gen, device=device, dtype=torch.float16)
    y = torch.randn(1, config["adm_in_channels"], generator=gen, device=device, dtype=torch.float16)
    return x, torch.tensor([500.0], device=device), context, y


def model_step(label: str, tiny: bool, device):
    """module -> one denoising step of it (1024² at full size): the SDXL UNet's or Flux's forward."""
    if label == "flux":
        x, t, context, y, guidance = flux_inputs(None, tiny, device)
        return lambda module: (lambda: module(x, t, context, y=y, guidance=guidance))
    x, t, context, y = sdxl_inputs(tiny, device)
    return lambda module: (lambda: module(x, t, context=context, y=y))


def compiled_rows(label: str, base, path: Path, sd: dict, device, timer, repeats: int, tiny: bool) -> list[dict]:
    """torch.compile of the whole model (inductor on a GPU; in a dry run dynamo with the eager backend, which traces
    and counts the same graphs without generating code): graphs per run and one compiled step, our bypass vs
    ComfyUI's merged model, after a re-run (ComfyUI ejects and re-injects around every sampling run) and after a
    strength change (a new clone at 0.5, loaded)."""
    backend = "inductor" if device.type == "cuda" else "eager"
    stats, step_of, lfile = torch._dynamo.utils.counters["stats"], model_step(label, tiny, device), load(path)
    makers = {"ours bypass": lambda s: apply_file(lfile, base, None, s, 0.0, False, None, "bypass")[0],
              "ComfyUI merged": lambda s: core_patched(base, sd, s)}
    runs = {}
    for name, make in makers.items():
        torch._dynamo.reset()
        patched = make(1.0)
        patched.patch_model(device_to=device, lowvram_model_memory=0)
        with torch.no_grad():  # uncompiled once: the layers learn their input's dtype (a BaseModel's get_dtype tells
            step_of(base.model.diffusion_model)()  # them at inject; this bare model has none)
        step = torch.no_grad()(step_of(torch.compile(base.model.diffusion_model, backend=backend)))
        counts, times = [], {}
        with torch._dynamo.config.patch(recompile_limit=64):
            before = stats["unique_graphs"]
            times["first"] = [timer(step)]
            counts.append(stats["unique_graphs"] - before)
            patched.eject_model()
            patched.inject_model()
            before = stats["unique_graphs"]
            times["re-run"] = timer.runs(step, repeats)
            counts.append(stats["unique_graphs"] - before)
            restore(patched)
            patched = make(0.5)
            patched.patch_model(device_to=device, lowvram_model_memory=0)
            before = stats["unique_graphs"]
            times["strength"] = timer.runs(step, repeats)
            counts.append(stats["unique_graphs"] - before)
        restore(patched)
        runs[name] = counts, times
    torch._dynamo.reset()
    (ours, ours_t), (core, core_t) = runs["ours bypass"], runs["ComfyUI merged"]
    note = (f"{backend}; graphs first/re-run/strength: ours {'/'.join(map(str, ours))}, ComfyUI merged "
            f"{'/'.join(map(str, core))}; first run {ours_t['first'][0]:.2f} s vs {core_t['first'][0]:.2f} s")
    return [row(f"compiled {label} step after a {run}, bypass vs merged", ours_t[run], core_t[run], note)
            for run in ("re-run", "strength")]


@contextmanager
def fp16_accumulation():
    """ComfyUI's `--fast fp16_accumulation`, where this ComfyUI has it: the flag in its args (ComfyUI 0.38's fused
    fp16 linear path reads it at each call) and torch's fp16-accumulating matmuls (where this torch has them)."""
    from comfy.cli_args import PerformanceFeature, args

    feature = getattr(PerformanceFeature, "Fp16Accumulation", None)
    matmul = torch.backends.cuda.matmul
    had, fast = getattr(matmul, "allow_fp16_accumulation", None), args.fast
    if feature is not None:
        args.fast = {*fast, feature}
    if had is not None:
        matmul.allow_fp16_accumulation = True
    try:
        yield feature is not None
    finally:
        args.fast = fast
        if had is not None:
            matmul.allow_fp16_accumulation = had


def fp16_accumulation_rows(base, path: Path, sd: dict, device, timer, repeats: int, tiny: bool) -> list[dict]:
    """One SDXL step (fp16) with fp16 accumulation on: our bypass vs ComfyUI's merged model, and whether the bypass
    changed the output as the merge did (‖bypass − merged‖ / ‖merged − unpatched‖; a bypass whose forward was
    skipped gives 1)."""
    step_of, lfile = model_step("sdxl-unet", tiny, device), load(path)
    outputs, times = {}, {}
    with fp16_accumulation() as known, torch.no_grad():
        for name, make in (("unpatched", lambda: base.clone()), ("merged", lambda: core_patched(base, sd, 1.0)),
                           ("bypass", lambda: apply_file(lfile, base, None, 1.0, 0.0, False, None, "bypass")[0])):
            patched = make()
            patched.patch_model(device_to=device, lowvram_model_memory=0)
            step = step_of(base.model.diffusion_model)
            outputs[name] = step().float()
            if name != "unpatched":
                times[name] = timer.runs(step, repeats)
            restore(patched)
    change = float((outputs["merged"] - outputs["unpatched"]).norm())
    off = float((outputs["bypass"] - outputs["merged"]).norm()) / change if change else float("nan")
    note = (f"--fast fp16_accumulation {'on' if known else 'unknown to this ComfyUI'}; ‖bypass − merged‖/‖merged − "
            f"unpatched‖ = {off:.2e} (a skipped bypass: 1)")
    if not off < 0.3:  # fp16 rounding of W' and of the accumulation: a few 1e-2
        raise AssertionError(f"under fp16 accumulation the bypass is not applied: {note}")
    return [row("bypass forward sdxl-unet with fp16 accumulation", times["bypass"], times["merged"], note)]


def run(env, clock) -> tuple[list[Case], list[dict]]:
    tiny, device = env.dry_run, env.device
    timer = Timer(device)
    repeats = 1 if tiny else 3
    rows, cases = [], []
    with tempfile.TemporaryDirectory(dir=env.work) as tmp:
        for label, build in (("sdxl-unet", sdxl_unet), ("flux", flux_transformer)):
            if clock.out():
                cases.append(Case(f"speed/{label}", "not-run", detail="time budget spent"))
                continue
            try:
                root = build(tiny, device)
                base = comfy.model_patcher.ModelPatcher(root, load_device=device, offload_device=device)
                path = Path(tmp) / f"{label}.safetensors"
                sd, count = locon_file(root, path)
                made = merge_rows(label, base, path, sd, count, device, timer, repeats)
                made += strength_rows(label, base, path, sd, device, timer, repeats)
                if not tiny or label == "flux":  # a dry run traces the tiny SDXL UNet for minutes: Flux only
                    made += compiled_rows(label, base, path, sd, device, timer, repeats, tiny)
                if label == "flux":
                    made += forward_rows(base, path, sd, device, timer, repeats, tiny)
                    dm = root.diffusion_model
                    for r in made:
                        r["notes"] = f"{r['notes']}; {len(dm.double_blocks)}+{len(dm.single_blocks)} blocks"
                else:
                    made += fp16_accumulation_rows(base, path, sd, device, timer, repeats, tiny)
                rows += made
                cases.append(Case(f"speed/{label}", "pass", {"rows": len(made)}))
                del root, base
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001 - a model not built or patched fails its rows, reported
                cases.append(Case(f"speed/{label}", "error", detail=f"{type(e).__name__}: {e}", trace=True))
    return cases, rows
