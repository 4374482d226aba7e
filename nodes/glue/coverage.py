"""What a file did to a model: where each module went (`Target`, `Applied`) and the coverage report a loader logs
and its panel shows (`ApplyReport`), with the sentences made from it (family verdict, nothing fits, rounded merges).
"""

from collections import Counter
from dataclasses import dataclass, field

from ...lycoris_core import LycorisError, LycorisFile, Module, Plan
from ...lycoris_core.summary import declared_family, family_id, infer_family

# Prefixes trainers use for text-encoder modules: explains a miss when no CLIP is connected.
TEXT_ENCODER_PREFIXES = ("lora_te", "lora_prior_te", "text_encoder", "text_encoders.", "te_", "te1_", "te2_")
NO_CLIP = "text-encoder module, but no CLIP is connected"
NO_MODEL = "diffusion-model module, but no MODEL is connected"
MAX_LISTED = 20
AT_WEIGHT_CAST = "int8 layers ComfyUI runs without their forward"
@dataclass(frozen=True)
class Target:
    side: str  # "model" or "clip"
    patch_key: object  # what add_patches takes: "key" or (key, offset[, function])
    shape: tuple[int, ...]

    @property
    def key(self) -> str:
        return self.patch_key if isinstance(self.patch_key, str) else self.patch_key[0]

    @property
    def offset(self):
        return None if isinstance(self.patch_key, str) else self.patch_key[1]


@dataclass(frozen=True)
class Applied:
    target: Target
    plan: Plan
    module: Module


def by_count(counter: Counter) -> list[tuple[str, int]]:
    """Most frequent first, ties by name: the same line for the same model whatever order its layers were met in."""
    return sorted(counter.items(), key=lambda item: (-item[1], item[0]))


@dataclass
class ApplyReport:
    file: str
    total: int
    applied: dict[str, str] = field(default_factory=dict)  # module key -> model key
    labels: Counter = field(default_factory=Counter)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (module key, reason)
    unused_keys: list[tuple[str, str]] = field(default_factory=list)
    params_total: int = 0
    params_applied: int = 0
    verdict: str = ""  # one sentence when the file does not look made for this model
    bypassed: int = 0  # patches run in the layers' forward instead of merged (apply_mode bypass/auto)
    # ... of which added to the weight when ComfyUI casts it, on int8 layers it multiplies without their forward
    at_weight_cast: int = 0
    bypassed_formats: Counter = field(default_factory=Counter)  # bypassed weights not stored as plain float
    merged_rounded: Counter = field(default_factory=Counter)  # merged weights whose storage re-rounds W+dW
    warnings: list[str] = field(default_factory=list)  # what the loader assumed where the file says nothing
    targets: dict[str, Applied] = field(default_factory=dict, repr=False)

    def line(self) -> str:
        algos = ", ".join(f"{label} {n}" for label, n in self.labels.most_common())
        share = f", {100 * self.params_applied / self.params_total:.0f}% of parameters" if self.params_total else ""
        bypass = f", {self.bypassed} in bypass" if self.bypassed else ""
        if self.at_weight_cast:
            bypass += f", {self.at_weight_cast} of them added at the weight cast ({AT_WEIGHT_CAST})"
        if self.bypassed_formats:
            bypass += "; " + ", ".join(f"{fmt}: {n} bypassed" for fmt, n in by_count(self.bypassed_formats))
        return (f"{self.file}: {len(self.applied)}/{self.total} modules applied"
                + (f" ({algos}{share}{bypass})" if algos else "") + (f". {self.verdict}" if self.verdict else ""))

    def details(self) -> str:
        rows = [f"  {key}: {reason}" for key, reason in self.problems + self.unused_keys]
        more = f"\n  … and {len(rows) - MAX_LISTED} more" if len(rows) > MAX_LISTED else ""
        return "\n".join(rows[:MAX_LISTED]) + more

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line(), "applied": len(self.applied), "total": self.total,
                "algorithms": dict(self.labels.most_common()), "params_applied": self.params_applied,
                "params_total": self.params_total, "verdict": self.verdict, "bypassed": self.bypassed,
                "at_weight_cast": self.at_weight_cast, "bypassed_formats": dict(by_count(self.bypassed_formats)),
                "warnings": list(self.warnings),
                "problems": [list(p) for p in self.problems], "unused_keys": [list(u) for u in self.unused_keys]}


def family_verdict(lfile: LycorisFile, report: ApplyReport, model_family: str | None) -> str:
    """One sentence when the file does not fit and looks made for another model family than this model's.

    Modules missing only because no CLIP is connected are not a misfit, and a file of this model's own family gets
    no verdict whatever else went wrong (its problems are listed one by one instead).
    """
    misfits = [key for key, reason in report.problems if reason not in (NO_CLIP, NO_MODEL)]
    if len(misfits) < len(report.applied):
        return ""
    declared = declared_family(lfile.metadata)
    inferred = infer_family({m.prefix: m.layout.flat_in for m in lfile.modules.values()})
    file_ids = {family_id(declared), family_id(inferred)} - {None}
    model_id = family_id(model_family)
    if model_id is not None and model_id in file_ids:
        return ""
    if not file_ids and report.applied:
        return ""  # nothing says it is for another model: the problems list speaks for itself
    made_for = " / ".join(dict.fromkeys(x for x in (declared, inferred) if x)) or "another model"
    return f"This file looks made for {made_for}, not for this {model_family or 'model'}."


def model_family(model) -> str | None:
    config = getattr(model.model, "model_config", None) if model is not None else None
    return type(config).__name__ if config is not None else None


def nothing_applied_error(report: ApplyReport) -> LycorisError:
    reasons = Counter(reason.split(";")[0] for _, reason in report.problems).most_common(1)
    examples = ", ".join(key for key, _ in report.problems[:3])
    return LycorisError(
        f"none of its {report.total} modules fit this model. {report.verdict or ''} "
        f"Most common reason: {reasons[0][0] if reasons else 'none'}. Examples: {examples}", file=report.file)


def rounded_merge_warning(merged_rounded: Counter, apply_mode: str) -> str:
    formats = ", ".join(f"{fmt} {n}" for fmt, n in by_count(merged_rounded))
    hint = "; apply_mode auto keeps it exact (the change runs in those layers' forward)" if apply_mode == "merge" else ""
    return (f"{sum(merged_rounded.values())} patches were merged into quantized weights ({formats}): the merge "
            f"re-rounds W+dW to the stored format, so part of the change is lost{hint}")
