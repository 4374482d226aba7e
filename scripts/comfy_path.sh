#!/usr/bin/env bash
# Prints the ComfyUI folder the scripts and tests use: $COMFYUI_PATH if set,
# else the copy scripts/setup.sh puts in .deps/ComfyUI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${COMFYUI_PATH:-$root/.deps/ComfyUI}"
if [[ ! -f "$dir/main.py" ]]; then
    echo "comfy_path: no ComfyUI at $dir (run scripts/setup.sh)" >&2
    exit 1
fi
cd "$dir" && pwd
