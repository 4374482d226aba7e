"""The PEFT configuration of a PEFT/diffusers adapter file, and the options it gives each module.

PEFT state dicts carry no alpha: the scale lives in the adapter's config (`LoraConfig.to_dict()`), which is kept
* by diffusers in the safetensors metadata field `lora_adapter_metadata` (JSON). A model's own `save_lora_adapter`
  writes the config as is; a pipeline's `save_lora_weights` flattens one config per component into one dict, its keys
  prefixed with the component (`unet.r`, `text_encoder.lora_alpha`), as the component prefixes the tensor keys;
* by PEFT's `save_pretrained` in an `adapter_config.json` beside the weights.

`rank_pattern`/`alpha_pattern` override `r` and the alpha per module: PEFT takes the first pattern key (in the
config's order) that, as a regular expression, matches the module's name in the model either whole or after a `.`,
and falls back to `r`/alpha when none does. The name PEFT matched is the module's path in the model it wrapped, so
the file's component prefix and a PeftModel's `base_model.model.` are removed before matching.
"""

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import LycorisError

METADATA_KEY = "lora_adapter_metadata"
CONFIG_FILE = "adapter_config.json"
PEFT_MODEL_PREFIX = "base_model.model."
# LoRA calls its alpha `lora_alpha`, LoHa and LoKr call it `alpha`.
ALPHA_KEYS = ("lora_alpha", "alpha")
PATTERN_KEYS = ("rank_pattern", "alpha_pattern")


@dataclass(frozen=True)
class PeftConfig:
    source: str  # where it was read, for messages: "lora_adapter_metadata" or the adapter_config.json path
    components: dict[str, dict[str, Any]]  # component prefix ("" when unprefixed) -> that component's config


_MAX_CONFIG_CHARS = 16 * 1024 * 1024  # PEFT writes a few kB; a file this big is not a config


def _parse_json(text: str, source: str) -> dict[str, Any]:
    """The config object; LycorisError with `source` as the key (the caller knows the file)."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError) as e:  # bad JSON, nested past the recursion limit, a 5000-digit number
        raise LycorisError(f"the PEFT config is not valid JSON ({type(e).__name__}: {e})", key=source) from e
    if not isinstance(parsed, dict):
        raise LycorisError("the PEFT config is not a JSON object", key=source)
    return parsed


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_pattern_table(value, check) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict):
        return False
    for pattern, entry in value.items():
        try:
            re.compile(pattern)
        except re.error:
            return False
        if not check(entry):
            return False
    return True


# What the options the pack reads must be, as PEFT writes them (None: PEFT's own "not set").
_OPTION_CHECKS = {
    "r": lambda v: _is_number(v) and v >= 0,  # OFT with oft_block_size writes r = 0
    "lora_alpha": lambda v: v is None or _is_number(v),
    "alpha": lambda v: v is None or _is_number(v),
    "use_rslora": lambda v: v is None or isinstance(v, bool),
    "rank_pattern": lambda v: _is_pattern_table(v, lambda r: _is_number(r) and r >= 0),
    "alpha_pattern": lambda v: _is_pattern_table(v, _is_number),
    "feedforward_modules": lambda v: v is None or isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(name, str) for name in v)),
    "peft_version": lambda v: v is None or isinstance(v, str),
    "use_cayley_neumann": lambda v: v is None or isinstance(v, bool),
    "num_cayley_neumann_terms": lambda v: v is None or (_is_number(v) and v == int(v) and 0 <= v <= 100),
    "coft": lambda v: v is None or isinstance(v, bool),
    "eps": lambda v: v is None or _is_number(v),
}


def _checked(components: dict[str, dict[str, Any]], source: str) -> dict[str, dict[str, Any]]:
    """Refuse, at load, a config whose values the scale or an algorithm would choke on when a patch is built."""
    for component, config in components.items():
        if not isinstance(config, dict):
            raise LycorisError(f"the PEFT config of '{component}' is not an object", key=source)
        for option, check in _OPTION_CHECKS.items():
            if option in config and not check(config[option]):
                name = f"{component}.{option}" if component else option
                raise LycorisError(f"the PEFT config's '{name}' is not what PEFT writes there (a number, flag, "
                                   f"name list or table of valid regular expressions)", key=source)
    return components


def _split_components(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A pipeline's flattened dict (`unet.r`, `unet.lora_alpha`…) -> one config per component. A config whose keys
    carry no component (a model's own save, or adapter_config.json) is the component ""."""
    if "r" in flat or "peft_type" in flat:
        return {"": flat}
    components: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        component, _, option = key.rpartition(".")
        components.setdefault(component, {})[option] = value
    return components


def from_metadata(metadata: Mapping[str, str], source: str = METADATA_KEY) -> PeftConfig | None:
    """The config diffusers stored in the safetensors metadata, or None when there is none."""
    text = metadata.get(METADATA_KEY)
    if not text:
        return None
    return PeftConfig(source, _checked(_split_components(_parse_json(text, source)), source))


def from_sibling(path: str | os.PathLike) -> PeftConfig | None:
    """The adapter_config.json PEFT's save_pretrained writes beside the weights, or None when there is none."""
    config_path = os.path.join(os.path.dirname(os.fspath(path)), CONFIG_FILE)
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            text = f.read(_MAX_CONFIG_CHARS + 1)
    except (OSError, UnicodeDecodeError) as e:  # its text would quote the byte: name the problem only
        raise LycorisError(f"cannot read the PEFT config ({type(e).__name__})", key=CONFIG_FILE) from e
    if len(text) > _MAX_CONFIG_CHARS:
        raise LycorisError(f"the PEFT config is larger than {_MAX_CONFIG_CHARS} characters", key=CONFIG_FILE)
    return PeftConfig(config_path, _checked({"": _parse_json(text, CONFIG_FILE)}, CONFIG_FILE))


def read_config(path: str | os.PathLike | None, metadata: Mapping[str, str]) -> PeftConfig | None:
    """The metadata's config first (it travels with the file), else adapter_config.json beside `path`. A config
    that cannot be read is a LycorisError naming the file and where the config is."""
    try:
        found = from_metadata(metadata)
        if found is None and path is not None:
            found = from_sibling(path)
    except LycorisError as e:
        if path is None:
            raise
        raise e.located(file=os.path.basename(os.fspath(path))) from e
    return found


def _component_of(config: PeftConfig, module_prefix: str) -> tuple[dict[str, Any], str] | None:
    """The component config that covers this module and the module's name inside that component."""
    for component in sorted(config.components, key=len, reverse=True):  # longest first: text_encoder_2 vs …
        if component == "":
            return config.components[""], module_prefix
        if module_prefix.startswith(component + "."):
            return config.components[component], module_prefix[len(component) + 1:]
    return None


def pattern_value(patterns: Mapping[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's rule: the first pattern key matching the module's full name or a dot-separated tail of it."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return patterns[pattern]
    return default


def module_name(config: PeftConfig | None, module_prefix: str) -> str:
    """The module's name in the model PEFT wrapped (what its patterns and feedforward_modules were matched against):
    the file's key prefix without its component and without a PeftModel's `base_model.model.`."""
    found = _component_of(config, module_prefix) if config is not None else None
    name = found[1] if found is not None else module_prefix
    return name.removeprefix(PEFT_MODEL_PREFIX)


def module_options(config: PeftConfig | None, module_prefix: str) -> dict[str, Any]:
    """The module's PEFT options: its component's config with `r` and the alpha resolved through rank_pattern and
    alpha_pattern (the patterns themselves left out). `module_prefix` is the key prefix in the file. Empty when no
    config covers the module."""
    found = _component_of(config, module_prefix) if config is not None else None
    if found is None:
        return {}
    raw, name = found[0], module_name(config, module_prefix)
    options = {k: v for k, v in raw.items() if k not in PATTERN_KEYS}
    if "r" in raw:
        options["r"] = pattern_value(raw.get("rank_pattern") or {}, name, raw["r"])
    for key in ALPHA_KEYS:
        if key in raw:
            options[key] = pattern_value(raw.get("alpha_pattern") or {}, name, raw[key])
    return options
