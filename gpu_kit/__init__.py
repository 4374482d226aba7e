"""The GPU evidence kit (issue #26): `make gpu-kit` builds dist/gpu-kit/, `bash dist/gpu-kit/run.sh` runs it.

build.py makes the folder; run.sh installs it offline and calls `python -m gpu_kit` (main.py), which runs each
section (seeds.py, exact.py, speed.py) in its own process (part.py) under a time budget and writes the report
(report.py). env.py makes ComfyUI and the pack importable; models.py and truth.py give the layers and the
reference's truth. The report format is documented in docs/gpu-kit.md.
"""
