"""LyCORIS Info: what a file is, and (with a model/clip connected) exactly what it does to them."""

import json

from comfy_api.latest import io

from ...lycoris_core.summary import summarize
from ..glue import cache
from ..glue.apply import map_file
from ..glue.inputs import CATEGORY, fingerprint_by_file, lycoris_input, lycoris_path
from ..glue.lora_files import validate_name
from ..glue.report import block_changes, patchers_of, payload

# What a person reads first, in this order; the long lists come last, one entry per line.
_FIRST = ("line", "verdict", "applied", "total", "warnings", "notes", "not_listed")
_LISTS = ("problems", "harmless", "unused_keys", "blocks")


def coverage_json(panel: dict) -> str:
    """The coverage output: JSON that reads top down. A file made for another model stops at the verdict: listing
    each of its (hundreds of) modules as 'no such weight' says nothing more, and the full list stays in the node's
    UI output (`lycoris`), for machines."""
    report = {k: v for k, v in panel.items() if k != "summary"}
    if report.get("verdict"):
        report["not_listed"] = (f"{len(report.get('problems') or [])} modules and {len(report.get('unused_keys') or [])}"
                                " unused keys: the file is for another model (full list in the node's UI output)")
        for name in _LISTS:
            report.pop(name, None)
    ordered = {k: report[k] for k in _FIRST if k in report} | {k: v for k, v in report.items() if k not in _FIRST}
    lines = []
    for key, value in ordered.items():
        if key in _LISTS and isinstance(value, list) and value:
            items = ",\n".join(f"  {json.dumps(item, ensure_ascii=False)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}"


class LycorisInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisInfo",
            display_name="LyCORIS Info",
            category=CATEGORY,
            description=(
                "Shows what a LyCORIS/LoRA file is (algorithms, rank, alpha, DoRA, base model, training metadata, "
                "trigger words) and, when a model or clip is connected, which modules fit it, which do not and why, "
                "and how much each block changes at the given strength. Patches nothing."
            ),
            is_output_node=True,
            inputs=[
                lycoris_input(),
                io.Model.Input("model", optional=True, tooltip="Check the file against this diffusion model."),
                io.Clip.Input("clip", optional=True, tooltip="Check the file against this text encoder."),
                io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01, optional=True,
                               tooltip="The strength at which the per-block change is measured."),
            ],
            outputs=[
                io.String.Output(display_name="summary",
                                 tooltip="What the file is, as readable text, and a last line on the pack's file "
                                         "cache (files, memory, budget, hits, misses, evictions)."),
                io.String.Output(display_name="trigger_words",
                                 tooltip="Trigger words (modelspec trigger phrase, then the most frequent training "
                                         "tags), comma-separated, ready to join into a prompt."),
                io.String.Output(display_name="coverage",
                                 tooltip="JSON that reads top down: the coverage line, the verdict, counts, then "
                                         "each module that did not apply (with its reason), those this model lacks "
                                         "by design (harmless), unused keys and the per-block change. A file made "
                                         "for another model stops at the verdict (the full list stays in the node's "
                                         "UI output). Empty object when no model or clip is connected."),
            ],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, lycoris_name, model=None, clip=None, strength=1.0):
        path = lycoris_path(lycoris_name)
        summary = summarize(path)
        panel = {"summary": summary.to_json(), "line": None, "blocks": None, "problems": []}
        coverage_text = "{}"
        if model is not None or clip is not None:
            _patches, report = map_file(cache.load_cached(path), model, clip, reference=False)
            blocks = block_changes(report, patchers_of(model, clip), {"model": strength, "clip": strength})
            panel = payload(path, report, blocks)
            coverage_text = coverage_json(panel)
        cache_stats = cache.stats()  # after load_cached, so a file read by this run is counted
        return io.NodeOutput(f"{summary.text()}\n{cache_stats.line()}", ", ".join(summary.trigger_words),
                             coverage_text, ui={"lycoris": [panel], "cache": [cache_stats.to_json()]})
