"""Shared by run.py and load_child.py: ComfyUI (CPU mode) and this pack importable, timing, and the row format.

Import this module before anything from `comfy`: ComfyUI picks its device when comfy.model_management is imported.
"""

import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))

from comfy_env import setup_comfy  # tests/comfy_env.py: ComfyUI on sys.path, CPU mode
from pack import import_pack  # tests/pack.py: this repo as the package `lycoris_nodes`

setup_comfy()
import_pack()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values) -> float:
    return statistics.median(list(values))


def spread(values) -> str:
    """"±x%": half the range of `values` relative to their median."""
    values = list(values)
    mid = median(values)
    return f"±{50 * (max(values) - min(values)) / mid:.0f}%" if mid else "±0%"


def _against(limit: float, value: float, low: float, high: float) -> tuple[bool, bool]:
    """(met, within noise): the median meets the limit; the limit lies inside the repetitions' range."""
    return value <= limit, low <= limit < high


@dataclass
class Row:
    """One result line: `<name>: <note> <status> ours=<v> builtin=<v> ratio=<ours/builtin> [<lo>-<hi>] goal=<goal>`.

    `ours_runs` and `builtin_runs` hold one value per repetition, measured in turn (pairs: the same repetition), so
    the ratio's range is that of the per-repetition ratios; `ours` and `builtin` are medians and `ratio` is
    ours/builtin. `builtin_runs` is None when the built-in cannot do the work at all (no adapter for the format).
    `limit` is the goal on the ratio (None: report only); `ours_limit` is a goal on ours alone (row 1's 2 × floor).
    A part whose goal lies inside its range over the repetitions is "within noise": the status says so, and MISSED
    says which parts were missed.
    """

    name: str
    ours_runs: list[float]
    builtin_runs: list[float] | None
    goal: str
    limit: float | None = None
    unit: str = "s"
    note: str = ""
    ours_limit: float | None = None
    comparable: bool = True  # False when the built-in did not do the work (a patch failed and was skipped)

    @property
    def ours(self) -> float:
        return median(self.ours_runs)

    @property
    def builtin(self) -> float | None:
        return median(self.builtin_runs) if self.builtin_runs else None

    @property
    def ratio(self) -> float | None:
        if not self.builtin:
            return None
        return self.ours / self.builtin

    @property
    def ratios(self) -> list[float]:
        return [o / b for o, b in zip(self.ours_runs, self.builtin_runs or []) if b]

    @property
    def ratio_range(self) -> str:
        return f"{min(self.ratios):.3f}-{max(self.ratios):.3f}" if self.ratios else "n/a"

    def parts(self) -> dict[str, tuple[bool, bool]]:
        parts = {}
        if self.limit is not None and self.ratio is not None:
            parts["ratio"] = _against(self.limit, self.ratio, min(self.ratios), max(self.ratios))
        if self.ours_limit is not None:
            parts["floor"] = _against(self.ours_limit, self.ours, min(self.ours_runs), max(self.ours_runs))
        return parts

    @property
    def status(self) -> str:
        if not self.comparable:
            return "N/A"
        parts = self.parts()
        if not parts:
            return "N/A" if self.limit is not None else "REPORT"
        missed = [name for name, (met, _) in parts.items() if not met]
        if not missed:
            return "MET (within noise)" if any(noisy for _, noisy in parts.values()) else "MET"
        noisy = all(parts[name][1] for name in missed)
        return "MISSED:" + ",".join(missed) + (" (within noise)" if noisy else "")

    def value(self, v: float | None) -> str:
        if v is None:
            return "n/a"
        return str(int(v)) if self.unit == "B" else f"{v:.4g}"

    def cell(self, runs: list[float] | None) -> str:
        """Median and its spread over the repetitions."""
        return "n/a" if not runs else f"{self.value(median(runs))} {spread(runs)}"

    def line(self) -> str:
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.3f} [{self.ratio_range}]"
        note = f"{self.note} " if self.note else ""
        return (f"{self.name}: {note}{self.status} ours={self.cell(self.ours_runs)} "
                f"builtin={self.cell(self.builtin_runs)} ratio={ratio} goal={self.goal} (n={len(self.ours_runs)})")


class AdapterErrors(logging.Filter):
    """Counts, and keeps off the console, the errors ComfyUI's adapters log when their maths fails ("ERROR <name>
    <key> <exception>"): the adapter then returns the weight unpatched, so a built-in time measured that way is the
    time of doing nothing."""

    def __init__(self):
        super().__init__()
        self.count, self.last = 0, ""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and message.startswith("ERROR "):
            self.count += 1
            self.last = message
            return False
        return True


ADAPTER_ERRORS = AdapterErrors()
logging.getLogger().addFilter(ADAPTER_ERRORS)


def table(rows: list[Row], other: str) -> list[str]:
    """The results table every bench writes: one line per row, `other` naming the side we are compared with."""
    lines = [f"| row | ours | {other} | ratio | range | n | goal | status | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.3f}"
        lines.append(f"| {r.name} | {r.cell(r.ours_runs)} | {r.cell(r.builtin_runs)} | {ratio} | {r.ratio_range} "
                     f"| {len(r.ours_runs)} | {r.goal} | {r.status} | {r.note} |")
    return lines
