"""Exact everywhere on the real server: the ComfyUI setting, written through ComfyUI's own settings API as the
settings dialog writes it, switches core's Load LoRA at the next queue (issue #25).

The frontend, on a switch, asks the server to drop what its nodes computed (POST /free, web/lycoris_panel.js):
ComfyUI keeps a node's outputs while its inputs stay the same, so a Load LoRA run before the switch would otherwise
hand on the model it patched the old way. The test does what the frontend does.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
from test_server_demo import loader_id, run, with_inputs

pytestmark = pytest.mark.e2e

SETTING = "LycorisNodes.ExactEverywhere"
LINE = "LyCORIS (everywhere) "


def switch(server, on: bool) -> None:
    """What the settings dialog and web/lycoris_panel.js's onChange send."""
    server._request(f"api/settings/{SETTING}", on)
    assert server.get_json(f"api/settings/{SETTING}") is on
    server._request("api/free", {"unload_models": True, "free_memory": True})
    time.sleep(1.0)  # the prompt worker drops its caches when it wakes for the flag, before it takes the next prompt


def with_core_loader(prompt: dict) -> dict:
    """The example with ComfyUI's own Load LoRA in place of LyCORIS Loader, on the same file and strengths."""
    core = copy.deepcopy(prompt)
    lid = loader_id(prompt)
    inputs = prompt[lid]["inputs"]
    core[lid] = {"class_type": "LoraLoader",
                 "inputs": {"model": inputs["model"], "clip": inputs["clip"], "lora_name": inputs["lycoris_name"],
                            "strength_model": inputs["strength_model"], "strength_clip": inputs["strength_clip"]}}
    return core


def test_the_setting_makes_core_load_lora_give_our_image_from_the_next_queue(server, prompt):
    core = with_core_loader(prompt)
    file = prompt[loader_id(prompt)]["inputs"]["lycoris_name"]
    try:
        _, before = run(server, core)  # off: ComfyUI's own path
        assert LINE not in server.log_text()
        switch(server, True)
        _, on = run(server, core)
        assert f"{LINE}{file}: " in server.log_text()  # the coverage line, from core's own node
        _, ours = run(server, with_inputs(prompt, apply_mode="merge"))
        assert np.array_equal(on, ours)
        switch(server, False)
        lines = server.log_text().count(LINE)
        _, off = run(server, core)
        assert server.log_text().count(LINE) == lines  # loaded again, ComfyUI's way
        assert np.array_equal(off, before)
    finally:
        switch(server, False)
