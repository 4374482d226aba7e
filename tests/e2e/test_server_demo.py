"""End to end: the example workflow on a real ComfyUI server (CPU) with this pack, a tiny SD1.5 and a LyCORIS file
made by the reference implementation. One server is shared by the whole session: the `assets`, `server` and `prompt`
fixtures are in conftest.py (shared with test_info_route.py)."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_demo_lycoris
from comfy_server import ComfyError, ComfyServer, prepare_base_dir
from example_models import DEMO_FILES, SD15_CHECKPOINT, YOUR_LYCORIS, YOUR_SECOND_LYCORIS, write_demo_workflows
from test_tools_writer import kill_at, workspaces

pytestmark = pytest.mark.e2e

# Generated once and reused across runs (the checkpoint is 180 MB and takes ~6 s to write).
ASSETS = REPO_ROOT / ".deps" / "test-assets"
# What the examples name for users (the SD1.5 checkpoint, your LyCORIS files) is run on these (example_models).
CHECKPOINT = DEMO_FILES[SD15_CHECKPOINT["name"]]
LYCORIS = DEMO_FILES[YOUR_LYCORIS]
# The second demo file (LoHa over the UNet and the text encoder), for the stack and schedule examples.
LYCORIS_LOHA = DEMO_FILES[YOUR_SECOND_LYCORIS]
# The examples with the demo files in place of the standard names (example_models.for_demo), as files: conftest.py's
# `prompt` and the browser scripts read them. WORKFLOW is the main example, the one `make demo` runs.
DEMO_EXAMPLES = write_demo_workflows(ASSETS / "demo_workflows")
WORKFLOW = DEMO_EXAMPLES / "lycoris_loader.json"
BAD_LOG_LINES = ("lora key not loaded", "NOT LOADED")


def make_base_dir(base: Path, assets: dict[str, Path | list[Path]]) -> Path:
    """A ComfyUI base dir whose model folders link to the cached assets (one path or a list per folder)."""
    prepare_base_dir(base)
    for folder, paths in assets.items():
        for path in paths if isinstance(paths, (list, tuple)) else [paths]:
            (base / "models" / folder / path.name).symlink_to(path)
    return base


def loader_id(prompt: dict) -> str:
    (node_id,) = [k for k, v in prompt.items() if v["class_type"] == "LycorisLoader"]
    return node_id


def with_inputs(prompt: dict, **inputs) -> dict:
    changed = copy.deepcopy(prompt)
    changed[loader_id(prompt)]["inputs"].update(inputs)
    return changed


def without_loader(prompt: dict) -> dict:
    """The same graph with the LyCORIS loader cut out: core ComfyUI nodes only."""
    lid = loader_id(prompt)
    loader_inputs = prompt[lid]["inputs"]
    upstream = {0: loader_inputs["model"], 1: loader_inputs["clip"]}
    core = copy.deepcopy({k: v for k, v in prompt.items() if k != lid})
    for node in core.values():
        for name, value in node["inputs"].items():
            if isinstance(value, list) and value[0] == lid:
                node["inputs"][name] = list(upstream[value[1]])
    return core


def run(server: ComfyServer, prompt: dict) -> tuple[bytes, np.ndarray]:
    entry = server.wait(server.queue(prompt), timeout=180)
    png = server.image_bytes(entry)
    # Compare pixels, not files: SaveImage embeds the (different) prompt in the PNG.
    return png, np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.fixture(scope="session")
def images(server, prompt) -> dict[str, tuple[bytes, np.ndarray]]:
    return {
        "full": run(server, prompt),
        "zero": run(server, with_inputs(prompt, strength_model=0.0, strength_clip=0.0)),
        "core": run(server, without_loader(prompt)),
    }


def test_demo_file_loads_in_core_comfyui(assets):
    """Independent of our nodes: core ComfyUI maps and consumes every key of the demo file."""
    assert make_demo_lycoris.verify(assets["loras"], assets["checkpoints"]) == 65


def test_second_demo_file_loads_in_core_comfyui(loha_file, assets):
    """The LoHa file (UNet + text encoder) too: core ComfyUI maps and consumes every key, text encoder included."""
    assert make_demo_lycoris.verify(loha_file, assets["checkpoints"]) == 65 + 72


def test_object_info_lists_the_nodes(server):
    info = server.object_info()
    for node_id in ("LycorisLoader", "LycorisLoaderModelOnly"):
        assert node_id in info, f"{node_id} not registered; server log:\n{server.log_tail()}"
        assert info[node_id]["category"] == "loaders/lycoris"


def test_example_workflow_makes_a_png(images):
    png, pixels = images["full"]
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert pixels.shape == (64, 64, 3)


def test_lycoris_changes_the_image(images):
    assert not np.array_equal(images["full"][1], images["zero"][1])


def test_strength_zero_is_identical_to_no_loader(images):
    assert np.array_equal(images["zero"][1], images["core"][1])


def test_model_only_loader_and_lycoris_mode_run(server, prompt):
    half = run(server, with_inputs(prompt, strength_model=0.5, strength_clip=0.5, strength_mode="lycoris"))[1]
    assert half.shape == (64, 64, 3)

    model_only = copy.deepcopy(prompt)
    lid = loader_id(prompt)
    inputs = model_only[lid]["inputs"]
    model_only[lid] = {
        "class_type": "LycorisLoaderModelOnly",
        "inputs": {k: v for k, v in inputs.items() if k not in ("clip", "strength_clip")},
    }
    for node in model_only.values():  # the text encoders take the checkpoint's CLIP directly
        if node["inputs"].get("clip") == [lid, 1]:
            node["inputs"]["clip"] = list(inputs["clip"])
    assert run(server, model_only)[1].shape == (64, 64, 3)


def test_a_name_saved_on_windows_loads(server, prompt, model_files):
    """A workflow saved on Windows names a file in a subfolder `sub\\file.safetensors`: ComfyUI's own check of the
    name would refuse it here (it lists `sub/file.safetensors`); the loader takes it and applies that file."""
    subfolder = server.base_dir / "models" / "loras" / "windows-saved"
    subfolder.mkdir(exist_ok=True)
    source = model_files["loras"][0]
    (subfolder / source.name).unlink(missing_ok=True)
    (subfolder / source.name).symlink_to(source)
    _, posix = run(server, with_inputs(prompt, lycoris_name=f"windows-saved/{source.name}"))
    _, windows = run(server, with_inputs(prompt, lycoris_name=f"windows-saved\\{source.name}"))
    _, unchanged = run(server, with_inputs(prompt, strength_model=0.0, strength_clip=0.0))
    assert np.array_equal(windows, posix) and not np.array_equal(windows, unchanged)
    answer = server.get_json(f"lycoris/info?name=windows-saved%5C{source.name}")
    assert answer["name"] == source.name and answer["module_count"] > 0, answer

    missing = with_inputs(prompt, lycoris_name="windows-saved\\no_such_file.safetensors")
    with pytest.raises(ComfyError, match="no_such_file.safetensors' is not a file in the loras folders"):
        server.queue(missing)


def test_server_log_has_no_unloaded_keys(server, images):
    bad = [line for line in server.log_text().splitlines() if any(b in line for b in BAD_LOG_LINES)]
    assert not bad, "\n".join(bad[:20])


def test_demo_once(tmp_path, model_files):
    """`make demo ONCE=1` in a temp base dir: comfy-cli (or the fallback) starts ComfyUI, the workflow runs. A tool
    write killed before (kill -9 just before its file was moved into place) left a workspace in the loras folder:
    after the start there is none, and the folder holds only complete files."""
    base = make_base_dir(tmp_path / "base", model_files)
    loras = base / "models" / "loras"
    kill_at(loras, "hard", "before_move")
    assert workspaces(loras) and not (loras / "killed.safetensors").exists()
    cmd = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "demo.py"),
        "--once",
        "--base-dir",
        str(base),
        "--cli-home",
        str(tmp_path / "cli-home"),
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    (image_line,) = [line for line in result.stdout.splitlines() if line.startswith("demo: image: ")]
    image = Path(image_line.removeprefix("demo: image: "))
    assert image.is_relative_to(base / "output"), image
    assert image.read_bytes().startswith(b"\x89PNG")
    assert workspaces(loras) == [] and sorted(p.name for p in loras.iterdir()) == sorted(
        p.name for p in model_files["loras"])
