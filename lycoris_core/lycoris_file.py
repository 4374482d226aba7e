"""A whole LyCORIS file: keys grouped into modules, every tensor checked once, at load.

Checking everything at load (internal shapes, finite values) is what lets patch computation be unable to fail:
ComfyUI does not roll back a patch that raises half-way, and clones share one module.
"""

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .algos.base import Layout
from .algos.full import MODULATION
from .errors import LycorisError, encodable
from .keys import ADAPTER_NAMED, PEFT_MAGNITUDE, read_as_written, split_key
from .module import Module, build_modules
from .module_config import ModuleConfig, config_note, split_configs
from .peft_config import PeftConfig, from_metadata, module_name, module_options, read_config
from .safetensors_file import SafetensorsFile


@dataclass(frozen=True)
class UnusedKey:
    key: str
    reason: str


@dataclass
class LycorisFile:
    name: str
    modules: dict[str, Module]  # "<prefix>.<param>" -> module, in file order
    unused: list[UnusedKey] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what was assumed where the file says nothing
    configs: list[ModuleConfig] = field(default_factory=list)  # `<module>.config` entries: read, not applied
    notes: list[str] = field(default_factory=list)  # what the file holds beside its modules (module_config)

    @property
    def algorithms(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for module in self.modules.values():
            counts[module.label] = counts.get(module.label, 0) + 1
        return counts


def group_keys(state_dict: Mapping[str, torch.Tensor], file: str | None = None
               ) -> tuple[dict[str, dict[str, torch.Tensor]], list[UnusedKey]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    as_written = read_as_written(state_dict)
    for key, tensor in state_dict.items():
        split = split_key(key, renamed=not as_written(key))
        if split is None:
            unknown.append(UnusedKey(key, "not a key of any LyCORIS algorithm"))
            continue
        prefix, suffix = split
        group = groups.setdefault(prefix, {})
        if suffix in group:
            raise LycorisError(f"two keys of module '{prefix}' mean the same '{suffix}'", file=file, key=key)
        group[suffix] = tensor
    _rejoin_kohya_magnitudes(groups)
    return groups, unknown


def adapter_named(state_dict: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The module prefixes (as group_keys reads them) whose keys keep PEFT's adapter name (keys.ADAPTER_NAMED)."""
    as_written = read_as_written(state_dict)
    return frozenset(split_key(key, renamed=not as_written(key))[0] for key in state_dict
                     if key.endswith(ADAPTER_NAMED))


def _rejoin_kohya_magnitudes(groups: dict[str, dict[str, torch.Tensor]]) -> None:
    """diffusers' convert_state_dict_to_kohya turns all but a key's last two dots into underscores, so a DoRA
    magnitude (one dot fewer than `.lora_down.weight`) keeps its module's last dot: `lora_unet_x.to_q.
    lora_magnitude_vector` beside `lora_unet_x_to_q.lora_down.weight`. Such a lone magnitude joins its module."""
    for prefix in [p for p, group in groups.items() if set(group) == {PEFT_MAGNITUDE} and "." in p]:
        owner = groups.get(prefix.replace(".", "_"))
        if owner is not None and PEFT_MAGNITUDE not in owner:
            owner[PEFT_MAGNITUDE] = groups.pop(prefix)[PEFT_MAGNITUDE]


_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8_SLICE = 1 << 22


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf. min and max propagate NaN and are ±Inf when any value is, and one fused reduction over the
    flattened tensor is ~10× faster than an elementwise isfinite on CPU fp16/bf16 (and ~100× faster than the same
    reduction over a 2-D/4-D view): this check reads every byte of every file loaded."""
    if tensor.dtype in _MINMAX_DTYPES:
        return all(bool(torch.isfinite(bound)) for bound in torch.aminmax(tensor.reshape(-1)))
    # fp8 has neither kernel on CPU: widen a slice at a time (a whole fp32 copy could be 4× the file)
    return all(bool(torch.isfinite(part.float()).all()) for part in tensor.reshape(-1).split(_FP8_SLICE))


def check_values(state_dict: Mapping[str, torch.Tensor], file: str | None = None,
                 checked: Callable[[torch.Tensor], None] | None = None) -> None:
    """NaN or Inf anywhere would poison the whole weight it patches; refuse the file and say where.
    `checked(tensor)` is called after each tensor passes (the reader releases its pages there)."""
    for key, tensor in state_dict.items():
        if tensor.is_floating_point() and tensor.numel() and not all_finite(tensor):
            bad = sum(int((~torch.isfinite(part.float())).sum()) for part in tensor.reshape(-1).split(_FP8_SLICE))
            raise LycorisError(f"{bad} of {tensor.numel()} values are NaN or Inf; the file is damaged", file=file,
                               key=key)
        if checked is not None:
            checked(tensor)


def metadata_json(metadata: Mapping[str, str], key: str):
    """A metadata value that holds JSON, parsed; None when it is absent or is not JSON Python can read back (bad
    syntax, nested past the recursion limit, a number of more than 4300 digits) or holds a number JSON cannot
    write again (NaN, Infinity, 1E400: the summary is served as strict JSON). For values that only describe a
    file (trigger words, training settings): what cannot be read is left out, never a reason to refuse the file."""
    try:
        return _encodable_json(json.loads(metadata.get(key) or "null", parse_constant=_not_finite,
                                          parse_float=_finite_float))
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError, as is the digit limit
        return None


def _not_finite(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def _encodable_json(value):
    """A parsed JSON value with its strings `encodable` (an escaped lone surrogate decodes to one)."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list):
        return [_encodable_json(item) for item in value]
    if isinstance(value, dict):
        return {encodable(str(k)): _encodable_json(v) for k, v in value.items()}
    return value


def software_name(metadata: Mapping[str, str]) -> str | None:
    """The `software` name ai-toolkit's get_meta_for_safetensors writes (a JSON object), or None."""
    software = metadata_json(metadata, "software")
    return software.get("name") if isinstance(software, dict) else None


def scale_warnings(name: str, modules: list[Module], metadata: Mapping[str, str]) -> list[str]:
    """The one warning for modules whose alpha was assumed. ai-toolkit saves its PEFT-format LoRAs without alpha
    because it trains them with alpha = rank (toolkit/lora_special.py: `if self.peft_format: self.alpha =
    self.lora_dim`): in its files scale 1 is the definition, not an assumption. So in LightX2V's, told by the `diff_m`
    only its extractor writes (tools/extract/lora_extractor.py writes no alpha; lightx2v/utils/lora_loader.py
    `apply_lora` scales a pair without one by 1)."""
    assumed = [m for m in modules if m.scale_assumed]
    if not assumed or software_name(metadata) == "ai-toolkit" or any(m.algorithm is MODULATION for m in modules):
        return []
    return [assumed_scale_warning(name, assumed)]


def assumed_scale_warning(name: str, modules: list[Module]) -> str:
    return (f"{name}: {len(modules)} modules (e.g. '{modules[0].prefix}') have no alpha tensor and no PEFT config "
            f"gives theirs (neither the file's 'lora_adapter_metadata' nor an adapter_config.json beside it): assumed "
            f"alpha = rank (scale 1), diffusers' convention for PEFT files without one")


def option_warnings(name: str, parts: Iterable[tuple[Module, Layout]]) -> list[str]:
    """One warning per set of PEFT options taken at PEFT's defaults, for (module, layout) pairs: the layouts read at
    load time (an OFT file saved without its config), or resolved against a weight (a square conv's (IA)³ side). A
    trainer's COFT, exact Cayley or feed-forward layers would otherwise be replaced by the defaults without a word."""
    by_options: dict[tuple[str, str], list[Module]] = {}
    for module, layout in parts:
        assumed = getattr(layout, "assumed", ())
        if assumed:
            by_options.setdefault((module.algorithm.name, ", ".join(assumed)), []).append(module)
    return [f"{name}: {len(group)} {group[0].algorithm.label} modules (e.g. '{group[0].prefix}') carry no options and "
            f"no PEFT config gives them (neither the file's 'lora_adapter_metadata' nor an adapter_config.json beside "
            f"it): assumed PEFT's defaults {assumed}; if it was trained otherwise "
            f"({group[0].algorithm.assumable_options}), put its adapter_config.json beside it"
            for (_, assumed), group in by_options.items()]


@dataclass(frozen=True)
class GroupedKeys:
    """A state dict's keys, grouped by module as both the loader and the summary read them."""

    groups: dict[str, dict[str, torch.Tensor]]  # module prefix -> its keys (canonical suffix -> tensor), file order
    unused: list[UnusedKey]  # keys of no algorithm, then module configs that cannot be read
    configs: list[ModuleConfig]  # `<module>.config` entries: read, not applied
    tensors: Mapping[str, torch.Tensor]  # the state dict without its module configs


def grouped_keys(state_dict: Mapping[str, torch.Tensor], file: str | None = None) -> GroupedKeys:
    """Module configs set aside, the other keys grouped (group_keys: a module with two keys meaning the same
    suffix refuses the file)."""
    tensors, configs, unreadable = split_configs(state_dict)
    groups, unknown = group_keys(tensors, file)
    return GroupedKeys(groups, unknown + [UnusedKey(key, reason) for key, reason in unreadable], configs, tensors)


@dataclass(frozen=True)
class ParsedGroup:
    """A key group that parsed: its modules (none when no algorithm uses this combination of keys, and then every
    key is unused) and the keys they leave unused."""

    prefix: str
    keys: dict[str, torch.Tensor]
    modules: tuple[Module, ...]
    unused: tuple[UnusedKey, ...]
    options: dict[str, Any]  # its PEFT config's options (peft_config.module_options), what its alpha may come from


@dataclass(frozen=True)
class DamagedGroup:
    """A key group no module can be built from (tensors that do not fit each other or their algorithm): the loader
    refuses the file with `error`, which names file and key; the summary reports the module as damaged."""

    prefix: str
    keys: dict[str, torch.Tensor]
    error: LycorisError

    @property
    def key(self) -> str:
        return self.error.key or self.prefix

    @property
    def reason(self) -> str:
        return self.error.reason


def parse_groups(groups: Mapping[str, dict[str, torch.Tensor]], file: str | None,
                 config: PeftConfig | None) -> Iterator[ParsedGroup | DamagedGroup]:
    """Each key group built into its modules, in file order: the one parse the loader and the summary share, each
    applying its own rule to a DamagedGroup (the loader refuses the file, the summary reports the module). Lazy, so
    the loader stops at the first damaged group and releases each group's pages before the next is read."""
    for prefix, group in groups.items():
        options = module_options(config, prefix)
        try:
            built, leftover = build_modules(prefix, group, file, options, module_name(config, prefix))
        except LycorisError as error:
            yield DamagedGroup(prefix, group, error)
            continue
        reason = f"not read by {built[0].label}" if built else "no LyCORIS algorithm uses this combination of keys"
        yield ParsedGroup(prefix, group, tuple(built), tuple(UnusedKey(f"{prefix}.{suffix}", reason)
                                                             for suffix in leftover), options)


def parse_state_dict(state_dict: Mapping[str, torch.Tensor], name: str = "<state dict>",
                     metadata: Mapping[str, str] | None = None,
                     checked: Callable[[torch.Tensor], None] | None = None,
                     config: PeftConfig | None = None) -> LycorisFile:
    """`config`: the PEFT config of a PEFT/diffusers file (peft_config.read_config); by default the one in the
    metadata, if any. The loader's rule over parse_groups: a damaged module refuses the whole file, naming file and
    key (patching must not be able to fail later)."""
    if not state_dict:
        raise LycorisError("the file holds no tensors", file=name)
    check_values(state_dict, name, checked)
    if config is None:
        try:
            config = from_metadata(metadata or {})
        except LycorisError as e:
            raise e.located(file=name) from e
    keys = grouped_keys(state_dict, name)
    named = adapter_named(keys.tensors)
    unused = list(keys.unused)
    modules: dict[str, Module] = {}
    for parsed in parse_groups(keys.groups, name, config):
        if isinstance(parsed, DamagedGroup):  # the loader's rule: nothing of a file that could fail half-way patched
            raise parsed.error
        if checked is not None:  # reading alpha faulted in the pages around it, mostly this module's own tensors
            for tensor in parsed.keys.values():
                checked(tensor)
        unused += parsed.unused
        for module in parsed.modules:
            modules[f"{parsed.prefix}.{module.param}"] = replace(module, adapter_named=parsed.prefix in named)
    if not modules:
        example = f"e.g. '{next(iter(keys.tensors))}'" if keys.tensors else "the file holds only module configs"
        raise LycorisError(f"no LyCORIS/LoRA module found among {len(keys.tensors)} keys ({example}); is this an "
                           f"adapter file?", file=name)
    warnings = scale_warnings(name, list(modules.values()), metadata or {})
    warnings += option_warnings(name, ((m, m.layout) for m in modules.values()))
    notes = [config_note(name, keys.configs)] if keys.configs else []
    return LycorisFile(name, modules, unused, dict(metadata or {}), warnings, keys.configs, notes)


def load(path: str | os.PathLike, temp_dir: str | os.PathLike | None = None) -> LycorisFile:
    """Read and check a .safetensors file: its tensors are views of a private snapshot of it (see
    safetensors_file.py), so a later change to the file never reaches what was checked. A PEFT file's config comes
    from its metadata, else from the adapter_config.json beside it."""
    reader = SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
    config = read_config(path, reader.metadata)
    parsed = parse_state_dict(reader.tensors(), reader.name, reader.metadata, checked=reader.release, config=config)
    reader.release_all()
    return parsed
