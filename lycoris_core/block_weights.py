"""Block weights: a per-block multiplier on a file's strength, written by name.

    default=1; input_blocks.4-8=0.5; output_blocks.*=0; te=0.8

* Rules are separated by `;` or new lines; `#` starts a comment. Each is `pattern=value`.
* A pattern is a dotted path matched against the start of a weight's key (the `diffusion_model.` prefix dropped; text
  encoder keys as `te.<encoder>.…`, see blocks.py). `*` matches one component, `a-b` an inclusive index range, and
  `te` alone every text-encoder weight. `default` sets the weight of everything no rule matches (1 when absent).
* When several rules match a key, the last one written wins, so general rules go first and exceptions after.
* A1111/Inspire LBW vectors for SD1.5 (17 or 26 numbers) and SDXL (12 or 20 numbers) are accepted too and turned into
  the same rules.
"""

import math
import re
from dataclasses import dataclass

from .blocks import MODEL_PREFIX, TEXT_ENCODER, text_encoder_path
from .errors import LycorisError

_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class Rule:
    pattern: tuple[str, ...]
    weight: float

    def matches(self, path: tuple[str, ...]) -> bool:
        if len(path) < len(self.pattern):
            return False
        return all(_component_matches(p, c) for p, c in zip(self.pattern, path))


def _component_matches(pattern: str, component: str) -> bool:
    if pattern == "*" or pattern == component:
        return True
    span = _RANGE.match(pattern)
    return bool(span and component.isdigit() and int(span[1]) <= int(component) <= int(span[2]))


@dataclass(frozen=True)
class BlockWeights:
    rules: tuple[Rule, ...] = ()
    default: float = 1.0

    def weight_for(self, model_key: str) -> float:
        path = key_path(model_key)
        weight = self.default
        for rule in self.rules:
            if rule.matches(path):
                weight = rule.weight
        return weight


def key_path(model_key: str) -> tuple[str, ...]:
    """A weight key as the path rules match: `input_blocks.4.1.proj_in.weight`, `te.clip_l.layers.5.mlp.fc1.weight`."""
    if model_key.startswith(MODEL_PREFIX):
        return tuple(model_key[len(MODEL_PREFIX):].split("."))
    return text_encoder_path(model_key)


# LBW vectors: the block each position stands for, in ComfyUI's ldm key names. BASE is the text encoder.
def _in(*ids: int) -> list[str]:
    return [f"input_blocks.{i}" for i in ids]


def _out(*ids: int) -> list[str]:
    return [f"output_blocks.{i}" for i in ids]


LBW_LAYOUTS: dict[int, tuple[str, list[str]]] = {
    17: ("SD1.5", [TEXT_ENCODER, *_in(1, 2, 4, 5, 7, 8), "middle_block", *_out(3, 4, 5, 6, 7, 8, 9, 10, 11)]),
    26: ("SD1.5 (all blocks)", [TEXT_ENCODER, *_in(*range(12)), "middle_block", *_out(*range(12))]),
    12: ("SDXL", [TEXT_ENCODER, *_in(4, 5, 7, 8), "middle_block", *_out(0, 1, 2, 3, 4, 5)]),
    20: ("SDXL (all blocks)", [TEXT_ENCODER, *_in(*range(9)), "middle_block", *_out(*range(9))]),
}


def _number(text: str, source: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LycorisError(f"'{text}' is not a number in block weights '{source}'") from None
    if not math.isfinite(value):  # a NaN/Inf strength would poison every weight of the block
        raise LycorisError(f"'{text}' is not a finite number in block weights '{source}'")
    return value


def _from_vector(values: list[str], source: str) -> list[Rule]:
    if len(values) not in LBW_LAYOUTS:
        sizes = ", ".join(f"{n} ({name})" for n, (name, _) in LBW_LAYOUTS.items())
        raise LycorisError(f"a block weight vector has {len(values)} numbers; LBW vectors have {sizes}")
    _name, blocks = LBW_LAYOUTS[len(values)]
    # Blocks an LBW vector leaves out (e.g. IN00 in the 17-form) keep their weight, as in the webui.
    return [Rule(tuple(block.split(".")), _number(v, source)) for block, v in zip(blocks, values)]


def parse(text: str) -> BlockWeights:
    """BlockWeights from named rules and/or LBW vectors (a line of numbers); LycorisError saying what is wrong."""
    lines = [line.split("#", 1)[0] for line in text.replace(";", "\n").splitlines()]
    rules, default = [], 1.0
    for entry in (e.strip() for e in lines):
        if not entry:
            continue
        if "=" not in entry:
            rules += _from_vector([v.strip() for v in entry.split(",") if v.strip()], text)
            continue
        name, _sep, value = (part.strip() for part in entry.partition("="))
        if not name:
            raise LycorisError(f"'{entry}' is not 'block=weight' in block weights '{text}'")
        if name == "default":
            default = _number(value, text)
        else:
            rules.append(Rule(tuple(name.split(".")), _number(value, text)))
    return BlockWeights(tuple(rules), default)
