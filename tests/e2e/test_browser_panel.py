"""The LyCORIS panel (web/lycoris_panel.js) in headless Chromium against a real ComfyUI server with the pack.

tests/browser/panel.mjs drives the real frontend: it loads the example workflow, checks the panel's metadata, queues
the workflow, and checks the coverage line, the per-block chart and the trigger-word chips; once with the classic
LiteGraph canvas and once with the Vue "Nodes 2.0" renderer. Screenshots are kept in artifacts/.

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

import make_demo_lycoris
import make_tiny_sd15
from comfy_server import ComfyServer
from test_server_demo import ASSETS, CHECKPOINT, LYCORIS, make_base_dir

pytestmark = pytest.mark.e2e

BROWSER_DIR = REPO_ROOT / "tests" / "browser"
SCRIPT = BROWSER_DIR / "panel.mjs"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO_ROOT / "artifacts"
RUN_TIMEOUT = 300  # s for one panel.mjs run (it takes about 20 s)


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


@pytest.fixture(scope="module")
def panel_server(tmp_path_factory, browser_ready):
    """A server of its own: a fresh user folder (so the first-run templates dialog opens, as for a new user), and no
    output cache (--cache-none), so every queued run executes the loader and sends its report again."""
    ckpt = make_tiny_sd15.write_tiny_sd15(ASSETS / CHECKPOINT)  # cached in .deps/test-assets after the first run
    assets = {"checkpoints": ckpt, "loras": make_demo_lycoris.write_demo_lycoris(ASSETS / LYCORIS, ckpt)}
    base = make_base_dir(tmp_path_factory.mktemp("comfy-browser"), assets)
    with ComfyServer(base, extra_args=["--cache-none"]) as srv:
        yield srv


@pytest.mark.parametrize("renderer", ["classic", "vue"])
def test_panel_in_browser(panel_server, renderer):
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / f"browser_panel_{renderer}.png"
    env = {**os.environ, "COMFY_URL": panel_server.url, "SCREENSHOT": str(screenshot), "RENDERER": renderer}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            ["node", str(SCRIPT)], cwd=BROWSER_DIR, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
            stdin=subprocess.DEVNULL, check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"panel.mjs ({renderer}) did not finish in {RUN_TIMEOUT} s; stderr:\n{err.stderr}")
    seconds = time.monotonic() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    print(f"browser panel ({renderer}): {seconds:.1f} s; screenshots: {screenshot} and {result.get('node_screenshot')}")
    print(json.dumps(result, indent=1, ensure_ascii=False))
    assert proc.returncode == 0, (
        f"panel.mjs ({renderer}) exited {proc.returncode}: {result.get('error') or '(no result line)'}\n"
        f"stderr:\n{proc.stderr[-4000:]}\nserver log tail:\n{panel_server.log_tail()}"
    )
    assert result.get("ok") is True
    assert screenshot.exists()
