"""Applying a parsed file to a MODEL and/or CLIP through ComfyUI's own key maps and `add_patches`.

Every module ends in exactly one of: applied, or a problem with a reason. Nothing is skipped silently, and nothing
is half-applied: every module is checked against its target weight before any patch is added.
"""

import difflib
import itertools
import logging
import uuid
from dataclasses import replace

import comfy.utils
import torch
from comfy.patcher_extension import WrappersMP

from ...lycoris_core import LycorisError, LycorisFile, Module, Plan
from ...lycoris_core.block_weights import BlockWeights
from ...lycoris_core.lycoris_file import option_warnings
from .adapter import LycorisAdapter
from .bypass import bypassed_layers, contribution, forward_check, injection, layer_name, patch_route
from .coverage import (
    MAX_LISTED,
    NO_CLIP,
    NO_MODEL,
    NOT_CONNECTED,
    TEXT_ENCODER_PREFIXES,
    Applied,
    ApplyReport,
    Target,
    by_design,
    family_verdict,
    model_family,
    nothing_applied_error,
    rounded_merge_warning,
)
from .keymap import TRAINED_ON_UNKNOWN, fused_parts, lora_key_map, model_shapes, row_order_target, row_runs
from .object_params import changed_parameter, is_skipped_by_load
from .patch_key import Offset, PatchKey
from .weight_format import merge_dtype, merge_rounds, narrowed_format, skips_forward, storage_format

log = logging.getLogger("lycoris_nodes")

CONVERTED_WEIGHT = ("ComfyUI stores this parameter converted (its converter function reorders it) and converts only "
                    "a change back; this module's change reads the parameter in the file's layout: not applied")


NO_SUCH_WEIGHT = "no weight of this model has this name"


def _mapped(key_map: dict, name: str) -> PatchKey | None:
    """The key map's target for `name` (ComfyUI's form, read once here), or None."""
    target = key_map.get(name)
    return None if target is None else PatchKey.from_comfy(target)


def _parameter_key(module: Module, key_map: dict) -> PatchKey | None:
    """A part that patches another parameter of its module (LightX2V's `diff_m`: `modulation`) goes to that
    parameter's own key-map entry: ComfyUI maps every diffusion-model parameter that is not a `.weight` to itself
    (comfy/lora.py `model_lora_keys_unet`, "generic lora format for not .weight"). A whole parameter only."""
    key = _mapped(key_map, f"{module.prefix}.{module.param}")
    return key if key is not None and key.is_whole and not key.weight.endswith(".weight") else None


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


def find_target(module: Module, key_map: dict, shapes: dict[str, dict], trained_on: str = TRAINED_ON_UNKNOWN
                ) -> Target | list[Target] | str | None:
    """Where this module goes (the runs of a weight's rows it holds in another order, keymap.row_runs, as one
    target each, in the file's row order), or the reason it goes nowhere; None for an optional part whose
    parameter this layer does not have (nothing to change)."""
    patch_key = _mapped(key_map, module.prefix) if module.param in ("weight", "bias") else _parameter_key(module, key_map)
    if patch_key is None:
        is_text_encoder = module.prefix.startswith(TEXT_ENCODER_PREFIXES)
        if is_text_encoder and "clip" not in shapes:
            return NO_CLIP
        if not is_text_encoder and "model" not in shapes:
            return NO_MODEL
        return NO_SUCH_WEIGHT
    if module.param == "bias":
        patch_key = patch_key.bias_twin()
        if patch_key is None:
            return "bias change for a target that has no separate bias"
    patch_key, unplaced = row_order_target(patch_key, module.adapter_named, trained_on, shapes.get("model", {}))
    if unplaced is not None:
        return unplaced
    key = patch_key.weight
    for side, side_shapes in shapes.items():
        if key in side_shapes:
            runs = row_runs(patch_key, side_shapes[key][0]) if side_shapes[key] else None
            if runs is not None:
                parts = [PatchKey(key, Offset(0, start, count)) for start, count in runs]
                return [Target(side, part, part.narrowed(side_shapes[key])) for part in parts]
            return Target(side, patch_key, patch_key.narrowed(side_shapes[key]))
    if module.algorithm.optional:
        return None
    return f"target {key} does not exist in this model"


def reads_converted_weight(target: Target, plan: Plan) -> bool:
    """A change computed from a parameter ComfyUI hands over in its own layout, where the file's is converted:
    ComfyUI's converter function maps a change, not the weight (or bias) it is computed from (e.g. Flux's swapped
    norm_out halves). Plan.reads_param: the change reads the parameter it patches (PEFT's (IA)³ bias part reads the
    bias)."""
    return target.patch_key.is_converted and plan.reads_param


SUPERSEDED = ("the file's fused module {fused} covers this weight: diffusers keeps the unfused projection beside the "
              "fused one after fuse_qkv_projections, and the trained forward runs only the fused one")


def superseded_parts(lfile: LycorisFile, key_map: dict) -> dict[str, str]:
    """Unfused projection name -> the fused module of the same file that replaces it in the trained forward."""
    return {part: module.prefix for module in lfile.modules.values()
            for part in fused_parts(module.prefix, key_map) or ()}


def split_targets(module: Module, parts: tuple[str, ...], key_map: dict, shapes: dict[str, dict]
                  ) -> Target | list[Target] | str | None:
    """Where a fused module's rows go: one target when its projections are consecutive rows of one weight (Flux's
    qkv), else one target per projection, in row order; or the reason they go nowhere."""
    targets = []
    for name in parts:
        target = find_target(replace(module, prefix=name), key_map, shapes)
        if isinstance(target, list):
            return f"its projection {name} is stored with its rows in another order"
        if not isinstance(target, Target):
            return target if target is None else f"its projection {name}: {target}"
        if target.patch_key.is_converted:
            return f"its projection {name} is stored converted by ComfyUI"  # a converter maps whole changes only
        targets.append(target)
    inputs = {(t.side, t.shape[1:]) for t in targets}
    if len(inputs) != 1:
        return "its projections' weights take inputs of different sizes: " + ", ".join(
            f"{name} {list(t.shape)}" for name, t in zip(parts, targets))
    return _consecutive(targets, shapes) or targets


def _consecutive(targets: list[Target], shapes: dict[str, dict]) -> Target | None:
    """The one target the parts make up when they are consecutive row slices of one weight (the whole weight, or
    its rows from the first part's on), else None."""
    key, offsets = targets[0].key, [t.offset for t in targets]
    if (any(t.key != key for t in targets) or None in offsets
            or any(a.end != b.start for a, b in itertools.pairwise(offsets))):
        return None
    start, rows = offsets[0].start, sum(o.length for o in offsets)
    whole = rows == shapes[targets[0].side][key][0]
    joined = PatchKey(key) if whole else PatchKey(key, Offset(0, start, rows))
    return Target(targets[0].side, joined, (rows, *targets[0].shape[1:]))


def split_modules(module: Module, targets: list[Target], reference: bool, file: str
                  ) -> list[tuple[Target, Module, Plan]]:
    """The fused module checked against the weight its projections' rows make up (rows sum to its out dim), then
    one module per projection: its rows of the fused change (Module.rows), planned for that projection's weight."""
    fused = (sum(t.shape[0] for t in targets), *targets[0].shape[1:])
    try:
        module.plan_for(fused, reference=reference, file=file)
    except LycorisError as e:
        sizes = " + ".join(str(t.shape[0]) for t in targets)
        raise LycorisError(f"{e.reason} (this model's projections: {sizes} rows)", file=file, key=e.key) from e
    split, start = [], 0
    for target in targets:
        part = module.rows(start, target.shape[0], fused, file=file)
        split.append((target, part, part.plan_for(target.shape, reference=reference, file=file)))
        start += target.shape[0]
    return split


def _add_split(report: ApplyReport, patches: dict, module_key: str, module: Module, targets: list[Target],
               reference: bool) -> None:
    """One fused module applied to several weights: one patch per weight, counted once in the report."""
    try:
        split = split_modules(module, targets, reference, report.file)
    except LycorisError as e:
        report.problems.append((module_key, e.reason))
        return
    keys = [t.key for t in targets]
    for target, part, plan in split:
        patches[target.side][target.patch_key.as_comfy()] = LycorisAdapter.from_module(part, plan)
        rows = "" if keys.count(target.key) == 1 else f" rows {target.offset.start}-{target.offset.end}"
        report.targets[f"{module_key}[{target.key}{rows}]"] = Applied(target, plan, part)
    report.applied[module_key] = " + ".join(dict.fromkeys(t.key for t in targets))  # a weight's runs: once
    report.labels[split[0][2].label] += 1
    report.params_applied += _params(module)


def _params(module: Module) -> int:
    return sum(t.numel() for t in module.tensors.values())


def _report_miss(report: ApplyReport, module_key: str, module: Module, reason: str, shapes: dict[str, dict]) -> None:
    """A module with no target: harmless when a side is not connected or the model lacks it by design (a rule of
    coverage.BY_DESIGN holds on the weights of the side it is for), a failure otherwise."""
    if reason in NOT_CONNECTED:
        report.harmless.append((module_key, reason))
        report.harmless_what[NOT_CONNECTED[reason]] += 1
        return
    missing = reason == NO_SUCH_WEIGHT or reason.startswith("target ")
    rule = by_design(module, shapes) if missing else None
    if rule is None:
        report.problems.append((module_key, reason))
        return
    report.harmless.append((module_key, rule.reason))
    report.harmless_what[rule.what] += 1


def build_patches(lfile: LycorisFile, key_map: dict, shapes: dict[str, dict], reference: bool,
                  trained_on: str = TRAINED_ON_UNKNOWN) -> tuple[dict[str, dict], ApplyReport]:
    report = ApplyReport(lfile.name, len(lfile.modules))
    report.unused_keys = [(u.key, u.reason) for u in lfile.unused]
    report.warnings = list(lfile.warnings)
    report.notes = list(lfile.notes)
    patches: dict[str, dict] = {side: {} for side in shapes}
    resolved_options = []  # options assumed only once the target's shape was known (a square conv's (IA)³ side)
    superseded = superseded_parts(lfile, key_map)
    for module_key, module in lfile.modules.items():
        if module.prefix in superseded:
            report.total -= 1
            report.unused_keys.append((module_key, SUPERSEDED.format(fused=superseded[module.prefix])))
            continue
        parts = fused_parts(module.prefix, key_map)
        if parts is None:
            target = find_target(module, key_map, shapes, trained_on)
        else:
            target = split_targets(module, parts, key_map, shapes)
        if target is None:  # e.g. PEFT's (IA)³ bias part on a layer without a bias: PEFT's merge changes nothing
            report.total -= 1
            continue
        report.params_total += _params(module)
        if isinstance(target, str):
            _report_miss(report, module_key, module, target, shapes)
            continue
        if isinstance(target, list):
            _add_split(report, patches, module_key, module, target, reference)
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
        patches[target.side][target.patch_key.as_comfy()] = LycorisAdapter.from_module(module, plan)
        report.applied[module_key] = target.key
        report.targets[module_key] = Applied(target, plan, module)
        report.labels[plan.label] += 1
        report.params_applied += _params(module)
    report.warnings += option_warnings(lfile.name, resolved_options)
    return patches, report


def map_file(lfile: LycorisFile, model, clip, reference: bool, trained_on: str = TRAINED_ON_UNKNOWN
             ) -> tuple[dict[str, dict], ApplyReport]:
    """Patches per side and the coverage report for this file on this model/clip (nothing is patched yet);
    `trained_on` answers keymap.ROW_ORDER_UNKNOWN's question for the modules that ask it."""
    key_map, shapes = {}, {}
    if model is not None:
        key_map.update(lora_key_map(model.model, is_clip=False))
        shapes["model"] = model_shapes(model.model)
    if clip is not None:
        key_map.update(lora_key_map(clip.cond_stage_model, is_clip=True))
        shapes["clip"] = model_shapes(clip.cond_stage_model)
    patches, report = build_patches(lfile, key_map, shapes, reference, trained_on)
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
    for comfy_key, adapter in patches.items():
        groups.setdefault(weights.weight_for(PatchKey.from_comfy(comfy_key).weight), {})[comfy_key] = adapter
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
    for note in report.notes:
        log.info("LyCORIS %s", note)
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


def patched_clone(target, patches: dict, strength: float, weights: BlockWeights | None = None,
                  apply_mode: str = "merge", key: str | None = None, file: str = "",
                  report: ApplyReport | None = None) -> tuple[object, int]:
    """(a clone of `target` (MODEL or CLIP) carrying `patches` at `strength` × block weight, patches bypassed).

    Merged patches go through add_patches; bypassed ones become one injection under `key`. A `report` gets the
    bypassed count, and how many of those are added at the weight cast instead of the forward."""
    patched = target.clone()
    patcher = getattr(patched, "patcher", patched)  # a CLIP keeps its ModelPatcher in .patcher
    refused, bypassed, merged, any_replaced = [], [], set(), False
    before = bypassed_layers(patcher)
    # merge with no bypassed file before it: nothing can be bypassed, so skip the per-layer look-up
    modules = dict(patcher.model.named_modules()) if apply_mode != "merge" or before else {}
    merged_in = merge_dtype(patcher)
    for weight, group in by_block_weight(patches, weights or BlockWeights()).items():
        keys = {k: PatchKey.from_comfy(k) for k in group}  # group stays keyed as ComfyUI takes it
        to_bypass = {k for k, a in group.items() if modules
                     and patch_route(apply_mode, modules.get(layer_name(keys[k].weight)), keys[k], a.plan, before,
                                     merged_in).bypassed}
        bypassed += [(keys[k].weight, contribution(group[k], keys[k], strength * weight)) for k in group
                     if k in to_bypass]
        to_merge = {k: a for k, a in group.items() if k not in to_bypass}
        replaced = {k: a for k, a in to_merge.items()
                    if keys[k].is_whole and is_skipped_by_load(patcher.model, keys[k].weight)}
        for k, adapter in replaced.items():  # ComfyUI's loading would never patch these (object_params.py)
            patcher.add_object_patch(keys[k].weight, changed_parameter(patcher, keys[k].weight, adapter,
                                                                       strength * weight))
        to_merge = {k: a for k, a in to_merge.items() if k not in replaced}
        any_replaced = any_replaced or bool(replaced)
        merged.update(keys[k].weight for k in to_merge)
        if to_merge:
            accepted = set(patched.add_patches(to_merge, strength * weight))
            refused += [k for k in to_merge if k not in accepted]
    if any_replaced:  # a new weight set, as ComfyUI's own object-patching set_model_compute_dtype marks it
        patcher.patches_uuid = uuid.uuid4()
    if refused:
        # add_patches only refuses keys missing from the state dict, which find_target already ruled out.
        raise LycorisError(f"ComfyUI refused {len(refused)} patches, e.g. {refused[0]}", file=file)
    if bypassed:
        key = key or f"lycoris:{uuid.uuid4().hex}"
        installed = injection(key, bypassed, patcher.model, modules)
        patcher.set_injections(key, [installed])
        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, key, installed.lycoris_prepare)  # forms reading W, ahead
        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, key, forward_check(installed, file))  # or stop the run
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
