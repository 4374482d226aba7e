"""What the pack prints and logs survives a console that only encodes cp1252, as on a Windows portable ComfyUI.

There Python's console streams are cp1252 whenever the output is not a real console window (a launcher, a log file,
a pipe, comfy-test's Windows runners), and ComfyUI's logger replaces sys.stdout and sys.stderr by a LogInterceptor:
a TextIOWrapper with the stream's encoding and strict errors, which the root log handler writes to. A character
outside cp1252 in a log message then makes logging print "--- Logging error ---" with a UnicodeEncodeError instead
of the message (the user never sees the warning), and in a print() it raises inside the node.

So a real ComfyUI server runs here with PYTHONIOENCODING=cp1252 (LogInterceptor keeps that encoding, strict), and
real workflows make the pack log its info line, its warnings (keys not applied, a merge re-rounded into fp8
weights, a bad cache budget) and its errors (files for another model, damaged files, a bad block-weight rule, bad
adapter shapes), which ComfyUI logs with their tracebacks. The console log must hold each message and no encoding
error. The maths in docstrings and comments stays as it is: only what is printed is tested.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_demo_lycoris
import make_tiny_sd15
from comfy_server import ComfyServer, execution_error, prepare_base_dir

pytestmark = pytest.mark.e2e

ASSETS = REPO_ROOT / ".deps" / "test-assets"
CHECKPOINT = "tiny_sd15.safetensors"
DEMO = "demo_lokr_dora.safetensors"
ENCODING_ERRORS = ("--- Logging error ---", "UnicodeEncodeError", "codec can't encode")
WORKER_DIED = "Exception in thread"
TO_Q = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q"


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def _lora(prefix, out, inn, seed, rank=4):
    return {f"{prefix}.lora_up.weight": _rand(out, rank, seed=seed),
            f"{prefix}.lora_down.weight": _rand(rank, inn, seed=seed + 1),
            f"{prefix}.alpha": torch.tensor(2.0)}


def _write_files(loras: Path) -> None:
    """The files the workflows load: each one makes the pack say something different."""
    save_file(_lora(TO_Q, 320, 320, seed=1), str(loras / "good.safetensors"))
    save_file({**_lora(TO_Q, 320, 320, seed=1),
               **_lora("lora_unet_no_such_block_attn1_to_q", 320, 320, seed=3),  # no such layer: not applied
               **_lora("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k", 320, 64, seed=5)},  # wrong shape
              str(loras / "partly.safetensors"))
    save_file({**_lora("lora_unet_double_blocks_0_img_attn_qkv", 96, 32, seed=1),
               **_lora("lora_unet_single_blocks_0_linear1", 64, 32, seed=2)},
              str(loras / "flux.safetensors"), metadata={"ss_base_model_version": "flux1"})
    save_file({f"{TO_Q}.lokr_w1": _rand(16, 16, seed=1), f"{TO_Q}.lokr_w2": _rand(20, 20, seed=2),
               f"{TO_Q}.alpha": torch.tensor(4.0), f"{TO_Q}.row_offset": torch.tensor(-1)},
              str(loras / "lokr_bad_row_offset.safetensors"))
    save_file({"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.oft_R.weight": _rand(4, 7, seed=1)},
              str(loras / "peft_oft_bad_shape.safetensors"))
    (loras / "truncated.safetensors").write_bytes((loras / "good.safetensors").read_bytes()[:-1000])
    header = b'{"a": {"dtype": "F32", "shape": [2,'
    (loras / "bad_header.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))


class Console:
    """A ComfyUI server on a cp1252 console, started again when a test left its prompt worker dead.

    A character the console cannot encode in an exception's message kills ComfyUI's prompt worker thread (logging
    fails to print the traceback, and the error escapes the worker): the server stays up and queues every later
    prompt forever. One such failure must fail its own test, not hang the rest.
    """

    def __init__(self, base: Path):
        self.base = base
        self.server: ComfyServer | None = None

    def start(self) -> ComfyServer:
        if self.server is not None:
            self.server.stop()
        self.server = ComfyServer(self.base)
        self.server.start()
        return self.server

    def run(self, prompt: dict, expect_error: bool) -> tuple[dict | None, str]:
        """Queue `prompt` and return (history entry, what the console got while it ran). A dead worker fails."""
        server = self.server
        before = len(server.log_path.read_bytes())
        prompt_id = server.queue(prompt)
        deadline = time.monotonic() + 120
        while True:
            server.check_alive()
            console = server.log_path.read_bytes()[before:]
            entry = server.get_json(f"history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                break
            if WORKER_DIED.encode() in console:
                self.start()  # for the tests after this one
                pytest.fail(f"ComfyUI's prompt worker died; console:\n{console.decode('cp1252', 'replace')[-5000:]}")
            assert time.monotonic() < deadline, f"prompt {prompt_id} did not finish"
            time.sleep(0.1)
        failed = entry["status"].get("status_str") == "error"
        assert failed == expect_error, execution_error(entry)
        # The worker thread may still be logging (the traceback) when the history already says done.
        size, settle = -1, time.monotonic() + 10
        while size != len(console) and time.monotonic() < settle:
            size = len(console)
            time.sleep(0.3)
            console = server.log_path.read_bytes()[before:]
        # The bytes are what a cp1252 console received; they decode back to the text.
        return entry, console.decode("cp1252")


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    checkpoint = make_tiny_sd15.write_tiny_sd15(ASSETS / CHECKPOINT)
    demo = make_demo_lycoris.write_demo_lycoris(ASSETS / DEMO, checkpoint)
    base = prepare_base_dir(tmp_path_factory.mktemp("cp1252-base"))
    (base / "models" / "checkpoints" / CHECKPOINT).symlink_to(checkpoint)
    (base / "models" / "diffusion_models").mkdir(parents=True, exist_ok=True)
    (base / "models" / "diffusion_models" / CHECKPOINT).symlink_to(checkpoint)  # UNETLoader reads the UNet part
    (base / "models" / "loras" / DEMO).symlink_to(demo)
    _write_files(base / "models" / "loras")
    # ComfyServer hands its environment to the server process: a cp1252 console, strict, and a cache budget the
    # pack has to warn about.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONIOENCODING", "cp1252:strict")
        patch.setenv("LYCORIS_CACHE_MB", "lots")
        holder = Console(base)
        holder.start()
        try:
            yield holder
        finally:
            holder.server.stop()


def _checkpoint():
    return {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT}}}


def _loader(name, model=("1", 0), clip=("1", 1), apply_mode="merge"):
    inputs = {"model": list(model), "lycoris_name": name, "strength_model": 1.0, "strength_mode": "linear",
              "apply_mode": apply_mode}
    if clip is None:
        return {"class_type": "LycorisLoaderModelOnly", "inputs": inputs}
    return {"class_type": "LycorisLoader", "inputs": {**inputs, "clip": list(clip), "strength_clip": 1.0}}


def _info(name, model=("2", 0)):
    return {"class_type": "LycorisInfo", "inputs": {"lycoris_name": name, "model": list(model), "strength": 1.0}}


def _assert_clean(console: str) -> None:
    for marker in ENCODING_ERRORS:
        assert marker not in console, console[-4000:]


def test_startup_console_is_cp1252_and_clean(console):
    text = console.server.log_path.read_bytes().decode("cp1252")
    assert "Starting server" in text
    _assert_clean(text)


def test_applied_file_logs_its_line_and_the_cache_budget_warning(console):
    _entry, out = console.run({**_checkpoint(), "2": _loader(DEMO), "3": _info(DEMO)}, expect_error=False)
    assert f"LyCORIS {DEMO}" in out, out
    # The first file read makes the cache read its budget, and warn about the bad one this server was given.
    assert "LYCORIS_CACHE_MB" in out, out
    _assert_clean(out)


def test_keys_not_applied_are_a_printable_warning(console):
    _entry, out = console.run({**_checkpoint(), "2": _loader("partly.safetensors"), "3": _info(DEMO)},
                              expect_error=False)
    assert "not applied" in out and "lora_unet_no_such_block_attn1_to_q" in out, out
    _assert_clean(out)


def test_merge_into_fp8_weights_warning_is_printable(console):
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": CHECKPOINT, "weight_dtype": "fp8_e4m3fn"}},
              "2": _loader(DEMO, clip=None, apply_mode="merge"), "3": _info(DEMO)}
    _entry, out = console.run(prompt, expect_error=False)
    assert "merged into quantized weights" in out, out
    _assert_clean(out)


@pytest.mark.parametrize("name,expected", [
    ("flux.safetensors", "flux1"),  # made for another model: one error naming what the file is for
    ("truncated.safetensors", "truncated.safetensors"),
    ("bad_header.safetensors", "bad_header.safetensors"),
    ("lokr_bad_row_offset.safetensors", "row_offset"),
    ("peft_oft_bad_shape.safetensors", "oft_R"),
])
def test_errors_and_their_tracebacks_are_printable(console, name, expected):
    entry, out = console.run({**_checkpoint(), "2": _loader(name), "3": _info(DEMO)}, expect_error=True)
    message = execution_error(entry)
    assert expected in message, message
    # ComfyUI logs the message and the traceback (with each frame's source line) to the console.
    assert "Exception during processing" in out and expected in out, out
    _assert_clean(out)


def test_block_weight_rule_error_is_printable(console):
    loader = _loader(DEMO)
    block_weights = {"class_type": "LycorisBlockWeights",
                     "inputs": {**loader["inputs"], "block_weights": "input_blocks.1 = two"}}
    prompt = {**_checkpoint(), "2": block_weights, "3": _info(DEMO)}
    _entry, out = console.run(prompt, expect_error=True)
    assert "Exception during processing" in out, out
    _assert_clean(out)
