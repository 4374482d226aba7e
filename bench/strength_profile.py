"""Row 2 (strength change, merge mode) taken apart: how much of each side's time is ComfyUI's own per-key work.

    python bench/strength_profile.py                # 50 SDXL-size layers, LoCon r32, 5 strength changes per side
    python bench/strength_profile.py --layers 10 --changes 3
    python bench/strength_profile.py --threads 1    # one torch thread: steadier while other processes run

A strength change is the loader node's work (built-in: `comfy.sd.load_lora_for_models` on the cached state dict;
ours: `apply_file` on the cached parsed file) and then `load_models_gpu`, which detaches the previous clone (its
weights restored from the backup) and re-patches every key in `ModelPatcher.patch_weight_to_device`: an fp32 copy of
the weight (`cast_to_device`), the adapters' `calculate_weight`, the rounding back to the stored dtype
(`comfy.float.stochastic_rounding`) and `set_attr_param` / `copy_to_param`. ComfyUI's functions are wrapped with
timers (not copied), by module attribute, where `patch_weight_to_device` looks them up; the fp32 copy is the
`cast_to_device` call made outside `calculate_weight` (inside it, the built-in adapters cast their factors).

Prints, per side, the median over the changes of each part (seconds) and the share of the total; then the best
ratios reachable: with our adapter maths at the machine's fp32 matmul floor (LoCon's W += s·up·down is 2·N·r
FLOPs, a rank-r update that cannot be done in less arithmetic) and, as a hard limit, in no time at all.
"""

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict

from harness import median, timed  # isort: skip (first: it sets up ComfyUI in CPU mode)

import adapter_files as files
import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.utils
import torch
import unet_shapes
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.glue.apply import apply_file
from run import Model, Weights, make_inputs, sdxl_layers

PARTS = ("node", "restore", "fp32 copy", "adapter maths", "rounding", "set param", "rest of patch_weight_to_device",
         "rest of load_models_gpu")


class Timers:
    """Accumulated seconds per part while `on`; the wrappers stay installed for the whole script."""

    def __init__(self):
        self.spent: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, part: str, outside: str | None = None) -> None:
        """Time `owner.attr` under `part`; with `outside`, only calls not made inside that part."""
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            if outside is not None and self.depth[outside]:
                return original(*args, **kwargs)
            self.depth[part] += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start
                self.depth[part] -= 1

        setattr(owner, attr, timed)


def install(timers: Timers) -> None:
    mp = comfy.model_patcher.ModelPatcher
    timers.wrap(mp, "patch_weight_to_device", "patch_weight_to_device")
    timers.wrap(mp, "unpatch_model", "restore")
    timers.wrap(comfy.model_management, "cast_to_device", "fp32 copy", outside="adapter maths")
    timers.wrap(comfy.lora, "calculate_weight", "adapter maths")
    timers.wrap(comfy.float, "stochastic_rounding", "rounding")
    timers.wrap(comfy.utils, "set_attr_param", "set param", outside="restore")
    timers.wrap(comfy.utils, "copy_to_param", "set param", outside="restore")


def profile(layers: int, changes: int) -> dict[str, dict[str, list[float]]]:
    shapes = sdxl_layers(layers)
    key_map = unet_shapes.key_map(shapes)
    weights = Weights(shapes.values(), seed=3)
    inputs = make_inputs(shapes, 16)
    sd = files.state_dict("locon_r32", shapes, key_map, seed=10)
    lfile = parse_state_dict(sd, "locon_r32.safetensors")
    load = comfy.model_management.load_models_gpu

    def builtin(base, s):
        return comfy.sd.load_lora_for_models(base, None, sd, s, 0.0)[0]

    def ours(base, s):
        return apply_file(lfile, base, None, s, 0.0, reference=False)[0]

    sides = {"builtin": builtin, "ours": ours}
    models = {name: Model(shapes, weights, inputs) for name in sides}
    current = {name: node(models[name].base, 0.75) for name, node in sides.items()}
    for new in current.values():
        load([new])
    timers = Timers()
    install(timers)
    parts = {name: defaultdict(list) for name in sides}
    for s in [0.9, 1.0, 0.8, 0.6, 1.1, 0.7, 0.5, 0.95, 0.85][:changes]:
        for name, node in sides.items():
            timers.spent.clear()
            start = time.perf_counter()
            new = node(models[name].base, s)
            node_s = time.perf_counter() - start
            load([new])
            total = time.perf_counter() - start
            current[name] = new
            spent = dict(timers.spent)
            inner = sum(spent.get(p, 0.0) for p in ("fp32 copy", "adapter maths", "rounding", "set param"))
            got = {"node": node_s, "restore": spent.get("restore", 0.0),
                   **{p: spent.get(p, 0.0) for p in ("fp32 copy", "adapter maths", "rounding", "set param")},
                   "rest of patch_weight_to_device": spent.get("patch_weight_to_device", 0.0) - inner}
            got["rest of load_models_gpu"] = total - node_s - got["restore"] - spent.get("patch_weight_to_device", 0.0)
            got["total"] = total
            for part, value in got.items():
                parts[name][part].append(value)
    comfy.model_management.unload_all_models()
    del current
    return parts


def matmul_flops() -> float:
    """fp32 matmul throughput of this machine (3072², best of 5), as run.py's floor measures it."""
    n = 3072
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(5))
    return 2 * n**3 / best


def report(parts: dict, layers: int, changes: int) -> None:
    med = {name: {p: median(v) for p, v in by_part.items()} for name, by_part in parts.items()}
    print(f"strength change, merge mode: {layers} SDXL-size layers, LoCon r32, medians of {changes} changes "
          f"(seconds; share of the side's total)")
    print(f"{'part':34s} {'built-in':>16s} {'ours':>16s}")
    for part in (*PARTS, "total"):
        cells = [f"{med[n][part]:.4f} ({100 * med[n][part] / med[n]['total']:3.0f}%)" for n in ("builtin", "ours")]
        print(f"{part:34s} {cells[0]:>16s} {cells[1]:>16s}")
    totals = {n: parts[n]["total"] for n in parts}
    ratios = [o / b for o, b in zip(totals["ours"], totals["builtin"])]
    comfy_own = {n: med[n]["total"] - med[n]["adapter maths"] - med[n]["node"] for n in med}
    print(f"ratio ours/built-in: {med['ours']['total'] / med['builtin']['total']:.3f} "
          f"(per change {min(ratios):.3f}-{max(ratios):.3f}, stdev {statistics.pstdev(ratios):.3f})")
    print(f"ComfyUI's own per-change work (everything but the node and the adapter maths): built-in "
          f"{comfy_own['builtin']:.4f} s, ours {comfy_own['ours']:.4f} s")
    flops = sum(2 * math.prod(s) * 32 for s in sdxl_layers(layers).values())
    floor = flops / matmul_flops()
    without = med["ours"]["total"] - med["ours"]["adapter maths"]
    print(f"our maths {med['ours']['adapter maths']:.4f} s vs its floor {floor:.4f} s ({flops / 1e9:.1f} GFLOP at the "
          f"measured fp32 matmul rate); built-in maths / ours {med['builtin']['adapter maths'] / med['ours']['adapter maths']:.2f}")
    print(f"best ratio reachable: our maths at its floor {(without + floor) / med['builtin']['total']:.3f}, "
          f"our maths at zero {without / med['builtin']['total']:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    opts = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    report(profile(opts.layers, opts.changes), opts.layers, opts.changes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
