"""A new user's tour in headless Chromium against the session's real ComfyUI server (tests/browser/tour.mjs).

In both renderers (classic LiteGraph and Vue "Nodes 2.0"), on the frontend of the ComfyUI under test (1.32.9 with
ComfyUI 0.3.75, 1.49.6 with 0.33): the template browser lists the pack's examples with their own thumbnails (loaded,
not the frontend's placeholder), each example opens from its card with all its nodes on screen, the LyCORIS Loader's
panel is right fresh, after a run, and after the page is reopened and the same prompt queued again (ComfyUI answers the
loader from its cache and sends no report: the panel must still show the run's), no request for the pack's files
answers 404, and nothing of the pack's is left on window or in document.head/body.

Each tour meets its server as a new user does (test_browser_panel.as_new_user: the user's settings and the queue's
history cleared, so the frontend greets a new user with its first-run dialog), on the session's server of its
frontend (conftest.browser_server) with the output cache on, unlike test_browser_panel's. The reset is the tour's
subject, and it keeps the tour independent of what ran before on that server: frontend 1.49.6 takes 3-7 s longer to
open the template browser's category once its user has completed the first-run tutorial (setting
Comfy.TutorialCompleted), 40 s against 110 s for the tour on a quiet 2-core machine. (A server of its own per tour
cost a server start each, 11-19 s.)
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
from test_browser_panel import ARTIFACTS, BROWSER_DIR, as_new_user, browser_ready, run_browser_script  # noqa: F401

pytestmark = pytest.mark.e2e

SCRIPT = BROWSER_DIR / "tour.mjs"
EXAMPLES = REPO_ROOT / "example_workflows"
# A strength of the run's own (not the example's): the "after a run" state is a run of the loader with it.
STRENGTH = {"classic": 0.9, "vue": 0.85}


# Both renderers on the ComfyUI's own frontend; the newest frontend in the classic one (its Vue renderer runs every
# example, the panel and the reload in test_browser_templates.py; CI's time is bounded).
TOURS = [(frontend, renderer) for frontend in FRONTENDS for renderer in ("classic", "vue")
         if frontend == BUNDLED or renderer == "classic"]


@pytest.mark.parametrize(("browser_server", "renderer"), TOURS, indirect=["browser_server"])
def test_browser_tour(browser_server, browser_ready, renderer):  # noqa: F811 (fixture)
    server = browser_server
    as_new_user(server)
    demo = {"files": DEMO_FILES, "size": DEMO_SIZE, "steps": DEMO_STEPS}
    result = run_browser_script(
        SCRIPT, server, renderer, ARTIFACTS / f"browser_tour_{renderer}.png",
        STRENGTH=str(STRENGTH[renderer]), DEMO=json.dumps(demo),
    )
    assert result["first_run"] is True, "the tour is a new user's: the frontend must have seen one"
    names = sorted(p.stem for p in EXAMPLES.glob("*.json"))
    assert sorted(result["thumbnails"]) == names
    assert sorted(result["examples"]) == names
    assert all(not e["off_screen"] for e in result["examples"].values())
    ran, cached = result["after_run"], result["after_cached_run"]
    assert "run the workflow to see what it changed" in result["fresh"]["text"]
    assert ran["lines"] and cached["lines"] == ran["lines"]
    assert "run the workflow" not in cached["text"]
