"""The LyCORIS panel (web/lycoris_panel.js) in headless Chromium against a real ComfyUI server with the pack.

tests/browser/panel.mjs drives the real frontend: it loads the example workflow, checks the panel's metadata, queues
the workflow, and checks the coverage line, the per-block chart and the trigger-word chips; once with the classic
LiteGraph canvas and once with the Vue "Nodes 2.0" renderer. tests/browser/block_weights.mjs does the same for the
per-block sliders of LyCORIS Loader (Block Weights) on example_workflows/lycoris_block_weights.json: run, move two
sliders, check the block_weights text, run again. Screenshots are kept in artifacts/. The rule editing behind the
sliders (web/lycoris_block_rules.js) is also tested under Node alone and against lycoris_core's parser.
Both run on ComfyUI 0.3.75's frontend (1.32.9) and 0.33's (1.49.6); on a fresh server the first script closes the
templates dialog the frontend opens over the graph for a new user (check_first_run_dialogs).

Chromium (Debian's, /usr/bin/chromium), Node.js and tests/browser/node_modules come from scripts/setup.sh; when one is
missing this test fails and says so (it is never skipped).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from comfy_server import stretched, ui_to_api
from example_models import demo_workflow
from frontends import BUNDLED, FRONTENDS

pytestmark = pytest.mark.e2e

BROWSER_DIR = REPO_ROOT / "tests" / "browser"
SCRIPT = BROWSER_DIR / "panel.mjs"
BLOCK_WEIGHTS_SCRIPT = BROWSER_DIR / "block_weights.mjs"
RULES_TEST = BROWSER_DIR / "block_rules.test.mjs"
CHROMIUM = Path("/usr/bin/chromium")
EXAMPLES = REPO_ROOT / "example_workflows"
ARTIFACTS = REPO_ROOT / "artifacts"
# One browser script's overall deadline on a quiet machine: the longest (templates.mjs) takes about 90 s on a quiet
# 2-core machine. The scripts stretch their own waits by the machine's load (common.mjs within()); this only ends a
# hung script, so it is generous and stretched by the load too (comfy_server.stretched, issue #38).
RUN_TIMEOUT = 600
TEMPLATES_DIALOG = "global-workflow-template-selector"  # aria-labelledby of the frontend's templates dialog
_runs_per_server: dict[Path, int] = {}  # browser runs so far on each server, by its base folder


def missing_browser_pieces() -> list[str]:
    missing = []
    if not CHROMIUM.exists():
        missing.append(f"{CHROMIUM} (Debian package 'chromium')")
    if shutil.which("node") is None:
        missing.append("node (Node.js 20+)")
    if not (BROWSER_DIR / "node_modules" / "playwright-core" / "package.json").exists():
        missing.append("tests/browser/node_modules/playwright-core ('npm ci' in tests/browser)")
    return missing


@pytest.fixture(scope="module")
def browser_ready() -> None:
    missing = missing_browser_pieces()
    if missing:
        pytest.fail(
            "the browser test needs " + "; ".join(missing) + ". Run `bash scripts/setup.sh` (as root it installs "
            "Chromium with apt-get and playwright-core with npm ci).",
            pytrace=False,
        )


@pytest.fixture
def panel_server(request, browser_ready, frontend_server):
    """The session's server of the frontend a test asks for (indirect parametrization, frontends.FRONTENDS;
    conftest.frontend_server), its cached outputs forgotten first, so the script's first run executes the
    loader and sends its report again. ComfyUI's worker drops them as soon as it wakes, milliseconds after the
    request; the script queues seconds later, once Chromium and the page are up. (A server of its own with
    --cache-none did the same for one more server start, 11-15 s, per frontend.)"""
    server = frontend_server(request.param)
    server.forget_outputs()
    return server


def as_new_user(server) -> None:
    """The server as a new user first meets it: the default user's settings gone (so the frontend greets a new user
    with its first-run templates dialog, which the next run_browser_script expects) and the queue's history empty.
    The frontend keeps nothing else of a user on the server; each script's browser profile is fresh."""
    (server.base_dir / "user" / "default" / "comfy.settings.json").unlink(missing_ok=True)
    server.clear_history()
    _runs_per_server.pop(server.base_dir, None)


def run_browser_script(script: Path, server, renderer: str, screenshot: Path, **env_extra: str) -> dict:
    """Run one of the tests/browser scripts against the server; fail with its error, stderr and the server log."""
    ARTIFACTS.mkdir(exist_ok=True)
    # By base folder, not URL: a server started after another has stopped can get its port.
    first_on_server = server.base_dir not in _runs_per_server
    _runs_per_server[server.base_dir] = _runs_per_server.get(server.base_dir, 0) + 1
    env = {**os.environ, "COMFY_URL": server.url, "SCREENSHOT": str(screenshot), "RENDERER": renderer, **env_extra}
    start = time.monotonic()
    deadline = stretched(RUN_TIMEOUT)
    try:
        proc = subprocess.run(
            ["node", str(script)], cwd=BROWSER_DIR, env=env, capture_output=True, text=True, timeout=deadline,
            stdin=subprocess.DEVNULL, check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{script.name} ({renderer}) did not finish in {deadline:.0f} s; stderr:\n{err.stderr}")
    seconds = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    print(f"{script.name} ({renderer}): {seconds:.1f} s; screenshots: {screenshot} and {result.get('node_screenshot')}")
    print(json.dumps({k: v for k, v in result.items() if k != "prompts"}, indent=1, ensure_ascii=False))
    assert proc.returncode == 0, (
        f"{script.name} ({renderer}) exited {proc.returncode}: {result.get('error') or '(no result line)'}\n"
        f"stderr:\n{proc.stderr[-4000:]}\nserver log tail:\n{server.log_tail()}"
    )
    assert result.get("ok") is True
    assert screenshot.exists()
    check_first_run_dialogs(result, first_on_server)
    return result


def frontend_version(result: dict) -> tuple[int, ...]:
    return tuple(int(part) for part in result["frontend_version"].split(".")[:2])


def check_first_run_dialogs(result: dict, first_on_server: bool) -> None:
    """A new user (the first run on a fresh server) gets the templates dialog over the graph, which takes the clicks
    and the keyboard focus the checks need: the script must have found and closed it, and only then.

    The two frontends differ here: 1.32.9 (ComfyUI 0.3.75) opens it as a "layout" dialog that ignores Escape, so it
    takes its close button; 1.49.6 (ComfyUI 0.33) closes it on Escape."""
    assert result["first_run"] is first_on_server
    if not first_on_server:
        assert result["first_run_dialogs"] == []
        return
    closed_by = "escape" if frontend_version(result) >= (1, 49) else "close button"
    expected = [{"dialog": TEMPLATES_DIALOG, "closed_by": closed_by}]
    assert result["first_run_dialogs"] == expected, f"frontend {result['frontend_version']}"


@pytest.fixture(scope="module")
def demo_examples(tmp_path_factory) -> Path:
    """The examples as the tests run them: on the tiny model and the demo files (example_models.for_demo)."""
    folder = tmp_path_factory.mktemp("demo-examples")
    for path in EXAMPLES.glob("*.json"):
        (folder / path.name).write_text(json.dumps(demo_workflow(path.name)), encoding="utf-8")
    return folder


# The newest frontend runs the block-weight sliders in the classic renderer (their undo step uses an API 1.58
# renamed); the panel is covered there by test_browser_templates.py, which runs every example in both renderers
# (CI's time is bounded). The tools' report widget is checked there too, on every frontend and renderer, for each
# tool's example: a script of its own ran the Extract example again for it.
@pytest.mark.parametrize("panel_server", [BUNDLED], indirect=True)
@pytest.mark.parametrize("renderer", ["classic", "vue"])
def test_panel_in_browser(panel_server, demo_examples, renderer):
    run_browser_script(SCRIPT, panel_server, renderer, ARTIFACTS / f"browser_panel_{renderer}.png",
                       WORKFLOW=str(demo_examples / "lycoris_loader.json"))


@pytest.mark.parametrize(("panel_server", "renderer"),
                         [(f, r) for f in FRONTENDS for r in ("classic", "vue") if f == BUNDLED or r == "classic"],
                         indirect=["panel_server"])
def test_block_weight_sliders_in_browser(panel_server, demo_examples, renderer):
    """The sliders and the room the block_weights text gets; in the classic run also: the frontend makes of every
    example workflow the prompt ui_to_api makes (the one test_example_workflows.py runs), so the saved JSON files say
    what a user would queue."""
    extra = {"EXAMPLES_DIR": str(demo_examples)} if renderer == "classic" else {}
    extra["WORKFLOW"] = str(demo_examples / "lycoris_block_weights.json")
    screenshot = ARTIFACTS / f"browser_block_weights_{renderer}.png"
    result = run_browser_script(BLOCK_WEIGHTS_SCRIPT, panel_server, renderer, screenshot, **extra)
    if renderer != "classic":
        return
    object_info = panel_server.object_info()

    def declared(kind: str, inputs: dict) -> dict:
        # Frontend-only widgets (Preview as Text's "preview") are sent too; the server ignores what it does not declare.
        spec = object_info[kind]["input"]
        return {k: v for k, v in inputs.items() if k in spec.get("required", {}) or k in spec.get("optional", {})}

    assert sorted(result["prompts"]) == sorted(p.name for p in EXAMPLES.glob("*.json"))
    for name, converted in result["prompts"].items():
        assert converted["missing"] == [], f"{name}: node types the frontend does not know: {converted['missing']}"
        ours = ui_to_api(json.loads((demo_examples / name).read_text()), object_info)
        frontend = {k: (v["class_type"], declared(v["class_type"], v["inputs"])) for k, v in converted["output"].items()}
        assert frontend == {k: (v["class_type"], v["inputs"]) for k, v in ours.items()}, name


def node_or_fail() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node (Node.js 20+) is needed; run `bash scripts/setup.sh`", pytrace=False)
    return node


def run_node_tests(path: Path) -> None:
    """A *.test.mjs file under Node's own test runner; fails with its output."""
    proc = subprocess.run([node_or_fail(), "--test", str(path)], cwd=BROWSER_DIR, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_block_rules_under_node():
    """web/lycoris_block_rules.js (what the sliders write) under Node's own test runner."""
    run_node_tests(RULES_TEST)


# Texts and block names the panel reads weights from; the text-encoder blocks are left out (see below).
CROSS_TEXTS = [
    "default=1\ninput_blocks.1=0.5\nmiddle_block=1.5\noutput_blocks.0-1=0.75\nte=0.8",
    "default=0.2; input_blocks.4-8=0.5; output_blocks.*=0; output_blocks.3=2 # comment",
    "1,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.1,1.2,1.3,1.4,1.5,1.6,1.7",
    "1,0.5,1,0.5,1,0.5,1,0.5,1,0.5,1,0.5\nmiddle_block.1=-1",
    "default=1\ninput_blocks.1=0.75\nmiddle_block=1.5\noutput_blocks.0-1=0.75\nte=0.8\nmiddle_block.1=-1",
]
CROSS_BLOCKS = [*(f"input_blocks.{i}" for i in range(12)), "middle_block.0", "middle_block.1", "middle_block.2",
                *(f"output_blocks.{i}" for i in range(12)), "time_embed", "out"]


def test_block_rules_read_like_the_python_parser(tmp_path):
    """The slider values the panel shows are the weights lycoris_core gives the blocks' weights."""
    from lycoris_nodes.lycoris_core.block_weights import parse

    pairs = [(text, block) for text in CROSS_TEXTS for block in CROSS_BLOCKS]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    proc = subprocess.run([node_or_fail(), str(RULES_TEST)], cwd=BROWSER_DIR, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CROSS_CHECK": str(tmp_path / "pairs.json")},
                          stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    js = json.loads(proc.stdout.strip().splitlines()[-1])
    python = [parse(text).weight_for(f"diffusion_model.{block}.0.weight") for text, block in pairs]
    differ = [(pairs[i], js[i], python[i]) for i in range(len(pairs)) if js[i] != pytest.approx(python[i])]
    assert not differ, differ[:10]
