"""Make a real ComfyUI importable as a library (tests, scripts). No pytest imports here.

Usage: ``from comfy_env import setup_comfy; comfy_dir = setup_comfy()`` before importing any ``comfy.*``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Our kernels default to the plain torch backend under test (no GPU, reproducible numbers).
os.environ.setdefault("LYCORIS_KERNEL_BACKEND", "torch")

# Set by .ci/run: a test may then skip only for the version matrix (tests/conftest.py), and a missing test dependency
# fails instead of skipping.
IN_CI = os.environ.get("LYCORIS_CI") == "1"


def find_comfyui() -> Path:
    """The ComfyUI folder: $COMFYUI_PATH, else the copy scripts/setup.sh makes in .deps/ComfyUI."""
    env = os.environ.get("COMFYUI_PATH")
    path = Path(env).resolve() if env else REPO_ROOT / ".deps" / "ComfyUI"
    if not (path / "main.py").is_file():
        raise FileNotFoundError(f"no ComfyUI at {path}: run scripts/setup.sh (or set COMFYUI_PATH)")
    return path


def setup_comfy() -> Path:
    """Put ComfyUI first on sys.path and force CPU mode; returns the ComfyUI folder. Idempotent."""
    comfy_dir = find_comfyui()
    entry = str(comfy_dir)
    # First, not just present: ComfyUI's own top-level modules (nodes.py, utils/, tests/) must win over
    # same-named folders elsewhere on sys.path, such as this repo's nodes/ package.
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)

    stray = sys.modules.get("nodes")
    if stray is not None and not str(getattr(stray, "__file__", "")).startswith(entry):
        raise RuntimeError(f"'nodes' was imported from {stray!r} before setup_comfy(); ComfyUI's nodes.py is needed")

    import comfy.options

    # cli_args must not parse pytest's argv; it parses [] when parsing is disabled.
    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    # Must be set before comfy.model_management is imported: it picks the device at import time.
    if "comfy.model_management" in sys.modules and not args.cpu:
        raise RuntimeError("comfy.model_management was imported before setup_comfy(); CPU mode cannot apply")
    args.cpu = True
    return comfy_dir
