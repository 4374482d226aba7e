"""Many files in one node, one row each (issue #36): LyCORIS Loader (Rows), and LyCORIS Loader (Wan 2.2 Experts) for
Wan 2.2 A14B's high-noise and low-noise models.

What a node applies, in order: the incoming LORA_STACK's items, then the rows (rows.py: one JSON text the frontend
draws), then the `<lora:...>` tags of `lora_text` (lora_tags.py). Each becomes an Entry: where it came from and the
Placements of its files (one file on one model at its strengths). Every entry is resolved and every file read and
checked before anything is applied, so a bad row is an error naming it and no model is half patched. Each placement
then goes through the same apply_file as LyCORIS Loader, in order: a row is exactly a chained loader.

On the experts node a row's expert decides where its file goes: "auto" reads the file's name (experts.find_pair):
a HIGH file goes to the high-noise model and its LOW sibling, found in the loras folders, to the low-noise one; a
name without an expert's word goes to both. "both", "high" and "low" say it outright. A pair half without its
sibling, and a file whose metadata names the other expert, are said in the row's report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import comfy.model_base
import folder_paths
from comfy_api.latest import io

from ...lycoris_core import LycorisError
from ...lycoris_core.block_weights import parse as parse_block_weights
from ...lycoris_core.summary import trigger_words
from ..glue import lora_files
from ..glue.apply import apply_file, is_off
from ..glue.cache import load_cached
from ..glue.coverage import model_family
from ..glue.inputs import (
    CATEGORY,
    DEFAULT_APPLY_MODE,
    apply_mode_input,
    clip_input,
    lycoris_path,
    mode_input,
    model_clip_outputs,
    model_input,
    node_key,
    remember_linked,
    stamps_with_linked,
)
from ..glue.lora_stack import LoraStack, StackRow, read_item
from .experts import HIGH, LOW, find_pair, metadata_expert
from .lora_tags import parse_tags
from .rows import Row, parse_rows

EXPERT_NAMES = {HIGH: "high-noise", LOW: "low-noise"}
ROWS_TOOLTIP = (
    "The rows, drawn by the node's editor: one file each, applied top to bottom after the lora_stack input and before "
    "lora_text. Stored as JSON (a list of {\"on\", \"lora\", \"strength\", \"strength_clip\", \"block_weights\"}; on "
    "the Wan 2.2 experts node also \"strength_low\" and \"expert\": auto, both, high or low), so a workflow or an API "
    "prompt carries them as they are."
)
TEXT_TOOLTIP = (
    "Optional text with <lora:name:strength> or <lora:name:model strength:clip strength> tags (A1111, LoRA Manager), "
    "applied after the rows; names with or without extension or subfolder. Other text is ignored."
)
STACK_TOOLTIP = "Optional LORA_STACK from another node; its files apply first."


@dataclass(frozen=True)
class Placement:
    """One file on one model at its strengths. `clip` False: the text-encoder change comes from another placement of
    the same entry (an expert pair's files are applied to the text encoder once)."""

    file: str
    expert: str | None
    strength_model: float
    strength_clip: float
    block_weights: str = ""
    clip: bool = True

    def to_json(self) -> dict:
        return {"file": self.file, "expert": self.expert, "strength_model": self.strength_model,
                "strength_clip": self.strength_clip if self.clip else None}


@dataclass
class Entry:
    """A row, a stack item or a tag, and the placements of its files."""

    source: str  # "row", "stack" or "text"
    number: int  # from 1, within its source
    lora: str  # as written
    on: bool = True
    placements: list[Placement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        what = {"row": "row", "stack": "lora_stack item", "text": "lora_text tag"}[self.source]
        return f"{what} {self.number} ({self.lora})"


def _listed(name: str, label: str) -> str:
    listed = lora_files.listed_name(name) if isinstance(name, str) else None
    if listed is None:
        raise LycorisError(f"{label}: '{name}' is not a file in the loras folders")
    return listed


def _stack_entries(lora_stack) -> list[tuple[Entry, Row]]:
    items = [read_item(item, i) for i, item in enumerate(lora_stack or (), start=1)]
    return [(Entry("stack", i, item[0]), Row(lora=item[0], strength=item[1], strength_clip=item[2],
                                              block_weights=item.block_weights))
            for i, item in enumerate(items, start=1)]


def _tag_entries(lora_text: str | None, listed: list[str]) -> list[tuple[Entry, Row]]:
    return [(Entry("text", i, tag.text), Row(lora=tag.name, strength=tag.strength_model,
                                              strength_clip=tag.strength_clip))
            for i, tag in enumerate(parse_tags(lora_text or "", listed), start=1)]


def gather(rows: str, lora_text: str | None, lora_stack) -> list[tuple[Entry, Row]]:
    """Every entry in apply order (stack, rows, tags), with the row it reads as; nothing is resolved yet."""
    listed = folder_paths.get_filename_list(lora_files.FOLDER)
    from_rows = [(Entry("row", i, row.lora, on=row.on), row) for i, row in enumerate(parse_rows(rows), start=1)]
    return [*_stack_entries(lora_stack), *from_rows, *_tag_entries(lora_text, listed)]


def place_on_one_model(entry: Entry, row: Row) -> None:
    if entry.on:
        entry.placements.append(Placement(_listed(row.lora, entry.label), None, row.strength, row.clip_strength,
                                          row.block_weights))


def _expert_placements(entry: Entry, row: Row, listed: list[str]) -> list[tuple[str, str]]:
    """(file, expert) pairs of a row on the experts node, with the row's notes on how they were found."""
    picked = _listed(row.lora, entry.label)
    if row.expert in (HIGH, LOW):
        return [(picked, row.expert)]
    pair = find_pair(picked, listed) if row.expert == "auto" else None
    if pair is None:
        if row.expert == "auto":
            entry.notes.append("no expert's word in its name: on both experts")
        return [(picked, HIGH), (picked, LOW)]
    if pair.sibling is None:
        other = LOW if pair.expert == HIGH else HIGH
        entry.notes.append(f"its name says {EXPERT_NAMES[pair.expert]} ({pair.rule}), and no '{pair.sibling_name}' "
                           f"is in the loras folders: the {EXPERT_NAMES[other]} expert gets no file from this row")
        return [(picked, pair.expert)]
    entry.notes.append(f"pair by name ({pair.rule}): {pair.high} on the high-noise expert, {pair.low} on the "
                       "low-noise one")
    return [(pair.high, HIGH), (pair.low, LOW)]


def place_on_experts(entry: Entry, row: Row, listed: list[str]) -> None:
    if not entry.on:
        return
    picked = _listed(row.lora, entry.label)
    for file, expert in _expert_placements(entry, row, listed):
        strength = row.strength if expert == HIGH else row.low_strength
        # The text encoder is shared by both experts: it gets the change of the file the row names, once.
        carries_clip = file == picked and not any(p.clip for p in entry.placements)
        entry.placements.append(Placement(file, expert, strength, row.clip_strength if carries_clip else 0.0,
                                          row.block_weights, clip=carries_clip))


def check_files(entries: list[Entry]) -> None:
    """Read (and so check) every file before anything is applied; the metadata's expert is compared on the way."""
    for entry in entries:
        for placement in entry.placements:
            try:
                lfile = load_cached(lycoris_path(placement.file))
                parse_block_weights(placement.block_weights)
            except LycorisError as err:
                raise LycorisError(f"{entry.label}: {err}") from err
            said = metadata_expert(lfile.metadata) if placement.expert else None
            if said is not None and said.expert != placement.expert:
                entry.notes.append(f"{placement.file}: its metadata names the {EXPERT_NAMES[said.expert]} expert "
                                   f"({said.evidence}), and it goes to the {EXPERT_NAMES[placement.expert]} one")


def _add_words(words: list[str], metadata: dict) -> None:
    for word in trigger_words(metadata):
        if word not in words:
            words.append(word)


@dataclass
class RowsRun:
    """What applying the entries made so far: the models by expert (None: the one model), the clip, the report."""

    models: dict
    clip: object
    reference: bool  # LyCORIS strength semantics
    apply_mode: str
    report: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    words: list[str] = field(default_factory=list)  # of the files applied

    def place(self, entry: Entry, placement: Placement, key: str | None) -> dict:
        """One file on its model (and on the clip, when it carries the row's text-encoder change); its report."""
        data = placement.to_json()
        carries_clip = placement.clip and self.clip is not None
        strength_clip = placement.strength_clip if carries_clip else 0.0
        if not carries_clip:
            data["strength_clip"] = None  # no text encoder connected: no clip strength to report
        if is_off(placement.strength_model, self.reference) and is_off(strength_clip, self.reference):
            data["line"] = f"{placement.file}: strength 0, not applied"
            return data
        lfile = load_cached(lycoris_path(placement.file))
        try:
            model, clip, report = apply_file(lfile, self.models[placement.expert], self.clip if placement.clip else None,
                                             placement.strength_model, strength_clip, self.reference,
                                             parse_block_weights(placement.block_weights), self.apply_mode, key)
        except LycorisError as err:
            raise LycorisError(f"{entry.label}: {err}") from err
        self.models[placement.expert] = model
        if placement.clip and clip is not None:
            self.clip = clip
        data["line"], data["verdict"] = report.line(), report.verdict
        where = f", {EXPERT_NAMES[placement.expert]} expert" if placement.expert else ""
        self.lines.append(f"{entry.label}{where}: {report.line()}")
        _add_words(self.words, lfile.metadata)
        return data

    def add_report(self, entry: Entry, placed: list[dict]) -> None:
        words: list[str] = []  # the entry's own, applied or not (a row at strength 0 still says its words)
        for placement in entry.placements:
            _add_words(words, load_cached(lycoris_path(placement.file)).metadata)
        self.lines += [f"{entry.label}: {note}" for note in entry.notes]
        self.report.append({"source": entry.source, "row": entry.number if entry.source == "row" else None,
                            "number": entry.number, "lora": entry.lora, "off": not entry.on, "placements": placed,
                            "notes": entry.notes, "trigger_words": words})


def apply_entries(entries: list[Entry], models: dict, clip, strength_mode: str, apply_mode: str,
                  node: str | None) -> RowsRun:
    """Every placement in order, each through apply_file as a LyCORIS Loader would (its own injection key)."""
    out = RowsRun(dict(models), clip, strength_mode == "lycoris", apply_mode)
    for i, entry in enumerate(entries):
        placed = [out.place(entry, placement, None if node is None else f"{node}:{i}:{j}")
                  for j, placement in enumerate(entry.placements)]
        out.add_report(entry, placed)
    return out


def out_stack(lora_stack, entries: list[tuple[Entry, Row]]) -> list:
    """The incoming stack, then the enabled rows and the tags, as LORA_STACK items."""
    added = [StackRow(row.lora, row.strength, row.clip_strength, row.block_weights)
             for entry, row in entries if entry.source != "stack" and entry.on]
    return [*(lora_stack or []), *added]


def _row_files(rows: str, pairs: bool) -> list[str]:
    try:
        parsed = parse_rows(rows)
    except LycorisError:
        return []  # validate_inputs reports it
    names = [row.lora for row in parsed]
    if pairs:
        listed = folder_paths.get_filename_list(lora_files.FOLDER)
        for row in parsed:
            pair = find_pair(row.lora, listed)
            names += [name for name in (pair.high, pair.low) if name] if pair else []
    return names


def fingerprint_rows(cls, rows="", **_inputs) -> str:
    """fingerprint_by_file (glue/inputs.py) for every file the rows name and every file a node has applied from
    linked inputs (glue/inputs.py LinkedFiles): a file rewritten under the same name is read again."""
    return stamps_with_linked(_row_files(str(rows), pairs=False))


def fingerprint_expert_rows(cls, rows="", **_inputs) -> str:
    """fingerprint_rows with the siblings the experts node finds for them."""
    return stamps_with_linked(_row_files(str(rows), pairs=True))


def remember_linked_files(entries: list[Entry]) -> None:
    remember_linked(p.file for entry in entries if entry.source != "row" for p in entry.placements)


def validate_rows(cls, rows=None) -> bool | str:
    """Malformed rows and missing files are refused before the prompt runs, naming the row (rows from a link are
    checked when the node runs)."""
    if not isinstance(rows, str):
        return True
    try:
        for i, row in enumerate(parse_rows(rows), start=1):
            if row.on:
                _listed(row.lora, f"row {i} ({row.lora})")
    except LycorisError as err:
        return str(err)
    return True


def rows_input() -> io.String.Input:
    return io.String.Input("rows", multiline=True, default="[]", tooltip=ROWS_TOOLTIP)


def text_input() -> io.String.Input:
    return io.String.Input("lora_text", optional=True, force_input=True, tooltip=TEXT_TOOLTIP)


def stack_input() -> io.Custom.Input:
    return LoraStack.Input("lora_stack", optional=True, tooltip=STACK_TOOLTIP)


def words_output() -> io.String.Output:
    return io.String.Output(display_name="trigger_words",
                            tooltip="The trigger words of the files applied (their metadata), joined with ', '.")


class LycorisRows(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisRows",
            display_name="LyCORIS Loader (Rows)",
            category=CATEGORY,
            description=(
                "Several LyCORIS/LoRA files in one node, one row each (on/off, strengths, block weights), applied in "
                "order exactly as chained LyCORIS Loaders would: the lora_stack input's files first, then the rows, "
                "then <lora:name:strength> tags from lora_text. Outputs the stack and the files' trigger words."
            ),
            inputs=[model_input(), clip_input(optional=True), rows_input(), text_input(), stack_input(),
                    mode_input(), apply_mode_input()],
            outputs=[*model_clip_outputs(),
                     LoraStack.Output(display_name="LORA_STACK", tooltip="lora_stack, then the rows and tags applied."),
                     words_output()],
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_rows)
    validate_inputs = classmethod(validate_rows)

    @classmethod
    def execute(cls, model, rows, clip=None, lora_text=None, lora_stack=None, strength_mode="linear",
                apply_mode=DEFAULT_APPLY_MODE):
        entries = gather(rows, lora_text, lora_stack)
        for entry, row in entries:
            place_on_one_model(entry, row)
        remember_linked_files([entry for entry, _row in entries])
        check_files([entry for entry, _row in entries])
        done = apply_entries([entry for entry, _row in entries], {None: model}, clip, strength_mode, apply_mode,
                             node_key(cls))
        return io.NodeOutput(done.models[None], done.clip, out_stack(lora_stack, entries), ", ".join(done.words),
                             ui={"lycoris_rows": done.report, "text": done.lines})


def check_experts(model_high, model_low) -> None:
    """Both inputs must be Wan 2.2 A14B's experts: two Wan models (ComfyUI loads A14B as WAN21), not the same one."""
    for side, model in (("model_high", model_high), ("model_low", model_low)):
        base = getattr(model, "model", None)
        if not isinstance(base, comfy.model_base.WAN21) or type(base).__name__ == "WAN22":
            kind = "Wan 2.2 5B, a single model" if type(base).__name__ == "WAN22" else model_family(model)
            raise LycorisError(f"{side} is {kind}, not a Wan 2.2 A14B expert: this node puts each file on the "
                               "high-noise or low-noise model of Wan 2.2 A14B; for one model use LyCORIS Loader (Rows)")
    if model_high.model is model_low.model:
        raise LycorisError("model_high and model_low are the same model: connect the high-noise expert to model_high "
                           "and the low-noise expert to model_low")


class LycorisExperts(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisExperts",
            display_name="LyCORIS Loader (Wan 2.2 Experts)",
            category=CATEGORY,
            description=(
                "The rows loader for Wan 2.2 A14B's two models: each row goes to the high-noise expert, the low-noise "
                "one or both, with a strength each. Pick one file of a HIGH/LOW pair and its sibling goes to the "
                "other expert (the README lists the names it reads); every row says which file went where."
            ),
            inputs=[
                io.Model.Input("model_high", tooltip="Wan 2.2 A14B's high-noise expert (the first steps)."),
                io.Model.Input("model_low", tooltip="Wan 2.2 A14B's low-noise expert (the last steps)."),
                clip_input(optional=True), rows_input(), text_input(), stack_input(), mode_input(), apply_mode_input(),
            ],
            outputs=[
                io.Model.Output(display_name="MODEL_HIGH", tooltip="The high-noise expert, patched."),
                io.Model.Output(display_name="MODEL_LOW", tooltip="The low-noise expert, patched."),
                io.Clip.Output(display_name="CLIP", tooltip="The text encoder, patched once per row."),
                words_output(),
            ],
            hidden=[io.Hidden.unique_id],
        )

    fingerprint_inputs = classmethod(fingerprint_expert_rows)
    validate_inputs = classmethod(validate_rows)

    @classmethod
    def execute(cls, model_high, model_low, rows, clip=None, lora_text=None, lora_stack=None, strength_mode="linear",
                apply_mode=DEFAULT_APPLY_MODE):
        check_experts(model_high, model_low)
        entries = gather(rows, lora_text, lora_stack)
        listed = folder_paths.get_filename_list(lora_files.FOLDER)
        for entry, row in entries:
            place_on_experts(entry, row, listed)
        remember_linked_files([entry for entry, _row in entries])
        check_files([entry for entry, _row in entries])
        done = apply_entries([entry for entry, _row in entries], {HIGH: model_high, LOW: model_low}, clip,
                             strength_mode, apply_mode, node_key(cls))
        return io.NodeOutput(done.models[HIGH], done.models[LOW], done.clip, ", ".join(done.words),
                             ui={"lycoris_rows": done.report, "text": done.lines})


NODES: list[type[io.ComfyNode]] = [LycorisRows, LycorisExperts]
