"""Make the template thumbnails: example_workflows/<name>.jpg, a picture of each example as the frontend opens it.

ComfyUI's template browser shows a custom node pack's example_workflows/<name>.json with the picture
example_workflows/<name>.jpg (the frontend asks for /api/workflow_templates/<pack folder>/<name>.jpg; docs.comfy.org,
custom-nodes/workflow_templates). This script starts a real ComfyUI with the pack (scripts/comfy_server.py), opens
each example in headless Chromium (scripts/thumbnails.mjs, the browser tests' Chromium and playwright-core), takes
the page, crops it to the nodes and saves a small JPEG. It fails when a node is drawn off the screen (so the views the
examples save are checked in the real frontend too) or a picture is 100 kB or more.

    .venv/bin/python scripts/make_thumbnails.py            # writes example_workflows/*.jpg
    .venv/bin/python scripts/make_thumbnails.py --check    # writes nothing; fails if a node is off screen

No model is needed: the examples are opened, not run (the frontend shows the file names whether or not they exist).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from comfy_server import ComfyServer, prepare_base_dir

EXAMPLES = REPO_ROOT / "example_workflows"
SIZE = 512  # px, square: the template browser's cards are square (ComfyUI's own thumbnails are 300 to 1024 px)
MAX_BYTES = 100_000
PAD = 16  # px around the nodes
# A new user's first-run templates dialog would cover the graph; missing-model dialogs too (no model is installed).
SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Workflow.ShowMissingModelsWarning": False}


def screenshots(out: Path, renderer: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="lycoris-thumbnails-") as tmp:
        base = prepare_base_dir(Path(tmp) / "base")
        settings = base / "user" / "default" / "comfy.settings.json"
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps(SETTINGS), encoding="utf-8")
        with ComfyServer(base) as server:
            env = {"COMFY_URL": server.url, "EXAMPLES_DIR": str(EXAMPLES), "OUT_DIR": str(out), "RENDERER": renderer}
            proc = subprocess.run(["node", str(REPO_ROOT / "scripts" / "thumbnails.mjs")], env={**os.environ, **env},
                                  capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or not result.get("ok"):
        raise SystemExit(f"thumbnails.mjs failed ({proc.returncode}): {result.get('error')}\n{proc.stderr[-3000:]}")
    return result


# Where a node is in plain view on the 1600x1000 page (the browser tests' window), in page px: right of the side
# toolbar, below the tab bar, the workflow menu and the Run toolbar; and not under the minimap (bottom right).
VISIBLE = (64, 130, 1590, 990)
MINIMAP = (1340, 730, 1600, 1000)


def hidden(box) -> bool:
    x0, y0, x1, y1 = box
    left, top, right, bottom = VISIBLE
    under_minimap = x1 > MINIMAP[0] and y1 > MINIMAP[1]
    return x0 < left or y0 < top or x1 > right or y1 > bottom or under_minimap


def off_screen(workflow: dict) -> list[str]:
    return [f"{n['type']} #{n['id']} at {n['box']}" for n in workflow["nodes"] if hidden(n["box"])]


def thumbnail(png: Path, workflow: dict, dest: Path) -> int:
    """Crop the page to the nodes (plus PAD), fit it in a SIZE square on the canvas's own background (the template
    browser shows square cards), save as JPEG under MAX_BYTES; returns its size."""
    image = Image.open(png).convert("RGB")
    boxes = [n["box"] for n in workflow["nodes"]]
    left = max(0, min(b[0] for b in boxes) - PAD)
    top = max(0, min(b[1] for b in boxes) - PAD)
    right = min(image.width, max(b[2] for b in boxes) + PAD)
    bottom = min(image.height, max(b[3] for b in boxes) + PAD)
    background = image.getpixel((right - 2, bottom - 2))
    graph = image.crop((left, top, right, bottom))
    ratio = min(SIZE / graph.width, SIZE / graph.height)
    graph = graph.resize((round(graph.width * ratio), round(graph.height * ratio)), Image.LANCZOS)
    card = Image.new("RGB", (SIZE, SIZE), background)
    card.paste(graph, ((SIZE - graph.width) // 2, (SIZE - graph.height) // 2))
    for quality in (85, 75, 65, 55):
        card.save(dest, "JPEG", quality=quality, optimize=True, progressive=True)
        if dest.stat().st_size < MAX_BYTES:
            return dest.stat().st_size
    raise SystemExit(f"{dest.name}: {dest.stat().st_size} bytes even at quality {quality}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that every node is on screen")
    parser.add_argument("--renderer", choices=("classic", "vue"), default="classic")
    parser.add_argument("--keep", type=Path, help="also keep the full-page screenshots in this folder")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lycoris-pages-") as tmp:
        pages = opts.keep or Path(tmp)
        pages.mkdir(parents=True, exist_ok=True)
        result = screenshots(pages, opts.renderer)
        print(f"frontend {result.get('frontend_version')}, {opts.renderer} renderer")
        bad = {name: off for name, wf in result["workflows"].items() if (off := off_screen(wf))}
        for name, workflow in sorted(result["workflows"].items()):
            stem = Path(name).stem
            if opts.check:
                print(f"{name}: {len(workflow['nodes'])} nodes, {'off screen: ' + ', '.join(bad[name]) if name in bad else 'all on screen'}")
                continue
            size = thumbnail(pages / f"{stem}.png", workflow, EXAMPLES / f"{stem}.jpg")
            print(f"{EXAMPLES.name}/{stem}.jpg: {size} bytes")
    if bad:
        print("nodes off screen:\n" + "\n".join(f"  {k}: {v}" for k, v in bad.items()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
