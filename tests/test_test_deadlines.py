"""The e2e tests' deadlines grow with the machine's load (issue #38): scripts/comfy_server.py stretched(), which the
servers, prompts and browser scripts wait with, and scripts/under_load.py, which checks the browser tests under load.

A deadline there ends a hung server or page; on a busy machine it must stretch rather than fail a slow pass. The
browser scripts' within() (tests/browser/common.mjs) follows the same rule, checked here against its source.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
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


# A pytest plugin that stands for a long browser run: it writes its pid, then sleeps in pytest_configure.
SLEEPY_PLUGIN = """
import os, time
def pytest_configure(config):
    with open(os.environ["SLEEPY_PID"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.environ["SLEEPY_PID"] + ".tmp", os.environ["SLEEPY_PID"])
    time.sleep(600)
"""


def live_processes(pgid: int, token: str) -> dict[int, str]:
    """The live processes (not zombies) in a process group or with `token` in their command line, from /proc: pid
    and command line."""
    found = {}
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            fields = (folder / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while /proc was listed
        if fields[0] != "Z" and (int(fields[2]) == pgid or token in cmdline):
            found[int(folder.name)] = cmdline
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc (Linux)")
@pytest.mark.parametrize("term_after", ["pytest started", "0.0 s", "0.15 s", "0.3 s"])
def test_a_term_stops_the_busy_processes_and_the_tests_however_early_it_comes(tmp_path, term_after):
    """A TERM while the browser tests run (a CI step's timeout) ends under_load with 143 and leaves no process of its
    own (its busy processes) nor of pytest's group (pytest, servers, browsers); also when the TERM comes while the
    busy processes or pytest are still being started, and when it was started in the background by a script (SIGINT
    ignored, so only a TERM ends pytest's group)."""
    plugin = f"sleepy_{uuid.uuid4().hex[:12]}"  # names this case's pytest in the process list
    (tmp_path / f"{plugin}.py").write_text(SLEEPY_PLUGIN, encoding="utf-8")
    pid_file = tmp_path / "pytest.pid"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SLEEPY_PID": str(pid_file)}
    # Started as a script's `cmd &` starts it: SIGINT ignored (`trap "" INT`), which exec keeps.
    script = shlex.quote(str(REPO_ROOT / "scripts" / "under_load.py"))
    command = f'trap "" INT; exec "$0" {script} --runs 1 --busy 2 -- -p {plugin}'
    proc = subprocess.Popen(["bash", "-c", command, sys.executable], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if term_after == "pytest started":
            deadline = time.monotonic() + comfy_server.stretched(60)
            while not pid_file.exists():
                assert time.monotonic() < deadline and proc.poll() is None, "pytest did not start"
                time.sleep(0.05)
        else:
            time.sleep(float(term_after.split()[0]))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=comfy_server.stretched(60))
        leftovers = live_processes(proc.pid, plugin)
    finally:  # nothing of a failing case may spin on beside the rest of the suite
        for pid in live_processes(proc.pid, plugin):
            with contextlib.suppress(ProcessLookupError):  # it ended since it was listed
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    # A TERM before the handler is in place ends the script by the default action (-15), with nothing started yet.
    assert proc.returncode in (143, -signal.SIGTERM), out
    if proc.returncode == 143:
        assert "under_load: stopped by a signal" in out
    if term_after == "pytest started":
        assert proc.returncode == 143
    assert not leftovers, out
