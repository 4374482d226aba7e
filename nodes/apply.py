"""Applying a parsed file to a MODEL and/or CLIP through ComfyUI's own key maps and `add_patches`.

Every module ends in exactly one of: applied, or a problem with a reason. Nothing is skipped silently, and nothing
is half-applied: every module is checked against its target weight before any patch is added.
"""

import logging
from collections import Counter
from dataclasses import dataclass, field

import comfy.lora

from ..lycoris_core import LycorisError, LycorisFile, Module
from .adapter import LycorisAdapter

log = logging.getLogger("lycoris_nodes")

# Prefixes trainers use for text-encoder modules: explains a miss when no CLIP is connected.
TEXT_ENCODER_PREFIXES = ("lora_te", "lora_prior_te", "text_encoder", "text_encoders.", "te_", "te1_", "te2_")
MAX_LISTED = 20


@dataclass(frozen=True)
class Target:
    side: str  # "model" or "clip"
    patch_key: object  # what add_patches takes: "key" or (key, offset[, function])
    shape: tuple[int, ...]


@dataclass
class ApplyReport:
    file: str
    total: int
    applied: dict[str, str] = field(default_factory=dict)  # module key -> model key
    labels: Counter = field(default_factory=Counter)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (module key, reason)
    unused_keys: list[tuple[str, str]] = field(default_factory=list)

    def line(self) -> str:
        algos = ", ".join(f"{label} {n}" for label, n in self.labels.most_common())
        return f"{self.file}: {len(self.applied)}/{self.total} modules applied" + (f" ({algos})" if algos else "")

    def details(self) -> str:
        rows = [f"  {key}: {reason}" for key, reason in self.problems + self.unused_keys]
        more = f"\n  … and {len(rows) - MAX_LISTED} more" if len(rows) > MAX_LISTED else ""
        return "\n".join(rows[:MAX_LISTED]) + more


def _narrowed(shape: tuple[int, ...], offset) -> tuple[int, ...]:
    if offset is None:
        return shape
    dim, _start, length = offset
    return shape[:dim] + (length,) + shape[dim + 1:]


def _bias_key(patch_key):
    """The bias twin of a weight target (diff_b / b_norm modules)."""
    if isinstance(patch_key, str):
        return patch_key[: -len(".weight")] + ".bias" if patch_key.endswith(".weight") else None
    key, offset = patch_key[0], patch_key[1]
    if not key.endswith(".weight") or offset[0] != 0:
        return None
    return (key[: -len(".weight")] + ".bias", offset, *patch_key[2:])


def find_target(module: Module, key_map: dict, shapes: dict[str, dict]) -> Target | str:
    """Where this module goes, or the reason it goes nowhere."""
    patch_key = key_map.get(module.prefix)
    if patch_key is None:
        if module.prefix.startswith(TEXT_ENCODER_PREFIXES) and "clip" not in shapes:
            return "text-encoder module, but no CLIP is connected"
        return "no weight of this model has this name"
    if module.param == "bias":
        patch_key = _bias_key(patch_key)
        if patch_key is None:
            return "bias change for a target that has no separate bias"
    key = patch_key if isinstance(patch_key, str) else patch_key[0]
    offset = None if isinstance(patch_key, str) else patch_key[1]
    for side, side_shapes in shapes.items():
        if key in side_shapes:
            return Target(side, patch_key, _narrowed(side_shapes[key], offset))
    return f"target {key} does not exist in this model"


def build_patches(lfile: LycorisFile, key_map: dict, shapes: dict[str, dict], reference: bool
                  ) -> tuple[dict[str, dict], ApplyReport]:
    report = ApplyReport(lfile.name, len(lfile.modules))
    report.unused_keys = [(u.key, u.reason) for u in lfile.unused]
    patches: dict[str, dict] = {side: {} for side in shapes}
    for module_key, module in lfile.modules.items():
        target = find_target(module, key_map, shapes)
        if isinstance(target, str):
            report.problems.append((module_key, target))
            continue
        try:
            plan = module.plan_for(target.shape, reference=reference, file=lfile.name)
        except LycorisError as e:
            report.problems.append((module_key, e.reason))
            continue
        patches[target.side][target.patch_key] = LycorisAdapter.from_module(module, plan)
        report.applied[module_key] = target.patch_key if isinstance(target.patch_key, str) else target.patch_key[0]
        report.labels[plan.label] += 1
    return patches, report


def nothing_applied_error(lfile: LycorisFile, report: ApplyReport, model_name: str) -> LycorisError:
    declared = lfile.metadata.get("ss_base_model_version") or lfile.metadata.get("modelspec.architecture")
    hint = f" The file says it is for '{declared}'." if declared else ""
    examples = ", ".join(key for key, _ in report.problems[:3])
    reasons = Counter(reason.split(":")[0] for _, reason in report.problems).most_common(1)
    return LycorisError(
        f"none of its {report.total} modules fit this {model_name} model (most common reason: "
        f"{reasons[0][0] if reasons else 'none'}); is it made for another base model?{hint} "
        f"Examples: {examples}", file=lfile.name)


def model_shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def apply_file(lfile: LycorisFile, model, clip, strength_model: float, strength_clip: float, reference: bool):
    """(patched model clone or None, patched clip clone or None, report). Raises LycorisError when nothing fits."""
    key_map, shapes = {}, {}
    if model is not None:
        key_map = comfy.lora.model_lora_keys_unet(model.model, key_map)
        shapes["model"] = model_shapes(model.model)
    if clip is not None:
        key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
        shapes["clip"] = model_shapes(clip.cond_stage_model)
    patches, report = build_patches(lfile, key_map, shapes, reference)
    if not report.applied:
        name = type(model.model).__name__ if model is not None else "text encoder"
        raise nothing_applied_error(lfile, report, name)
    if report.problems or report.unused_keys:
        log.warning("LyCORIS %s; not applied:\n%s", report.line(), report.details())
    else:
        log.info("LyCORIS %s", report.line())
    new_model = _patched(model, patches.get("model"), strength_model, report)
    new_clip = _patched(clip, patches.get("clip"), strength_clip, report)
    return new_model, new_clip, report


def _patched(target, patches: dict | None, strength: float, report: ApplyReport):
    if target is None or not patches:
        return target
    patched = target.clone()
    accepted = set(patched.add_patches(patches, strength))
    refused = [k for k in patches if k not in accepted]
    if refused:
        # add_patches only refuses keys missing from the state dict, which find_target already ruled out.
        raise LycorisError(f"ComfyUI refused {len(refused)} patches, e.g. {refused[0]}", file=report.file)
    return patched
