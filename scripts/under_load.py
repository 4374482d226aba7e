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
import contextlib
import os
import signal
import subprocess
import sys
import threading
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


def end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to pytest's process group (pytest, its ComfyUI servers, node and Chromium), then SIGKILL to whatever is
    left once pytest has ended or 30 s have passed. Not SIGINT: a process started in the background by a
    non-interactive shell ignores it."""
    for signum, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):  # the whole group has ended (maybe on its own since the poll)
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):  # pytest ignored the TERM: the KILL comes next
            proc.wait(grace)


def run_pytest(pytest_args: list[str], stopping: threading.Event) -> int | None:
    """pytest on the e2e tests in a process group of its own; its exit status, or None when `stopping` was set
    first (then the group is ended)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-m", "e2e", "-p", "no:cacheprovider", *pytest_args],
                            cwd=REPO_ROOT, start_new_session=True)
    while proc.poll() is None:
        if stopping.wait(0.5):
            end_group(proc)
            return None
    return proc.returncode


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="how many times in a row (default 3)")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (e.g. -k tour)")
    args = parser.parse_args(argv)
    pytest_args = [*BROWSER_TESTS, *args.pytest_args]
    # A TERM (a CI step's timeout, `kill`) or Ctrl-C only sets this flag, which the wait loop reads: raising from the
    # handler could land inside Popen, leaving a pytest started that nothing ends. SIGINT stays ignored when it is
    # (started with `&` by a script, as Ctrl-C is meant not to reach it).
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, lambda *_: stopping.set())
    busy = start_busy(args.busy)
    print(f"under_load: {args.busy} busy processes; load average {load()}", flush=True)
    try:
        for run in range(1, args.runs + 1):
            if stopping.is_set():
                break
            start = time.monotonic()
            status = run_pytest(pytest_args, stopping)
            seconds = time.monotonic() - start
            if status is None:
                break
            print(f"under_load: run {run}/{args.runs} exited {status} in {seconds:.0f} s; load average {load()}",
                  flush=True)
            if status != 0:
                return status
    finally:
        stop(busy)
    if stopping.is_set():
        print("under_load: stopped by a signal", flush=True)
        return 128 + signal.SIGTERM
    print(f"under_load: {args.runs} of {args.runs} runs passed beside {args.busy} busy processes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
