"""Every example workflow run in headless Chromium, then measured (tests/browser/templates.mjs): after its run no node
covers another (panels and reports grow with the run's results), the pack causes no console warning or error and no
failed request (common.mjs's PACK_WATCH), and after a page reload the loader's panel shows its last run again.
Each tool's node shows its report widget (web/lycoris_panel.js, "lycoris_report"): the hint before the run, then
the node's report naming the file it wrote; the widget adds nothing to the saved workflow, and the page throws
nothing while a tool's example loads and runs.

The examples the tiny models cannot run (example_models.LOAD_ONLY: Wan 2.2's) are opened and laid out, not queued.

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

from example_models import LOAD_ONLY, demo_workflow
from test_browser_panel import ARTIFACTS, BROWSER_DIR, browser_ready, run_browser_script  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

SCRIPT = BROWSER_DIR / "templates.mjs"
EXAMPLES = REPO_ROOT / "example_workflows"
TOOLS = ("LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert")
# The Convert example runs on the Resize example's output (the demo file is LoKr, which no PEFT name holds; see
# test_example_workflows.INPUT_FROM), so Resize runs first.
LAST = ("lycoris_convert",)


def browser_examples(tag: str) -> tuple[dict[str, dict], dict[str, dict[str, str]]]:
    """The examples on the tiny model (for_demo), each tool writing `<its output name>_<tag>` (the tools never
    overwrite, and every renderer and frontend runs them on the same server's loras folder); and by example, each
    tool node's output name (by node id, as text)."""
    names = sorted(p.stem for p in EXAMPLES.glob("*.json"))
    names = [n for n in names if n not in LAST] + list(LAST)
    out, outputs = {}, {}
    for name in names:
        workflow = demo_workflow(f"{name}.json")
        outputs[name] = {}
        for node in workflow["nodes"]:
            if node["type"] not in TOOLS:
                continue
            values = node["widgets_values"]
            for i, value in enumerate(values):
                if isinstance(value, str) and value.startswith("lycoris/"):
                    values[i] = outputs[name][str(node["id"])] = f"{value}_{tag}"
            if node["type"] == "LycorisConvert":
                values[0] = f"lycoris/resized_{tag}.safetensors"
        out[name] = workflow
    return out, outputs


def check_tool_reports(name: str, workflow: dict, outputs: dict[str, str], measured: dict) -> None:
    """Each tool node of the example: the hint before the run, its report naming its file after (a line for the file,
    then one per module), and its saved widget values the example's own (the report widget is not saved); and no
    page error while a tool's example loaded and ran."""
    reports = measured["tools"]
    assert sorted(reports["before"]) == sorted(reports["after"]) == sorted(outputs), (name, reports)
    if outputs:
        assert measured["page_errors"] == [], name
    values = {str(node["id"]): node["widgets_values"] for node in workflow["nodes"]}
    for node_id, output in outputs.items():
        before, after = reports["before"][node_id], reports["after"][node_id]
        assert before["idle"] and "Run to write the file" in before["text"], (name, before)
        assert before["saved"] == values[node_id], (name, before["saved"], values[node_id])
        assert after["visible"] and not after["idle"], (name, after)
        assert output in after["text"] and len(after["text"].split("\n")) >= 2, (name, after["text"][:300])


@pytest.mark.parametrize("renderer", ["classic", "vue"])
def test_examples_run_without_covering_nodes(browser_server, browser_ready, tmp_path, renderer):  # noqa: F811
    tag = f"browser_{renderer}_{browser_server.port}"
    examples, outputs = browser_examples(tag)
    (tmp_path / "examples.json").write_text(json.dumps(examples), encoding="utf-8")
    shots = tmp_path / "shots"
    result = run_browser_script(SCRIPT, browser_server, renderer, ARTIFACTS / f"browser_templates_{renderer}.png",
                                WORKFLOWS=str(tmp_path / "examples.json"), SHOTS=str(shots),
                                LOAD_ONLY=",".join(LOAD_ONLY))
    keep = ARTIFACTS / "templates" / f"{result['frontend_version']}-{renderer}"
    keep.mkdir(parents=True, exist_ok=True)
    for png in shots.glob("*.png"):
        png.replace(keep / png.name)
    assert list(result["examples"]) == list(examples)
    for name, measured in result["examples"].items():
        assert measured["ran"] == (name not in LOAD_ONLY), name
        assert measured["before"] == [] and measured["after"] == [], (name, measured)
        assert len(measured["rects"]) == len(examples[name]["nodes"]), name
        check_tool_reports(name, examples[name], outputs[name], measured)
    assert sum(len(o) for o in outputs.values()) == len(TOOLS)  # every tool's example, each with one tool node
    assert result["pack_issues"] == []
    assert sorted(p.stem for p in keep.glob("*.png")) == sorted(examples)
    reload = result["reload"]
    lines = {node: panel["lines"] for node, panel in reload["ran"].items()}
    assert any(lines.values()) and {n: p["lines"] for n, p in reload["restored"].items()} == lines
