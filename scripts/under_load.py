"""Run the browser tests beside busy processes that pin every core, several times in a row (issue #38).

    <venv python> scripts/under_load.py [--runs 3] [--busy N] [-- more pytest arguments]

`make test-browser-under-load` runs it on the ComfyUI of COMFY. It starts N processes that spin on the CPU (default:
one per core, so two on CI's 2-core machine), runs pytest on the browser tests (tests/e2e/test_browser_*.py, with
any further pytest arguments, e.g. `-k tour`) `--runs` times, and stops the busy processes however it ends. It stops at the first run
that fails and exits with pytest's status; each run's time and the load average are printed. Not part of `make test`
(it takes several times the browser tests' own time); it shows that their waits hold when the CPU is shared.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BROWSER_TESTS = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests" / "e2e").glob("test_browser_*.py"))
SPIN = "while True:\n    pass\n"


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.wait()


def run_pytest(pytest_args: list[str]) -> int:
    """pytest on the e2e tests, in a process group of its own: when this script is stopped, the group gets SIGINT (as
    from Ctrl-C: pytest stops its servers, node and Chromium end), then SIGKILL if it is still there 30 s later."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "e2e", "-p", "no:cacheprovider", *pytest_args],
                            cwd=REPO_ROOT, start_new_session=True)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="how many times in a row (default 3)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (e.g. -k tour)")
    args = parser.parse_args(argv)
    pytest_args = [*BROWSER_TESTS, *args.pytest_args]
    # A TERM (a CI step's timeout, `kill`) ends this like Ctrl-C does, so the finally below stops the busy processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    busy = start_busy(args.busy)
    print(f"under_load: {args.busy} busy processes; load average {load()}", flush=True)
    try:
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            status = run_pytest(pytest_args)
            seconds = time.monotonic() - start
            print(f"under_load: run {run}/{args.runs} exited {status} in {seconds:.0f} s; load average {load()}",
                  flush=True)
            if status != 0:
                return status
    finally:
        stop(busy)
    print(f"under_load: {args.runs} of {args.runs} runs passed beside {args.busy} busy processes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
