"""Load many distinct files through the pack's cache under macOS's default descriptor limit, keep them all, then open
ordinary files: run in its own process by test_descriptor_limit.py (the limit is per process).

    python many_files_under_fd_limit.py PACK_ROOT FOLDER [FILES] [OPENS]

PACK_ROOT is the pack's folder (a copy of another version of it can be measured the same way). Prints one JSON line:
how many files loaded, the first error, and the open descriptors at the start, after loading and after the opens.
"""

import importlib.util
import json
import os
import resource
import sys
from pathlib import Path

MACOS_DEFAULT_SOFT_LIMIT = 256  # ComfyUI does not raise it


def open_descriptors() -> int | None:
    """None when not even the listing can be opened: the process is at its limit."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # not the listing's own
    except OSError:
        return None


def import_pack(root: Path):
    spec = importlib.util.spec_from_file_location("lycoris_nodes", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["lycoris_nodes"] = pack
    spec.loader.exec_module(pack)
    return pack


def write_small_lora(path: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    save_file({"lora_unet_b0.lora_up.weight": torch.randn(8, 2, generator=gen),
               "lora_unet_b0.lora_down.weight": torch.randn(2, 8, generator=gen),
               "lora_unet_b0.alpha": torch.tensor(1.0)}, str(path))


def main(pack_root: Path, folder: Path, files: int, opens: int) -> dict:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (MACOS_DEFAULT_SOFT_LIMIT, hard))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from comfy_env import setup_comfy

    setup_comfy()
    import_pack(pack_root)
    import folder_paths
    from lycoris_nodes.lycoris_core import LycorisError
    from lycoris_nodes.nodes.glue import cache

    folder_paths.set_temp_directory(str(folder / "temp"))
    paths = [folder / f"lora_{i:04d}.safetensors" for i in range(files)]
    for i, path in enumerate(paths):
        write_small_lora(path, seed=i)

    result = {"files": files, "loaded": 0, "opened": 0, "error": None, "fds_start": open_descriptors()}
    held = []  # as patched models hold them
    try:
        for path in paths:
            held.append(cache.load_cached(path))
            result["loaded"] += 1
    except LycorisError as e:
        result["error"] = str(e)
    result["fds_after_loads"] = open_descriptors()
    ordinary = []
    try:
        for i in range(opens):
            ordinary.append(open(folder / f"plain_{i}.txt", "w", encoding="utf-8"))  # noqa: SIM115 (kept open)
            result["opened"] += 1
    except OSError as e:
        result["error"] = result["error"] or f"open: {e}"
    result["fds_after_opens"] = open_descriptors()
    for f in ordinary:
        f.close()
    return result


if __name__ == "__main__":
    root, where = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    extra = int(sys.argv[4]) if len(sys.argv) > 4 else 100
    print(json.dumps(main(root, where, count, extra)))
