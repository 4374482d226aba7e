"""Writing a .safetensors file whole or not at all, never over an existing file unless asked, and cleaning up after
writes that were killed.

The tensors go to a file in a private workspace folder `.<stem>.<random>` + TEMPORARY_SUFFIX beside the target (same
filesystem; safetensors itself writes through a `.tmp…` file of its own there), which is fsync'ed and then moved
into place: with `overwrite` by `os.replace` (atomic), without it by `os.link` (fails if the name exists, so two
writers racing for one name cannot both win). Where the filesystem has no hard links (FAT/exFAT, some network
shares), Windows' `os.rename` refuses an existing name atomically; elsewhere the name is reserved by an exclusive
lock file `.<name>` + LOCK_SUFFIX, checked free, and `os.replace`d into. The folder is fsync'ed after the move
(POSIX), so the new name survives a power cut. Any failure removes the workspace; a killed write leaves only a
workspace or a lock file (never an empty or partial file at the final name). Each records its owner (host, pid,
start time), so `sweep` removes them at once when that process has ended on this machine, else once they are stale.
Where the folder is chosen (never outside the loras folders for the nodes) is the caller's business.
"""

import errno
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from ..errors import LycorisError

log = logging.getLogger("lycoris_nodes")

# The only names this module creates besides the output, and the only ones `sweep` removes: workspace folders and
# lock files.
TEMPORARY_SUFFIX = ".lycoris-partial"
LOCK_SUFFIX = ".lycoris-lock"
_RANDOM = r"[a-z0-9_]{8}"  # tempfile's random part
TEMPORARY_NAME = re.compile(rf"\..+\.{_RANDOM}{re.escape(TEMPORARY_SUFFIX)}")
LOCK_NAME = re.compile(rf"\..+\.safetensors{re.escape(LOCK_SUFFIX)}")
# Versions before these names wrote the temporary file `.<stem>.<random>.partial` (a file). Other programs may use
# that shape too (it is Python's mkstemp with an obvious suffix), so such a file is removed only if it also starts
# like a safetensors file (8-byte header length, then the JSON header's "{"): an abandoned tensor write, whoever
# made it. An empty one is left: nothing tells whose it is, and it costs no space.
LEGACY_TEMPORARY_NAME = re.compile(rf"\..+\.{_RANDOM}\.partial")

# Whose a leftover is: each workspace holds an OWNER file, written before anything else, and each lock file holds the
# same record, JSON {"host": socket.gethostname(), "pid": os.getpid(), "started": the process's start time or null}.
# `sweep` removes a leftover at once when its owner ran on this machine and the caller's `owner_alive(pid, started)`
# says it is not running (no such pid, or one started at another time: the pid was reused). lycoris_core knows no
# process table: the nodes answer with psutil (nodes/tools/common.py); never os.kill(pid, 0), which on Windows
# terminates the process.
OWNER = "owner"
OWNER_LIMIT = 4096  # bytes read of a record; a longer one is not ours
OwnerAlive = Callable[[int, float | None], bool]

# Otherwise (no `owner_alive`, the owner on another machine sharing the folder, a record missing or unreadable: an
# earlier version's leftover, or a kill before the record was complete; or the owner still running) liveness is
# judged by age, not by an advisory lock: flock is local-only or unsupported on some network shares and
# msvcrt.locking is mandatory on Windows (it would block the writer's own second handle), while the mtime behaves the
# same everywhere. A live write touches its workspace while it writes; its longest untouched step (fsync of a
# multi-GB file to a slow USB stick) takes minutes, and a lock file lives for one rename. An hour covers both, plus
# clock differences between this machine and a network share.
STALE_AFTER = 3600.0  # seconds


def metadata_text(metadata: Mapping[str, object]) -> dict[str, str]:
    """safetensors metadata is str -> str: other values are stored as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in metadata.items()}


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, object],
          overwrite: bool = False, started: float | None = None) -> Path:
    """Write `tensors` (contiguous copies are made as needed) with `metadata` to `path`; returns the path.
    LycorisError when the file exists and `overwrite` is off, or another write of this name is under way.
    `started`: this process's start time as the sweeping side's `owner_alive` measures it, recorded with the host and
    pid as the write's owner (None: no start time, so a reused pid passes for the owner and only the age rule
    applies to it)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise LycorisError("the output name must end in .safetensors", file=str(path))
    if not overwrite and path.exists():
        raise _name_taken(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    owned = _own_storage(tensors)  # before the workspace exists, so its age counts from the write's first bytes
    owner = owner_record(started)
    workspace = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", suffix=TEMPORARY_SUFFIX, dir=path.parent))
    try:
        with open(workspace / OWNER, "xb") as record:  # first: a workspace without it is judged by age alone
            record.write(owner)
        written = workspace / "tensors"  # no .safetensors: ComfyUI lists files in hidden folders too
        save_file(owned, written, metadata=metadata_text(metadata))
        _fsync_file(written)
        if overwrite:
            os.replace(written, path)
        else:
            _move_new(written, path, owner)
        _fsync_folder(path.parent)
    finally:
        shutil.rmtree(workspace)
    return path


def owner_record(started: float | None) -> bytes:
    """What a workspace's OWNER file and a lock file hold: this process, on this machine, started at `started`."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}).encode()


def sweep(folder: str | os.PathLike, stale_after: float = STALE_AFTER,
          owner_alive: OwnerAlive | None = None) -> list[Path]:
    """Remove what killed writes left under `folder` (recursively, not following links): workspaces and lock files
    whose owner record names this machine and a process `owner_alive(pid, started)` says is not running, at once;
    those and earlier versions' temporary files untouched for `stale_after` seconds, whoever owned them. Returns the
    removed paths. Never raises OSError (`owner_alive` must not raise either): a file or folder that cannot be read
    or removed is logged as a warning and left."""
    removed = []
    if not os.path.isdir(folder):  # a configured folder that does not exist (yet) holds nothing to sweep
        return removed
    host = socket.gethostname()

    def ended(record: bytes | None) -> bool:
        return owner_alive is not None and _owner_ended(record, host, owner_alive)

    abandoned = _Abandoned(time.time() - stale_after, ended)
    for directory, folders, names in os.walk(folder, onerror=_warn_unreadable):
        workspaces = [name for name in folders if TEMPORARY_NAME.fullmatch(name)]
        folders[:] = [name for name in folders if name not in workspaces]  # not walked into: handled whole
        removed += [path for path in (Path(directory, name) for name in workspaces)
                    if _remove_if_abandoned(path, abandoned, _remove_workspace)]
        leftovers = [name for name in names if LOCK_NAME.fullmatch(name) or LEGACY_TEMPORARY_NAME.fullmatch(name)]
        removed += [path for path in (Path(directory, name) for name in leftovers)
                    if _remove_if_abandoned(path, abandoned, _remove_file)]
    return removed


def _name_taken(path: Path) -> LycorisError:
    return LycorisError("a file of this name exists; choose another name or allow overwriting", file=str(path))


def _own_storage(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing storage with another (safetensors refuses shared memory, and a tool may
    well write one tensor under two names, e.g. the same alpha)."""
    seen: set[int] = set()
    owned = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        owned[key] = tensor
    return owned


def _fsync_file(path: Path) -> None:
    with open(path, "r+b") as written:  # Windows flushes only a handle open for writing
        os.fsync(written.fileno())


def _fsync_folder(folder: Path) -> None:
    """Make the folder's new entry durable (POSIX). Windows cannot open a folder, and commits renames itself."""
    if os.name == "nt":
        return
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # this filesystem does not sync folders (some network and FUSE filesystems): nothing more can be done
    finally:
        os.close(handle)


def _move_new(written: Path, path: Path, owner: bytes) -> None:
    """Move `written` to a `path` that must not exist. A hard link refuses an existing name atomically."""
    try:
        os.link(written, path)
    except FileExistsError as e:
        raise _name_taken(path) from e
    except OSError:  # no hard links here (FAT/exFAT, some network shares)
        if os.name == "nt":
            _rename_new(written, path)
        else:
            _replace_under_lock(written, path, owner)


def _rename_new(written: Path, path: Path) -> None:
    """Windows' rename refuses an existing name, atomically."""
    try:
        os.rename(written, path)
    except FileExistsError as e:
        raise _name_taken(path) from e


def _replace_under_lock(written: Path, path: Path, owner: bytes) -> None:
    """POSIX rename replaces silently, so the name is reserved first by an exclusive lock file beside it, holding
    the owner record: a racing writer of this pack fails on the lock. Killed here, the write leaves the lock and its
    workspace (swept once their owner has ended, or stale), never an empty or partial file at `path`."""
    lock = lock_path(path)
    try:
        handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError as e:
        raise LycorisError(f"another write of this name is under way (or one was killed: its lock file {lock.name} "
                           f"is removed when its process is known to have ended, else after "
                           f"{STALE_AFTER / 60:.0f} minutes; or delete it)", file=str(path)) from e
    try:
        with os.fdopen(handle, "wb") as record:
            record.write(owner)
        if os.path.lexists(path):
            raise _name_taken(path)
        os.replace(written, path)
    finally:
        lock.unlink(missing_ok=True)  # a sweep may have judged it stale; the reservation has done its job either way


def lock_path(path: Path) -> Path:
    """The lock file reserving `path`'s name. Named after the whole name, so it clashes exactly when the names do
    (also on case-insensitive filesystems)."""
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


class _Abandoned(NamedTuple):
    """How `sweep` judges a leftover: untouched since `cutoff` (an mtime), or `ended(record)`: its owner record names
    a process of this machine that has ended."""

    cutoff: float
    ended: Callable[[bytes | None], bool]


def _owner_ended(record: bytes | None, host: str, owner_alive: OwnerAlive) -> bool:
    """Whether `record` is a well-formed owner record naming `host` and a process `owner_alive` says is not running.
    False for anything else: no record, a cut-short or foreign one, another machine's, a running process's."""
    try:
        owner = json.loads(record) if record is not None else None
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return False
    if not isinstance(owner, dict) or owner.get("host") != host:
        return False
    pid, started = owner.get("pid"), owner.get("started")
    if type(pid) is not int or pid <= 0:
        return False
    if started is not None and (type(started) not in (int, float) or not math.isfinite(started)):
        return False
    return not owner_alive(pid, started)


def _read_record(path: str | os.PathLike) -> bytes | None:
    """The content of `path` if it is a regular file of at most OWNER_LIMIT bytes, not reached through a link; None
    if it is not one or cannot be read (the leftover is then judged by age)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        handle = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return None
        data = b""
        while len(data) <= OWNER_LIMIT and (chunk := os.read(handle, OWNER_LIMIT + 1 - len(data))):
            data += chunk
        return data if len(data) <= OWNER_LIMIT else None
    except OSError:
        return None
    finally:
        os.close(handle)


def _remove_if_abandoned(path: Path, abandoned: _Abandoned, remove: Callable[[Path, _Abandoned], bool]) -> bool:
    """`remove(path, abandoned)` (which says whether it removed it). OSError, other than the path being gone already,
    is logged with the path's name, not raised."""
    try:
        if not remove(path, abandoned):
            return False
    except FileNotFoundError:  # another sweep (or the writer) removed it first
        return False
    except OSError as e:
        log.warning("LyCORIS: could not remove %s, left by a killed write: %s", path, e)
        return False
    log.info("LyCORIS: removed %s, left by a killed write", path)
    return True


def _remove_workspace(path: Path, abandoned: _Abandoned) -> bool:
    """A real folder (not a link) whose entries are all files, its owner ended or none of them touched since the
    cutoff: what a write leaves in its workspace (the owner record, the output, safetensors' own .tmp file). Anything
    else in it is not ours to delete."""
    if not stat.S_ISDIR(path.lstat().st_mode):
        return False
    entries = [(entry.path, entry.stat(follow_symlinks=False)) for entry in os.scandir(path)]
    untouched = max([path.lstat().st_mtime, *(status.st_mtime for _, status in entries)]) < abandoned.cutoff
    owner = [entry for entry, status in entries if os.path.basename(entry) == OWNER and stat.S_ISREG(status.st_mode)]
    if not (untouched or (owner and abandoned.ended(_read_record(owner[0])))):
        return False
    if not all(stat.S_ISREG(status.st_mode) for _, status in entries):
        log.warning("LyCORIS: left %s: named like a killed write's folder, but it holds more than a write leaves", path)
        return False
    for entry, _ in entries:
        os.unlink(entry)
    os.rmdir(path)
    return True


def _remove_file(path: Path, abandoned: _Abandoned) -> bool:
    """A regular file: a lock whose owner ended or not touched since the cutoff; an earlier version's temporary file
    not touched since the cutoff that starts like safetensors."""
    status = path.lstat()
    if not stat.S_ISREG(status.st_mode):
        return False
    if LOCK_NAME.fullmatch(path.name):
        if status.st_mtime >= abandoned.cutoff and not abandoned.ended(_read_record(path)):
            return False
    elif status.st_mtime >= abandoned.cutoff or not _starts_like_safetensors(path):
        return False
    path.unlink()
    return True


def _starts_like_safetensors(path: Path) -> bool:
    with open(path, "rb") as f:
        start = f.read(9)
    return len(start) == 9 and int.from_bytes(start[:8], "little") > 0 and start[8:] == b"{"


def _warn_unreadable(error: OSError) -> None:
    log.warning("LyCORIS: could not look for leftovers of killed writes in %s: %s", error.filename, error)
