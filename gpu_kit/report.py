"""The report: cases, sections, time budgets, and gpu-report.json / gpu-report.md (format in docs/gpu-kit.md)."""

import json
import platform
import time
import traceback
from dataclasses import asdict, dataclass, field

STATUSES = ("pass", "fail", "error", "skip", "not-run")


@dataclass
class Case:
    id: str
    status: str  # one of STATUSES
    numbers: dict = field(default_factory=dict)
    detail: str = ""
    trace: bool | str = False  # True: take the traceback of the exception being handled

    def __post_init__(self):
        assert self.status in STATUSES, self.status
        if self.trace is True:
            self.trace = traceback.format_exc(limit=12)


class Clock:
    """A section's time budget: cases check it before they start; those it stops are reported as not run."""

    def __init__(self, budget: float):
        self.budget, self.started = budget, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out(self) -> bool:
        return self.elapsed() > self.budget


def section_status(cases: list[dict], crashed: str = "") -> str:
    """fail: a case failed or errored, or the section's process died; incomplete: the budget stopped cases; else
    pass (skips are the reference's own limits, each with its reason)."""
    statuses = {c["status"] for c in cases}
    if crashed or statuses & {"fail", "error"}:
        return "fail"
    if "not-run" in statuses or not cases:
        return "incomplete"
    return "pass"


def section(name: str, title: str, cases: list[Case], clock: Clock, notes: list[str], rows: list[dict] | None = None,
            environment: dict | None = None) -> dict:
    data = [asdict(c) for c in cases]
    return {"name": name, "title": title, "status": section_status(data), "budget_s": clock.budget,
            "elapsed_s": round(clock.elapsed(), 2), "counts": {s: sum(c["status"] == s for c in data)
                                                              for s in STATUSES},
            "notes": notes, "cases": data, "rows": rows or [], "environment": environment or {}}


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "platform": platform.platform()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, vram_gb=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", driver=torch.version.cuda)
    return info


def write(path_json, path_md, report: dict) -> None:
    with open(path_json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(path_md, "w", encoding="utf-8") as f:
        f.write(markdown(report))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown(report: dict) -> str:
    kind = "Dry run (CPU, tiny shapes, fake cuda:0)" if report["dry_run"] else "Real run"
    when = f"of commit `{report['commit']}` on {report['started']}, {report['elapsed_s']:.0f} s in all."
    lines = [f"# GPU evidence: {report['verdict'].upper()}", "", f"{kind} {when}", ""]
    m = report["machine"]
    lines += ["| machine | |", "|---|---|", *[f"| {k} | {v} |" for k, v in m.items()], ""]
    lines += ["| section | status | cases (pass/fail/error/skip/not run) | time / budget |", "|---|---|---|---|"]
    for s in report["sections"]:
        c = s["counts"]
        lines.append(f"| {s['title']} | {s['status'].upper()} | {c['pass']}/{c['fail']}/{c['error']}/{c['skip']}/"
                     f"{c['not-run']} | {s['elapsed_s']:.0f} s / {s['budget_s']:.0f} s |")
    for s in report["sections"]:
        lines += ["", f"## {s['title']}: {s['status'].upper()}", ""]
        lines += [f"- {n}" for n in s["notes"]]
        if s["rows"]:
            keys = list(s["rows"][0])
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |" for r in s["rows"]]
        many = len(s["cases"]) > 40
        if many:
            lines += ["", *by_combination(s["cases"])]
        shown = [c for c in s["cases"] if c["status"] != "pass"] if many else s["cases"]
        if shown:
            keys = sorted({k for c in shown for k in c["numbers"]})
            columns = ["case", "status", *keys, "detail"]
            lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for c in shown:
                detail = c["detail"].replace("|", "/").replace("\n", " ")[:300]
                cells = [c["id"], c["status"], *(_fmt(c["numbers"].get(k, "")) for k in keys), detail]
                lines.append("| " + " | ".join(cells) + " |")
        if len(shown) < len(s["cases"]):
            lines.append(f"\n{len(s['cases']) - len(shown)} passing cases not listed (all are in gpu-report.json).")
    return "\n".join(lines) + "\n"


def by_combination(cases: list[dict]) -> list[str]:
    """Exactness cases ("set/variant/dtype/load/mode") counted per set/dtype/load/mode, with the worst
    error ratio (ours / the ideal's) among them."""
    groups: dict[str, list[dict]] = {}
    for c in cases:
        parts = c["id"].split("/")
        groups.setdefault("/".join(parts[:1] + parts[2:]), []).append(c)
    lines = ["| set/dtype/load/mode | pass | fail or error | skip | not run | worst ratio | inconclusive layers |",
             "|---|---|---|---|---|---|---|"]
    for key, group in groups.items():
        ratios = [c["numbers"]["worst_ratio"] for c in group if "worst_ratio" in c["numbers"]]
        count = {s: sum(c["status"] == s for c in group) for s in STATUSES}
        worst = f"{max(ratios):.3g}" if ratios else ""
        inconclusive = sum(c["numbers"].get("inconclusive", 0) for c in group)
        lines.append(f"| {key} | {count['pass']} | {count['fail'] + count['error']} | {count['skip']} | "
                     f"{count['not-run']} | {worst} | {inconclusive} |")
    return lines
