"""A file that changes after it was loaded (issue #11): rewritten in place, shrunk, emptied or removed.

`cp new.safetensors old.safetensors` truncates the file and writes it again, on the same inode. Read through a memory
map, that killed the process with SIGBUS (a page past the new end) or, when the size stayed, handed the new bytes,
never checked, to the next re-patch of a model already patched from the file. The loader now reads a private
snapshot (lycoris_core/safetensors_file.py), so:
- a patched model re-patches with exactly the bytes that were checked, whatever happens to the file;
- the next load reads the new file and checks it: new values when it is good, a clear error naming it when not;
- a node whose file changed runs again on the next queue instead of being served from ComfyUI's cache.
"""

import os
import time
from pathlib import Path

import comfy.model_management
import pytest
import test_nodes
import torch
from lycoris_nodes.lycoris_core import LycorisError, SafetensorsFile
from lycoris_nodes.lycoris_core import safetensors_file as reader_module
from lycoris_nodes.nodes.glue import cache
from lycoris_nodes.nodes.inspection.block_info import LycorisBlockInfo
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoader, LycorisLoaderModelOnly
from lycoris_nodes.nodes.loading.weighting import LycorisBlockWeights
from lycoris_nodes.nodes.scheduling.schedule import LycorisHook
from lycoris_nodes.nodes.scheduling.stack import LycorisStack
from node_runner import execute
from safetensors.torch import save_file
from test_nodes import TO_Q, TO_Q_KEY, lora, weights_after_full_load, write

sd15, loras = test_nodes.sd15, test_nodes.loras  # fixtures


def file_bytes(sd: dict, metadata: dict | None = None, tmp=None) -> bytes:
    path = tmp / "scratch.safetensors"
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    data = path.read_bytes()
    path.unlink()
    return data


def rewrite_in_place(path, data: bytes) -> None:
    """What `cp new old` does: the same inode, truncated, then written."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a coarse clock must still see a change


def nan_version(sd: dict) -> dict:
    poisoned = {k: v.clone() for k, v in sd.items()}
    poisoned[f"{TO_Q}.lora_up.weight"][0, 0] = float("nan")
    return poisoned


REWRITES = {
    "NaN, same size": lambda sd, tmp: file_bytes(nan_version(sd), tmp=tmp),
    "shorter valid file": lambda sd, tmp: file_bytes(lora(TO_Q, 320, 320, seed=7, rank=1), tmp=tmp),
    "a few bytes": lambda sd, tmp: b"\x10\x00\x00",
    "empty": lambda sd, tmp: b"",
}


@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_a_rewrite_after_loading_never_reaches_the_patched_model(sd15, loras, tmp_path, rewrite):
    model, _clip = sd15
    sd = lora(TO_Q, 320, 320, seed=1)
    name = write(loras, "changing.safetensors", sd)
    (patched,) = execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0,
                         apply_mode="merge").result
    first = weights_after_full_load(patched, [TO_Q_KEY])[TO_Q_KEY]
    assert not torch.equal(first, model.model.state_dict()[TO_Q_KEY])  # the file did change the weight

    rewrite_in_place(loras / name, REWRITES[rewrite](sd, tmp_path))
    comfy.model_management.unload_all_models()
    again = weights_after_full_load(patched, [TO_Q_KEY])[TO_Q_KEY]  # a re-patch, as after an offload
    assert torch.equal(again, first), "the re-patch read bytes that were never checked"


def test_a_removed_file_still_re_patches_from_its_snapshot(sd15, loras):
    model, _clip = sd15
    name = write(loras, "gone.safetensors", lora(TO_Q, 320, 320, seed=2))
    (patched,) = execute(LycorisLoaderModelOnly, model=model, lycoris_name=name, strength_model=1.0,
                         apply_mode="merge").result
    first = weights_after_full_load(patched, [TO_Q_KEY])[TO_Q_KEY]
    os.unlink(loras / name)
    cache.clear()  # the snapshot lives on in the patches alone
    assert torch.equal(weights_after_full_load(patched, [TO_Q_KEY])[TO_Q_KEY], first)


def test_the_next_load_reads_the_rewritten_file_and_checks_it(loras, tmp_path):
    sd = lora(TO_Q, 320, 320, seed=3)
    path = loras / write(loras, "next.safetensors", sd)
    before = cache.load_cached(path).modules[f"{TO_Q}.weight"].tensors["lora_up.weight"].clone()

    newer = lora(TO_Q, 320, 320, seed=4)
    rewrite_in_place(path, file_bytes(newer, tmp=tmp_path))
    now = cache.load_cached(path).modules[f"{TO_Q}.weight"].tensors["lora_up.weight"]
    assert torch.equal(now, newer[f"{TO_Q}.lora_up.weight"]) and not torch.equal(now, before)

    rewrite_in_place(path, file_bytes(nan_version(newer), tmp=tmp_path))
    with pytest.raises(LycorisError, match=r"next\.safetensors: .*lora_up\.weight: 1 of 1280 values are NaN"):
        cache.load_cached(path)
    rewrite_in_place(path, b"\x10\x00")
    with pytest.raises(LycorisError, match=r"next\.safetensors: the file is incomplete and was modified \d+ s ago: "
                                           r"it is probably still being written"):
        cache.load_cached(path)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))  # nothing has written it for long: damaged, not being written
    with pytest.raises(LycorisError, match=r"next\.safetensors: not a safetensors file: 2 bytes"):
        cache.load_cached(path)
    os.unlink(path)
    with pytest.raises(LycorisError, match=r"next\.safetensors: cannot open the file"):
        cache.load_cached(path)


def test_a_file_growing_while_it_is_copied_is_refused_not_half_read(loras, monkeypatch):
    path = loras / write(loras, "growing.safetensors", lora(TO_Q, 320, 320, seed=5))
    copy = reader_module._copy_bytes

    def copy_then_append(source, target):
        copied = copy(source, target)
        with open(path, "ab") as f:  # a download or a save still writing
            f.write(b"\0" * 4096)
        return copied

    monkeypatch.setattr(reader_module, "_copy_bytes", copy_then_append)
    with pytest.raises(LycorisError, match=r"growing\.safetensors: the file changed while it was being read"):
        SafetensorsFile(path, snapshot=True)


def test_the_loaded_tensors_are_views_of_a_private_copy_not_of_the_file(loras):
    path = loras / write(loras, "private.safetensors", lora(TO_Q, 320, 320, seed=6))
    reader = SafetensorsFile(path, snapshot=True)
    up = reader.tensor(f"{TO_Q}.lora_up.weight")
    first, end = reader.mapped_range()
    assert first <= up.data_ptr() < end
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the mapping is not the user's file
        maps = maps.read_text(encoding="utf-8")
        mapped_files = [line.split()[-1] for line in maps.splitlines() if line.split()[0].startswith(f"{first:x}-")]
        assert mapped_files and str(path) not in mapped_files[0]


@pytest.mark.parametrize("node, inputs", [
    (LycorisLoader, {}), (LycorisLoaderModelOnly, {}), (LycorisBlockWeights, {}), (LycorisBlockInfo, {}),
    (LycorisHook, {}), (LycorisInfo, {}),
])
def test_a_node_whose_file_changed_runs_again(loras, tmp_path, node, inputs):
    """ComfyUI serves a node from its cache while `fingerprint_inputs` returns what it returned last time."""
    name = write(loras, "retrained.safetensors", lora(TO_Q, 320, 320, seed=8))
    before = node.fingerprint_inputs(lycoris_name=name, **inputs)
    assert node.fingerprint_inputs(lycoris_name=name, **inputs) == before  # unchanged file: cached as before
    rewrite_in_place(loras / name, file_bytes(lora(TO_Q, 320, 320, seed=9), tmp=tmp_path))
    assert node.fingerprint_inputs(lycoris_name=name, **inputs) != before


def test_a_stack_whose_file_changed_runs_again(loras, tmp_path):
    name = write(loras, "in_stack.safetensors", lora(TO_Q, 320, 320, seed=8))
    stack = f"{name} | 0.5\n\n"
    before = LycorisStack.fingerprint_inputs(stack=stack)
    rewrite_in_place(loras / name, file_bytes(lora(TO_Q, 320, 320, seed=9), tmp=tmp_path))
    assert LycorisStack.fingerprint_inputs(stack=stack) != before


def test_a_hook_registers_the_file_as_checked_when_its_node_ran(loras, tmp_path):
    sd = lora(TO_Q, 320, 320, seed=10)
    name = write(loras, "hooked.safetensors", sd)
    (hooks,) = execute(LycorisHook, lycoris_name=name, strength_model=1.0, strength_clip=1.0).result
    rewrite_in_place(loras / name, file_bytes(nan_version(sd), tmp=tmp_path))  # before sampling registers it
    (hook,) = hooks.hooks
    registered = hook.file.modules[f"{TO_Q}.weight"].tensors["lora_up.weight"]
    assert torch.equal(registered, sd[f"{TO_Q}.lora_up.weight"])
