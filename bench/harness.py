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


@dataclass
class Row:
    """One result line: `<name>: <note> <status> ours=<v> builtin=<v> ratio=<ours/builtin> goal=<goal>`.

    `limit` is the goal on the ratio (None: report only); `also_ok` is a second condition of the goal (the machine
    floor of the merge rows). MISSED says which part was missed.
    """

    name: str
    ours: float | None
    builtin: float | None
    goal: str
    limit: float | None = None
    unit: str = "s"
    note: str = ""
    also_ok: bool = True
    comparable: bool = True  # False when the built-in did not do the work (a patch failed and was skipped)

    @property
    def ratio(self) -> float | None:
        if self.ours is None or not self.builtin:
            return None
        return self.ours / self.builtin

    @property
    def status(self) -> str:
        if self.ratio is None or not self.comparable:
            return "N/A"
        if self.limit is None:
            return "REPORT"
        missed = [part for part, ok in (("ratio", self.ratio <= self.limit), ("floor", self.also_ok)) if not ok]
        return "MISSED:" + ",".join(missed) if missed else "MET"

    def value(self, v: float | None) -> str:
        if v is None:
            return "n/a"
        return str(int(v)) if self.unit == "B" else f"{v:.4g}"

    def line(self) -> str:
        ratio = "n/a" if self.ratio is None else f"{self.ratio:.3f}"
        note = f"{self.note} " if self.note else ""
        return (f"{self.name}: {note}{self.status} ours={self.value(self.ours)} builtin={self.value(self.builtin)} "
                f"ratio={ratio} goal={self.goal}")


class AdapterErrors(logging.Filter):
    """Counts, and keeps off the console, the errors ComfyUI's adapters log when their maths fails ("ERROR <name>
    <key> <exception>"): the adapter then returns the weight unpatched, so a built-in time measured that way is the
    time of doing nothing."""

    def __init__(self):
        super().__init__()
        self.count, self.first = 0, ""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and message.startswith("ERROR "):
            self.count += 1
            self.first = self.first or message
            return False
        return True


ADAPTER_ERRORS = AdapterErrors()
logging.getLogger().addFilter(ADAPTER_ERRORS)
