"""Every example workflow run in headless Chromium, then measured (tests/browser/templates.mjs): after its run no node
covers another (panels and reports grow with the run's results), the pack causes no console warning or error and no
failed request (common.mjs's PACK_WATCH), and after a page reload the loader's panel shows its last run again.

On each frontend of frontends.FRONTENDS (the ComfyUI's own; with 0.33 also the newest, 1.58.1) and both renderers.
One screenshot per example after its run: artifacts/templates/<frontend version>-<renderer>/<example>.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from example_models import demo_workflow
from test_browser_panel import ARTIFACTS, BROWSER_DIR, browser_ready, run_browser_script  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

SCRIPT = BROWSER_DIR / "templates.mjs"
EXAMPLES = REPO_ROOT / "example_workflows"
TOOLS = ("LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert")
# The Convert example runs on the Resize example's output (the demo file is LoKr, which no PEFT name holds; see
# test_example_workflows.INPUT_FROM), so Resize runs first.
LAST = ("lycoris_convert",)


def browser_examples(tag: str) -> dict[str, dict]:
    """The examples on the tiny model (for_demo), each tool writing `<its output name>_<tag>` (the tools never
    overwrite, and every renderer and frontend runs them on the same server's loras folder)."""
    names = sorted(p.stem for p in EXAMPLES.glob("*.json"))
    names = [n for n in names if n not in LAST] + list(LAST)
    out = {}
    for name in names:
        workflow = demo_workflow(f"{name}.json")
        for node in workflow["nodes"]:
            if node["type"] not in TOOLS:
                continue
            values = node["widgets_values"]
            for i, value in enumerate(values):
                if isinstance(value, str) and value.startswith("lycoris/"):
                    values[i] = f"{value}_{tag}"
            if node["type"] == "LycorisConvert":
                values[0] = f"lycoris/resized_{tag}.safetensors"
        out[name] = workflow
    return out


@pytest.mark.parametrize("renderer", ["classic", "vue"])
def test_examples_run_without_covering_nodes(browser_server, browser_ready, tmp_path, renderer):  # noqa: F811
    tag = f"browser_{renderer}_{browser_server.port}"
    examples = browser_examples(tag)
    (tmp_path / "examples.json").write_text(json.dumps(examples), encoding="utf-8")
    shots = tmp_path / "shots"
    result = run_browser_script(SCRIPT, browser_server, renderer, ARTIFACTS / f"browser_templates_{renderer}.png",
                                WORKFLOWS=str(tmp_path / "examples.json"), SHOTS=str(shots))
    keep = ARTIFACTS / "templates" / f"{result['frontend_version']}-{renderer}"
    keep.mkdir(parents=True, exist_ok=True)
    for png in shots.glob("*.png"):
        png.replace(keep / png.name)
    assert list(result["examples"]) == list(examples)
    for name, measured in result["examples"].items():
        assert measured["before"] == [] and measured["after"] == [], (name, measured)
        assert len(measured["rects"]) == len(examples[name]["nodes"]), name
    assert result["pack_issues"] == []
    assert sorted(p.stem for p in keep.glob("*.png")) == sorted(examples)
    reload = result["reload"]
    lines = {node: panel["lines"] for node, panel in reload["ran"].items()}
    assert any(lines.values()) and {n: p["lines"] for n, p in reload["restored"].items()} == lines
