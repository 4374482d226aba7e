"""ui_to_api (UI workflow -> API prompt) on hand-made graphs; no server needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from comfy_server import ui_to_api
from example_models import DEMO_FILES, YOUR_LYCORIS, demo_workflow

# The parts of /object_info that ui_to_api reads, shaped like ComfyUI 0.3.75's answer.
OBJECT_INFO = {
    "Loader": {"input": {"required": {"name": [["a.safetensors", "b.safetensors"], {}]}}},
    "Patch": {
        "input": {
            "required": {"model": ["MODEL", {}], "strength": ["FLOAT", {"default": 1.0}]},
            "optional": {"mode": [["linear", "lycoris"], {}]},
        }
    },
    "Sampler": {
        "input": {
            "required": {
                "model": ["MODEL", {}],
                "seed": ["INT", {"default": 0, "control_after_generate": True}],
                "steps": ["INT", {"default": 20}],
                "latent": ["LATENT", {"forceInput": True}],
            }
        }
    },
}


def node(node_id, kind, widgets=(), inputs=(), mode=0):
    return {"id": node_id, "type": kind, "mode": mode, "inputs": list(inputs), "widgets_values": list(widgets)}


def graph(patch_mode=0, with_reroute=False):
    nodes = [
        node(1, "Loader", ["b.safetensors"]),
        node(2, "Patch", [0.5, "lycoris"], [{"name": "model", "type": "MODEL", "link": 1}], mode=patch_mode),
        node(3, "Sampler", [7, "fixed", 4], [{"name": "model", "type": "MODEL", "link": 2}]),
        node(4, "Note", ["just text"]),
    ]
    links = [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 3, 0, "MODEL"]]
    if with_reroute:
        nodes.append(node(5, "Reroute", [], [{"name": "", "type": "*", "link": 3}]))
        links = [[1, 1, 0, 2, 0, "MODEL"], [3, 2, 0, 5, 0, "MODEL"], [2, 5, 0, 3, 0, "MODEL"]]
    return {"nodes": nodes, "links": links}


def test_widgets_links_and_seed_control():
    prompt = ui_to_api(graph(), OBJECT_INFO)
    assert prompt == {
        "1": {"class_type": "Loader", "inputs": {"name": "b.safetensors"}, "_meta": {"title": "Loader"}},
        "2": {
            "class_type": "Patch",
            "inputs": {"strength": 0.5, "mode": "lycoris", "model": ["1", 0]},
            "_meta": {"title": "Patch"},
        },
        # "fixed" after the seed is the frontend's control_after_generate value, not a widget of its own.
        "3": {
            "class_type": "Sampler",
            "inputs": {"seed": 7, "steps": 4, "model": ["2", 0]},
            "_meta": {"title": "Sampler"},
        },
    }


def test_bypassed_node_passes_its_input_through():
    prompt = ui_to_api(graph(patch_mode=4), OBJECT_INFO)
    assert "2" not in prompt
    assert prompt["3"]["inputs"]["model"] == ["1", 0]


def test_muted_node_and_its_links_are_dropped():
    prompt = ui_to_api(graph(patch_mode=2), OBJECT_INFO)
    assert "2" not in prompt
    assert "model" not in prompt["3"]["inputs"]


def test_reroute_is_followed():
    prompt = ui_to_api(graph(with_reroute=True), OBJECT_INFO)
    assert "5" not in prompt
    assert prompt["3"]["inputs"]["model"] == ["2", 0]


def test_unknown_node_type_is_reported():
    with pytest.raises(KeyError, match="Missing"):
        ui_to_api({"nodes": [node(1, "Missing")], "links": []}, OBJECT_INFO)


def test_example_workflow_is_a_valid_ui_graph():
    workflow = json.loads((REPO_ROOT / "example_workflows" / "lycoris_loader.json").read_text())
    assert workflow["version"] == 0.4
    ids = {n["id"] for n in workflow["nodes"]}
    assert workflow["last_node_id"] == max(ids)
    assert workflow["last_link_id"] == max(link[0] for link in workflow["links"])
    for link_id, origin, origin_slot, target, target_slot, kind in workflow["links"]:
        src = next(n for n in workflow["nodes"] if n["id"] == origin)
        dst = next(n for n in workflow["nodes"] if n["id"] == target)
        assert link_id in src["outputs"][origin_slot]["links"]
        assert dst["inputs"][target_slot]["link"] == link_id
        assert src["outputs"][origin_slot]["type"] == dst["inputs"][target_slot]["type"] == kind
    (loader,) = [n for n in workflow["nodes"] if n["type"] == "LycorisLoader"]
    assert loader["widgets_values"] == [YOUR_LYCORIS, 1.0, 1.0, "linear", "merge"]
    # What the tests and `make demo` run: the same graph on the demo file.
    (demo,) = [n for n in demo_workflow("lycoris_loader.json")["nodes"] if n["type"] == "LycorisLoader"]
    assert demo["widgets_values"] == [DEMO_FILES[YOUR_LYCORIS], 1.0, 1.0, "linear", "merge"]
