"""Exact everywhere (opt-in): ComfyUI's own LoRA loading applies files with this pack's maths and names.

Every LoRA loader, core's or a pack's (Load LoRA, LoraLoaderModelOnly, the hook nodes, anything built on
`comfy.sd.load_lora_for_models` or `comfy.lora.load_lora`), turns a file into patches through the same few functions,
which every caller looks up on its module at call time:

    comfy.utils.load_torch_file        the file -> a state dict
    comfy.lora.model_lora_keys_unet    the model -> {name in a file: weight key}
    comfy.lora.model_lora_keys_clip    the text encoders -> the same
    comfy.lora.load_lora               state dict + that map -> {weight key: patch}, by the adapter registry
    comfy.sd.load_bypass_lora_for_models (0.33)  the same, applied in the layers' forward

`install()` wraps each (ComfyUI's files are not touched). Switched off, the default, a wrapper calls ComfyUI's
function with the arguments it got and returns its result: nothing of ComfyUI changes. Switched on:
- a file read from a loras folder is read and checked by this pack first (cache.read), so a damaged file, a pickle or
  a NaN stops the node with the error this pack's loader gives, naming the file and key; the state dict ComfyUI
  reads is returned with the parsed file attached (`LoraStateDict`);
- the key maps get this pack's extra names (keymap.extend; ComfyUI's own entries win) and remember which model they
  were built for (`KeyMap`), which load_lora needs: a module is planned on its weight's shape, as in our loader;
- load_lora builds this pack's adapters for the whole file (apply.build_patches) and logs the coverage line where
  ComfyUI logs "lora key not loaded"; ComfyUI then adds them with add_patches as it adds its own, so a full load,
  offloading, hooks, merging and saving patch exactly as LyCORIS Loader in `merge` mode does;
- the bypass loader runs this pack's bypass (ComfyUI's needs `h`/`g` methods whose inputs cannot express DoRA, OFT
  and the other adapters that read the weight).

Not the registry (`comfy.weight_adapter.adapters`): its loop offers one name at a time, without the weight's shape
or the rest of the file, and a later adapter there replaces an earlier one's patch; ComfyUI's training nodes also
build their adapters from it, and they keep doing so, switched on or off.

The switch (`Switch`): LYCORIS_EXACT_EVERYWHERE=1/0 in the environment, read once at start-up, wins (any other value
logs one error naming the variable and counts as off: a typo must not stop ComfyUI loading its models); else the
ComfyUI setting of the same meaning, read from the default user's settings file at start-up and again when a prompt
is queued (`on_prompt`), so switching it takes effect at the next queue and loading a file reads nothing more.
"""

import functools
import json
import logging
import os
from pathlib import Path

import comfy.lora
import comfy.sd
import comfy.utils
import folder_paths

from ...lycoris_core import LycorisFile, parse_state_dict
from . import cache
from .apply import apply_file, build_patches
from .coverage import family_verdict
from .keymap import lora_key_map, model_shapes
from .patch_key import PatchKey

log = logging.getLogger("lycoris_nodes")

ENV = "LYCORIS_EXACT_EVERYWHERE"
SETTING = "LycorisNodes.ExactEverywhere"
SETTINGS_FILE = "comfy.settings.json"
ON, OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no", "")
STATE_DICT_NAME = "a LoRA state dict (no file name)"


def environment_switch(environ) -> bool | None:
    """LYCORIS_EXACT_EVERYWHERE in `environ`: on, off, or None when it is not set (the setting decides). Any other value
    logs one error naming the variable and counts as off."""
    value = environ.get(ENV)
    if value is None:
        return None
    word = value.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    log.error("LyCORIS: %s=%r is neither on (%s) nor off (0, false, off, no): exact everywhere stays off", ENV, value,
              ", ".join(ON))
    return False


def settings_path() -> Path:
    """The settings file of ComfyUI's default user (a server without --multi-user has only that one)."""
    return Path(folder_paths.get_user_directory()) / "default" / SETTINGS_FILE


def user_setting(path: Path) -> bool:
    """The setting as the file says now; a missing file is off, an unreadable one is off and logged."""
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        log.warning("LyCORIS: cannot read %s (%s): '%s' taken as off", path, e, SETTING)
        return False
    return isinstance(settings, dict) and settings.get(SETTING) is True


class Switch:
    """Whether exact everywhere is on: the environment as start-up found it, else the setting as last read."""

    def __init__(self, environment: bool | None, settings_file: Path):
        self.environment, self.settings_file = environment, settings_file
        self.setting = False
        self.reread()

    def reread(self) -> None:
        """Read the setting again (at start-up and when a prompt is queued); the environment, when set, wins."""
        if self.environment is None:
            self.setting = user_setting(self.settings_file)

    @property
    def on(self) -> bool:
        return self.environment if self.environment is not None else self.setting


SWITCH: Switch | None = None  # made by install(), at start-up


def enabled() -> bool:
    return SWITCH is not None and SWITCH.on


def on_prompt(json_data: dict) -> dict:
    """ComfyUI's on-prompt hook (a prompt was queued): the setting may have been switched since the last queue."""
    if SWITCH is not None:
        SWITCH.reread()
    return json_data


class LoraStateDict(dict):
    """A state dict ComfyUI read from a loras folder, with this pack's parsed and checked copy of the file."""

    lycoris_file: LycorisFile


class KeyMap(dict):
    """A LoRA key map as ComfyUI's functions return it, plus the modules it maps into: {"model"|"clip": module}."""

    sides: dict


def in_loras_folder(path) -> bool:
    """The path names a file in a loras folder, as given (a file there may be a link to elsewhere) or resolved (the
    folder itself may be reached through a link)."""
    for resolve in (os.path.abspath, os.path.realpath):
        file = os.path.normcase(resolve(path))
        if any(_inside(file, os.path.normcase(resolve(folder))) for folder in folder_paths.get_folder_paths("loras")):
            return True
    return False


def _inside(file: str, root: str) -> bool:
    try:
        return os.path.commonpath([file, root]) == root
    except ValueError:  # on another drive (Windows)
        return False


def parsed(lora) -> LycorisFile:
    """The file behind a state dict: attached when the dict came from a loras folder, else parsed and checked here
    (a pack's own dict, ComfyUI's converted special formats, a trained LoRA handed over in memory)."""
    attached = getattr(lora, "lycoris_file", None)
    return attached if attached is not None else parse_state_dict(lora, STATE_DICT_NAME)


def wrap_load_torch_file(original):
    @functools.wraps(original)
    def load_torch_file(ckpt, *args, **kwargs):
        if not (in_loras_folder(ckpt) and enabled()):  # every file ComfyUI loads passes here: the folder first
            return original(ckpt, *args, **kwargs)
        lfile = cache.read(ckpt)  # the pack's checks and named errors, before ComfyUI reads anything
        result = original(ckpt, *args, **kwargs)
        state_dict, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, None)
        attached = LoraStateDict(state_dict)
        attached.lycoris_file = lfile
        return attached if rest is None else (attached, *rest)
    return load_torch_file


def wrap_key_map(original, side: str):
    is_clip = side == "clip"

    @functools.wraps(original)
    def model_lora_keys(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        if not enabled():
            return result
        extended = KeyMap(result)
        extended.sides = {**getattr(result, "sides", {}), side: model}
        for name, key in lora_key_map(model, is_clip).items():
            extended.setdefault(name, key)
        return extended
    return model_lora_keys


def wrap_load_lora(original):
    @functools.wraps(original)
    def load_lora(lora, to_load, *args, **kwargs):
        if not (isinstance(to_load, KeyMap) and enabled()):
            return original(lora, to_load, *args, **kwargs)
        log_missing = args[0] if args else kwargs.get("log_missing", True)
        lfile = parsed(lora)
        shapes = {side: model_shapes(module) for side, module in to_load.sides.items()}
        patches, report = build_patches(lfile, dict(to_load), shapes, reference=False)
        if not report.applied:  # a warning, as in ComfyUI (LyCORIS Loader refuses such a file)
            config = getattr(to_load.sides.get("model"), "model_config", None)
            report.verdict = family_verdict(lfile, report, type(config).__name__ if config is not None else None)
        loaded = {key: adapter for side in patches.values() for key, adapter in side.items()}
        loaded.update(registry_patches(original, lora, to_load, report, loaded))
        if (report.problems or report.unused_keys) and log_missing:
            log.warning("LyCORIS (everywhere) %s; not applied:\n%s", report.line(), report.details())
        else:
            log.info("LyCORIS (everywhere) %s", report.line())
        for warning in report.warnings:
            log.warning("LyCORIS %s", warning)
        return loaded
    return load_lora


def registry_patches(original, lora, to_load: KeyMap, report, ours: dict) -> dict:
    """What ComfyUI's adapter registry makes of the keys this pack does not read (another pack's registered
    algorithm): its patches for weights this pack leaves alone. The keys it took leave the report's not-applied
    list."""
    leftover = {key: lora[key] for key, _ in report.unused_keys if key in lora}
    if not leftover:
        return {}
    found = {key: patch for key, patch in original(leftover, to_load, False).items() if key not in ours}
    taken = set()
    for patch in found.values():
        taken |= set(getattr(patch, "loaded_keys", ()))  # an adapter says; ("diff"/"set", …) tuples do not:
    for key in leftover:  # a key of a module whose weight (or bias) got one of them
        target = to_load.get(key.rsplit(".", 1)[0])
        whole = target is not None and PatchKey.from_comfy(target).is_whole
        if whole and {target, target.removesuffix(".weight") + ".bias"} & set(found):
            taken.add(key)
    if found:
        log.info("LyCORIS (everywhere) %s: %d patches from ComfyUI's own adapters for keys this pack does not "
                 "read (e.g. '%s')", report.file, len(found), next(iter(sorted(taken) or leftover)))
    report.unused_keys = [(key, reason) for key, reason in report.unused_keys if key not in taken]
    return found


def wrap_load_bypass(original):
    @functools.wraps(original)
    def load_bypass_lora_for_models(model, clip, lora, strength_model, strength_clip, *args, **kwargs):
        if not enabled():
            return original(model, clip, lora, strength_model, strength_clip, *args, **kwargs)
        new_model, new_clip, _ = apply_file(parsed(lora), model, clip, strength_model, strength_clip,
                                            reference=False, apply_mode="bypass")
        return new_model, new_clip
    return load_bypass_lora_for_models


# (module, attribute, wrapper factory); an attribute this ComfyUI lacks (0.3.75 has no bypass loader) is skipped
WRAPPED = (
    (comfy.utils, "load_torch_file", wrap_load_torch_file),
    (comfy.lora, "model_lora_keys_unet", lambda f: wrap_key_map(f, "model")),
    (comfy.lora, "model_lora_keys_clip", lambda f: wrap_key_map(f, "clip")),
    (comfy.lora, "load_lora", wrap_load_lora),
    (comfy.sd, "load_bypass_lora_for_models", wrap_load_bypass),
)
INSTALLED = "__lycoris_everywhere__"


def install() -> None:
    """Read the switch, and wrap ComfyUI's functions once per process (a reimported pack finds its wrappers in
    place)."""
    global SWITCH
    SWITCH = Switch(environment_switch(os.environ), settings_path())
    for module, name, wrap in WRAPPED:
        original = getattr(module, name, None)
        if original is None or getattr(original, INSTALLED, False):
            continue
        wrapper = wrap(original)
        setattr(wrapper, INSTALLED, True)
        setattr(module, name, wrapper)


def uninstall() -> None:
    """Put ComfyUI's functions back (tests compare with a ComfyUI that never had the pack)."""
    for module, name, _ in WRAPPED:
        current = getattr(module, name, None)
        while current is not None and getattr(current, INSTALLED, False):
            current = current.__wrapped__
            setattr(module, name, current)
