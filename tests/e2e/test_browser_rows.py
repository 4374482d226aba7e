"""The rows editor of LyCORIS Loader (Rows) (web/panel/rows_editor.js, issue #36) in headless Chromium against a real
ComfyUI server with the pack, and what it writes (web/panel/rows_model.js) under Node against rows.py.

tests/browser/rows.mjs edits the rows through the editor like a user and checks the `rows` text after each step,
the saved workflow, the run's report under each row, that no node covers another, and the page reloaded; then, in
the same page, LyCORIS Loader (Wan 2.2 Experts) on two tiny Wan experts (conftest.tiny_wan): the low-noise strength
and the expert edited through its editor, and the run's report of the row's HIGH/LOW pair, one line per expert. Once
per frontend (frontends.FRONTENDS) and renderer. One browser run each: every check is in the one script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from example_models import DEMO_FILES, SD15_CHECKPOINT, YOUR_LYCORIS, YOUR_SECOND_LYCORIS
from frontends import FRONTENDS
from lycoris_nodes.nodes.loading.rows import Row, parse_rows, rows_text
from make_tiny_wan import EXPERTS, LORAS
from test_browser_panel import (  # noqa: F401 (fixtures)
    ARTIFACTS,
    BROWSER_DIR,
    browser_ready,
    node_or_fail,
    panel_server,
    run_browser_script,
    run_node_tests,
)

SCRIPT = BROWSER_DIR / "rows.mjs"
MODEL_TEST = BROWSER_DIR / "rows_editor.test.mjs"
FILE_A, FILE_B = DEMO_FILES[YOUR_LYCORIS], DEMO_FILES[YOUR_SECOND_LYCORIS]
WAN_HIGH, WAN_LOW = LORAS["high"][0], LORAS["low"][0]  # the tiny HIGH/LOW pair in every e2e server's loras folder


def node(id_, type_, pos, size, inputs, outputs, values):
    return {"id": id_, "type": type_, "pos": pos, "size": size, "flags": {}, "order": id_ - 1, "mode": 0,
            "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": type_}, "widgets_values": values}


def graph(nodes: list[dict], links: list[list]) -> dict:
    return {"last_node_id": len(nodes), "last_link_id": len(links), "nodes": nodes, "links": links, "groups": [],
            "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4}


def rows_workflow() -> dict:
    """Checkpoint -> LyCORIS Loader (Rows) (two rows, model and clip linked, one <lora:...> tag on lora_text) ->
    Preview as Text of its trigger words: the smallest graph that runs the node. The rows node has nothing below or
    to its right, so its editor and report can grow it."""
    initial = rows_text([Row(lora=FILE_A), Row(lora=FILE_B, strength=0.75, strength_clip=0.5)])
    nodes = [
        node(1, "CheckpointLoaderSimple", [40, 120], [315, 98], [],
             [{"name": "MODEL", "type": "MODEL", "links": [1]}, {"name": "CLIP", "type": "CLIP", "links": [2]},
              {"name": "VAE", "type": "VAE", "links": []}], [DEMO_FILES[SD15_CHECKPOINT["name"]]]),
        node(2, "PrimitiveStringMultiline", [40, 300], [315, 110], [],
             [{"name": "STRING", "type": "STRING", "links": [3]}], [f"<lora:{Path(FILE_B).stem}:0.5>"]),
        node(3, "LycorisRows", [400, 120], [440, 260],
             [{"name": "model", "type": "MODEL", "link": 1}, {"name": "clip", "type": "CLIP", "link": 2},
              {"name": "lora_text", "type": "STRING", "link": 3}, {"name": "lora_stack", "type": "LORA_STACK", "link": None}],
             [{"name": "MODEL", "type": "MODEL", "links": []}, {"name": "CLIP", "type": "CLIP", "links": []},
              {"name": "LORA_STACK", "type": "LORA_STACK", "links": []},
              {"name": "trigger_words", "type": "STRING", "links": [4]}],
             [initial, "linear", "auto"]),
        node(4, "PreviewAny", [880, 120], [300, 200], [{"name": "source", "type": "*", "link": 4}], [], []),
    ]
    links = [[1, 1, 0, 3, 0, "MODEL"], [2, 1, 1, 3, 1, "CLIP"], [3, 2, 0, 3, 2, "STRING"], [4, 3, 3, 4, 0, "STRING"]]
    return graph(nodes, links)


def experts_workflow() -> dict:
    """Load Diffusion Model x2 (the tiny Wan experts) -> LyCORIS Loader (Wan 2.2 Experts) (one row naming the HIGH
    file, clip not linked) -> Preview as Text of its trigger words. Nothing below or right of the experts node."""
    initial = rows_text([Row(lora=WAN_HIGH, strength=0.8)])
    model = [{"name": "MODEL", "type": "MODEL", "links": [1]}]
    nodes = [
        node(1, "UNETLoader", [40, 120], [315, 82], [], model, [EXPERTS["high"][0], "default"]),
        node(2, "UNETLoader", [40, 250], [315, 82], [], [{**model[0], "links": [2]}], [EXPERTS["low"][0], "default"]),
        node(3, "LycorisExperts", [400, 120], [440, 260],
             [{"name": "model_high", "type": "MODEL", "link": 1}, {"name": "model_low", "type": "MODEL", "link": 2},
              {"name": "clip", "type": "CLIP", "link": None}, {"name": "lora_text", "type": "STRING", "link": None},
              {"name": "lora_stack", "type": "LORA_STACK", "link": None}],
             [{"name": "MODEL_HIGH", "type": "MODEL", "links": []}, {"name": "MODEL_LOW", "type": "MODEL", "links": []},
              {"name": "CLIP", "type": "CLIP", "links": []}, {"name": "trigger_words", "type": "STRING", "links": [3]}],
             [initial, "linear", "auto"]),
        node(4, "PreviewAny", [880, 120], [300, 200], [{"name": "source", "type": "*", "link": 3}], [], []),
    ]
    links = [[1, 1, 0, 3, 0, "MODEL"], [2, 2, 0, 3, 1, "MODEL"], [3, 3, 3, 4, 0, "STRING"]]
    return graph(nodes, links)


@pytest.mark.e2e
@pytest.mark.parametrize("panel_server", FRONTENDS, indirect=True)
@pytest.mark.parametrize("renderer", ["classic", "vue"])
def test_rows_editor_in_browser(panel_server, tmp_path, renderer):  # noqa: F811
    workflow, experts = tmp_path / "rows.json", tmp_path / "experts.json"
    workflow.write_text(json.dumps(rows_workflow()), encoding="utf-8")
    experts.write_text(json.dumps(experts_workflow()), encoding="utf-8")
    result = run_browser_script(SCRIPT, panel_server, renderer, ARTIFACTS / f"browser_rows_{renderer}.png",
                                WORKFLOW=str(workflow), EXPERTS_WORKFLOW=str(experts))
    assert result["pack_issues"] == []
    # Every text the editor wrote is what rows.py writes for the rows it holds (but for the new row's file, which
    # the server refuses until the user picks one).
    for step in result["steps"]:
        text = step["value"].replace('"lora": ""', '"lora": "(new)"')
        assert rows_text(parse_rows(text)) == text, step
    assert result["saved"][0] == rows_text([Row(lora=FILE_A, strength=0.3),
                                            Row(lora=FILE_B, strength=0.75, strength_clip=0.5)])
    # The experts node: each edit wrote what rows.py writes for the rows it asked for.
    low = Row(lora=WAN_HIGH, strength=0.8, strength_low=0.5)
    assert [(s["step"], s["value"]) for s in result["experts"]["steps"]] == [
        ("low strength 0.5", rows_text([low])),
        ("expert both", rows_text([Row(lora=WAN_HIGH, strength=0.8, strength_low=0.5, expert="both")])),
        ("expert auto again", rows_text([low])),
    ]
    high_line, low_line = result["experts"]["report"]["lines"]  # the script checked each in full
    assert WAN_HIGH in high_line and WAN_LOW in low_line and "modules applied" in high_line + low_line
    assert result["experts"]["report"]["triggers"] == ["trigger words: tiny wan high, tiny wan low"]


def test_rows_model_under_node():
    """web/panel/rows_model.js (what the editor reads and writes) under Node's own test runner."""
    run_node_tests(MODEL_TEST)


# Texts rows.py reads: the editor must write each back as rows_text does.
CROSS_TEXTS = [
    "[]",
    '[{"lora": "a.safetensors"}]',
    '[{"on": false, "lora": "sub/b.safetensors", "strength": 2, "strength_clip": 0, "block_weights": "default=0.5"}]',
    '[{"lora": "x", "strength": 1e-05, "strength_low": -0.0, "expert": "low"}, {"lora": "y", "strength": 12345678901234567890}]',
    '[{"lora": "w\\u00e9\\"\\\\q\\n", "strength": 0.1, "strength_clip": null, "expert": "auto", "block_weights": ""}]',
    '  [ {"strength": 0.30000000000000004, "lora": "z", "on": true, "expert": "both", "strength_low": 1.5e300} ]  ',
]
# Texts rows.py refuses, which the editor must not read as rows either (it would rewrite them).
REFUSED = ['{"lora": "a"}', '[{"lora": "a", "weight": 1}]', '[{"lora": "a", "on": 1}]', '[{"lora": "a", "expert": "mid"}]',
           '[{"lora": "a", "strength": "1"}]', '[{"lora": "a", "strength": NaN}]', "[1]", "[{"]


def test_rows_text_like_rows_py(tmp_path):
    """What the editor writes for a text is character for character what rows.py's rows_text writes for it."""
    (tmp_path / "texts.json").write_text(json.dumps(CROSS_TEXTS + REFUSED))
    proc = subprocess.run([node_or_fail(), str(MODEL_TEST)], cwd=BROWSER_DIR, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "CROSS_CHECK": str(tmp_path / "texts.json")},
                          stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    js = json.loads(proc.stdout.strip().splitlines()[-1])
    assert js[:len(CROSS_TEXTS)] == [rows_text(parse_rows(text)) for text in CROSS_TEXTS]
    assert js[len(CROSS_TEXTS):] == [None] * len(REFUSED)
