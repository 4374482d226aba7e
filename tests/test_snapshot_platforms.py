"""The loader's private snapshot on each platform's branch, run here on Linux (issue #23).

lycoris_core/safetensors_file.py probes what the OS offers once (its PLATFORM): copy_file_range, madvise, O_NONBLOCK,
and a map that holds no descriptor (torch's from_file, then the copy's name removed). Here they are switched off to
run macOS's branch (no kernel copy, no madvise: a user-space copy) and Windows' (none: the copy kept by its Python
mmap). Each branch must read the same tensors, hold no descriptor after loading (Windows' holds its map's own handle,
here a descriptor, until the tensors go), leave no copy behind, and say a file is still being written rather than
damaged while a writer is at it: deterministic cases, and real races against a writer in another process
(safetensors' own save_file, and a rewrite in place as `cp` does) and one writing in chunks.
"""

import dataclasses
import errno
import gc
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from lycoris_nodes.lycoris_core import LycorisError, SafetensorsFile, load
from lycoris_nodes.lycoris_core import safetensors_file as reader_module
from safetensors.torch import load_file, save_file

ALL_OFF = {"kernel_copy": False, "madvise": None, "nonblocking_open": 0, "map_without_descriptor": False,
           "open_sharing_delete": None}
PLATFORMS = {
    "linux": {},  # everything this machine offers
    "macos-like": {"kernel_copy": False, "madvise": None},
    "windows-like": ALL_OFF,
}
BEING_WRITTEN = r"the file is incomplete and was modified \d+ s ago: it is probably still being written"
CHANGED_WHILE_READ = (r"the file changed while it was being read"
                      r"|the file is incomplete and changed while it was being read: it is probably still being written")
STILL_WRITING = re.compile(f"{BEING_WRITTEN}|{CHANGED_WHILE_READ}")


def test_this_machine_offers_every_capability():
    """Else the "linux" row would not be the all-on branch."""
    real = reader_module.PLATFORM
    assert real.kernel_copy and real.madvise is not None and real.nonblocking_open and real.map_without_descriptor
    assert real.open_sharing_delete is None and reader_module._windows_opener() is None


@pytest.fixture(params=list(PLATFORMS))
def platform(request, monkeypatch):
    chosen = dataclasses.replace(reader_module.PLATFORM, **PLATFORMS[request.param])
    monkeypatch.setattr(reader_module, "PLATFORM", chosen)
    return chosen


@pytest.fixture()
def temp_dir(tmp_path):
    folder = tmp_path / "comfy_temp"
    folder.mkdir()
    return folder


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def snapshot_maps(temp_dir: Path) -> list[str]:
    """The lines of /proc/self/maps that map a copy in `temp_dir` (a removed file's name still shows there)."""
    maps = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
    return [line for line in maps if str(temp_dir) in line]


def bitwise(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def every_dtype_file(path: Path) -> Path:
    """One tensor of each dtype the format has, and one large enough for several user-space copy chunks."""
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(7, 5, generator=gen)
    save_file({
        "f64": floats.double(), "f32": floats, "f16": floats.half(), "bf16": floats.bfloat16(),
        "f8_e4m3": floats.to(torch.float8_e4m3fn), "f8_e5m2": floats.to(torch.float8_e5m2),
        "i64": torch.arange(-9, 9), "i32": torch.arange(5, dtype=torch.int32), "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-4, 4, dtype=torch.int8), "u8": torch.arange(11, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
        "large": torch.randn(3 * reader_module._USER_COPY_CHUNK // 4 + 123, generator=gen),
    }, str(path))
    return path


def misaligned_file(path: Path) -> Path:
    """Three bytes, then a float32 at byte 3 of the data: older writers left such files; a view cannot be made."""
    header = {"odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "after": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.25))
    return path


def assert_same_tensors(tensors: dict[str, torch.Tensor], official: dict[str, torch.Tensor]) -> None:
    assert tensors.keys() == official.keys()
    for key, tensor in tensors.items():
        assert tensor.dtype == official[key].dtype and tensor.shape == official[key].shape, key
        assert torch.equal(bitwise(tensor), bitwise(official[key])), key


def test_every_branch_reads_what_safetensors_reads_and_holds_no_descriptor(platform, tmp_path, temp_dir):
    dtypes = every_dtype_file(tmp_path / "dtypes.safetensors")
    misaligned = misaligned_file(tmp_path / "misaligned.safetensors")
    before = open_descriptors()
    held = {path.name: SafetensorsFile(path, snapshot=True, temp_dir=temp_dir).tensors()
            for path in (dtypes, misaligned)}
    # Windows keeps each copy through its map's handle (a descriptor here on Linux; a handle there, of which a
    # process may have millions); every other branch holds nothing.
    assert open_descriptors() - before == (0 if platform.map_without_descriptor else len(held))
    assert os.listdir(temp_dir) == [], "a copy is left with a name"
    assert_same_tensors(held[dtypes.name], load_file(str(dtypes)))
    assert_same_tensors(held[misaligned.name], {"odd": torch.tensor([1, 2, 3], dtype=torch.uint8),
                                                "after": torch.tensor([1.5, -2.25])})
    assert snapshot_maps(temp_dir)
    del held
    gc.collect()
    assert open_descriptors() == before and snapshot_maps(temp_dir) == [], "a copy outlived its last tensor"


@pytest.mark.parametrize("variant_id", ["lokr_dora_out", "locon_bf16_file"])
def test_a_reference_lycoris_file_parses_the_same_on_every_branch(variant_id, reference_files, monkeypatch,
                                                                  temp_dir):
    path, real = reference_files[variant_id].path, reader_module.PLATFORM
    expected = load(path, temp_dir=temp_dir)
    for name, overrides in PLATFORMS.items():
        monkeypatch.setattr(reader_module, "PLATFORM", dataclasses.replace(real, **overrides))
        before = open_descriptors()
        parsed = load(path, temp_dir=temp_dir)
        assert open_descriptors() - before == (1 if name == "windows-like" else 0)
        assert parsed.modules.keys() == expected.modules.keys(), name
        for module_key, module in parsed.modules.items():
            for key, tensor in module.tensors.items():
                assert torch.equal(bitwise(tensor), bitwise(expected.modules[module_key].tensors[key])), (name, key)


def mapping_rss_kb(address: int) -> int:
    """Resident kB of the mapping that holds `address`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text(encoding="utf-8").splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            first, end = (int(x, 16) for x in head.split("-"))
            inside = first <= address < end
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_release_gives_the_pages_back_where_madvise_exists(platform, tmp_path, temp_dir):
    path = tmp_path / "pages.safetensors"
    save_file({f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}, str(path))  # 8 MB
    reader = SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
    tensors = reader.tensors()
    sums = {key: float(t.sum()) for key, t in tensors.items()}  # faults every page in
    first, _end = reader.mapped_range()
    assert mapping_rss_kb(first) > 7 * 1024
    reader.release(tensors["t3"])
    reader.release_all()
    resident = mapping_rss_kb(first)
    assert resident == 0 if platform.madvise is not None else resident > 7 * 1024, resident
    assert {key: float(t.sum()) for key, t in tensors.items()} == sums  # read back from the copy


def test_a_failed_madvise_is_an_error_not_ignored():
    with pytest.raises(OSError) as error:
        reader_module._drop_pages(4096, 4097)  # nothing is mapped at page 1
    assert error.value.errno == errno.ENOMEM


def test_the_kernel_copy_falls_back_to_user_space_across_file_systems(monkeypatch, tmp_path, temp_dir):
    def cross_device(*_args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(reader_module.os, "copy_file_range", cross_device)
    path = every_dtype_file(tmp_path / "dtypes.safetensors")
    tensors = SafetensorsFile(path, snapshot=True, temp_dir=temp_dir).tensors()
    official = load_file(str(path))
    assert all(torch.equal(bitwise(tensors[key]), bitwise(official[key])) for key in official)


def test_a_file_changing_during_the_copy_is_refused_on_every_branch(platform, monkeypatch, tmp_path, temp_dir):
    path = every_dtype_file(tmp_path / "growing.safetensors")
    copy = reader_module._copy_bytes

    def copy_then_append(source, target):
        copied = copy(source, target)
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)
        return copied

    monkeypatch.setattr(reader_module, "_copy_bytes", copy_then_append)
    with pytest.raises(LycorisError, match=r"growing\.safetensors: the file changed while it was being read"):
        SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
    assert os.listdir(temp_dir) == []


# --- incomplete files: still being written, or damaged ------------------------------------------------------------
def valid_bytes(tmp_path: Path) -> bytes:
    scratch = tmp_path / "scratch.safetensors"
    save_file({"lora_unet_x.lora_up.weight": torch.randn(64, 4), "lora_unet_x.lora_down.weight": torch.randn(4, 64),
               "lora_unet_x.alpha": torch.tensor(4.0)}, str(scratch))
    data = scratch.read_bytes()
    scratch.unlink()
    return data


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


# name -> (bytes of the file from a valid file's, the message once it is an hour old)
INCOMPLETE = {
    "empty": (lambda data: b"", r"not a safetensors file: 0 bytes"),
    "header cut": (lambda data: data[:header_end(data) // 2], r"not a safetensors file, or truncated"),
    "data cut": (lambda data: data[:(header_end(data) + len(data)) // 2], r"file is truncated: tensor data ends"),
}


@pytest.mark.parametrize("case", list(INCOMPLETE))
def test_an_incomplete_file_just_written_is_said_to_be_still_written_and_an_old_one_damaged(case, platform, tmp_path,
                                                                                           temp_dir):
    cut, damaged = INCOMPLETE[case]
    path = tmp_path / "partial.safetensors"
    path.write_bytes(cut(valid_bytes(tmp_path)))
    with pytest.raises(LycorisError, match=rf"^partial\.safetensors: (.*: )?{BEING_WRITTEN}") as error:
        SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
    assert "not a safetensors" not in str(error.value)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    with pytest.raises(LycorisError, match=rf"^partial\.safetensors: (.*: )?{damaged}"):
        SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
    with pytest.raises(LycorisError, match=rf"^partial\.safetensors: (.*: )?{damaged}"):
        SafetensorsFile(path)  # the summary's reader says the same
    assert os.listdir(temp_dir) == []


def test_an_old_incomplete_file_that_moves_while_it_is_looked_at_is_being_written(monkeypatch, tmp_path):
    """A writer that last wrote long ago (a paused trainer) and goes on during the short re-check."""
    path = tmp_path / "paused.safetensors"
    data = valid_bytes(tmp_path)
    path.write_bytes(data[:header_end(data) + 10])
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    waits = []

    def writer_goes_on(seconds):
        waits.append(seconds)
        with open(path, "ab") as f:
            f.write(data[header_end(data) + 10:][:100])

    monkeypatch.setattr(reader_module.time, "sleep", writer_goes_on)
    with pytest.raises(LycorisError, match=rf"^paused\.safetensors: .*{CHANGED_WHILE_READ}"):
        SafetensorsFile(path, snapshot=True, temp_dir=tmp_path)
    assert waits == [reader_module._RECHECK_SECONDS]


def assert_only_still_writing(errors: list[str], name: str) -> None:
    wrong = [e for e in errors if not (e.startswith(f"{name}: ") and STILL_WRITING.search(e))]
    assert not wrong, wrong[:5]


def load_while_written(writer: subprocess.Popen, path: Path, temp_dir: Path, expected: dict, *, loads_wanted: int,
                       refusals_wanted: int, seconds: float = 30) -> tuple[int, list[str]]:
    """Load `path` again and again while `writer` runs, until that many loads and refusals were seen or `seconds`
    passed (a busy machine races less often); every load must read exactly `expected`. (loads, refusals)."""
    loads, errors = 0, []
    deadline = time.monotonic() + seconds
    while writer.poll() is None and time.monotonic() < deadline and (
            loads < loads_wanted or len(errors) < refusals_wanted):
        try:
            tensors = SafetensorsFile(path, snapshot=True, temp_dir=temp_dir).tensors()
        except LycorisError as e:
            errors.append(str(e))
            continue
        loads += 1
        assert all(torch.equal(tensors[key], expected[key]) for key in expected)
    return loads, errors


def eight_mb_lora(path: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"lora_unet_b{i}.lora_up.weight": torch.randn(1024, 64, generator=gen) for i in range(16)}
    tensors.update({f"lora_unet_b{i}.lora_down.weight": torch.randn(64, 1024, generator=gen) for i in range(16)})
    tensors.update({f"lora_unet_b{i}.alpha": torch.tensor(8.0) for i in range(16)})
    save_file(tensors, str(path))
    return tensors


# A trainer saving again and again with safetensors' save_file (0.8 here writes a temporary file and renames it over
# the old one: a reader opens the old file or the new one, both complete).
SAVE_LOOP = """
import random, sys, time
from safetensors.torch import load_file, save_file
path, reference = sys.argv[1], sys.argv[2]
tensors = load_file(reference)
save_file(tensors, path)
print("ready", flush=True)
while True:
    save_file(tensors, path)
    time.sleep(random.random() * 0.01)
"""

# What `cp`, a download or a trainer writing in place does: the same file truncated, then written in steps.
REWRITE_IN_PLACE_LOOP = """
import random, sys, time
path, reference = sys.argv[1], sys.argv[2]
data = open(reference, "rb").read()
open(path, "wb").close()
print("ready", flush=True)
while True:
    with open(path, "r+b") as f:
        f.truncate(0)
        for start in range(0, len(data), 1 << 20):
            f.write(data[start:start + (1 << 20)])
            f.flush()
    time.sleep(random.random() * 0.02)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", ["save_file", "rewrite in place"])
def test_loading_while_the_file_is_saved_again_and_again(loop, platform, tmp_path, temp_dir):
    reference, path = tmp_path / "reference.safetensors", tmp_path / "training.safetensors"
    expected = eight_mb_lora(reference)
    script = SAVE_LOOP if loop == "save_file" else REWRITE_IN_PLACE_LOOP
    writer = subprocess.Popen([sys.executable, "-c", script, str(path), str(reference)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        in_place = loop == "rewrite in place"
        loads, errors = load_while_written(writer, path, temp_dir, expected, loads_wanted=5,
                                           refusals_wanted=5 if in_place else 0)
        assert writer.poll() is None, "the writer died"
    finally:
        writer.kill()
        writer.wait()
    assert loads >= 1, (loads, errors[:3])
    if in_place:
        assert errors, "the race was never caught"
    assert_only_still_writing(errors, path.name)
    assert os.listdir(temp_dir) == []


def write_slowly(path: Path, data: bytes, chunk: int, pause: float) -> None:
    """A trainer writing tensor after tensor: the file grows in steps, with pauses between them."""
    with open(path, "wb") as f:
        for start in range(0, len(data), chunk):
            f.write(data[start:start + chunk])
            f.flush()
            time.sleep(pause)


@pytest.mark.timeout(120)
def test_loading_while_a_file_is_written_in_chunks(platform, tmp_path, temp_dir):
    gen = torch.Generator().manual_seed(1)
    source = tmp_path / "complete.safetensors"
    save_file({f"lora_unet_b{i}.diff": torch.randn(256, 256, generator=gen) for i in range(8)}, str(source))
    data = source.read_bytes()  # 2 MB
    path = tmp_path / "in_progress.safetensors"
    path.write_bytes(b"")
    writer = threading.Thread(target=write_slowly, args=(path, data, 64 * 1024, 0.01))
    writer.start()
    errors = []
    while writer.is_alive():
        try:
            SafetensorsFile(path, snapshot=True, temp_dir=temp_dir)
        except LycorisError as e:
            errors.append(str(e))
    writer.join()
    assert len(errors) > 10
    assert_only_still_writing(errors, path.name)
    tensors = SafetensorsFile(path, snapshot=True, temp_dir=temp_dir).tensors()  # complete now
    assert all(torch.equal(tensors[key], value) for key, value in load_file(str(source)).items())


def test_the_probe_says_no_where_a_mapped_file_cannot_be_removed(monkeypatch):
    """As on Windows, where removing an open or mapped file fails with PermissionError: the Windows branch is chosen
    by what the OS does, not by its name."""
    real_unlink, refused = os.unlink, []

    def refuse_once(name, *args, **kwargs):
        if not refused:
            refused.append(name)
            raise PermissionError(errno.EACCES, "The process cannot access the file")
        return real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(reader_module.os, "unlink", refuse_once)
    assert reader_module._probe_map_without_descriptor() is False
    assert refused and not os.path.exists(refused[0]), "the probe left its file"
    monkeypatch.undo()
    assert reader_module._probe_map_without_descriptor() is True
