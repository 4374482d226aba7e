"""The model files the example workflows name, and what the tests and `make demo` run in their place.

The examples in example_workflows/ are made for users, the way ComfyUI's own templates are: the checkpoint is the
standard public SD1.5 file under its usual name, with the frontend's download metadata on the node
(``properties.models``: name, url, directory; ComfyUI's own "default" template uses the same entry), and the LyCORIS
files are placeholders the user replaces with a file of their own. The tests and the demo cannot download 2 GB, so
they run the same graphs on the tiny random SD1.5 (scripts/make_tiny_sd15.py) and the demo LyCORIS files
(scripts/make_demo_lycoris.py), small and fast: ``for_demo`` below is the one place that says how.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

# The checkpoint of ComfyUI's own SD1.5 templates (comfyui_workflow_templates: default.json), with the same
# download metadata. The frontend offers the download when a node's widget names a file that is missing and the
# node's properties.models has an entry for that name with a url (huggingface.co or civitai.com) and a directory.
SD15_CHECKPOINT = {
    "name": "v1-5-pruned-emaonly-fp16.safetensors",
    "url": "https://huggingface.co/Comfy-Org/stable-diffusion-v1-5-archive/resolve/main/"
    "v1-5-pruned-emaonly-fp16.safetensors?download=true",
    "directory": "checkpoints",
}

# Wan 2.2 A14B text to video as ComfyUI's own template (comfyui_workflow_templates_media_video,
# video_wan2_2_14B_t2v.json) names it, with the same download metadata, and its lightx2v 4-step LoRA pair, which the
# experts example (lycoris_wan22_experts.json) applies from one row. Tens of GB: no test runs that example (see
# LOAD_ONLY); its node runs on tiny WAN21 models in tests/test_row_loader.py.
_WAN22 = "https://huggingface.co/Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/"
WAN22_T2V = {
    "high": {"name": "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
             "url": _WAN22 + "diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
             "directory": "diffusion_models"},
    "low": {"name": "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
            "url": _WAN22 + "diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
            "directory": "diffusion_models"},
    "text_encoder": {"name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                     "url": "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
                     "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                     "directory": "text_encoders"},
    "vae": {"name": "wan_2.1_vae.safetensors", "url": _WAN22 + "vae/wan_2.1_vae.safetensors", "directory": "vae"},
    "lora_high": {"name": "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                  "url": _WAN22 + "loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors",
                  "directory": "loras"},
    "lora_low": {"name": "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
                 "url": _WAN22 + "loras/wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors",
                 "directory": "loras"},
}
# Examples the tests open and lay out but cannot run on the tiny models, by reason.
LOAD_ONLY = {"lycoris_wan22_experts": "Wan 2.2 A14B's models, text encoder and VAE are tens of GB"}
# The files each example names with their downloads (the workflow's `models` list); SD1.5's for the others.
STANDARD_MODELS = {"lycoris_wan22_experts": list(WAN22_T2V.values())}

# What the user replaces: no public file is implied, so there is nothing to download. The name says it and a
# note next to the node says what to pick.
YOUR_LYCORIS = "your_lycoris_file.safetensors"
YOUR_SECOND_LYCORIS = "your_second_lycoris_file.safetensors"

# Standard name -> what the tests and the demo run instead (files written by make_tiny_sd15 / make_demo_lycoris).
DEMO_FILES = {
    SD15_CHECKPOINT["name"]: "tiny_sd15.safetensors",
    YOUR_LYCORIS: "demo_lokr_dora.safetensors",
    YOUR_SECOND_LYCORIS: "demo_loha_te.safetensors",
}
# The tiny model makes noise at any size, slowly at 512x512 on a CPU: the tests run 64x64 and few steps.
DEMO_SIZE = 64
DEMO_STEPS = 4
NOTES = ("Note", "MarkdownNote")  # their text is for the user and stays as it is


def _substitute(value):
    if isinstance(value, str):
        for standard, demo in DEMO_FILES.items():
            value = value.replace(standard, demo)
    return value


def for_demo(workflow: dict) -> dict:
    """A copy of a UI-format example workflow that runs on the tiny model and the demo LyCORIS files.

    Every file name in DEMO_FILES is replaced wherever it occurs in a widget value (a LyCORIS Stack names files in
    its text; notes are left alone), the download metadata goes (the demo files are not to be downloaded), the latent is DEMO_SIZE
    square and samplers take DEMO_STEPS steps. Nothing else changes: links, strengths, seeds and modes are the
    example's own.
    """
    out = copy.deepcopy(workflow)
    out.pop("models", None)
    for node in out["nodes"]:
        if node["type"] in NOTES:
            continue
        values = node.get("widgets_values")
        if isinstance(values, list):
            node["widgets_values"] = [_substitute(v) for v in values]
        (node.get("properties") or {}).pop("models", None)
        if node["type"] == "EmptyLatentImage":
            node["widgets_values"][0:2] = [DEMO_SIZE, DEMO_SIZE]
        elif node["type"] == "KSampler":
            node["widgets_values"][2] = DEMO_STEPS
    return out


EXAMPLES = Path(__file__).resolve().parent.parent / "example_workflows"


def demo_workflow(name: str) -> dict:
    """example_workflows/<name> as the tests and the demo run it (for_demo)."""
    return for_demo(json.loads((EXAMPLES / name).read_text(encoding="utf-8")))


def write_demo_workflows(dest: Path) -> Path:
    """Every example, for_demo, as <dest>/<same name>.json (for the browser scripts, which read files); returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(EXAMPLES.glob("*.json")):
        text = json.dumps(demo_workflow(path.name), indent=2, ensure_ascii=False) + "\n"
        target = dest / path.name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
    return dest
