"""A new user's tour in headless Chromium against the session's real ComfyUI server (tests/browser/tour.mjs).

In both renderers (classic LiteGraph and Vue "Nodes 2.0"), on the frontend of the ComfyUI under test (1.32.9 with
ComfyUI 0.3.75, 1.49.6 with 0.33): the template browser lists the pack's examples with their own thumbnails (loaded,
not the frontend's placeholder), each example opens from its card with all its nodes on screen, the LyCORIS Loader's
panel is right fresh, after a run, and after the page is reopened and the same prompt queued again (ComfyUI answers the
loader from its cache and sends no report: the panel must still show the run's), no request for the pack's files
answers 404, and nothing of the pack's is left on window or in document.head/body.

Each tour has a server of its own with a fresh user folder, as a new user has (and with its output cache, unlike
test_browser_panel's). That is the tour's subject, and it keeps the tour independent of what ran before: frontend
1.49.6 takes 3-7 s longer to open the template browser's category once its user has completed the first-run tutorial
(setting Comfy.TutorialCompleted), 40 s against 110 s for the tour on a quiet 2-core machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from comfy_server import ComfyServer
from example_models import DEMO_FILES, DEMO_SIZE, DEMO_STEPS
from frontends import BUNDLED, FRONTENDS, frontend_args
from test_browser_panel import ARTIFACTS, BROWSER_DIR, browser_ready, run_browser_script  # noqa: F401 (fixture)
from test_server_demo import make_base_dir

pytestmark = pytest.mark.e2e

SCRIPT = BROWSER_DIR / "tour.mjs"
EXAMPLES = REPO_ROOT / "example_workflows"
# A strength of the run's own (not the example's): the "after a run" state is a run of the loader with it.
STRENGTH = {"classic": 0.9, "vue": 0.85}


# Both renderers on the ComfyUI's own frontend; the newest frontend in the classic one (its Vue renderer runs every
# example, the panel and the reload in test_browser_templates.py; CI's time is bounded).
TOURS = [(frontend, renderer) for frontend in FRONTENDS for renderer in ("classic", "vue")
         if frontend == BUNDLED or renderer == "classic"]


@pytest.fixture
def new_user_server(request, tmp_path_factory, model_files):
    """A server of the tour's own on the frontend of its parameter: a fresh user folder, so the frontend greets a new
    user (the first-run templates dialog, which run_browser_script checks is found and closed)."""
    base = make_base_dir(tmp_path_factory.mktemp("comfy-tour"), model_files)
    with ComfyServer(base, extra_args=frontend_args(request.param)) as srv:
        yield srv


@pytest.mark.parametrize(("new_user_server", "renderer"), TOURS, indirect=["new_user_server"])
def test_browser_tour(new_user_server, browser_ready, renderer):  # noqa: F811 (fixture)
    server = new_user_server
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
