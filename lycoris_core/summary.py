"""What a file is, read from its header alone: algorithms, ranks, alphas, DoRA, dtypes, training metadata, trigger
words, the base model family (families.py: declared in metadata, or inferred from key names and shapes) and who made
it (trainers.py).

Tensor data is not read except the tiny `alpha`, `on_input` and `row_offset` scalars: modules are parsed on `meta`
tensors of the right shapes, with the same detection and layout code that patching uses.
"""

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from .algos import LAYOUT_ONLY_KEYS
from .errors import MAX_NAME, LycorisError, clipped
from .families import declared_family, infer_family
from .keys import ALPHA, DORA_SCALE
from .lycoris_file import (
    DamagedGroup,
    ParsedGroup,
    grouped_keys,
    metadata_json,
    option_warnings,
    parse_groups,
    scale_warnings,
    software_name,
)
from .module import Module
from .module_config import MAX_BYTES, config_note, is_config_key
from .peft_config import PATTERN_KEYS, PeftConfig, read_config
from .safetensors_file import SafetensorsFile
from .trainers import made_by

# Read for real: the layout needs their values (alpha, LoHa/IA3 on_input, row offsets, PEFT options held in the file).
SCALAR_SUFFIXES = (ALPHA, "on_input", *sorted(LAYOUT_ONLY_KEYS))
TRAINING_KEYS = {
    "ss_base_model_version": "base model", "ss_network_module": "network module", "ss_network_dim": "dim",
    "ss_network_alpha": "alpha", "ss_network_args": "network args", "ss_resolution": "resolution",
    "ss_num_train_images": "train images", "ss_epoch": "epochs", "ss_steps": "steps",
    "ss_learning_rate": "learning rate", "ss_optimizer": "optimizer", "ss_mixed_precision": "precision",
    "ss_output_name": "output name", "ss_training_comment": "comment", "ss_sd_model_name": "trained on",
    "modelspec.architecture": "architecture", "modelspec.title": "title", "modelspec.author": "author",
    "modelspec.description": "description", "modelspec.date": "date", "modelspec.resolution": "resolution",
}


@dataclass
class ModuleSummary:
    key: str
    algorithm: str
    rank: int | None
    alpha: float | None  # the alpha the loader uses: the file's, else its PEFT config's; None when none gives one
    params: int
    conv: bool
    dora_axis: str | None = None
    tucker: bool = False
    scale: float | None = None  # what the loader multiplies the change by: alpha / rank (rsLoRA: alpha / sqrt(rank))


@dataclass
class FileSummary:
    name: str
    size_bytes: int
    module_count: int
    algorithms: dict[str, int]
    rank: dict[str, int] | None
    alpha: dict[str, float] | None
    conv_rank: dict[str, int] | None
    dtypes: dict[str, int]
    dora_axis: str | None
    tucker: bool
    params: int
    base_model: dict[str, str | None]
    trigger_words: list[str]
    title: str | None
    training: dict[str, str]
    lycoris_config: dict | None
    metadata_count: int
    unused_keys: int
    made_by: dict[str, str | None] = field(default_factory=dict)  # trainer, format, evidence, line (see made_by)
    alpha_from: dict = field(default_factory=dict)  # source, rslora, patterns, line (see _alpha_from)
    warnings: list[str] = field(default_factory=list)  # what the loader assumes where the file says nothing
    notes: list[str] = field(default_factory=list)  # what the file holds beside its modules (module configs)
    modules: list[ModuleSummary] = field(default_factory=list, repr=False)

    def to_json(self, with_modules: bool = False) -> dict:
        data = asdict(self)
        if not with_modules:
            data.pop("modules")
        return data

    def text(self) -> str:
        """A few human lines for the Info node's STRING output."""
        rank = f"rank {_span(self.rank)}" if self.rank else "no rank"
        alpha = f", alpha {_span(self.alpha)}" if self.alpha else ""
        algos = ", ".join(f"{name} ×{n}" for name, n in self.algorithms.items())
        lines = [
            f"{self.title or self.name}: {self.module_count} modules ({algos}), {rank}{alpha}",
            (f"base model: {self.base_model['declared'] or '?'} (declared), "
             f"{self.base_model['inferred'] or '?'} (from key names)"),
            (f"tensors: {', '.join(f'{d} ×{n}' for d, n in self.dtypes.items())}; {self.params:,} parameters; "
             f"{self.size_bytes / 2**20:.1f} MiB"),
        ]
        if self.alpha_from.get("line"):
            lines.append(self.alpha_from["line"])
        if self.made_by:
            lines.append(self.made_by["line"])
        if self.conv_rank:
            lines.append(f"conv layers: rank {_span(self.conv_rank)}")
        if self.dora_axis:
            lines.append(f"DoRA: magnitude per {'output row' if self.dora_axis == 'out' else 'input channel'}")
        if self.trigger_words:
            lines.append("trigger words: " + ", ".join(self.trigger_words))
        lines += [f"{label}: {value}" for label, value in self.training.items()]
        lines += [f"warning: {warning}" for warning in self.warnings]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _span(values: dict) -> str:
    return f"{values['min']:g}" if values["min"] == values["max"] else f"{values['min']:g}–{values['max']:g}"


def _range(values: list) -> dict | None:
    return {"min": min(values), "max": max(values)} if values else None


def _shape_only(reader: SafetensorsFile) -> dict[str, torch.Tensor]:
    """Meta tensors of the right shapes, except the scalars whose values the layouts need and the module configs
    (small JSON texts the summary reports)."""
    tensors = {}
    for key, entry in reader.entries.items():
        if (key.endswith(SCALAR_SUFFIXES) and entry.numel <= 1) or (is_config_key(key) and entry.numel <= MAX_BYTES):
            tensors[key] = reader.tensor(key)
        else:
            tensors[key] = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    return tensors


def _module_summary(key: str, module: Module, alpha: float | None) -> ModuleSummary:
    tensors = module.tensors
    return ModuleSummary(
        key=key, algorithm=module.label, rank=module.layout.rank, alpha=alpha, scale=module.layout.scale,
        params=sum(t.numel() for t in tensors.values()),
        conv=any(t.ndim > 2 for name, t in tensors.items() if name != DORA_SCALE),
        dora_axis="out" if module.dora_per_output else _dora_axis(tensors.get(DORA_SCALE)),  # PEFT: per output
        tucker=any(name in tensors for name in ("lora_mid.weight", "hada_t1", "lokr_t2")),
    )


def _dora_axis(scale: torch.Tensor | None) -> str | None:
    if scale is None:
        return None
    return "in" if scale.ndim >= 2 and scale.shape[0] == 1 and scale.shape[1] > 1 else "out"


def trigger_words(metadata: dict[str, str], top: int = 8) -> list[str]:
    """modelspec.trigger_phrase first, then the most frequent training tags (kohya ss_tag_frequency)."""
    words = [w.strip() for w in metadata.get("modelspec.trigger_phrase", "").split(",") if w.strip()]
    frequency = metadata_json(metadata, "ss_tag_frequency")
    counts: Counter = Counter()
    for tags in frequency.values() if isinstance(frequency, dict) else ():
        if isinstance(tags, dict):
            counts.update({str(tag).strip(): n for tag, n in tags.items() if _is_count(n)})
    for tag, _n in counts.most_common():
        if len(words) >= top:
            break
        if tag and tag not in words:
            words.append(tag)
    return words


def _is_count(value) -> bool:
    """A tag count as kohya writes it: a non-negative JSON integer."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _alpha_used(module: Module, options: dict, in_file: bool) -> float | None:
    """The file's alpha, else the one the PEFT config gives this module (for rsLoRA its lora_alpha as written, not
    the alpha·√rank that Module.alpha holds so that alpha / rank is the scale)."""
    if in_file or module.alpha is None:
        return module.alpha
    return float(options.get("lora_alpha", options.get("alpha")))


def _alpha_from(config: PeftConfig | None, sources: Counter, metadata: dict[str, str]) -> dict:
    """Where the modules' alphas come from (`sources` counts "file", "config" and "assumed"), and the summary line
    for a PEFT config: the loader's scale rests on it, so the inspector says which one and what it holds."""
    if not sources["config"]:
        if sources["assumed"] and software_name(metadata) == "ai-toolkit":  # see lycoris_file.scale_warnings
            return {"source": "ai-toolkit", "rslora": False, "patterns": [],
                    "line": f"alpha = rank for {sources['assumed']} modules: ai-toolkit trains its PEFT format so"}
        return {"source": "file" if sources["file"] else None, "rslora": False, "patterns": [], "line": None}
    components = config.components.values()
    rslora = any(c.get("use_rslora") for c in components)
    patterns = [key for key in PATTERN_KEYS if any(c.get(key) for c in components)]
    line = (f"alpha from the PEFT config in {config.source} ({sources['config']} modules"
            + "".join(f", {key} of {max(len(c.get(key) or {}) for c in components)}" for key in patterns)
            + (", rsLoRA: scale = alpha/sqrt(rank)" if rslora else "") + ")")
    return {"source": config.source, "rslora": rslora, "patterns": patterns, "line": line}


def summarize(path) -> FileSummary:
    with SafetensorsFile(path) as reader:  # reads the header and the scalars the layouts need, nothing else
        return _summarize(path, reader)


def _summarize(path, reader: SafetensorsFile) -> FileSummary:
    config = read_config(path, reader.metadata)  # the loader's own source of a PEFT file's alpha
    keys = grouped_keys(_shape_only(reader), reader.name)
    modules: list[ModuleSummary] = []
    in_features: dict[str, int | None] = {}
    alpha_sources: Counter = Counter()
    built_modules: list[Module] = []
    unused = len(keys.unused)
    damaged: list[DamagedGroup] = []
    for parsed in parse_groups(keys.groups, reader.name, config):
        parsed = _alpha_checked(parsed, reader.name)
        if isinstance(parsed, DamagedGroup):  # loading refuses the file: the summary says which module, and goes on
            unused += len(parsed.keys)
            damaged.append(parsed)
            continue
        prefix, group, built = parsed.prefix, parsed.keys, parsed.modules
        unused += len(parsed.unused)
        modules += [_module_summary(f"{prefix}.{m.param}", m, _alpha_used(m, parsed.options, ALPHA in group))
                    for m in built]
        in_features[prefix] = built[0].layout.flat_in if built else None
        built_modules += built
        alpha_sources.update("file" if ALPHA in group else "assumed" if m.scale_assumed else "config"
                             for m in built if m.alpha is not None or m.scale_assumed)
    meta = reader.metadata
    lycoris_config = metadata_json(meta, "lycoris_config")
    ranks = [m.rank for m in modules if m.rank is not None]
    dora_axes = {m.dora_axis for m in modules if m.dora_axis}
    return FileSummary(
        name=reader.name, size_bytes=reader.size, module_count=len(modules),
        algorithms=dict(Counter(m.algorithm for m in modules).most_common()),
        rank=_range(ranks), alpha=_range([m.alpha for m in modules if m.alpha is not None]),
        conv_rank=_range([m.rank for m in modules if m.conv and m.rank is not None]),
        dtypes=dict(Counter(_dtype_name(e.dtype) for e in reader.entries.values()).most_common()),
        dora_axis=dora_axes.pop() if len(dora_axes) == 1 else ("mixed" if dora_axes else None),
        tucker=any(m.tucker for m in modules), params=sum(m.params for m in modules),
        base_model={"declared": declared_family(meta),
                    "inferred": infer_family(in_features)},
        trigger_words=trigger_words(meta),
        title=meta.get("modelspec.title") or meta.get("ss_output_name") or None,
        training={label: meta[key] for key, label in TRAINING_KEYS.items() if meta.get(key)},
        lycoris_config=lycoris_config, metadata_count=len(meta), unused_keys=unused,
        made_by=made_by(list(reader.entries), meta), alpha_from=_alpha_from(config, alpha_sources, meta),
        warnings=_damage_warnings(damaged) + scale_warnings(reader.name, built_modules, meta)
        + option_warnings(reader.name, ((m, m.layout) for m in built_modules)),
        notes=[config_note(reader.name, keys.configs)] if keys.configs else [], modules=modules,
    )


def _alpha_checked(parsed: ParsedGroup | DamagedGroup, file: str) -> ParsedGroup | DamagedGroup:
    """A group whose alpha is NaN or Inf, as damaged. The loader refuses it before parsing (check_values, with its
    own text: "1 of 1 values are NaN or Inf; the file is damaged"); the summary reads no tensor data but the
    scalars, so it checks the alpha the modules were built with."""
    if isinstance(parsed, DamagedGroup) or all(m.alpha is None or math.isfinite(m.alpha) for m in parsed.modules):
        return parsed
    return DamagedGroup(parsed.prefix, parsed.keys,
                        LycorisError("alpha is NaN or Inf", file=file, key=f"{parsed.prefix}.{ALPHA}"))


def _damage_warnings(damaged: list[DamagedGroup]) -> list[str]:
    """One line for the modules loading refuses, so a damaged file never reads as a file of fewer modules."""
    if not damaged:
        return []
    first, more = damaged[0], len(damaged) - 1
    return [f"{len(damaged)} damaged {'module' if len(damaged) == 1 else 'modules'}: the loader refuses this file "
            f"('{clipped(first.key, MAX_NAME)}': {clipped(first.reason, 300)}" + (f"; and {more} more)" if more else ")")]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
            torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}.get(dtype, str(dtype).replace("torch.", ""))
