"""A new user's tour in headless Chromium against the session's real ComfyUI server (tests/browser/tour.mjs).

In both renderers (classic LiteGraph and Vue "Nodes 2.0"), on the frontend of the ComfyUI under test (1.32.9 with
ComfyUI 0.3.75, 1.49.6 with 0.33): the template browser lists the pack's examples with their own thumbnails (loaded,
not the frontend's placeholder), each example opens from its card with all its nodes on screen, the LyCORIS Loader's
panel is right fresh, after a run, and after the page is reopened and the same prompt queued again (ComfyUI answers the
loader from its cache and sends no report: the panel must still show the run's), no request for the pack's files
answers 404, and nothing of the pack's is left on window or in document.head/body.

The server is the session's (with its output cache, unlike test_browser_panel's): each renderer's run sets its own
loader strength, so its first run really executes the loader whatever ran on the server before.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from example_models import DEMO_FILES, DEMO_SIZE, DEMO_STEPS
from frontends import BUNDLED, FRONTENDS
from test_browser_panel import ARTIFACTS, BROWSER_DIR, browser_ready, run_browser_script  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

SCRIPT = BROWSER_DIR / "tour.mjs"
EXAMPLES = REPO_ROOT / "example_workflows"
# A strength no other test runs the loader example with, per renderer: the "after a run" state is a real run.
STRENGTH = {"classic": 0.9, "vue": 0.85}


# Both renderers on the ComfyUI's own frontend; the newest frontend in the classic one (its Vue renderer runs every
# example, the panel and the reload in test_browser_templates.py; CI's time is bounded).
TOURS = [(frontend, renderer) for frontend in FRONTENDS for renderer in ("classic", "vue")
         if frontend == BUNDLED or renderer == "classic"]


@pytest.mark.parametrize(("browser_server", "renderer"), TOURS, indirect=["browser_server"])
def test_browser_tour(browser_server, browser_ready, renderer):  # noqa: F811 (fixture)
    server = browser_server
    demo = {"files": DEMO_FILES, "size": DEMO_SIZE, "steps": DEMO_STEPS}
    result = run_browser_script(
        SCRIPT, server, renderer, ARTIFACTS / f"browser_tour_{renderer}.png",
        STRENGTH=str(STRENGTH[renderer]), DEMO=json.dumps(demo),
    )
    names = sorted(p.stem for p in EXAMPLES.glob("*.json"))
    assert sorted(result["thumbnails"]) == names
    assert sorted(result["examples"]) == names
    assert all(not e["off_screen"] for e in result["examples"].values())
    ran, cached = result["after_run"], result["after_cached_run"]
    assert "run the workflow to see what it changed" in result["fresh"]["text"]
    assert ran["lines"] and cached["lines"] == ran["lines"]
    assert "run the workflow" not in cached["text"]
