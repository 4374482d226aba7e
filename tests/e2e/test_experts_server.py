"""LyCORIS Loader (Wan 2.2 Experts) on a ComfyUI server (issue #36): two tiny WAN21 experts loaded by ComfyUI's own
Load Diffusion Model, a HIGH/LOW LoHa pair made by lycoris-lora (scripts/make_tiny_wan.py).

Picking the HIGH file puts it on the high-noise model and its LOW sibling on the low-noise one, every module of each
applied, the row's report and the trigger words saying so; what is not two Wan experts, and a row naming a missing
file, are refused with the reason. Exactness (equal to two chains of loaders) is tests/test_row_loader.py's.
"""

from __future__ import annotations

import json

import pytest
from comfy_server import ComfyError

pytestmark = pytest.mark.e2e


def experts_prompt(tiny_wan, rows: list[dict], model_low=("2", 0)) -> dict:
    high, low = (path.name for path in tiny_wan["diffusion_models"])
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": high, "weight_dtype": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": low, "weight_dtype": "default"}},
        "3": {"class_type": "LycorisExperts", "inputs": {"model_high": ["1", 0], "model_low": list(model_low),
                                                         "rows": json.dumps(rows), "apply_mode": "auto"}},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 3]}},
    }


def test_a_high_file_and_its_sibling_on_their_experts(server, tiny_wan):
    lora_high, lora_low = (path.name for path in tiny_wan["loras"])
    entry = server.wait(server.queue(experts_prompt(tiny_wan, [{"lora": lora_high, "strength": 0.8,
                                                                "strength_low": 0.5}])), timeout=120)
    (row,) = entry["outputs"]["3"]["lycoris_rows"]
    assert [(p["file"], p["expert"], p["strength_model"]) for p in row["placements"]] == [
        (lora_high, "high", 0.8), (lora_low, "low", 0.5)]
    for placement in row["placements"]:
        assert "20/20 modules applied" in placement["line"] and placement["verdict"] == "", placement
    assert "pair by name (HIGH / LOW)" in row["notes"][0]
    assert row["trigger_words"] == ["tiny wan high", "tiny wan low"]
    assert entry["outputs"]["4"]["text"] == ["tiny wan high, tiny wan low"]


def test_what_is_not_two_experts_is_refused(server, tiny_wan, assets):
    lora_high = tiny_wan["loras"][0].name
    prompt = experts_prompt(tiny_wan, [{"lora": lora_high}], model_low=("5", 0))
    prompt["5"] = {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": assets["checkpoints"].name}}
    with pytest.raises(ComfyError, match="model_low is SD15, not a Wan 2.2 A14B expert"):
        server.wait(server.queue(prompt), timeout=120)
    with pytest.raises(ComfyError, match=r"row 2 \(gone_HIGH.safetensors\): 'gone_HIGH.safetensors' is not a file"):
        server.queue(experts_prompt(tiny_wan, [{"lora": lora_high}, {"lora": "gone_HIGH.safetensors"}]))
