"""Row 5 of run.py in a fresh process, so its peak resident memory is its own: load one file and build its patches for
a model (key map and shapes made before the baseline), the built-in way or ours. Prints one JSON line.

    python bench/load_child.py builtin|ours FILE sd15|sdxl
"""

import gc
import json
import sys
import time
from pathlib import Path

import harness  # noqa: F401  (first: it sets up ComfyUI in CPU mode)  # isort: skip

import comfy.lora
import comfy.lora_convert
import comfy.utils
import unet_shapes
from lycoris_nodes.nodes.glue.apply import build_patches
from lycoris_nodes.nodes.glue.cache import load_cached


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> int:
    """Start a new peak-RSS window (Linux: clear_refs 5 resets VmHWM) and return the resident size now.

    Without the reset the peak would include whatever the imports and the key map briefly needed."""
    Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")
    return status_bytes("VmRSS")


def main(mode: str, path: str, model: str) -> None:
    shapes = unet_shapes.unet_weights(model)
    key_map = unet_shapes.key_map(shapes)
    gc.collect()
    baseline = reset_peak()
    start = time.perf_counter()
    if mode == "builtin":  # what LoraLoader does: load_torch_file, then load_lora_for_models' convert + load_lora
        sd = comfy.utils.load_torch_file(path, safe_load=True)
        patches = comfy.lora.load_lora(comfy.lora_convert.convert_lora(sd), key_map)
    elif mode == "ours":
        patches, _ = build_patches(load_cached(path), key_map, {"model": shapes}, reference=False)
        patches = patches["model"]
    else:
        raise SystemExit(f"unknown mode {mode}")
    seconds = time.perf_counter() - start
    if len(patches) != len(shapes):
        raise SystemExit(f"{mode}: {len(patches)} patches for {len(shapes)} weights")
    print(json.dumps({"mode": mode, "seconds": seconds, "peak_extra": status_bytes("VmHWM") - baseline,
                      "baseline": baseline,
                      "rss_anon_after": status_bytes("RssAnon"), "rss_file_after": status_bytes("RssFile")}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
