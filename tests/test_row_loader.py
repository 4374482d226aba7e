"""LyCORIS Loader (Rows) and LyCORIS Loader (Wan 2.2 Experts) (issue #36): many files in one node.

Truth: chained LyCORIS Loaders with the same files, strengths, block weights and apply mode (the documented
equivalence): bitwise equal weights in merge and auto, and bitwise equal samples in bypass (the same computations in
the same order). The rows are real lycoris-lora files on the tiny SD1.5 (test_block_weights.make_reference) and
LightX2V-style files on ComfyUI's own WAN21 at a tiny width, two instances with different weights standing for Wan
2.2 A14B's high-noise and low-noise experts (ComfyUI loads both as WAN21; test_distill_diffs.lightx2v_file).
"""

import asyncio
import json
from unittest.mock import patch

import comfy.model_management
import comfy.model_patcher
import execution
import pytest
import test_block_weights
import test_nodes
import torch
from comfy_execution.graph import DynamicPrompt
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.nodes.glue import inputs as glue_inputs
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from lycoris_nodes.nodes.loading.row_loader import LycorisExperts, LycorisRows
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.scheduling.stack import LycorisApplyStack
from node_runner import execute
from safetensors.torch import load_file, save_file
from test_block_weights import loaded_weights, make_reference, run, same_bits
from test_bypass_nodes import conds, sample  # noqa: F401 (fixture)
from test_distill_diffs import lightx2v_file
from test_nodes import weights_after_full_load, write
from test_stack_schedule import UNET_KEYS, assert_same_weights, weights
from test_video_dit_peft import ARCHS, comfy_model

import nodes as comfy_nodes  # ComfyUI's nodes.py

sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras
no_panel_measurement = test_block_weights.no_panel_measurement  # autouse

CPU = torch.device("cpu")
MODES = ("merge", "bypass", "auto")


@pytest.fixture(scope="module")
def files(sd15, tmp_path_factory):
    directory = tmp_path_factory.mktemp("rows_reference")
    return {"glora": make_reference("glora", *sd15, directory, seed=3),
            "lokr_dora": make_reference("lokr_dora", *sd15, directory),
            "locon": make_reference("locon", *sd15, directory)}


@pytest.fixture()
def installed(files, loras):
    names = {key: ref.install(loras, f"{key}.safetensors") for key, ref in files.items()}
    # The LoCon again, in a subfolder and with a trigger phrase in its metadata (as kohya's --training_comment-less
    # files carry `modelspec.trigger_phrase`), for tags written without folder or extension.
    (loras / "styles").mkdir()
    save_file(load_file(str(loras / names["locon"])), str(loras / "styles" / "ink.safetensors"),
              metadata={"modelspec.trigger_phrase": "inkwash, brush strokes"})
    names["ink"] = "styles/ink.safetensors"
    return names


def rows_text(*rows: dict) -> str:
    return json.dumps(list(rows))


def chained(model, clip, steps, mode="merge"):
    """LyCORIS Loaders one after another, as a user would wire them: (name, strength_model, strength_clip[, block
    weights])."""
    for i, (name, strength_model, strength_clip, *block_weights) in enumerate(steps):
        common = {"model": model, "lycoris_name": name, "strength_model": strength_model, "apply_mode": mode}
        if block_weights:
            model, clip = execute(LycorisBlockWeights, f"chain{i}", clip=clip, strength_clip=strength_clip,
                                  block_weights=block_weights[0], preset="custom", **common).result
        elif clip is None:
            (model,) = execute(LycorisLoaderModelOnly, f"chain{i}", **common).result
        else:
            model, clip = execute(LycorisLoader, f"chain{i}", clip=clip, strength_clip=strength_clip, **common).result
    return model, clip


# --- one model ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_rows_equal_chained_loaders(sd15, installed, conds, mode):  # noqa: F811
    """Rows in order, an off row skipped, a row with its own clip strength and block weights: exactly the chain."""
    model, clip = sd15
    bw = "te=0.25; middle_block=0; output_blocks.0-1=2"
    rows = rows_text({"lora": installed["glora"], "strength": 0.75, "strength_clip": 0.5},
                     {"on": False, "lora": installed["locon"], "strength": 1.0},
                     {"lora": installed["lokr_dora"], "strength": -0.5, "block_weights": bw},
                     {"lora": installed["locon"], "strength": 1.5, "strength_clip": 0.0})
    out = execute(LycorisRows, "40", model=model, clip=clip, rows=rows, apply_mode=mode)
    by_rows_model, by_rows_clip, stack, words = out.result
    chain_model, chain_clip = chained(model, clip, [(installed["glora"], 0.75, 0.5),
                                                    (installed["lokr_dora"], -0.5, -0.5, bw),
                                                    (installed["locon"], 1.5, 0.0)], mode)
    assert_same_weights(weights(by_rows_model, by_rows_clip), weights(chain_model, chain_clip), "rows vs chain")
    if mode == "bypass":
        assert torch.equal(sample(by_rows_model, conds), sample(chain_model, conds))
        assert set(by_rows_model.injections) == {"lycoris:40:0:0", "lycoris:40:2:0", "lycoris:40:3:0"}
    assert [tuple(item) for item in stack] == [(installed["glora"], 0.75, 0.5), (installed["lokr_dora"], -0.5, -0.5),
                                               (installed["locon"], 1.5, 0.0)]
    assert stack[1].block_weights == bw and words == ""
    report = out.ui["lycoris_rows"]
    assert [(e["row"], e["off"], len(e["placements"])) for e in report] == [(1, False, 1), (2, True, 0),
                                                                             (3, False, 1), (4, False, 1)]
    assert all(" modules applied" in e["placements"][0]["line"] for e in report if not e["off"])
    with_off_row = weights(*chained(model, clip, [(installed["glora"], 0.75, 0.5), (installed["locon"], 1.0, 1.0),
                                                  (installed["lokr_dora"], -0.5, -0.5, bw),
                                                  (installed["locon"], 1.5, 0.0)], mode))
    if mode != "bypass":
        assert not all(same_bits(a, b) for a, b in zip(weights(by_rows_model, by_rows_clip).values(),
                                                        with_off_row.values(), strict=True)), "row 2 must be off"


def test_stack_then_rows_then_tags(sd15, installed):
    """lora_stack's items first, then the rows, then lora_text's tags (a name without folder or extension, a tag
    with a model and a clip strength); LORA_STACK out is the three in that order; trigger words from the files'
    metadata."""
    model, clip = sd15
    foreign = [(installed["lokr_dora"], 0.5, 1.25)]
    text = "a portrait, <lora:ink:0.8:0.3> soft light, <lyco:glora.safetensors>"
    rows = rows_text({"lora": installed["locon"], "strength": -0.5})
    got_model, got_clip, stack, words = run(LycorisRows, model=model, clip=clip, rows=rows, lora_text=text,
                                            lora_stack=foreign)
    steps = [(installed["lokr_dora"], 0.5, 1.25), (installed["locon"], -0.5, -0.5), ("styles/ink.safetensors", 0.8, 0.3),
             (installed["glora"], 1.0, 1.0)]
    assert_same_weights(weights(got_model, got_clip), weights(*chained(model, clip, steps)), "stack, rows, tags")
    assert [tuple(item) for item in stack] == steps
    assert words == "inkwash, brush strokes"


def test_without_clip_the_rows_change_the_model_only(sd15, installed):
    model, _clip = sd15
    rows = rows_text({"lora": installed["locon"], "strength": 1.0, "strength_clip": 2.0})
    out = execute(LycorisRows, model=model, rows=rows)
    got_model, got_clip, _stack, _words = out.result
    assert got_clip is None
    (placement,) = out.ui["lycoris_rows"][0]["placements"]
    assert placement["strength_model"] == 1.0 and placement["strength_clip"] is None  # no text encoder: no strength
    (chain,) = run(LycorisLoaderModelOnly, model=model, lycoris_name=installed["locon"], strength_model=1.0)
    assert_same_weights(loaded_weights(got_model, UNET_KEYS), loaded_weights(chain, UNET_KEYS), "model only")


def test_a_row_at_strength_zero_is_reported_not_applied(sd15, installed):
    model, clip = sd15
    out = execute(LycorisRows, model=model, clip=clip,
                  rows=rows_text({"lora": installed["locon"], "strength": 0, "strength_clip": 0}))
    assert out.result[0] is model and out.result[1] is clip
    assert out.ui["lycoris_rows"][0]["placements"][0]["line"].endswith("strength 0, not applied")


@pytest.mark.parametrize("rows,message", [
    ('[{"lora": "nowhere.safetensors"}]', "row 1 (nowhere.safetensors): 'nowhere.safetensors' is not a file"),
    ('[{"lora": "{locon}", "strenght": 1}]', "row 1 has 'strenght', which no row takes"),
    ('[{"lora": "{locon}"}, {"lora": "{locon}", "strength": "high"}]', "row 2 ({locon}): 'strength' must be a finite"),
    ("[{]", "the rows are not JSON"),
])
def test_bad_rows_are_refused_naming_the_row(sd15, installed, rows, message):
    model, clip = sd15
    rows, message = rows.replace("{locon}", installed["locon"]), message.replace("{locon}", installed["locon"])
    assert message in LycorisRows.validate_inputs(rows=rows)
    with pytest.raises(LycorisError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(LycorisRows, model=model, clip=clip, rows=rows)


@pytest.mark.parametrize("item,message", [
    (("{locon}", "strong", 1.0), r"lora_stack item 2 is \('{locon}', 'strong', 1.0\), not \(file, strength_model"),
    (("{locon}",), r"lora_stack item 2 is \('{locon}',\), not"),
    (("{locon}", float("nan"), 1.0), r"lora_stack item 2 \({locon}\): its strengths must be finite"),
])
def test_a_malformed_stack_item_is_refused_naming_it(sd15, installed, item, message):
    model, clip = sd15
    item = tuple(v.replace("{locon}", installed["locon"]) if isinstance(v, str) else v for v in item)
    stack = [(installed["glora"], 1.0, 1.0), item]
    with pytest.raises(LycorisError, match=message.replace("{locon}", installed["locon"])):
        run(LycorisRows, model=model, clip=clip, rows="[]", lora_stack=stack)
    with pytest.raises(LycorisError, match=message.replace("{locon}", installed["locon"])):
        run(LycorisApplyStack, model=model, clip=clip, lora_stack=stack)  # the same check (glue/lora_stack.py)


def test_an_off_row_may_name_a_missing_file(sd15, installed):
    """A shared workflow whose off row names a file this user lacks still runs: only rows that apply must exist."""
    model, clip = sd15
    rows = rows_text({"on": False, "lora": "someone_elses.safetensors"}, {"lora": installed["locon"]})
    assert LycorisRows.validate_inputs(rows=rows) is True
    got_model, got_clip, _stack, _words = run(LycorisRows, model=model, clip=clip, rows=rows)
    assert_same_weights(weights(got_model, got_clip), weights(*chained(model, clip, [(installed["locon"], 1, 1)])),
                        "the on row alone")


def test_a_broken_file_fails_before_anything_is_applied(sd15, installed, loras):
    """Every file is read before the first is applied: the error names the row and the file."""
    model, clip = sd15
    data = (loras / installed["locon"]).read_bytes()
    (loras / "cut.safetensors").write_bytes(data[: len(data) // 2])
    rows = rows_text({"lora": installed["glora"]}, {"lora": "cut.safetensors"})
    with pytest.raises(LycorisError, match=r"row 2 \(cut.safetensors\): .*cut.safetensors"):
        run(LycorisRows, model=model, clip=clip, rows=rows)
    assert model.patches == {} and clip.patcher.patches == {}


@pytest.mark.parametrize("text,message", [
    ("<lora:locon:0.5", "'<lora:locon:0.5' is not a tag"),
    ("<lora:missing:1>", "no file 'missing'"),
    ("<lora:locon:1:2:3>", "has 3 strengths"),
])
def test_bad_lora_text_is_an_error_naming_the_fragment(sd15, installed, text, message):
    model, clip = sd15
    with pytest.raises(LycorisError, match=message):
        run(LycorisRows, model=model, clip=clip, rows="[]", lora_text=text)


def test_fingerprint_follows_a_rewritten_file(installed, loras):
    rows = rows_text({"lora": installed["locon"]})
    before = LycorisRows.fingerprint_inputs(rows=rows)
    write(loras, installed["locon"], {k: v * 2 for k, v in load_file(str(loras / installed["locon"])).items()})
    assert LycorisRows.fingerprint_inputs(rows=rows) != before


def comfy_fingerprint(node_class, inputs: dict):
    """The fingerprint ComfyUI's own executor computes for a node of `node_class` with these prompt inputs (a link
    is [node id, output]): execution.IsChangedCache, which passes linked inputs as None."""
    # node "1" only stands at the other end of the links: IsChangedCache reads node "2" alone
    prompt = {"1": {"class_type": "LycorisTextSource", "inputs": {}},
              "2": {"class_type": node_class.__name__, "inputs": inputs}}
    mappings = {**comfy_nodes.NODE_CLASS_MAPPINGS, node_class.__name__: node_class}
    with patch.dict(comfy_nodes.NODE_CLASS_MAPPINGS, mappings):
        cache = execution.IsChangedCache("fingerprint", DynamicPrompt(prompt), None)
        return asyncio.run(cache.get("2"))


@pytest.mark.parametrize("node, linked", [(LycorisRows, "lora_text"), (LycorisRows, "lora_stack"),
                                          (LycorisApplyStack, "lora_stack")])
def test_a_file_named_by_a_link_and_rewritten_runs_the_node_again(sd15, installed, loras, node, linked,
                                                                  monkeypatch):
    """A file named only by a linked lora_text or lora_stack (another pack's stacker, a text node): ComfyUI
    fingerprints the node without the link's value (execution.IsChangedCache). The node's fingerprint stays what it
    was when the node ran (queued again unchanged, it is served from ComfyUI's cache, and so is what follows it);
    rewriting the file under the same name changes it once (the node runs again), and every later rewrite to a value
    never seen before."""
    monkeypatch.setattr(glue_inputs, "LINKED_FILES", glue_inputs.LinkedFiles())  # no file from an earlier test
    model, clip = sd15
    name = installed["lokr_dora"]
    value = {"lora_text": f"<lora:{name}:0.5>", "lora_stack": [(name, 0.5, 0.5)]}[linked]
    widgets = {"rows": "[]"} if node is LycorisRows else {}
    inputs = {"model": ["1", 0], "clip": ["1", 0], linked: ["1", 0], **widgets}

    def rewrite(factor: float) -> None:
        write(loras, name, {k: v * factor for k, v in load_file(str(loras / name)).items()})

    queued = comfy_fingerprint(node, inputs)  # the first queue: computed before the node runs
    run(node, model=model, clip=clip, **widgets, **{linked: value})
    assert comfy_fingerprint(node, inputs) == queued  # queued again, nothing rewritten: cached
    rewrite(2.0)
    after_rewrite = comfy_fingerprint(node, inputs)
    assert after_rewrite != queued
    assert comfy_fingerprint(node, inputs) == after_rewrite  # and then cached again
    rewrite(0.5)
    assert comfy_fingerprint(node, inputs) not in (queued, after_rewrite)


# --- Wan 2.2 A14B's two experts ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def experts():
    """(high, low) patchers of ComfyUI's tiny WAN21, the low one with other weights, and their state dicts."""
    out = []
    for seed in (0, 1):
        model = comfy_model(ARCHS["wan21-t2v"])
        if seed:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for param in model.diffusion_model.parameters():
                    param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen))
        out.append(comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU))
    yield tuple(out)
    comfy.model_management.unload_all_models()


def wan_keys(patcher) -> list[str]:
    return [k for k in patcher.model.state_dict() if k.startswith("diffusion_model.blocks.") and k.endswith("weight")]


@pytest.fixture()
def wan_files(experts, loras):
    base = {k.removeprefix("diffusion_model."): v for k, v in experts[0].model.state_dict().items()
            if k.startswith("diffusion_model.")}
    (loras / "wan").mkdir()
    names = {
        "high": "wan/motion_HIGH_fp16.safetensors", "low": "wan/motion_LOW_fp16.safetensors",
        "style": "wan/style.safetensors", "lonely": "wan/lonely_high_noise.safetensors",
        "mislabeled": "wan/sway_HN.safetensors",
    }
    metadata = {"mislabeled": {"ss_sd_model_name": "wan2.2_t2v_low_noise_14B_fp16.safetensors"}}
    for seed, (key, name) in enumerate(names.items(), start=11):
        save_file(lightx2v_file(base, seed), str(loras / name), metadata=metadata.get(key))
    return names


def expert_weights(model) -> dict[str, torch.Tensor]:
    return weights_after_full_load(model, wan_keys(model))


@pytest.mark.parametrize("mode", ("merge", "auto"))
def test_each_expert_gets_exactly_its_files(experts, wan_files, mode):
    """A HIGH file picked: it goes to the high-noise model and its LOW sibling to the low-noise one, each at its own
    strength; a file without an expert's word on both; explicit high and low rows; equal to two hand-wired chains."""
    high, low = experts
    f = wan_files
    rows = rows_text({"lora": f["high"], "strength": 0.8, "strength_low": 0.6},
                     {"lora": f["style"], "strength": 1.0, "strength_low": 0.5},
                     {"lora": f["lonely"], "strength": 1.25},
                     {"lora": f["style"], "strength": 2.0, "expert": "low"})
    out = execute(LycorisExperts, "50", model_high=high, model_low=low, rows=rows, apply_mode=mode)
    got_high, got_low, clip, _words = out.result
    assert clip is None
    chain_high, _ = chained(high, None, [(f["high"], 0.8, 0), (f["style"], 1.0, 0), (f["lonely"], 1.25, 0)], mode)
    chain_low, _ = chained(low, None, [(f["low"], 0.6, 0), (f["style"], 0.5, 0), (f["style"], 2.0, 0)], mode)
    assert_same_weights(expert_weights(got_high), expert_weights(chain_high), "high-noise expert")
    assert_same_weights(expert_weights(got_low), expert_weights(chain_low), "low-noise expert")
    wrong_way, _ = chained(high, None, [(f["low"], 0.8, 0), (f["style"], 1.0, 0), (f["lonely"], 1.25, 0)], mode)
    assert not all(same_bits(a, b) for a, b in zip(expert_weights(got_high).values(),
                                                   expert_weights(wrong_way).values(), strict=True))
    report = out.ui["lycoris_rows"]
    assert [[(p["file"], p["expert"]) for p in e["placements"]] for e in report] == [
        [(f["high"], "high"), (f["low"], "low")], [(f["style"], "high"), (f["style"], "low")], [(f["lonely"], "high")],
        [(f["style"], "low")]]
    assert "HIGH / LOW" in report[0]["notes"][0] and f["low"] in report[0]["notes"][0]
    assert "on both experts" in report[1]["notes"][0]
    assert "no 'wan/lonely_low_noise.safetensors'" in report[2]["notes"][0]
    assert report[3]["notes"] == []
    (line,) = [line for line in out.ui["text"] if line.startswith(f"row 1 ({f['high']}), low-noise expert: ")]
    assert "motion_LOW_fp16.safetensors: " in line and " modules applied" in line


def test_picking_the_low_file_finds_the_high_one(experts, wan_files):
    high, low = experts
    f = wan_files
    got_high, got_low, _c, _w = run(LycorisExperts, model_high=high, model_low=low,
                                    rows=rows_text({"lora": f["low"], "strength": 0.7, "strength_low": 0.9}))
    assert_same_weights(expert_weights(got_high), expert_weights(chained(high, None, [(f["high"], 0.7, 0)])[0]), "high")
    assert_same_weights(expert_weights(got_low), expert_weights(chained(low, None, [(f["low"], 0.9, 0)])[0]), "low")


def test_metadata_naming_the_other_expert_is_said(experts, wan_files):
    high, low = experts
    out = execute(LycorisExperts, model_high=high, model_low=low, rows=rows_text({"lora": wan_files["mislabeled"]}))
    (note,) = [n for n in out.ui["lycoris_rows"][0]["notes"] if "metadata" in n]
    assert "low-noise expert (ss_sd_model_name = wan2.2_t2v_low_noise_14B_fp16.safetensors)" in note
    assert "goes to the high-noise one" in note


def test_tags_and_stack_on_the_experts_node_read_the_names_too(experts, wan_files):
    high, low = experts
    f = wan_files
    got_high, got_low, _c, _w = run(LycorisExperts, model_high=high, model_low=low, rows="[]",
                                    lora_text="<lora:motion_HIGH_fp16:0.5>", lora_stack=[(f["style"], 0.25, 0.25)])
    assert_same_weights(expert_weights(got_high),
                        expert_weights(chained(high, None, [(f["style"], 0.25, 0), (f["high"], 0.5, 0)])[0]), "high")
    assert_same_weights(expert_weights(got_low),
                        expert_weights(chained(low, None, [(f["style"], 0.25, 0), (f["low"], 0.5, 0)])[0]), "low")


def test_the_experts_fingerprint_follows_a_rewritten_sibling(wan_files, loras):
    """On the class clone ComfyUI calls it on (PREPARE_CLASS_CLONE): rewriting the LOW file of a row that names the
    HIGH one re-runs the node."""
    node = LycorisExperts.PREPARE_CLASS_CLONE({})
    rows = rows_text({"lora": wan_files["high"]})
    before = node.fingerprint_inputs(rows=rows)
    low = loras / wan_files["low"]
    write(loras, wan_files["low"], {k: v * 2 for k, v in load_file(str(low)).items()})
    assert node.fingerprint_inputs(rows=rows) != before


def test_the_experts_node_refuses_what_is_not_two_wan_experts(sd15, experts, wan_files):
    high, _low = experts
    rows = rows_text({"lora": wan_files["style"]})
    with pytest.raises(LycorisError, match="model_low is SD15.*not a Wan 2.2 A14B expert"):
        run(LycorisExperts, model_high=high, model_low=sd15[0], rows=rows)
    with pytest.raises(LycorisError, match="the same model"):
        run(LycorisExperts, model_high=high, model_low=high.clone(), rows=rows)


def test_the_wan_example_puts_the_lightx2v_pair_on_its_experts():
    """The Wan 2.2 example (example_workflows/lycoris_wan22_experts.json; too big to run here) as its node reads it
    with the two lightx2v files in the loras folder: the high_noise file picked, each file on its expert, the
    placeholder row off; and its high-noise input is the high-noise model."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from example_models import EXAMPLES, WAN22_T2V
    from lycoris_nodes.nodes.loading.row_loader import Entry, place_on_experts
    from lycoris_nodes.nodes.loading.rows import parse_rows

    workflow = json.loads((EXAMPLES / "lycoris_wan22_experts.json").read_text(encoding="utf-8"))
    nodes = {node["id"]: node for node in workflow["nodes"]}
    (experts_node,) = [node for node in nodes.values() if node["type"] == "LycorisExperts"]
    links = {link[0]: link for link in workflow["links"]}
    feeds = {inp["name"]: nodes[links[inp["link"]][1]] for inp in experts_node["inputs"] if inp["link"]}
    assert feeds["model_high"]["widgets_values"][0] == WAN22_T2V["high"]["name"]
    assert feeds["model_low"]["widgets_values"][0] == WAN22_T2V["low"]["name"]
    listed = [WAN22_T2V["lora_high"]["name"], WAN22_T2V["lora_low"]["name"]]
    rows = parse_rows(experts_node["widgets_values"][0])
    entries = [Entry("row", i, row.lora, on=row.on) for i, row in enumerate(rows, start=1)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lycoris_nodes.nodes.glue.lora_files.listed_name", lambda name: name if name in listed else None)
        for entry, row in zip(entries, rows, strict=True):
            place_on_experts(entry, row, listed)
    assert [(p.file, p.expert) for p in entries[0].placements] == [(listed[0], "high"), (listed[1], "low")]
    assert entries[1].on is False and entries[1].placements == []
