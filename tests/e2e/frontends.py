"""The frontends the browser tests run on (tests/e2e/conftest.py browser_server, test_browser_panel.py panel_server)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# The frontends the browser tests run on: the one the ComfyUI under test ships (1.32.9 with 0.3.75, 1.49.6 with 0.33)
# and, with 0.33, the newest on the registry (scripts/setup.sh LATEST_FRONTEND, served with --front-end-root).
LATEST_FRONTEND = re.search(r"^LATEST_FRONTEND=(\S+)$", (REPO_ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8"),
                            re.MULTILINE).group(1)
BUNDLED = "bundled"
FRONTENDS = [BUNDLED, *([LATEST_FRONTEND] if os.environ.get("COMFY") == "0.33" else [])]


def frontend_args(frontend: str) -> list[str]:
    """ComfyUI's arguments for a frontend of FRONTENDS; fails when setup.sh did not install it."""
    if frontend == BUNDLED:
        return []
    root = REPO_ROOT / ".deps" / f"frontend-{frontend}" / "comfyui_frontend_package" / "static"
    if not (root / "index.html").is_file():
        pytest.fail(f"frontend {frontend} is not in {root}: run `make setup COMFY=0.33`", pytrace=False)
    return ["--front-end-root", str(root)]
