"""The tools' writer (lycoris_core/tools/writer.py) and where the nodes write (nodes/tools/common.py): whole or
nothing, never over an existing file unless asked, never outside the loras folders, and nothing but complete files
left after a write killed with SIGKILL once the sweep has run: at once when the killed process was on this machine.

Truth: real kills. A child process writes with the pack's writer and is SIGKILLed by the test while safetensors
writes (its own .tmp file in the writer's workspace, not yet renamed), or SIGKILLs itself from a hook at the step
named (the hooks replace os.link/os.replace or the folder fsync in the child only); a filesystem without hard links
(FAT/exFAT) is emulated, in the child and then in the test process, by an os.link that fails with EPERM, as FAT's
does. Whether an owner runs is what the OS says of real processes (this one, children running, paused, killed,
reaped or not); pid reuse is a record naming this process's pid with another start time. "Stale" is an mtime set
back past writer.STALE_AFTER. Files are read back with safetensors.
"""

import errno
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from comfy_env import REPO_ROOT
from lycoris_nodes.lycoris_core import LycorisError
from lycoris_nodes.lycoris_core.tools import writer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# --- whole or nothing, never over an existing file ---------------------------------------------------------------------

def test_writer_never_overwrites_unless_asked(tmp_path):
    path = tmp_path / "x.safetensors"
    writer.write(path, {"a": torch.ones(2)}, {"k": "first"})
    with pytest.raises(LycorisError, match="exists"):
        writer.write(path, {"a": torch.zeros(2)}, {"k": "second"})
    with safe_open(path, "pt") as f:
        assert f.metadata()["k"] == "first"
    writer.write(path, {"a": torch.zeros(2)}, {"k": {"second": 2}}, overwrite=True)
    with safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["k"]) == {"second": 2}
        assert f.get_tensor("a").sum() == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_a_failed_write_leaves_nothing(tmp_path):
    """A tensor that cannot be read (a meta tensor: no data) fails the write: no file, no workspace left."""
    with pytest.raises(NotImplementedError):
        writer.write(tmp_path / "y.safetensors", {"a": torch.ones(2), "b": torch.ones(2, device="meta")}, {})
    assert list(tmp_path.iterdir()) == []


def test_tensors_sharing_storage_are_written(tmp_path):
    alpha = torch.tensor(4.0)
    base = torch.arange(6.0)
    writer.write(tmp_path / "z.safetensors", {"a.alpha": alpha, "b.alpha": alpha, "v": base[:3], "w": base[3:]}, {})
    with safe_open(tmp_path / "z.safetensors", "pt") as f:
        assert float(f.get_tensor("b.alpha")) == 4.0
        assert f.get_tensor("w").tolist() == [3.0, 4.0, 5.0]


def test_writer_refuses_other_extensions(tmp_path):
    with pytest.raises(LycorisError, match="safetensors"):
        writer.write(tmp_path / "x.ckpt", {"a": torch.ones(1)}, {})
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_hard_links(monkeypatch):
    """os.link failing as on FAT/exFAT (EPERM), in this process."""
    def link(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted (no hard links here)")

    monkeypatch.setattr(os, "link", link)


def test_without_hard_links_a_name_is_still_never_overwritten(tmp_path, no_hard_links):
    path = tmp_path / "x.safetensors"
    writer.write(path, {"a": torch.ones(2)}, {"k": "first"})
    with pytest.raises(LycorisError, match="exists") as raised:
        writer.write(path, {"a": torch.zeros(2)}, {"k": "second"})
    assert raised.value.file == str(path)
    with safe_open(path, "pt") as f:
        assert f.metadata()["k"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no lock, no workspace


def test_without_hard_links_a_name_being_written_is_refused(tmp_path, no_hard_links):
    """Another writer holds the name's lock: this one fails naming the file, and leaves the lock and nothing else."""
    path = tmp_path / "x.safetensors"
    writer.lock_path(path).touch()
    with pytest.raises(LycorisError, match="another write of this name is under way") as raised:
        writer.write(path, {"a": torch.ones(2)}, {})
    assert raised.value.file == str(path)
    assert [p.name for p in tmp_path.iterdir()] == [".x.safetensors.lycoris-lock"]


@pytest.mark.parametrize("links", ["hard", "none"])
def test_the_file_and_its_folder_are_fsynced(tmp_path, monkeypatch, request, links):
    """A spy on os.fsync during a real write records what each synced descriptor is: the written file (in the
    workspace, before it became the final name) and, after the move, its folder."""
    if links == "none":
        request.getfixturevalue("no_hard_links")
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        status = os.fstat(fd)
        synced.append((status.st_dev, status.st_ino, stat.S_ISDIR(status.st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = tmp_path / "sub" / "x.safetensors"
    writer.write(path, {"a": torch.ones(2)}, {})
    folder, written = os.stat(path.parent), os.stat(path)
    assert synced == [(written.st_dev, written.st_ino, False), (folder.st_dev, folder.st_ino, True)]


# --- where the nodes may write ----------------------------------------------------------------------------------------

@pytest.fixture
def two_loras_folders(tmp_path, monkeypatch):
    import folder_paths

    first, second = tmp_path / "loras", tmp_path / "more_loras"
    first.mkdir()
    second.mkdir()
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras", ([str(first), str(second)], {".safetensors"}))
    folder_paths.filename_list_cache.pop("loras", None)
    return first


@pytest.mark.parametrize("name", ["../outside", "sub/../../outside", "/tmp/absolute", "C:\\\\x", "", "dir/"])
def test_outputs_outside_the_loras_folder_are_refused(two_loras_folders, name):
    from lycoris_nodes.nodes.tools.common import write_file

    with pytest.raises(LycorisError):
        write_file(name, {"a": torch.ones(1)}, {}, overwrite=True)
    assert list(two_loras_folders.iterdir()) == []
    assert list(two_loras_folders.parent.glob("outside*")) == []


def test_outputs_go_in_the_loras_folder_and_are_listed(two_loras_folders):
    import folder_paths
    from lycoris_nodes.nodes.tools.common import write_file

    assert folder_paths.get_filename_list("loras") == []
    name = write_file("merged/mine", {"a": torch.ones(1)}, {}, overwrite=False)
    assert name == "merged/mine.safetensors"
    assert (two_loras_folders / "merged" / "mine.safetensors").is_file()
    assert folder_paths.get_filename_list("loras") == ["merged/mine.safetensors"]


# --- killed writes -----------------------------------------------------------------------------------------------------

# The child: the pack's writer (lycoris_core needs no ComfyUI) writing arange(numel) to folder/name, recording its
# start time as the nodes do (psutil, as tools/common.py: process_started). `links` "none"
# makes os.link fail as on FAT; `hook` picks the step at which it SIGKILLs itself ("before_move": the os.link or
# os.replace that moves the complete file into place; "after_move": the folder fsync that follows), or pauses there
# until a line arrives on stdin ("pause_before_move"), or "none".
CHILD = r"""
import errno, os, signal, sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
import psutil
import torch
from lycoris_core.tools import writer

folder, name, links, hook, numel = sys.argv[2:7]


def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def no_link(*args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted (emulated FAT)")


def paused(move):
    def pause(*args, **kwargs):
        print("ready", flush=True)
        sys.stdin.readline()
        return move(*args, **kwargs)
    return pause


if links == "none":
    os.link = no_link
move = "link" if links == "hard" else "replace"
if hook == "before_move":
    setattr(os, move, kill)
elif hook == "pause_before_move":
    setattr(os, move, paused(getattr(os, move)))
elif hook == "after_move":
    writer._fsync_folder = kill
print("writing", flush=True)
writer.write(Path(folder) / name, {"w": torch.arange(int(numel), dtype=torch.float32)}, {"k": "v"},
             started=psutil.Process().create_time())
print("done", flush=True)
"""

SMALL = 1000
LARGE = 32 * 1024 * 1024  # 128 MB of fp32: safetensors takes a good fraction of a second to write it
HOUR_AGO = time.time() - writer.STALE_AFTER - 60


def child(folder: Path, name: str, links: str, hook: str, numel: int = SMALL) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(REPO_ROOT), str(folder), name, links, hook, str(numel)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_during_save_file(folder: Path, links: str, attempts: int = 3) -> int:
    """SIGKILL a child while safetensors writes: its own temporary file is in the workspace (beside the owner
    record), the finished one (which safetensors renames into place last) is not yet. Returns the child's pid."""
    for _ in range(attempts):
        process = child(folder, "killed.safetensors", links, "none", LARGE)
        assert process.stdout.readline() == "writing\n"
        while process.poll() is None and set(in_workspaces(folder)) <= {writer.OWNER}:
            pass
        process.kill()
        process.wait()
        written = set(in_workspaces(folder)) - {writer.OWNER}
        if process.returncode == -signal.SIGKILL and written and "tensors" not in written:
            return process.pid
        for workspace in workspaces(folder):  # missed: the write had not started, or had ended
            shutil.rmtree(workspace)
        (folder / "killed.safetensors").unlink(missing_ok=True)
    pytest.fail(f"no kill landed during the write in {attempts} attempts")


def kill_at(folder: Path, links: str, hook: str) -> int:
    """A child SIGKILLed at `hook` (and reaped); returns its pid."""
    process = child(folder, "killed.safetensors", links, hook)
    process.wait(timeout=120)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()
    return process.pid


def workspaces(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if writer.TEMPORARY_NAME.fullmatch(p.name)]


def in_workspaces(folder: Path) -> list[str]:
    names = []
    for workspace in workspaces(folder):
        try:
            names += [p.name for p in workspace.iterdir()]
        except FileNotFoundError:  # removed between the listing and this look
            pass
    return names


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def assert_absent_or_whole(path: Path, numel: int) -> None:
    """The final name is never empty or partial: absent, or a file safetensors reads in full."""
    if path.exists():
        assert torch.equal(load_file(path)["w"], torch.arange(numel, dtype=torch.float32))


def age(paths) -> None:
    """Set the mtime an hour and a minute back: stale (the writer died long ago)."""
    for path in paths:
        os.utime(path, (HOUR_AGO, HOUR_AGO), follow_symlinks=False)


def age_tree(folder: Path) -> None:
    age([folder, *folder.rglob("*")])


@pytest.mark.parametrize("links", ["hard", "none"])
@pytest.mark.parametrize("moment", ["during_save_file", "before_move", "after_move"])
def test_a_killed_write_leaves_no_partial_file_and_the_sweep_cleans_up(two_loras_folders, request, links, moment):
    """Killed at each step, on both paths: the final name is absent or whole; the leftovers (a workspace, and
    without hard links the name's lock) name the killed process as their owner; until a sweep the lock keeps the
    name reserved, and a sweep by age alone keeps them (fresh); the start-up sweep removes them at once, no aging
    needed, and nothing else; the same name is then written."""
    from lycoris_nodes.nodes.tools.common import sweep_leftovers, write_file

    folder = two_loras_folders / "sub"
    folder.mkdir()
    save_file({"mine": torch.ones(3)}, folder / "user.safetensors")
    if moment == "during_save_file":
        pid = kill_during_save_file(folder, links)
    else:
        pid = kill_at(folder, links, moment)
    if links == "none":  # this process writes to the same (emulated) filesystem
        request.getfixturevalue("no_hard_links")
    final = folder / "killed.safetensors"
    assert final.exists() == (moment == "after_move")
    assert_absent_or_whole(final, SMALL)
    [workspace] = workspaces(folder)
    locked = links == "none" and moment == "before_move"
    lock = folder / ".killed.safetensors.lycoris-lock"
    assert leftovers(folder) == sorted([workspace.name] + [lock.name] * locked)
    inside = sorted(p.name for p in workspace.iterdir())
    assert writer.OWNER in inside
    inside.remove(writer.OWNER)
    if moment == "during_save_file":  # safetensors' own temporary file, cut short
        assert inside and not any(name.endswith(".safetensors") for name in inside)
    else:  # the complete file, unless it was moved out of the workspace
        assert inside == ([] if (links, moment) == ("none", "after_move") else ["tensors"])
    owner = json.loads((workspace / writer.OWNER).read_bytes())
    assert owner.keys() == {"host", "pid", "started"}
    assert (owner["host"], owner["pid"]) == (socket.gethostname(), pid)
    assert time.time() - 600 < owner["started"] <= time.time()
    if locked:
        assert json.loads(lock.read_bytes()) == owner
        if not final.exists():  # the lock reserves the name until a sweep finds its owner gone
            with pytest.raises(LycorisError, match="another write of this name is under way"):
                writer.write(final, {"w": torch.zeros(1)}, {})

    before = leftovers(folder)
    writer.sweep(two_loras_folders)  # by age alone: all of it is younger than the threshold
    assert leftovers(folder) == before
    sweep_leftovers()  # as at start-up: the owner is a process of this machine that no longer runs
    assert sorted(p.name for p in folder.iterdir()) == ["killed.safetensors", "user.safetensors"][not final.exists():]
    assert_absent_or_whole(final, SMALL)
    assert torch.equal(load_file(folder / "user.safetensors")["mine"], torch.ones(3))

    assert write_file("sub/killed", {"w": torch.zeros(1)}, {}, overwrite=final.exists()) == "sub/killed.safetensors"
    assert load_file(final)["w"].tolist() == [0.0]
    assert sorted(p.name for p in folder.iterdir()) == ["killed.safetensors", "user.safetensors"]


@pytest.mark.parametrize("links", ["hard", "none"])
def test_the_next_write_sweeps_a_killed_writes_leftovers(two_loras_folders, request, links):
    from lycoris_nodes.nodes.tools.common import write_file

    kill_at(two_loras_folders, links, "before_move")
    if links == "none":
        request.getfixturevalue("no_hard_links")
    assert leftovers(two_loras_folders)
    assert write_file("killed", {"w": torch.ones(1)}, {}, overwrite=False) == "killed.safetensors"
    assert sorted(p.name for p in two_loras_folders.iterdir()) == ["killed.safetensors"]


@pytest.mark.parametrize("links", ["hard", "none"])
def test_a_live_writers_files_are_not_swept_and_a_racing_writer_fails_cleanly(two_loras_folders, request, links):
    """A child paused with its complete file (and, without hard links, the name's lock) in place: the sweep leaves
    them. A second write of the same name: without hard links it fails on the lock, naming the file, and the paused
    write then finishes; with hard links the first to link wins (here the second) and the paused one then fails on
    the taken name, leaving nothing of its own."""
    from lycoris_nodes.nodes.tools.common import sweep_leftovers, write_file

    if links == "none":
        request.getfixturevalue("no_hard_links")
    final = two_loras_folders / "raced.safetensors"
    process = child(two_loras_folders, "raced.safetensors", links, "pause_before_move")
    try:
        assert process.stdout.readline() == "writing\n"
        assert process.stdout.readline() == "ready\n"
        before = leftovers(two_loras_folders)
        assert len(before) == (1 if links == "hard" else 2)
        sweep_leftovers()
        assert leftovers(two_loras_folders) == before
        if links == "none":
            with pytest.raises(LycorisError, match="another write of this name is under way") as raised:
                write_file("raced", {"w": torch.zeros(1)}, {}, overwrite=False)
            assert raised.value.file == str(final)
        else:
            assert write_file("raced", {"w": torch.zeros(1)}, {}, overwrite=False) == "raced.safetensors"
        process.stdin.write("go\n")
        process.stdin.flush()
        process.wait(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert [p.name for p in two_loras_folders.iterdir()] == ["raced.safetensors"]
    if links == "none":
        assert process.returncode == 0
        assert_absent_or_whole(final, SMALL)
    else:
        assert process.returncode == 1 and "a file of this name exists" in process.stderr.read()
        assert load_file(final)["w"].tolist() == [0.0]


def test_a_write_in_progress_in_this_process_is_not_swept(two_loras_folders, monkeypatch):
    """A tool write in another thread of this process, paused before its fsync: the sweep (the next write's, or
    start-up's) sees its owner is this process, running, and leaves its workspace; the write then finishes."""
    from lycoris_nodes.nodes.tools.common import sweep_leftovers, write_file

    paused, resume = threading.Event(), threading.Event()
    fsync_file = writer._fsync_file

    def pause(path):
        paused.set()
        assert resume.wait(60)
        fsync_file(path)

    monkeypatch.setattr(writer, "_fsync_file", pause)
    written = []
    thread = threading.Thread(target=lambda: written.append(write_file("busy", {"w": torch.ones(2)}, {}, False)))
    thread.start()
    try:
        assert paused.wait(60)
        [workspace] = workspaces(two_loras_folders)
        assert json.loads((workspace / writer.OWNER).read_bytes())["pid"] == os.getpid()
        sweep_leftovers()
        assert workspaces(two_loras_folders) == [workspace]
        assert sorted(p.name for p in workspace.iterdir()) == [writer.OWNER, "tensors"]
    finally:
        resume.set()
        thread.join(60)
    assert written == ["busy.safetensors"]
    assert [p.name for p in two_loras_folders.iterdir()] == ["busy.safetensors"]


# --- what the sweep removes ----------------------------------------------------------------------------------------------

def test_the_sweep_removes_only_stale_leftovers_of_the_writer_inside_the_loras_folders(two_loras_folders, tmp_path):
    from lycoris_nodes.nodes.tools.common import sweep_leftovers

    save_file({"w": torch.ones(4)}, tmp_path / "user.safetensors")
    tensors = (tmp_path / "user.safetensors").read_bytes()
    loras = two_loras_folders
    ours = {  # stale leftovers of killed writes, in any subfolder of either loras folder: path -> files in it
        "deep/er/.m.abcd_123.lycoris-partial": {".tmpAb12Cd": tensors[:20]},
        ".m.abcd1234.lycoris-partial": {},
        "../more_loras/.n.x.zz99zz99.lycoris-partial": {"tensors": tensors},
        ".m.safetensors.lycoris-lock": b"",
        ".old.ab12cd34.partial": tensors[:30],  # an earlier version's temporary file
    }
    kept = {  # other programs' and users' files and folders, however old
        "user.safetensors": tensors,
        ".hidden.safetensors": tensors,
        ".tmpAb12Cd": tensors[:20],  # safetensors' own temporary file, but not in a workspace
        "download.partial": tensors,
        "model.safetensors.partial": tensors,
        ".other.ab12cd34.partial": b"not tensors",  # the old shape, another program's content
        ".empty.ab12cd34.partial": b"",  # the old shape, no sign of a tensor write
        ".file.abcd1234.lycoris-partial": tensors,  # a workspace's name, but a file
        "m.abcd1234.lycoris-partial": {"tensors": tensors},  # no leading dot
        ".m.abcd123.lycoris-partial": {"tensors": tensors},  # not 8 random characters
        ".m.abcd1234.lycoris-partial.bak": {"tensors": tensors},
        ".m.lycoris-lock": b"",  # not a .safetensors name's lock
        "../outside/.m.abcd1234.lycoris-partial": {"tensors": tensors},  # outside the loras folders
        "../outside/.m.safetensors.lycoris-lock": b"",
    }
    for name, content in {**ours, **kept}.items():
        make(loras / name, content)
    (loras / ".nested.abcd1234.lycoris-partial" / "folder").mkdir(parents=True)  # holds more than a write leaves
    (loras / ".link.abcd1234.lycoris-partial").symlink_to(loras / "deep")
    (loras / ".link.safetensors.lycoris-lock").symlink_to(loras / "user.safetensors")
    age_tree(tmp_path)
    live = loras / ".live.abcd1234.lycoris-partial"  # an old folder, but a file in it is being written
    make(live, {".tmpXy34Zw": tensors[:10]})
    age([live])
    fresh = loras / ".fresh.safetensors.lycoris-lock"
    fresh.write_bytes(b"")

    sweep_leftovers()
    assert [name for name in ours if (loras / name).exists()] == []
    assert [name for name, content in kept.items() if read(loras / name) != content] == []
    assert live.is_dir() and fresh.is_file() and (loras / ".nested.abcd1234.lycoris-partial" / "folder").is_dir()
    assert (loras / ".link.abcd1234.lycoris-partial").is_symlink() and (loras / "deep").is_dir()
    assert (loras / ".link.safetensors.lycoris-lock").is_symlink()


def make(path: Path, content: bytes | dict) -> None:
    """A file of `content`, or a folder of files {name: bytes}."""
    if isinstance(content, bytes):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return
    path.mkdir(parents=True)
    for name, data in content.items():
        (path / name).write_bytes(data)


def read(path: Path) -> bytes | dict:
    return path.read_bytes() if path.is_file() else {p.name: p.read_bytes() for p in path.iterdir()}


def test_the_sweep_never_raises_and_names_what_it_cannot_read_or_remove(two_loras_folders, monkeypatch, caplog):
    """A lock that cannot be removed and a folder that cannot be listed (here an unlink and a scandir failing with
    EACCES) are logged by name and left; the rest is still swept; a loras folder that does not exist is skipped
    quietly."""
    import folder_paths
    from lycoris_nodes.nodes.tools.common import sweep_leftovers

    stuck, free = (two_loras_folders / f".{n}.safetensors.lycoris-lock" for n in ("stuck", "free"))
    unreadable = two_loras_folders / "unreadable"
    make(unreadable / ".hidden.safetensors.lycoris-lock", b"")
    for path in (stuck, free):
        path.write_bytes(b"")
    age_tree(two_loras_folders)
    real_unlink, real_scandir = Path.unlink, os.scandir

    def unlink(self, *args, **kwargs):
        if self == stuck:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_unlink(self, *args, **kwargs)

    def scandir(path="."):
        if Path(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(os, "scandir", scandir)
    paths = folder_paths.folder_names_and_paths["loras"][0]
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(two_loras_folders.parent / "missing"), *paths], {".safetensors"}))
    with caplog.at_level(logging.INFO, logger="lycoris_nodes"):
        sweep_leftovers()
    assert stuck.exists() and not free.exists() and (unreadable / ".hidden.safetensors.lycoris-lock").exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("Permission denied" in warning for warning in warnings)
    assert any(f"could not remove {stuck}," in warning for warning in warnings)
    assert any(f"could not look for leftovers of killed writes in {unreadable}:" in warning for warning in warnings)


def ended_pid() -> int:
    """The pid of a child that has run, ended and been reaped (not reused in the instant this test takes)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_owner_alive_tells_running_processes_from_ended_and_reused_ones():
    from lycoris_nodes.nodes.tools.common import START_TOLERANCE, owner_alive, process_started

    me, started = os.getpid(), process_started()
    assert started == psutil.Process().create_time()
    assert owner_alive(me, started) and owner_alive(me, started + START_TOLERANCE / 2) and owner_alive(me, None)
    assert not owner_alive(me, started - 60) and not owner_alive(me, started + 2 * START_TOLERANCE)  # pid reused
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        other = psutil.Process(process.pid).create_time()
        assert owner_alive(process.pid, other) and owner_alive(process.pid, None)
        assert not owner_alive(process.pid, other - 60)
    finally:
        process.kill()
    deadline = time.monotonic() + 60  # killed, not yet reaped: a zombie, which runs no code
    while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not owner_alive(process.pid, other) and not owner_alive(process.pid, None)
    process.wait()
    assert not owner_alive(process.pid, other) and not owner_alive(process.pid, None)  # no such pid


def test_the_sweep_removes_at_once_only_leftovers_whose_owner_ended_on_this_machine(two_loras_folders, tmp_path):
    """Workspaces and locks holding owner records: those of an ended process of this machine (no such pid, or this
    process's pid with another start time: reused) go at the first sweep; those of a running process, of another
    machine, or with a record that is missing, cut short or not ours stay until they are an hour old (the running
    ones are not aged here); a record reached through a link is never read."""
    from lycoris_nodes.nodes.tools.common import process_started, sweep_leftovers

    loras, here, me, started, gone = two_loras_folders, socket.gethostname(), os.getpid(), process_started(), ended_pid()

    def record(host=here, pid=me, when=started) -> bytes:
        return json.dumps({"host": host, "pid": pid, "started": when}).encode()

    ended = {
        "gone": record(pid=gone, when=started + 10),
        "gone_no_start": record(pid=gone, when=None),
        "reused": record(when=started - 3600),
        "reused_later": record(when=started + 5),
        "extra_keys": json.dumps({"host": here, "pid": gone, "started": None, "more": 1}).encode(),
    }
    running = {
        "mine": record(),
        "mine_no_start": record(when=None),
        "mine_within_tolerance": record(when=started + 0.5),
    }
    judged_by_age = {
        "other_host": record(host=f"{here}-elsewhere", pid=gone),
        "no_host": json.dumps({"pid": gone, "started": None}).encode(),
        "cut_short": record(pid=gone)[:-5],
        "empty": b"",
        "not_json": b"\xff\xfe owner",
        "a_list": json.dumps([here, gone, None]).encode(),
        "pid_text": record(pid=str(gone)),
        "pid_true": record(pid=True),
        "pid_zero": record(pid=0),
        "pid_negative": record(pid=-gone),
        "pid_fraction": record(pid=gone + 0.5),
        "started_text": record(pid=gone, when="yesterday"),
        "started_nan": record(pid=gone, when=float("nan")),
        "started_infinite": record(pid=gone, when=float("inf")),
        "too_long": record(pid=gone) + b" " * writer.OWNER_LIMIT,
        "no_record": None,
    }
    lock = {name: loras / f".{name}.safetensors.lycoris-lock" for name in [*ended, *running, *judged_by_age]}
    space = {name: loras / f".{name}.abcd1234.lycoris-partial" for name in lock}
    for name, content in {**ended, **running, **judged_by_age}.items():
        make(space[name], {"tensors": b"x"} if content is None else {writer.OWNER: content, "tensors": b"x"})
        if content is not None:
            lock[name].write_bytes(content)
    del lock["no_record"]
    # a dead owner's record reached through links: the workspace holds a link (not ours), the lock is a link
    (tmp_path / "record").write_bytes(ended["gone"])
    make(loras / ".linked.abcd1234.lycoris-partial", {"tensors": b"x"})
    (loras / ".linked.abcd1234.lycoris-partial" / writer.OWNER).symlink_to(tmp_path / "record")
    (loras / ".linked.safetensors.lycoris-lock").symlink_to(tmp_path / "record")

    def present(names) -> list[str]:
        return [n for n in names if space[n].is_dir() or (n in lock and lock[n].exists())]

    writer.sweep(loras)  # no owner_alive: the age rule alone
    assert present(ended) == list(ended)
    sweep_leftovers()
    assert present(ended) == []
    assert present(running) == list(running) and present(judged_by_age) == list(judged_by_age)
    assert all(space[n].is_dir() and lock[n].is_file() for n in running)
    assert all(space[n].is_dir() and (n not in lock or lock[n].is_file()) for n in judged_by_age)
    assert (loras / ".linked.abcd1234.lycoris-partial" / writer.OWNER).is_symlink()
    assert (loras / ".linked.safetensors.lycoris-lock").is_symlink()

    age_tree(tmp_path)  # an hour old, except the running owners'
    for name in running:
        for path in (space[name], *space[name].iterdir(), lock[name]):
            os.utime(path)
    sweep_leftovers()
    assert present(judged_by_age) == []
    assert present(running) == list(running)
    assert (loras / ".linked.abcd1234.lycoris-partial" / writer.OWNER).is_symlink()  # holds a link: never ours
    assert (loras / ".linked.safetensors.lycoris-lock").is_symlink()
    assert (tmp_path / "record").read_bytes() == ended["gone"]
