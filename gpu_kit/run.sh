#!/usr/bin/env bash
# The GPU evidence kit: re-runs the reported failures (the seeds), the exactness matrix and the speed comparison of
# LyCORIS Nodes on this machine's NVIDIA GPU, offline, and writes gpu-report.json and gpu-report.md.
#
#   bash run.sh                 the real run (needs CUDA; ~13 minutes on one H100-class GPU)
#   bash run.sh --dry-run       the same code on the CPU with tiny shapes and a fake cuda:0 (what CI runs)
#   bash run.sh --only seeds    one section (seeds, exact, dynamic, speed); repeatable
#   bash run.sh --out DIR       where the report goes (default: the current directory)
#
# Environment:
#   PYTHON=python3.12      the Python that has the CUDA PyTorch (torch, torchvision) installed
#   KIT_WORK=DIR           the private folder everything is installed into (default: <kit>/work); nothing is
#                          installed system-wide, and deleting that folder undoes the kit completely
#   KIT_NO_INSTALL=1       use $PYTHON's environment as it is (it must already have what requirements.txt lists)
set -euo pipefail

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="${KIT_WORK:-$KIT/work}"
say() { echo "gpu-kit: $*" >&2; }

command -v "$PYTHON" >/dev/null || { say "no $PYTHON: set PYTHON to the Python with the CUDA PyTorch"; exit 2; }
"$PYTHON" -c 'import torch' 2>/dev/null \
    || { say "$PYTHON cannot import torch: set PYTHON to the Python with the CUDA PyTorch"; exit 2; }
mkdir -p "$WORK"

# ComfyUI 0.33.0, unpacked once (a stamp names the tarball it came from).
TARBALL="$(ls "$KIT"/ComfyUI-*.tar.gz | head -n 1)"
if [[ "$(cat "$WORK/ComfyUI.from" 2>/dev/null || true)" != "$(basename "$TARBALL")" ]]; then
    rm -rf "$WORK/ComfyUI" "$WORK/ComfyUI.tmp"
    mkdir -p "$WORK/ComfyUI.tmp"
    tar -xzf "$TARBALL" -C "$WORK/ComfyUI.tmp"
    mv "$WORK/ComfyUI.tmp"/* "$WORK/ComfyUI"
    rmdir "$WORK/ComfyUI.tmp"
    basename "$TARBALL" > "$WORK/ComfyUI.from"
fi

if [[ "${KIT_NO_INSTALL:-0}" == 1 ]]; then
    RUN_PY="$PYTHON"
else
    # A venv of the kit's own that also sees $PYTHON's packages (the image's torch and pip), after its own: a .pth
    # listing $PYTHON's site-packages. (--system-site-packages would not: it means the base interpreter's, and a
    # CUDA PyTorch often lives in a venv or a conda env.) No pip of its own (--without-pip): ensurepip's bundled
    # setuptools would shadow the image's newer one that torch requires. The rest comes from the kit's wheels only.
    if [[ ! -x "$WORK/venv/bin/python" ]]; then
        "$PYTHON" -m venv --without-pip "$WORK/venv" \
            || { say "python -m venv failed (Debian/Ubuntu: apt install python3-venv)"; exit 2; }
        VENV_SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
        "$PYTHON" -c 'import sys
print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
            > "$VENV_SITE/gpu_kit_image.pth"
    fi
    RUN_PY="$WORK/venv/bin/python"
    "$RUN_PY" -m pip --version >/dev/null 2>&1 || { say "$PYTHON has no pip to install the kit's wheels with"; exit 2; }
    if [[ ! -d "$WORK/wheels" ]]; then
        "$RUN_PY" -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    tar.extractall(sys.argv[2], filter="data")' "$KIT/wheels.tar.xz" "$WORK"
    fi
    "$RUN_PY" -m pip install --isolated --no-index --find-links "$WORK/wheels" --disable-pip-version-check \
        --quiet -r "$KIT/requirements.txt"
fi

export PYTHONPATH="$KIT/checks${PYTHONPATH:+:$PYTHONPATH}"
exec "$RUN_PY" -m gpu_kit --comfyui "$WORK/ComfyUI" --pack "$KIT/pack" --work "$WORK" "$@"
