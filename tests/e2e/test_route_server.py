"""End to end, on the real ComfyUI server (the session server of conftest.py): GET /lycoris/info reads files off the
event loop, so /system_stats keeps answering while a slow file is summarized; and a file rewritten in place while the
route reads it never takes the server down (a memory map of a file that shrinks kills the process with SIGBUS) nor
gives anything but its summary or a JSON error naming it."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from test_routes import SLOW_MODULES, answers_during_parse, slow_lora_file

pytestmark = pytest.mark.e2e

REWRITE_SECONDS = 4.0
READERS = 3  # concurrent requests: under the route's WORKERS + QUEUED, so none is refused as busy


def get(server, path: str) -> tuple[int, dict]:
    """Status and JSON body of a GET, error statuses included (a dropped connection raises)."""
    try:
        with urllib.request.urlopen(server.url + path, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture
def loras(server):
    """The session server's loras folder; what a test puts there is removed after it (the server is shared)."""
    folder = server.base_dir / "models" / "loras"
    before = set(folder.iterdir())
    yield folder
    for path in set(folder.iterdir()) - before:
        path.unlink()


def fresh_name(stem: str) -> str:
    """A name no other test (or answer the route kept) has used."""
    return f"{stem}_{uuid.uuid4().hex[:8]}.safetensors"


def test_system_stats_answers_while_a_file_is_parsed(server, loras, tmp_path_factory):
    name = fresh_name("slow_lora")
    shutil.copy(slow_lora_file(tmp_path_factory), loras / name)
    read = {}

    def read_info():
        start = time.monotonic()
        read["answer"] = get(server, f"lycoris/info?name={name}")
        read["seconds"] = time.monotonic() - start

    reader = threading.Thread(target=read_info)
    reader.start()
    time.sleep(0.3)  # the request is in and the file being read
    latencies = []
    while reader.is_alive():
        start = time.monotonic()
        assert get(server, "system_stats")[0] == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    reader.join()
    status, body = read["answer"]
    assert status == 200 and body["name"] == name and body["module_count"] == SLOW_MODULES
    answers_during_parse(latencies, read["seconds"])


def lora_bytes(modules: int, width: int) -> bytes:
    """A valid LoRA file's bytes: alphas spread over the file, so reading them walks its pages."""
    sd = {}
    for i in range(modules):
        prefix = f"lora_unet_rewrite_{i}"
        sd.update({f"{prefix}.lora_up.weight": torch.ones(width, 4), f"{prefix}.lora_down.weight": torch.ones(4, width),
                   f"{prefix}.alpha": torch.tensor(2.0)})
    return save(sd)


def rewrite_in_place(path: Path, contents: list[bytes], stop: threading.Event) -> int:
    """As `cp new old` does: the same inode truncated, then written; a long, a short and a broken file in turn."""
    count = 0
    while not stop.is_set():
        with open(path, "r+b") as f:
            f.truncate()
            f.write(contents[count % len(contents)])
        count += 1
        time.sleep(0.01 * (count % 3))
    return count


def test_file_rewritten_in_place_while_read(server, loras):
    """Reads race rewrites of the same file: every answer is its summary or a 422 naming it, and the server lives."""
    contents = [lora_bytes(3000, 64), lora_bytes(10, 8), b"\x40\x00\x00\x00\x00\x00\x00\x00{not a header"]
    name = fresh_name("rewritten")
    path = loras / name
    path.write_bytes(contents[0])
    stop, answers, failures, rewrites = threading.Event(), [], [], []

    def hammer():
        while not stop.is_set():
            try:
                answers.append(get(server, f"lycoris/info?name={name}"))
            except (OSError, ValueError) as e:  # a dropped connection, or an answer that is not JSON
                failures.append(repr(e))
                return

    readers = [threading.Thread(target=hammer) for _ in range(READERS)]
    for reader in readers:
        reader.start()
    rewriter = threading.Thread(target=lambda: rewrites.append(rewrite_in_place(path, contents, stop)))
    rewriter.start()
    time.sleep(REWRITE_SECONDS)
    stop.set()
    for thread in [*readers, rewriter]:
        thread.join(60)
    server.check_alive()
    assert get(server, "system_stats")[0] == 200
    assert not failures, f"{failures[:3]}; server log:\n{server.log_tail()}"
    assert rewrites and rewrites[0] > 50 and len(answers) > 20, (rewrites, len(answers))
    assert {status for status, _ in answers} <= {200, 422}, [a for a in answers if a[0] not in (200, 422)][:3]
    assert all(name in body["error"] for status, body in answers if status == 422)
    module_counts = {body["module_count"] for status, body in answers if status == 200}
    assert module_counts and module_counts <= {3000, 10}, module_counts
