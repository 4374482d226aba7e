"""Applying a parsed file to a MODEL and/or CLIP through ComfyUI's own key maps and `add_patches`.

Every module ends in exactly one of: applied, or a problem with a reason. Nothing is skipped silently, and nothing
is half-applied: every module is checked against its target weight before any patch is added.
"""

import difflib
import logging
import uuid

import comfy.utils
import torch

from ...lycoris_core import LycorisError, LycorisFile, Module, Plan
from ...lycoris_core.block_weights import BlockWeights
from ...lycoris_core.bypass import reads_weight
from ...lycoris_core.lycoris_file import option_warnings
from .adapter import LycorisAdapter
from .bypass import (
    bypassed_layers,
    contribution,
    injection,
    layer_name,
    merge_dtype,
    merge_rounds,
    narrowed_format,
    skips_forward,
    storage_format,
    wants_bypass,
)
from .coverage import (
    MAX_LISTED,
    NO_CLIP,
    NO_MODEL,
    TEXT_ENCODER_PREFIXES,
    Applied,
    ApplyReport,
    Target,
    family_verdict,
    model_family,
    nothing_applied_error,
    rounded_merge_warning,
)
from .keymap import lora_key_map, model_shapes

log = logging.getLogger("lycoris_nodes")

CONVERTED_WEIGHT = ("ComfyUI stores this parameter converted (its converter function reorders it) and converts only "
                    "a change back; this module's change reads the parameter in the file's layout: not applied")


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
    if not key.endswith(".weight") or (offset is not None and offset[0] != 0):
        return None
    return (key[: -len(".weight")] + ".bias", offset, *patch_key[2:])


NO_SUCH_WEIGHT = "no weight of this model has this name"


def _nearest(prefix: str, names: list[str]) -> str:
    """The closest module name of this model, searched among names of about the same length and start (difflib
    over a whole key map costs ~0.06 s a module, too slow for a file made for another model)."""
    pool = [n for n in names if n[:6] == prefix[:6] and abs(len(n) - len(prefix)) <= 4]
    close = difflib.get_close_matches(prefix, pool, n=1, cutoff=0.75)
    return f"; nearest name in this model: {close[0]}" if close else ""


def _add_nearest_names(report: ApplyReport, lfile: LycorisFile, key_map: dict) -> None:
    names = [k for k in key_map if isinstance(k, str)]
    listed = 0
    for i, (module_key, reason) in enumerate(report.problems):
        if reason == NO_SUCH_WEIGHT and listed < MAX_LISTED:
            report.problems[i] = (module_key, reason + _nearest(lfile.modules[module_key].prefix, names))
            listed += 1


def find_target(module: Module, key_map: dict, shapes: dict[str, dict]) -> Target | str | None:
    """Where this module goes, or the reason it goes nowhere; None for an optional part whose parameter this layer
    does not have (nothing to change)."""
    patch_key = key_map.get(module.prefix)
    if patch_key is None:
        is_text_encoder = module.prefix.startswith(TEXT_ENCODER_PREFIXES)
        if is_text_encoder and "clip" not in shapes:
            return NO_CLIP
        if not is_text_encoder and "model" not in shapes:
            return NO_MODEL
        return NO_SUCH_WEIGHT
    if module.param == "bias":
        patch_key = _bias_key(patch_key)
        if patch_key is None:
            return "bias change for a target that has no separate bias"
    key = patch_key if isinstance(patch_key, str) else patch_key[0]
    offset = None if isinstance(patch_key, str) else patch_key[1]
    for side, side_shapes in shapes.items():
        if key in side_shapes:
            return Target(side, patch_key, _narrowed(side_shapes[key], offset))
    if module.algorithm.optional:
        return None
    return f"target {key} does not exist in this model"


def reads_converted_weight(target: Target, plan: Plan) -> bool:
    """A change computed from a weight ComfyUI hands over in its own layout, where the file's is converted: ComfyUI's
    converter function maps a change, not the weight it is computed from (e.g. Flux's swapped norm_out halves)."""
    converted = not isinstance(target.patch_key, str) and len(target.patch_key) > 2 and target.patch_key[2] is not None
    return converted and (reads_weight(plan) or plan.algorithm == "peft-ia3-bias")


def _params(module: Module) -> int:
    return sum(t.numel() for t in module.tensors.values())


def build_patches(lfile: LycorisFile, key_map: dict, shapes: dict[str, dict], reference: bool
                  ) -> tuple[dict[str, dict], ApplyReport]:
    report = ApplyReport(lfile.name, len(lfile.modules))
    report.unused_keys = [(u.key, u.reason) for u in lfile.unused]
    report.warnings = list(lfile.warnings)
    patches: dict[str, dict] = {side: {} for side in shapes}
    resolved_options = []  # options assumed only once the target's shape was known (a square conv's (IA)³ side)
    for module_key, module in lfile.modules.items():
        target = find_target(module, key_map, shapes)
        if target is None:  # e.g. PEFT's (IA)³ bias part on a layer without a bias: PEFT's merge changes nothing
            report.total -= 1
            continue
        report.params_total += _params(module)
        if isinstance(target, str):
            report.problems.append((module_key, target))
            continue
        try:
            plan = module.plan_for(target.shape, reference=reference, file=lfile.name)
        except LycorisError as e:
            report.problems.append((module_key, e.reason))
            continue
        if reads_converted_weight(target, plan):
            report.problems.append((module_key, CONVERTED_WEIGHT))
            continue
        if getattr(plan.layout, "assumed", ()) != getattr(module.layout, "assumed", ()):
            resolved_options.append((module, plan.layout))
        patches[target.side][target.patch_key] = LycorisAdapter.from_module(module, plan)
        report.applied[module_key] = target.key
        report.targets[module_key] = Applied(target, plan, module)
        report.labels[plan.label] += 1
        report.params_applied += _params(module)
    report.warnings += option_warnings(lfile.name, resolved_options)
    return patches, report


def map_file(lfile: LycorisFile, model, clip, reference: bool) -> tuple[dict[str, dict], ApplyReport]:
    """Patches per side and the coverage report for this file on this model/clip (nothing is patched yet)."""
    key_map, shapes = {}, {}
    if model is not None:
        key_map.update(lora_key_map(model.model, is_clip=False))
        shapes["model"] = model_shapes(model.model)
    if clip is not None:
        key_map.update(lora_key_map(clip.cond_stage_model, is_clip=True))
        shapes["clip"] = model_shapes(clip.cond_stage_model)
    patches, report = build_patches(lfile, key_map, shapes, reference)
    report.verdict = family_verdict(lfile, report, model_family(model))
    if not report.verdict:  # for a file made for another model, nearest names would only mislead
        _add_nearest_names(report, lfile, key_map)
    return patches, report


def patcher_patches(lfile: LycorisFile, patcher, is_clip: bool, reference: bool) -> tuple[dict, ApplyReport]:
    """Patches for one ModelPatcher (a diffusion model's, or a CLIP's `.patcher`), as hooks receive them."""
    root = patcher.model
    key_map = lora_key_map(root, is_clip)
    side = "clip" if is_clip else "model"
    patches, report = build_patches(lfile, key_map, {side: model_shapes(root)}, reference)
    return patches[side], report


def by_block_weight(patches: dict, weights: BlockWeights) -> dict[float, dict]:
    """Patches grouped by their block weight; a block weighted 0 is left out, so it stays exactly as it is."""
    groups: dict[float, dict] = {}
    for patch_key, adapter in patches.items():
        key = patch_key if isinstance(patch_key, str) else patch_key[0]
        groups.setdefault(weights.weight_for(key), {})[patch_key] = adapter
    groups.pop(0.0, None)
    return groups


def apply_file(lfile: LycorisFile, model, clip, strength_model: float, strength_clip: float, reference: bool,
               block_weights: BlockWeights | None = None, apply_mode: str = "merge", injection_key: str | None = None):
    """(patched model clone, patched clip clone, report); a side stays the input object when its strength is off.

    `block_weights` multiplies each weight's strength (through add_patches' strength_patch, so every algorithm
    scales like it does with the strength); a block weight of 0 leaves that block untouched.
    `apply_mode`: "merge" patches weights; "bypass" runs Linear/Conv adapters in the layers' forward (weights
    untouched; biases and norm layers are still merged, except a change of an fp8 bias); "auto" bypasses only
    layers whose weights are not plain float or that ComfyUI would merge through a narrower copy (fp32 under 0.33's
    fp16 `lora_compute_dtype`), and such biases' changes. `injection_key` names this node's bypass injection
    (unique per node, so bypass nodes stack).
    Raises LycorisError when nothing in the file fits the model/clip given.
    """
    patches, report = map_file(lfile, model, clip, reference)
    if not report.applied:
        raise nothing_applied_error(report)
    if report.problems or report.unused_keys:
        log.warning("LyCORIS %s; not applied:\n%s", report.line(), report.details())
    else:
        log.info("LyCORIS %s", report.line())
    weights = block_weights or BlockWeights()
    key = f"lycoris:{injection_key or uuid.uuid4().hex}"
    new_model = _patched(model, patches.get("model"), strength_model, reference, report, weights, apply_mode, key)
    new_clip = _patched(clip, patches.get("clip"), strength_clip, reference, report, weights, apply_mode, key)
    source = {"file": lfile.name, "strength_model": strength_model, "strength_clip": strength_clip,
              "strength_mode": "lycoris" if reference else "linear", "apply_mode": apply_mode,
              "block_weights": block_weights_text(weights), "id": key}
    for before, after in ((model, new_model), (clip, new_clip)):
        if after is not before:
            record_source(after, source)
    if report.merged_rounded:
        report.warnings.append(rounded_merge_warning(report.merged_rounded, apply_mode))
    for warning in report.warnings:
        log.warning("LyCORIS %s", warning)
    return new_model, new_clip, report


# The files applied to a patched MODEL/CLIP, in order, as LyCORIS Save writes them into its metadata. Kept in the clone's
# model_options (a tuple replaced, never mutated: clones share the dict's values until they change them).
SOURCES = "lycoris_sources"


def block_weights_text(weights: BlockWeights) -> str:
    """Block weights as the text the Block Weights node takes (block_weights.parse reads it back)."""
    rules = [f"{'.'.join(rule.pattern)}={rule.weight:.12g}" for rule in weights.rules]
    return "; ".join(([f"default={weights.default:.12g}"] if weights.default != 1.0 else []) + rules)


def record_source(target, source: dict) -> None:
    """Append `source` to the applied files a patched clone (MODEL, or CLIP through its patcher) carries."""
    patcher = getattr(target, "patcher", target)
    options = patcher.model_options
    options[SOURCES] = (*options.get(SOURCES, ()), source)


def sources_of(target) -> tuple[dict, ...]:
    patcher = getattr(target, "patcher", target)
    return tuple(patcher.model_options.get(SOURCES, ()))


def is_off(strength: float, reference: bool) -> bool:
    # Under LyCORIS semantics DoRA keeps W + ΔW (and OFT ρ⊙W) at strength 0, so only linear mode may skip the work.
    return strength == 0 and not reference


def _weight_key(patch_key) -> str:
    return patch_key if isinstance(patch_key, str) else patch_key[0]


def patched_clone(target, patches: dict, strength: float, weights: BlockWeights | None = None,
                  apply_mode: str = "merge", key: str | None = None, file: str = "",
                  report: ApplyReport | None = None) -> tuple[object, int]:
    """(a clone of `target` (MODEL or CLIP) carrying `patches` at `strength` × block weight, patches bypassed).

    Merged patches go through add_patches; bypassed ones become one injection under `key`. A `report` gets the
    bypassed count, and how many of those are added at the weight cast instead of the forward."""
    patched = target.clone()
    patcher = getattr(patched, "patcher", patched)  # a CLIP keeps its ModelPatcher in .patcher
    refused, bypassed, merged = [], [], set()
    before = bypassed_layers(patcher)
    # merge with no bypassed file before it: nothing can be bypassed, so skip the per-layer look-up
    modules = dict(patcher.model.named_modules()) if apply_mode != "merge" or before else {}
    merged_in = merge_dtype(patcher)
    for weight, group in by_block_weight(patches, weights or BlockWeights()).items():
        to_bypass = {k for k, a in group.items() if modules
                     and wants_bypass(apply_mode, modules.get(layer_name(_weight_key(k))), k, a.plan, before,
                                      merged_in)}
        bypassed += [(_weight_key(k), contribution(group[k], k, strength * weight)) for k in group if k in to_bypass]
        to_merge = {k: a for k, a in group.items() if k not in to_bypass}
        merged.update(_weight_key(k) for k in to_merge)
        if to_merge:
            accepted = set(patched.add_patches(to_merge, strength * weight))
            refused += [k for k in to_merge if k not in accepted]
    if refused:
        # add_patches only refuses keys missing from the state dict, which find_target already ruled out.
        raise LycorisError(f"ComfyUI refused {len(refused)} patches, e.g. {refused[0]}", file=file)
    if bypassed:
        key = key or f"lycoris:{uuid.uuid4().hex}"
        patcher.set_injections(key, [injection(key, bypassed, patcher.model, modules)])
    if report is not None:
        report.bypassed += len(bypassed)
        report.at_weight_cast += sum(skips_forward(modules[layer_name(k)]) for k, _ in bypassed)
        report.bypassed_formats.update(f for f in (_bypassed_format(modules[layer_name(k)], k, merged_in)
                                                   for k, _ in bypassed) if f)
        report.merged_rounded.update(f for f in (merge_rounds(comfy.utils.get_attr(patcher.model, k)) for k in merged)
                                     if f)
    return patched, len(bypassed)


def _bypassed_format(layer: torch.nn.Module, key: str, merged_in: torch.dtype | None) -> str | None:
    """How the report names a bypassed parameter's storage: its format, or the narrower dtype ComfyUI merges in."""
    tensor = layer.bias if key.endswith(".bias") else layer.weight
    return storage_format(tensor) or narrowed_format(tensor, merged_in)


def _patched(target, patches: dict | None, strength: float, reference: bool, report: ApplyReport,
             weights: BlockWeights, apply_mode: str, key: str):
    if target is None or not patches or is_off(strength, reference):
        return target
    patched, _ = patched_clone(target, patches, strength, weights, apply_mode, key, report.file, report)
    return patched
