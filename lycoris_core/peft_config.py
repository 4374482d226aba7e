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


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise LycorisError(f"the PEFT config is not valid JSON ({e})", file=source) from e
    if not isinstance(parsed, dict):
        raise LycorisError("the PEFT config is not a JSON object", file=source)
    return parsed


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
    return PeftConfig(source, _split_components(_parse_json(text, source)))


def from_sibling(path: str | os.PathLike) -> PeftConfig | None:
    """The adapter_config.json PEFT's save_pretrained writes beside the weights, or None when there is none."""
    config_path = os.path.join(os.path.dirname(os.fspath(path)), CONFIG_FILE)
    if not os.path.isfile(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        return PeftConfig(config_path, {"": _parse_json(f.read(), config_path)})


def read_config(path: str | os.PathLike | None, metadata: Mapping[str, str]) -> PeftConfig | None:
    """The metadata's config first (it travels with the file), else adapter_config.json beside `path`."""
    found = from_metadata(metadata)
    if found is None and path is not None:
        found = from_sibling(path)
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
