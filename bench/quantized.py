"""Issue #15: what `apply_mode` costs per sampling step on a quantized model, against ComfyUI's own LoRA loader.

    python bench/quantized.py                      # 4 steps, 3 timed runs per configuration
    python bench/quantized.py --steps 2 --repeats 1  # shorter

The tiny SD1.5 checkpoint (tests' `tiny_sd15`) loaded by ComfyUI with its UNet weights in fp8 e4m3fn (manual_cast
layers, fp32 compute on the CPU), and its UNet as a GGUF Q4_0 file loaded by the real ComfyUI-GGUF pack (there
ComfyUI's loader and our merge both go through the pack's run-time patching of the decoded weight). (A comfy_quant version of it could not be sampled on the CPU: ComfyUI 0.33's
`_quantized_apply` raises "Cannot set version_counter for inference tensor" when KSampler loads it.) Two files covering every
UNet Linear and Conv weight: LoCon rank 8 and LoCon+DoRA rank 8 (`dora_scale` on the output axis). For each model
and file, one KSampler run of N euler steps (64×64, cfg 1) with: no adapter, ComfyUI's `LoraLoaderModelOnly`
(merge), our loader in `merge`, `auto` and `bypass`. The configurations take turns, 3 rounds; before each timed run
a 1-step run loads (and, merged, patches) its model, so the time is sampling only; seconds per step = the best
round / N (other processes on a shared machine only ever slow a run down; `auto` and `bypass` do the same work on
the fp8 model, so their difference shows what noise is left). Ratios: ours against
ComfyUI's loader on the same model, file and run. Not a test (`make test` never runs it); report only.
"""

import argparse
import os
import platform
import sys
from datetime import datetime, timezone

from harness import BENCH, REPO, Row, timed  # isort: skip (first: it sets up ComfyUI in CPU mode)

import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
import torch
from lycoris_nodes.nodes.loading import loaders
from lycoris_nodes.nodes.loading.loaders import LycorisLoaderModelOnly
from safetensors.torch import save_file

import nodes as comfy_nodes  # ComfyUI's nodes.py

sys.path.insert(0, str(REPO / "tests"))
import test_gguf  # the real ComfyUI-GGUF pack, and GGUF files written by its convert.py and gguf-py
import test_nodes  # the tiny SD1.5 checkpoint
from node_runner import execute

RANK = 8
FP8 = torch.float8_e4m3fn


def log(message: str) -> None:
    print(message, flush=True)


def adapter_files(unet_sd: dict[str, torch.Tensor], folder: str) -> dict[str, str]:
    """LoCon and LoCon+DoRA files for every UNet Linear/Conv weight, in kohya key names; {label: file name}."""
    gen = torch.Generator().manual_seed(0)
    locon, dora = {}, {}
    for key, weight in unet_sd.items():
        if not key.endswith(".weight") or weight.ndim not in (2, 4):
            continue
        prefix = "lora_unet_" + key.removesuffix(".weight").replace(".", "_")
        out_ch, in_ch, *kernel = weight.shape
        down = torch.randn(RANK, in_ch, *kernel, generator=gen) / (in_ch * max(1, sum(kernel))) ** 0.5
        up = torch.randn(out_ch, RANK, *([1] * len(kernel)), generator=gen) * 0.02
        module = {f"{prefix}.lora_down.weight": down, f"{prefix}.lora_up.weight": up,
                  f"{prefix}.alpha": torch.tensor(float(RANK))}
        locon.update(module)
        norm = weight.float().flatten(1).norm(dim=1).reshape(out_ch, *([1] * (weight.ndim - 1)))
        dora.update(module)
        dora[f"{prefix}.dora_scale"] = norm * (1 + 0.05 * torch.randn(norm.shape, generator=gen))
    names = {"LoCon r8": "bench_locon.safetensors", "DoRA r8": "bench_dora.safetensors"}
    for sd, name in zip((locon, dora), names.values()):
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(folder, name))
    return names


def gguf_model(checkpoint: str, folder: str, qtype: str):
    """The tiny UNet as a `qtype` GGUF file (the pack's convert.py, re-quantized by gguf-py), loaded by the pack's
    own UnetLoaderGGUF."""
    loader = test_gguf._load_pack()
    f16 = os.path.join(folder, "tiny-F16.gguf")
    test_gguf.convert_to_f16(checkpoint, f16)
    test_gguf.requantize(f16, os.path.join(folder, f"tiny-{qtype}.gguf"), qtype)
    for key in ("diffusion_models", "unet_gguf"):
        folder_paths.folder_names_and_paths[key] = ([folder], {".gguf"})
    folder_paths.filename_list_cache.clear()
    return execute(loader(), unet_name=f"tiny-{qtype}.gguf")[0]


def models(steps_path: str, folder: str) -> dict[str, object]:
    """fp8 first: the adapter files are shaped from its state dict (a GGUF model's holds packed shapes)."""
    return {"fp8 e4m3fn": comfy.sd.load_checkpoint_guess_config(
        steps_path, output_vae=False, output_clip=False, model_options={"dtype": FP8})[0],
        "GGUF Q4_0": gguf_model(steps_path, folder, "Q4_0")}


def sample(model, steps: int, conds) -> None:
    latent = comfy_nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    with torch.inference_mode():
        comfy_nodes.common_ksampler(model, 0, steps, 1.0, "euler", "normal", *conds, latent)


def per_step(configs: dict[str, object], steps: int, conds, repeats: int) -> dict[str, float]:
    """Seconds per step of each configuration, the best of `repeats` rounds: on a shared machine other processes
    only ever slow a run down. The configurations take turns; before each timed run a 1-step run loads (and,
    merged, patches) its model."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, model in configs.items():
            sample(model, 1, conds)
            times[name].append(timed(lambda model=model: sample(model, steps, conds)) / steps)
    return {name: min(values) for name, values in times.items()}


def configurations(model, name: str) -> dict[str, object]:
    def ours(mode):
        return execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0, apply_mode=mode,
                       inference=True).result[0]

    builtin = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
    return {"none": model, "builtin": builtin, "merge": ours("merge"), "auto": ours("auto"), "bypass": ours("bypass")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    loaders.LOADER_MEASURE_BUDGET = -1  # the panel's per-block chart is not what is timed here
    load_before = os.getloadavg()[0]
    folder = os.path.join(BENCH, ".quantized-tmp")
    os.makedirs(folder, exist_ok=True)
    folder_paths.folder_names_and_paths["loras"] = ([folder], folder_paths.supported_pt_extensions)
    folder_paths.filename_list_cache.clear()
    path = str(test_nodes._tiny_sd15_path())
    gen = torch.Generator().manual_seed(0)
    conds = ([[torch.randn(1, 77, 768, generator=gen) * 0.5, {}]], [[torch.zeros(1, 77, 768), {}]])
    rows: list[Row] = []
    loaded = models(path, folder)
    files = adapter_files(next(iter(loaded.values())).model.diffusion_model.state_dict(), folder)
    for model_name, model in loaded.items():
        for label, name in files.items():
            times = per_step(configurations(model, name), opts.steps, conds, opts.repeats)
            comfy.model_management.unload_all_models()
            base = times["none"]
            log(f"{model_name}, {label}: no adapter {base:.4f} s/step, ComfyUI's loader {times['builtin']:.4f}")
            for mode in ("merge", "auto", "bypass"):
                row = Row(f"{model_name}, {label}: ours {mode} vs ComfyUI LoraLoader", [times[mode]],
                          [times["builtin"]], "report", note=f"no adapter {base:.3f} s/step; ours {(times[mode] - base) / base:+.0%}, "
                          f"ComfyUI {(times['builtin'] - base) / base:+.0%} of it")
                rows.append(row)
                log(row.line())
    write_table(rows, opts, (load_before, os.getloadavg()[0]))
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    return 0


def write_table(rows: list[Row], opts, load: tuple[float, float]) -> None:
    import comfyui_version

    path = BENCH / f"results-quantized-{comfyui_version.__version__}.md"
    header = (
        f"`python bench/quantized.py --steps {opts.steps} --repeats {opts.repeats}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}; 1-min load average "
        f"{load[0]:.1f} before, {load[1]:.1f} after. Tiny SD1.5, 64×64, euler, cfg 1; best of {opts.repeats} rounds "
        "with the model loaded. ratio = ours / ComfyUI's LoraLoaderModelOnly on the same model and file.")
    lines = [
        f"# Quantized models: seconds per sampling step (ComfyUI {comfyui_version.__version__})", "", header, "",
        "| row | ours (s/step) | ComfyUI (s/step) | ratio | notes |", "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.name} | {r.value(r.ours)} | {r.value(r.builtin)} | {r.ratio:.3f} | {r.note} |")
    path.write_text("\n".join(lines) + "\n")
    log(f"table written to {path}")


if __name__ == "__main__":
    sys.exit(main())
