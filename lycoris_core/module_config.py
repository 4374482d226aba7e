"""`<module>.config` entries: settings for one layer, as UTF-8 JSON text in a 1-D uint8 tensor. Not a weight change.

ComfyUI 0.38 defines them (Comfy-Org/ComfyUI master, Oct 2026): comfy/lora.py `load_lora` turns every key ending in
`.config` into a ("config", (tensor,)) patch under the key itself; comfy/model_patcher.py `ModelPatcher.add_patches`
applies it as an object patch `module.with_config(tensor)` when the module at that path is a
`comfy.configurable.ConfigurableModule` ("a new module configured from a uint8 JSON tensor"), and otherwise does not
accept it. Neither ComfyUI this pack runs on has such layers: the entries are read, checked and reported, never
counted as modules or unused keys; one that is not uint8 JSON is an unused key that says why.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SUFFIX = ".config"
MAX_BYTES = 1 << 20  # a layer's settings; larger is no config (and the summary would have to read it)
SHOWN = 120  # characters of a value a report shows


@dataclass(frozen=True)
class ModuleConfig:
    key: str  # as in the file: `<module path>.config`
    value: object  # the parsed JSON

    @property
    def module(self) -> str:
        return self.key[: -len(SUFFIX)]

    @property
    def text(self) -> str:
        """The value as compact ASCII JSON, clipped for a report line."""
        text = json.dumps(self.value, ensure_ascii=True, sort_keys=True, separators=(",", ":"))
        return text if len(text) <= SHOWN else text[: SHOWN - 1] + "…"


def is_config_key(key: str) -> bool:
    return key.endswith(SUFFIX) and len(key) > len(SUFFIX)


def read(key: str, tensor: torch.Tensor) -> ModuleConfig | str:
    """The entry, or why it is not one ComfyUI's `with_config` could read."""
    if tensor.dtype != torch.uint8 or tensor.ndim != 1:
        return (f"a module config must be UTF-8 JSON in a 1-D uint8 tensor, this is {str(tensor.dtype)[6:]} of shape "
                f"{list(tensor.shape)}")
    if tensor.numel() > MAX_BYTES:
        return f"a module config of {tensor.numel()} bytes (more than {MAX_BYTES}) was not read"
    if tensor.is_meta:
        return "a module config whose bytes were not read"
    try:
        return ModuleConfig(key, json.loads(tensor.contiguous().numpy().tobytes().decode("utf-8")))
    except UnicodeDecodeError as e:
        return f"a module config must be UTF-8 JSON: byte {e.start} is not UTF-8"
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, as is the digit limit
        return f"a module config must be UTF-8 JSON: {str(e)[:200]}"


def split_configs(state_dict: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], list[ModuleConfig], list[tuple[str, str]]]:
    """(the other entries, the config entries read, (key, reason) of those that are not uint8 JSON)."""
    rest, configs, unreadable = {}, [], []
    for key, tensor in state_dict.items():
        if not is_config_key(key):
            rest[key] = tensor
            continue
        entry = read(key, tensor)
        if isinstance(entry, ModuleConfig):
            configs.append(entry)
        else:
            unreadable.append((key, entry))
    return rest, configs, unreadable


def config_note(name: str, configs: list[ModuleConfig]) -> str:
    """One line for a file's config entries: what they set, and that this loader applies none of them."""
    first = configs[0]
    more = f"; and {len(configs) - 1} more" if len(configs) > 1 else ""
    return (f"{name}: {len(configs)} module config {'entry' if len(configs) == 1 else 'entries'} read, not applied "
            f"('{first.key}' = {first.text}{more}): layer settings for ComfyUI 0.38's configurable layers "
            f"(comfy/lora.py load_lora -> ModelPatcher.add_patches -> ConfigurableModule.with_config), not a weight "
            f"change; this loader patches weights only")
