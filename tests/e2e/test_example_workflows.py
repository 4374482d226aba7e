"""End to end: EVERY workflow in example_workflows/ on the session's ComfyUI server (conftest.py), converted with
ui_to_api as saved but on the tiny model and the demo LyCORIS files in place of the standard names the examples show
users (scripts/example_models.py: for_demo). Each must pass the server's validation, run and save an image; the
block-weight, stack, schedule and info examples are also checked against equivalent graphs, pixel for pixel
(SaveImage embeds the prompt, so files are never compared). The tools' examples (Save, Resize, Extract, Convert
LyCORIS) write a file instead: it must be in the server's loras folder, load through our loader with every module
applied, and (Save) sample like the stack it was saved from.

And what a user gets when opening one from the template browser: the standard SD1.5 checkpoint with the metadata
that makes the frontend offer its download, a placeholder LyCORIS name a note explains, the node library's titles,
every node on screen, and a thumbnail the frontend finds (<name>.jpg next to the json, served by ComfyUI)."""

from __future__ import annotations

import copy
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_thumbnails
from comfy_server import PACK_DIR_NAME, ui_to_api
from example_models import (
    DEMO_FILES,
    LOAD_ONLY,
    SD15_CHECKPOINT,
    STANDARD_MODELS,
    YOUR_LYCORIS,
    YOUR_SECOND_LYCORIS,
    demo_workflow,
)
from test_server_demo import BAD_LOG_LINES, run

pytestmark = pytest.mark.e2e

EXAMPLES = REPO_ROOT / "example_workflows"
WORKFLOWS = sorted(p.name for p in EXAMPLES.glob("*.json"))
EXPECTED = {  # the examples this file checks in detail; any other json is still run by test_example_runs
    "lycoris_loader.json",
    "lycoris_block_weights.json",
    "lycoris_stack.json",
    "lycoris_rows.json",
    "lycoris_schedule.json",
    "lycoris_info.json",
    "lycoris_bypass.json",
    "lycoris_save.json",
    "lycoris_resize.json",
    "lycoris_extract.json",
    "lycoris_convert.json",
}
TOOL_NODES = ("LycorisSave", "LycorisResize", "LycorisExtract", "LycorisConvert")  # they write a file, not an image


@dataclass
class Ran:
    prompt: dict
    entry: dict
    png: bytes | None  # None for a tool's example
    pixels: np.ndarray | None
    written: Path | None = None  # the tool's output file


def tool_node(prompt: dict) -> str | None:
    tools = [k for k, v in prompt.items() if v["class_type"] in TOOL_NODES]
    assert len(tools) <= 1, tools
    return tools[0] if tools else None


# PEFT/diffusers names hold LoRA only and the demo file is LoKr + DoRA (nothing of it converts): the Convert example
# runs on the Resize example's output instead, a plain LoRA of the demo file (the way its note tells users to go).
INPUT_FROM = {"lycoris_convert.json": ("LycorisConvert", "lycoris_resize.json")}


def loras_name(server, path: Path) -> str:
    """A file's name as the loras list gives it (relative to the loras folder, forward slashes)."""
    return path.relative_to(server.base_dir / "models" / "loras").as_posix()


def output_file(server, prompt: dict, tool: str) -> Path:
    """Where the tool writes: its output_name (+ .safetensors) in the server's loras folder."""
    name = prompt[tool]["inputs"]["output_name"]
    return server.base_dir / "models" / "loras" / (name if name.endswith(".safetensors") else name + ".safetensors")


@pytest.fixture(scope="module")
def object_info(server) -> dict:
    return server.object_info()


@pytest.fixture(scope="module")
def example(server, object_info):
    """example(name) -> Ran: the workflow as saved, run once per module."""
    done: dict[str, Ran] = {}

    def get(name: str) -> Ran:
        if name not in done:
            prompt = ui_to_api(demo_workflow(name), object_info)
            if name in INPUT_FROM:
                kind, source = INPUT_FROM[name]
                prompt = changed(prompt, kind, lycoris_name=loras_name(server, get(source).written))
            tool = tool_node(prompt)
            if tool is not None:  # a file from an earlier run would be refused (the tools never overwrite)
                written = output_file(server, prompt, tool)
                written.unlink(missing_ok=True)
                entry = server.wait(server.queue(prompt), timeout=180)
                done[name] = Ran(prompt, entry, None, None, written)
            else:
                entry = server.wait(server.queue(prompt), timeout=180)
                png = server.image_bytes(entry)
                done[name] = Ran(prompt, entry, png, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")))
        return done[name]

    return get


def pixels(server, prompt: dict) -> np.ndarray:
    return run(server, prompt)[1]


def only(prompt: dict, class_type: str) -> str:
    (node_id,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return node_id


def changed(prompt: dict, class_type: str, **inputs) -> dict:
    out = copy.deepcopy(prompt)
    out[only(prompt, class_type)]["inputs"].update(inputs)
    return out


def rewire(prompt: dict, old: str, new: str) -> None:
    """Every input fed by node `old` is fed by node `new` (same output slot) instead."""
    for node in prompt.values():
        for name, value in node["inputs"].items():
            if isinstance(value, list) and value[0] == old:
                node["inputs"][name] = [new, value[1]]


def test_all_examples_are_here():
    assert EXPECTED <= set(WORKFLOWS), sorted(EXPECTED - set(WORKFLOWS))


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_is_a_consistent_ui_graph(name):
    """Links agree with both ends' slots and types; ids are below last_node_id/last_link_id (no server needed)."""
    workflow = json.loads((EXAMPLES / name).read_text())
    assert workflow["version"] == 0.4
    nodes = {n["id"]: n for n in workflow["nodes"]}
    assert workflow["last_node_id"] == max(nodes)
    assert workflow["last_link_id"] == max(link[0] for link in workflow["links"])
    for link_id, origin, origin_slot, target, target_slot, kind in workflow["links"]:
        out, inp = nodes[origin]["outputs"][origin_slot], nodes[target]["inputs"][target_slot]
        assert link_id in out["links"] and inp["link"] == link_id, link_id
        assert out["type"] == kind and inp["type"] in (kind, "*"), link_id
    linked = {link[0] for link in workflow["links"]}
    for node in nodes.values():
        for inp in node.get("inputs", []):
            assert inp.get("link") is None or inp["link"] in linked, (node["id"], inp)
        if node["type"] in LYCORIS_FILE_NODES:
            assert node["widgets_values"][0] == YOUR_LYCORIS, (node["id"], node["widgets_values"])


LYCORIS_FILE_NODES = ("LycorisLoader", "LycorisBlockWeights", "LycorisBlockInfo", "LycorisInfo", "LycorisHook",
                      "LycorisResize", "LycorisConvert")
# How the frontends (1.32.9 and 1.49.6) decide a missing model can be downloaded: a url starting with one of these
# and a name ending in one of these (MissingModelsWarning / isModelDownloadable).
DOWNLOAD_HOSTS = ("https://civitai.com/", "https://huggingface.co/")
DOWNLOAD_SUFFIXES = (".safetensors", ".sft")


def strings(workflow: dict) -> list[str]:
    """Every string widget value of the graph's nodes, notes left out."""
    return [v for n in workflow["nodes"] if n["type"] not in ("Note", "MarkdownNote")
            for v in n.get("widgets_values") or [] if isinstance(v, str)]


MODEL_LOADERS = ("CheckpointLoaderSimple", "UNETLoader", "CLIPLoader", "VAELoader")


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_names_the_standard_checkpoint_with_its_download(name):
    """The user opens the models ComfyUI's own templates name (SD1.5's checkpoint; for the Wan 2.2 example, Wan 2.2's
    files and the lightx2v LoRA pair), and a missing one comes with its download: each model loader's
    properties.models entry for the name its widget shows (what the frontends read), with a url they accept and the
    folder; the workflow's `models` list (read by 1.32.9 too) holds every one of them."""
    workflow = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    standard = STANDARD_MODELS.get(Path(name).stem, [SD15_CHECKPOINT])
    assert workflow["models"] == standard
    loaders = [n for n in workflow["nodes"] if n["type"] in MODEL_LOADERS]
    assert loaders
    for loader in loaders:
        (entry,) = loader["properties"]["models"]
        assert entry in standard and loader["widgets_values"][0] == entry["name"], loader["id"]
    for entry in standard:
        assert entry["url"].startswith(DOWNLOAD_HOSTS) and entry["name"].endswith(DOWNLOAD_SUFFIXES)
        assert entry["url"].split("?")[0].endswith("/" + entry["name"]), entry
        assert entry["directory"] in ("checkpoints", "diffusion_models", "text_encoders", "vae", "loras"), entry
    # No file only the tests have: the demo names appear nowhere a user would see them.
    for value in strings(workflow) + [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "MarkdownNote"]:
        assert not any(demo in value for demo in DEMO_FILES.values()), value


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_says_which_file_to_replace(name):
    """The LyCORIS file is a placeholder no one has (its name says so) and the note on the canvas names it."""
    workflow = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    placeholders = {p for p in (YOUR_LYCORIS, YOUR_SECOND_LYCORIS) if any(p in v for v in strings(workflow))}
    assert YOUR_LYCORIS in placeholders
    (note,) = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "MarkdownNote"]
    for placeholder in placeholders:
        assert f"**{placeholder}**" in note, placeholder
    assert "models/loras" in note
    # Bold, not code spans: frontend 1.49.6's Vue renderer draws a note's code spans blue on blue (unreadable).
    assert "`" not in note


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_titles_are_the_node_library_names(object_info, name):
    """A node of the pack shows the name the node library lists (no title of its own, or that same name)."""
    workflow = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    for node in workflow["nodes"]:
        if node["type"].startswith("Lycoris"):
            assert node.get("title", object_info[node["type"]]["display_name"]) == \
                object_info[node["type"]]["display_name"], node["id"]


TITLE_HEIGHT = 30  # LiteGraph draws a node's title bar above its pos
MIN_SCALE = 0.6  # below about 0.57 LiteGraph draws nodes without their text (14 px font under its 8 px LOD limit)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_opens_with_every_node_on_screen(name):
    """With the view the workflow saves (extra.ds; the canvas fills the page: page = (graph + offset) * scale), every
    node is in plain view on a 1600x1000 window (make_thumbnails.hidden: not under ComfyUI's bars or the minimap), at
    a scale that draws the nodes' text. scripts/make_thumbnails.py --check measures the same in Chromium, as drawn."""
    workflow = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    scale, (dx, dy) = workflow["extra"]["ds"]["scale"], workflow["extra"]["ds"]["offset"]
    assert scale >= MIN_SCALE
    for node in workflow["nodes"]:
        (x, y), (w, h) = node["pos"], node["size"]
        box = ((x + dx) * scale, (y - TITLE_HEIGHT + dy) * scale, (x + w + dx) * scale, (y + h + dy) * scale)
        assert not make_thumbnails.hidden(box), (node["id"], node["type"], box)


def test_every_example_has_a_thumbnail(server):
    """The template browser asks for /api/workflow_templates/<pack folder>/<name>.jpg for each name the server lists
    (the frontend's getTemplateThumbnailUrl: extension jpg for a custom node pack); each is a small JPEG."""
    listed = server.get_json("api/workflow_templates")[PACK_DIR_NAME]
    assert sorted(listed) == sorted(Path(w).stem for w in WORKFLOWS)
    for stem in listed:
        data = server._request(f"api/workflow_templates/{PACK_DIR_NAME}/{stem}.jpg")
        assert data == (EXAMPLES / f"{stem}.jpg").read_bytes()
        assert len(data) < 100_000, (stem, len(data))
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.width >= 256 and image.height >= 128, (stem, image.size)


# Every example runs here except those the tiny models cannot stand in for (example_models.LOAD_ONLY: the browser
# tests open and lay them out; their nodes run in unit tests).
RUNNABLE = [name for name in WORKFLOWS if Path(name).stem not in LOAD_ONLY]


@pytest.mark.parametrize("name", RUNNABLE)
def test_example_runs(example, name):
    ran = example(name)
    if ran.written is not None:
        assert ran.written.is_file() and ran.written.stat().st_size > 0, f"{name} wrote no {ran.written}"
        (report,) = ran.entry["outputs"][tool_node(ran.prompt)]["text"]
        assert report.strip(), f"{name}: the tool reported nothing"
        return
    assert ran.png.startswith(b"\x89PNG\r\n\x1a\n")
    assert ran.pixels.shape == (64, 64, 3)
    assert ran.pixels.std() > 0, f"{name} made a flat image"


def test_block_weights_example(server, example):
    ran = example("lycoris_block_weights.json")
    prompt = ran.prompt
    weighted = only(prompt, "LycorisBlockWeights")
    assert "default=1" in prompt[weighted]["inputs"]["block_weights"]
    # The plain loader at the same strengths: the same node without block_weights and preset.
    plain = copy.deepcopy(prompt)
    plain[weighted] = {
        "class_type": "LycorisLoader",
        "inputs": {k: v for k, v in prompt[weighted]["inputs"].items() if k not in ("block_weights", "preset")},
    }
    plain_pixels = pixels(server, plain)
    assert not np.array_equal(ran.pixels, plain_pixels), "the block weights changed nothing"
    uniform = pixels(server, changed(prompt, "LycorisBlockWeights", block_weights="default=1", preset="custom"))
    assert np.array_equal(uniform, plain_pixels), "block weights 'default=1' are not exactly the plain loader"

    # LyCORIS Block Info listed the blocks (its panel payload, and its text shown by Preview as Text).
    info = only(prompt, "LycorisBlockInfo")
    (payload,) = ran.entry["outputs"][info]["lycoris"]
    names = [b["name"] for b in payload["blocks"]]
    assert names[0] == "input_blocks.1" and "middle_block.1" in names and "output_blocks.1" in names, names
    (shown,) = [out["text"][0] for out in ran.entry["outputs"].values() if "text" in out]
    assert shown.splitlines()[0].startswith("input_blocks.1: 15 modules, change ")


def parse_stack(text: str) -> list[list[str]]:
    """The stack's active rows as [name, strength_model, strength_clip, block weights] (as LycorisStack reads them)."""
    rows = []
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        name, *rest = (part.strip() for part in line.split("|"))
        model = rest[0] if rest and rest[0] else "1"
        clip = rest[1] if len(rest) > 1 and rest[1] else model
        rows.append([name, model, clip, rest[2] if len(rest) > 2 else ""])
    return rows


def test_stack_example_equals_chained_loaders(server, example):
    ran = example("lycoris_stack.json")
    prompt = ran.prompt
    stack_id, apply_id = only(prompt, "LycorisStack"), only(prompt, "LycorisApplyStack")
    rows = parse_stack(prompt[stack_id]["inputs"]["stack"])
    assert len(rows) == 2 and rows[0][3] == "" and rows[1][3], rows  # one plain row, one with block weights

    chained = {k: v for k, v in copy.deepcopy(prompt).items() if k not in (stack_id, apply_id)}
    model, clip = prompt[apply_id]["inputs"]["model"], prompt[apply_id]["inputs"]["clip"]
    mode = prompt[apply_id]["inputs"].get("strength_mode", "linear")
    for i, (name, strength_model, strength_clip, block_weights) in enumerate(rows):
        inputs = {"model": model, "clip": clip, "lycoris_name": name, "strength_model": float(strength_model),
                  "strength_clip": float(strength_clip), "strength_mode": mode}
        if block_weights:
            node = {"class_type": "LycorisBlockWeights", "inputs": {**inputs, "block_weights": block_weights}}
        else:
            node = {"class_type": "LycorisLoader", "inputs": inputs}
        chained[f"chain{i}"] = node
        model, clip = [f"chain{i}", 0], [f"chain{i}", 1]
    rewire(chained, apply_id, f"chain{len(rows) - 1}")
    assert np.array_equal(ran.pixels, pixels(server, chained)), "the stack is not the chained loaders"

    (lines,) = [out["text"] for key, out in ran.entry["outputs"].items() if key == apply_id]
    assert len(lines) == 2 and "137/137 modules applied" in lines[1], lines


def test_rows_example_equals_chained_loaders(server, example):
    """LyCORIS Loader (Rows) as its example runs it: the same image as its rows as chained loaders (Block Weights for
    the row with block weights), the trigger words it gave written into the prompt as text."""
    ran = example("lycoris_rows.json")
    prompt = ran.prompt
    rows_id = only(prompt, "LycorisRows")
    inputs = prompt[rows_id]["inputs"]
    rows = json.loads(inputs["rows"])
    assert len(rows) == 2 and not rows[0].get("block_weights") and rows[1]["block_weights"], rows
    (report,) = [out["lycoris_rows"] for key, out in ran.entry["outputs"].items() if key == rows_id]
    assert [len(entry["placements"]) for entry in report] == [1, 1]
    assert all(" modules applied" in entry["placements"][0]["line"] for entry in report), report

    chained = {k: v for k, v in copy.deepcopy(prompt).items() if k != rows_id}
    model, clip = inputs["model"], inputs["clip"]
    for i, row in enumerate(rows):
        loader = {"model": model, "clip": clip, "lycoris_name": row["lora"], "strength_model": row["strength"],
                  "strength_clip": row.get("strength_clip", row["strength"]),
                  "strength_mode": inputs["strength_mode"], "apply_mode": inputs["apply_mode"]}
        if row.get("block_weights"):
            chained[f"chain{i}"] = {"class_type": "LycorisBlockWeights",
                                    "inputs": {**loader, "block_weights": row["block_weights"]}}
        else:
            chained[f"chain{i}"] = {"class_type": "LycorisLoader", "inputs": loader}
        model, clip = [f"chain{i}", 0], [f"chain{i}", 1]
    words = ", ".join(dict.fromkeys(word for entry in report for word in entry["trigger_words"]))
    for node in chained.values():
        node["inputs"] = {k: words if v == [rows_id, 3] else v for k, v in node["inputs"].items()}
    rewire(chained, rows_id, f"chain{len(rows) - 1}")
    assert np.array_equal(ran.pixels, pixels(server, chained)), "the rows are not the chained loaders"


def test_schedule_example_fades(server, example):
    ran = example("lycoris_schedule.json")
    prompt = ran.prompt
    fade = prompt[only(prompt, "LycorisFade")]["inputs"]
    assert fade["strength_start"] != fade["strength_end"]
    assert prompt[only(prompt, "KSampler")]["inputs"]["steps"] >= 3
    assert prompt[only(prompt, "SetClipHooks")]["inputs"]["hooks"] == [only(prompt, "LycorisFade"), 0]
    constant = {s: pixels(server, changed(prompt, "LycorisFade", strength_start=s, strength_end=s)) for s in (0.0, 1.0)}
    assert not np.array_equal(constant[0.0], constant[1.0]), "the hook changes nothing at strength 1"
    assert not np.array_equal(ran.pixels, constant[0.0]), "the fade is the same as strength 0 throughout"
    assert not np.array_equal(ran.pixels, constant[1.0]), "the fade is the same as strength 1 throughout"


def test_info_example_feeds_the_trigger_words_into_the_prompt(server, example):
    ran = example("lycoris_info.json")
    info = only(ran.prompt, "LycorisInfo")
    (payload,) = ran.entry["outputs"][info]["lycoris"]
    assert payload["summary"]["trigger_words"] == ["lycodemo"] and payload["applied"] == 65
    texts = [out["text"][0] for out in ran.entry["outputs"].values() if "text" in out]
    assert any(t.startswith("LyCORIS Nodes demo (LoKr + DoRA, random)") for t in texts), texts
    assert any(json.loads(t).get("applied") == 65 for t in texts if t.startswith("{")), texts
    # The trigger word + ", " + the prompt: the loader example with that prompt (same file, seed and sampler).
    loader = example("lycoris_loader.json").prompt
    positive = ran.prompt[only(ran.prompt, "StringConcatenate")]["inputs"]["string_b"]
    (encode,) = [k for k, v in loader.items() if v["class_type"] == "CLIPTextEncode" and v["inputs"]["text"] == positive]
    loader = copy.deepcopy(loader)
    loader[encode]["inputs"]["text"] = "lycodemo, " + positive
    assert np.array_equal(ran.pixels, pixels(server, loader))


def test_bypass_example_matches_the_merged_loader(server, example):
    """The loader example in bypass mode: the same file applied in the layers' forward, weights untouched, gives the
    merged example's image (fp32 on the CPU: equal up to a rounding step of the 8-bit output)."""
    ran = example("lycoris_bypass.json")
    loader = only(ran.prompt, "LycorisLoader")
    assert ran.prompt[loader]["inputs"]["apply_mode"] == "bypass"
    (payload,) = ran.entry["outputs"][loader]["lycoris"]
    assert payload["bypassed"] > 0 and "in bypass" in payload["line"]
    merged = example("lycoris_loader.json").pixels.astype(int)
    assert np.abs(ran.pixels.astype(int) - merged).max() <= 2
    unpatched = pixels(server, changed(ran.prompt, "LycorisLoader", strength_model=0.0, strength_clip=0.0)).astype(int)
    assert np.abs(unpatched - merged).max() > 20, "the file hardly changes the image: the comparison proves nothing"


@pytest.mark.parametrize("name", ["lycoris_block_weights.json", "lycoris_info.json"])
def test_preview_text_keeps_its_line_breaks(example, name):
    """Preview as Text shows the text as Markdown in frontend 1.32.9 (ComfyUI 0.3.75; seen in Chromium: one paragraph,
    the lines joined by spaces), as plain text in 1.49.6. A Markdown hard break (two spaces before the newline) keeps
    the lines in the first and is invisible in the second: every multi-line text the example shows ends its lines so,
    and is otherwise the node's own text."""
    ran = example(name)
    shown = [out["text"][0] for out in ran.entry["outputs"].values() if "text" in out]
    assert shown and all("\n" in text for text in shown), shown
    for text in shown:
        lines = text.split("\n")
        assert all(line.endswith("  ") for line in lines[:-1]), lines[:5]
    # The node's own text, lines intact: the regex only appends the two spaces.
    workflow = json.loads((EXAMPLES / name).read_text(encoding="utf-8"))
    breaks = [n for n in workflow["nodes"] if n["type"] == "RegexReplace"]
    assert len(breaks) == len(shown)
    assert all(n["widgets_values"][1:3] == ["\\n", "  \\n"] for n in breaks)


def sample_with(server, example, written: Path) -> tuple[dict, np.ndarray]:
    """The loader example (same checkpoint, prompts, seed and sampler as the others) with `written` as its file at
    strength 1: (the loader's panel payload, the image's pixels)."""
    loader = example("lycoris_loader.json").prompt
    prompt = changed(loader, "LycorisLoader", lycoris_name=loras_name(server, written), strength_model=1.0,
                     strength_clip=1.0)
    entry = server.wait(server.queue(prompt), timeout=180)
    (payload,) = entry["outputs"][only(prompt, "LycorisLoader")]["lycoris"]
    png = server.image_bytes(entry)
    return payload, np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


TOOL_EXAMPLES = ["lycoris_save.json", "lycoris_resize.json", "lycoris_extract.json", "lycoris_convert.json"]


@pytest.mark.parametrize("name", TOOL_EXAMPLES)
def test_tool_example_file_loads_through_our_loader(server, example, name):
    """The file the tool wrote is offered by the loader right away and every module of it is applied."""
    ran = example(name)
    payload, image = sample_with(server, example, ran.written)
    assert payload["applied"] == payload["total"] > 0, payload["line"]
    assert not payload["problems"] and not payload["unused_keys"], payload
    assert image.std() > 0


def test_save_example_samples_like_its_stack(server, example):
    """Sampling with the saved file gives the image of the stack it was saved from: the stack example's rows are the
    save example's, on the same checkpoint, prompts, seed and sampler. Saved in fp32 here ('exact' is exact up to the
    file's dtype; the example saves fp16), equal up to a rounding step of the 8-bit output."""
    save = example("lycoris_save.json").prompt
    stack = example("lycoris_stack.json")
    assert save[only(save, "LycorisStack")]["inputs"] == stack.prompt[only(stack.prompt, "LycorisStack")]["inputs"]
    fp32 = changed(save, "LycorisSave", dtype="fp32", output_name="lycoris/saved_stack_fp32")
    written = output_file(server, fp32, only(fp32, "LycorisSave"))
    written.unlink(missing_ok=True)
    server.wait(server.queue(fp32), timeout=180)
    _payload, image = sample_with(server, example, written)
    plain = example("lycoris_loader.json").pixels.astype(int)
    assert np.abs(stack.pixels.astype(int) - plain).max() > 20, "the stack hardly differs from one file: proves nothing"
    assert np.abs(image.astype(int) - stack.pixels.astype(int)).max() <= 2


def test_no_unloaded_keys_in_the_server_log(server, example):
    for name in RUNNABLE:
        example(name)  # already run above, unless this test runs alone
    bad = [line for line in server.log_text().splitlines() if any(b in line for b in BAD_LOG_LINES)]
    assert not bad, "\n".join(bad[:20])
