"""The multi-file loader's rows as they are stored in a workflow (issue #36): one JSON text, plain values only.

The node's `rows` input is a STRING holding a JSON list, one object per file, in the order the files apply:

    [{"on": true, "lora": "wan/motion_HIGH.safetensors", "strength": 0.8},
     {"on": false, "lora": "style.safetensors", "strength": 1.0, "strength_clip": 0.5, "block_weights": "..."}]

    on              apply the row (default true)
    lora            the file, as the loras folders list it (required)
    strength        on the diffusion model (default 1); on Wan 2.2's high-noise expert in the experts node
    strength_clip   on the text encoder (default: strength)
    strength_low    on Wan 2.2's low-noise expert (default: strength); experts node only
    expert          "auto" (the file's name decides: experts.find_pair), "both", "high" or "low" (default "auto")
    block_weights   a preset name or rule text, as LyCORIS Loader (Block Weights) takes (default none)

One JSON text rather than an input per row: ComfyUI's V3 schema passes a node only the inputs it declares, and
dynamic inputs exist only in ComfyUI 0.33, so a shared workflow or an API prompt carries the rows the same way on
every ComfyUI. The frontend draws the rows from it and writes it back. Anything else in it is refused, naming the
row and the field: a key nobody reads could only be a typo that silently does nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ...lycoris_core import LycorisError
from ...lycoris_core.block_weights import parse as parse_block_weights

EXPERT_CHOICES = ("auto", "both", "high", "low")
_FIELDS = {"on", "lora", "strength", "strength_clip", "strength_low", "expert", "block_weights"}


@dataclass(frozen=True)
class Row:
    lora: str
    on: bool = True
    strength: float = 1.0
    strength_clip: float | None = None
    strength_low: float | None = None
    expert: str = "auto"
    block_weights: str = ""

    @property
    def clip_strength(self) -> float:
        return self.strength if self.strength_clip is None else self.strength_clip

    @property
    def low_strength(self) -> float:
        return self.strength if self.strength_low is None else self.strength_low

    def to_json(self) -> dict:
        out = {"on": self.on, "lora": self.lora, "strength": self.strength}
        for key in ("strength_clip", "strength_low", "block_weights"):
            if getattr(self, key) not in (None, ""):
                out[key] = getattr(self, key)
        if self.expert != "auto":
            out["expert"] = self.expert
        return out


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LycorisError(f"{where} must be a finite number, not {json.dumps(value)}")
    return float(value)


def _row(raw, number: int) -> Row:
    where = f"row {number}"
    if not isinstance(raw, dict):
        raise LycorisError(f"{where} must be an object like {{\"lora\": \"name.safetensors\", \"strength\": 1}}, "
                           f"not {json.dumps(raw)[:80]}")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise LycorisError(f"{where} has {', '.join(map(repr, unknown))}, which no row takes "
                           f"(a row takes {', '.join(sorted(_FIELDS))})")
    lora = raw.get("lora")
    if not isinstance(lora, str) or not lora.strip():
        raise LycorisError(f"{where} names no file ('lora')")
    on = raw.get("on", True)
    if not isinstance(on, bool):
        raise LycorisError(f"{where} ({lora}): 'on' must be true or false, not {json.dumps(on)}")
    expert = raw.get("expert", "auto")
    if expert not in EXPERT_CHOICES:
        raise LycorisError(f"{where} ({lora}): 'expert' must be one of {', '.join(EXPERT_CHOICES)}, "
                           f"not {json.dumps(expert)}")
    block_weights = raw.get("block_weights", "") or ""
    if not isinstance(block_weights, str):
        raise LycorisError(f"{where} ({lora}): 'block_weights' must be text, not {json.dumps(block_weights)}")
    try:
        parse_block_weights(block_weights)
    except LycorisError as err:
        raise LycorisError(f"{where} ({lora}): block weights: {err}") from None
    optional = {key: None if raw.get(key) is None else _number(raw[key], f"{where} ({lora}): '{key}'")
                for key in ("strength_clip", "strength_low")}
    strength = _number(raw.get("strength", 1.0), f"{where} ({lora}): 'strength'")
    return Row(lora=lora, on=on, strength=strength, expert=expert, block_weights=block_weights, **optional)


def parse_rows(text: str) -> list[Row]:
    """The rows of a `rows` input (empty text: none); an error names the row (counted from 1) and the field."""
    if not (text or "").strip():
        return []
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise LycorisError(f"the rows are not JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(raw, list):
        raise LycorisError(f"the rows must be a JSON list of rows, not {type(raw).__name__}")
    return [_row(item, i) for i, item in enumerate(raw, start=1)]


def rows_text(rows: list[Row]) -> str:
    """The `rows` value for these rows (what the frontend writes)."""
    return json.dumps([row.to_json() for row in rows], ensure_ascii=False)
