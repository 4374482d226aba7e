"""Take docs/images/loader-panel.png: the LyCORIS Loader with its panel after a run, in the classic renderer.

    .venv/bin/python tests/browser/screenshot_panel.py [out.png]

Starts a real ComfyUI server (scripts/comfy_server.py) on the tiny SD1.5 and the demo LyCORIS file (made and cached
in .deps/test-assets like the tests do), runs example_workflows/lycoris_loader.json on them (example_models.for_demo)
in headless Chromium (tests/browser/screenshot.mjs), crops the loader node and writes it as a palette PNG (< 150 kB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests" / "e2e"), str(REPO / "tests")]

import make_demo_lycoris
import make_tiny_sd15
from comfy_server import ComfyServer
from example_models import demo_workflow
from test_server_demo import ASSETS, CHECKPOINT, LYCORIS, make_base_dir

OUT = REPO / "docs" / "images" / "loader-panel.png"
MAX_BYTES = 150_000


def main(out: Path = OUT) -> None:
    ckpt = make_tiny_sd15.write_tiny_sd15(ASSETS / CHECKPOINT)
    lycoris = make_demo_lycoris.write_demo_lycoris(ASSETS / LYCORIS, ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        workflow = tmp / "lycoris_loader.json"
        workflow.write_text(json.dumps(demo_workflow("lycoris_loader.json")), encoding="utf-8")
        base = make_base_dir(tmp / "base", {"checkpoints": ckpt, "loras": [lycoris]})
        with ComfyServer(base, extra_args=["--cache-none"]) as server:
            env = {**os.environ, "COMFY_URL": server.url, "SCREENSHOT": str(tmp / "page.png"),
                   "RENDERER": "classic", "WORKFLOW": str(workflow)}
            proc = subprocess.run(["node", "screenshot.mjs"], cwd=REPO / "tests" / "browser", env=env,
                                  capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                sys.exit(f"screenshot.mjs failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        image = Image.open(tmp / "page-node.png").convert("RGB")
        out.parent.mkdir(parents=True, exist_ok=True)
        for colors in (256, 128, 64):
            image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
            if out.stat().st_size < MAX_BYTES:
                break
    print(f"{out}: {image.size[0]}x{image.size[1]}, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
