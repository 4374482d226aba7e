"""The e2e tests' deadlines grow with the machine's load (issue #38): scripts/comfy_server.py stretched(), which the
servers, prompts and browser scripts wait with, and scripts/under_load.py, which checks the browser tests under load.

A deadline there ends a hung server or page; on a busy machine it must stretch rather than fail a slow pass. The
browser scripts' within() (tests/browser/common.mjs) follows the same rule, checked here against its source.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import comfy_server
import under_load


@pytest.mark.parametrize(("load_per_core", "factor"), [(0.0, 1.0), (0.4, 1.0), (1.0, 2.0), (2.0, 4.0), (10.0, 8.0)])
def test_a_deadline_stretches_by_twice_the_load_per_core_from_1_to_8_times(monkeypatch, load_per_core, factor):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (2 * load_per_core, 0.0, 0.0))
    assert comfy_server.stretched(30) == pytest.approx(30 * factor)


def test_the_browser_scripts_stretch_by_the_same_rule():
    source = (REPO_ROOT / "tests" / "browser" / "common.mjs").read_text(encoding="utf-8")
    assert re.search(r"Math\.min\(8, Math\.max\(1, \(2 \* loadavg\(\)\[0\]\) / Math\.max\(1, cpus\(\)\.length\)\)\)",
                     source)
    assert "export const within = (ms) => Math.round(ms * slowdown());" in source


def test_waiting_for_a_prompt_that_never_finishes_times_out_after_the_stretched_deadline(monkeypatch):
    class Stuck(comfy_server.ComfyClient):
        def get_json(self, path):
            return {}

    monkeypatch.setattr(comfy_server, "stretched", lambda seconds: seconds * 3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish in 1 s"):
        Stuck(0, REPO_ROOT).wait("p", timeout=0.4)
    assert time.monotonic() - start >= 1.2


def test_the_load_check_runs_the_browser_tests():
    assert under_load.BROWSER_TESTS and all(Path(p).name.startswith("test_browser_") for p in under_load.BROWSER_TESTS)
