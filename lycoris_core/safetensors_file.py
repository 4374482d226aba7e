"""A safetensors reader that validates the header before trusting it and never memory-maps the user's file.

Why not `safetensors.safe_open`: we want (1) the header and metadata without touching tensor data, (2) an error that
names the file and the key for every way a file can be broken (truncated, overlapping or out-of-range offsets, bad
JSON), and (3) a process that survives the file being rewritten under it. A memory map of a file that is truncated
and rewritten in place (`cp new.safetensors old.safetensors`) kills the process with SIGBUS on the next read of a
page past the new end, and one that keeps its size silently serves the new bytes, unchecked. So the user's file is
only ever read with ordinary reads, which end short instead:
- by default each `tensor()` is a private copy read on demand (the summary reads a few scalars this way);
- with `snapshot=True` (the loader) the whole file is first copied into a temporary file of our own (in the kernel
  where it can: copy_file_range, a reflink on btrfs/xfs; elsewhere in user space). The header and values checked
  are the copy's, and tensors are views of a copy-on-write map of it: nobody else can write it, so every later
  patch reads exactly the bytes that were validated, and a large file costs reclaimable page cache and temporary
  disk space, not process memory. The map holds no open file where the OS allows (POSIX: the copy's name is
  removed as soon as it is mapped, and the copy is gone with the last view of it), so the cache and patched models
  can hold thousands of files under a 256-descriptor limit; on Windows, which cannot remove a mapped file, the map
  keeps the delete-on-close copy's handle (its limits are far higher).
A file that ends too early while it is still being written (recently modified, or moving while we look) is reported
as such, not as damaged. Pickle formats are refused: loading them runs arbitrary code. Errors never quote the
file's bytes (a symlink may point anywhere): they say what is wrong and where.
"""

import contextlib
import ctypes
import errno
import json
import math
import mmap
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import LycorisError, encodable

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl")
SNAPSHOT_PREFIX = "lycoris-snapshot-"  # the copies' names in the temp directory, for the moment they have one
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
_KERNEL_COPY_CHUNK = 1 << 30
# One buffer, reused (shutil.copyfileobj allocates a new chunk per read); 256 KiB to 8 MiB measured alike here.
_USER_COPY_CHUNK = 1 << 20
# copy_file_range is not supported on this pair of files (old kernel, other file systems): copy in user space.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}
# A file that ends too early and was modified this recently is taken to be still being written. A writer's mtime
# moves with every write, so while it writes this is the time since its last chunk: a minute covers a trainer's
# pauses between tensors (GPU-to-CPU copies, a slow or network disk, a sync tool's chunks) with room to spare, while a
# download cut off long ago still gets the plain "truncated" message.
_RECENT_WRITE_SECONDS = 60.0
# An older incomplete file is looked at again after this long (only on that error path): a writer that is still at it
# moves its size or mtime in far less.
_RECHECK_SECONDS = 0.2
_STILL_WRITING = ("it is probably still being written; run again once it is complete (if nothing is writing it, it "
                  "is truncated)")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# --- what this OS offers ---------------------------------------------------------------------------------------------
# Probed once at import. Each branch a capability selects is also run on Linux by the tests, which replace PLATFORM
# with capabilities switched off (tests/test_snapshot_platforms.py).

def _probe_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(2) (Python's mmap.madvise needs a Python mmap, which holds a descriptor); None on Windows."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def _probe_map_without_descriptor() -> bool:
    """Whether a copy-on-write map of a file can outlive its descriptor and its name: torch's from_file closes its
    descriptor once mapped, and POSIX lets an open, mapped file's name be removed. Windows refuses to remove it.
    Tried once, in the order the snapshot does it."""
    if not hasattr(torch.UntypedStorage, "from_file"):
        return False
    try:
        fd, name = tempfile.mkstemp(prefix=SNAPSHOT_PREFIX)
    except OSError:
        return False
    try:
        os.write(fd, b"\0")
        return _removable_while_open_and_mapped(name)
    except (OSError, RuntimeError):  # RuntimeError: torch could not map it
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _removable_while_open_and_mapped(name: str) -> bool:
    mapped = torch.UntypedStorage.from_file(name, shared=False, nbytes=1)
    try:
        os.unlink(name)
    except PermissionError:
        return False
    finally:
        del mapped
    return True


@dataclass(frozen=True)
class Platform:
    """The capabilities the reader uses, each with its fallback where it is missing."""

    kernel_copy: bool  # os.copy_file_range (Linux)
    madvise: Callable[[int, int, int], int] | None  # libc madvise (Linux, macOS); release() is a no-op without it
    nonblocking_open: int  # O_NONBLOCK, so that opening a FIFO does not wait for a writer; 0 where there is none
    map_without_descriptor: bool  # POSIX: the snapshot holds no open file
    open_sharing_delete: Callable[[str], int] | None  # Windows: see _windows_opener

    @classmethod
    def probe(cls) -> "Platform":
        return cls(kernel_copy=hasattr(os, "copy_file_range"), madvise=_probe_madvise(),
                   nonblocking_open=getattr(os, "O_NONBLOCK", 0),
                   map_without_descriptor=_probe_map_without_descriptor(), open_sharing_delete=_windows_opener())


# --- Windows: open the user's file so that a trainer can still replace it ---------------------------------------------
# os.open shares read and write but not delete on Windows, so a trainer saving by renaming a new file over this one
# (an atomic save) fails with PermissionError [WinError 5] while we copy it. CreateFileW with FILE_SHARE_DELETE lets
# the rename happen; our handle goes on reading the old file, and the copy check sees no change. CI runs on Linux and
# cannot execute these lines; they are kept to this one function.
_GENERIC_READ = 0x80000000
_FILE_SHARE_READ_WRITE_DELETE = 0x1 | 0x2 | 0x4
_OPEN_EXISTING = 3
_FILE_ATTRIBUTE_NORMAL = 0x80


def _windows_opener() -> Callable[[str], int] | None:
    """A function opening a path for reading, sharing read, write and delete, as a file descriptor; None off Windows."""
    if not hasattr(ctypes, "WinDLL"):
        return None
    import msvcrt
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    create_file, close_handle = kernel32.CreateFileW, kernel32.CloseHandle
    create_file.argtypes = (wintypes.LPCWSTR, wintypes.DWORD, wintypes.DWORD, wintypes.LPVOID, wintypes.DWORD,
                            wintypes.DWORD, wintypes.HANDLE)
    create_file.restype = wintypes.HANDLE
    close_handle.argtypes = (wintypes.HANDLE,)
    invalid_handle = wintypes.HANDLE(-1).value

    def open_sharing_delete(path: str) -> int:
        handle = create_file(path, _GENERIC_READ, _FILE_SHARE_READ_WRITE_DELETE, None, _OPEN_EXISTING,
                             _FILE_ATTRIBUTE_NORMAL, None)
        if handle is None or handle == invalid_handle:
            raise ctypes.WinError(ctypes.get_last_error())
        try:
            return msvcrt.open_osfhandle(handle, os.O_RDONLY | os.O_BINARY)
        except OSError:
            close_handle(handle)
            raise

    return open_sharing_delete


PLATFORM = Platform.probe()


# --- the reader --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """Header parsed and checked at construction; tensor bytes read only when `tensor()` is called.

    `snapshot=True`: read from a private copy made first (see the module docstring), in `temp_dir` (default: the
    system's temporary directory). Use as a context manager, or `close()`, to let go of the file early.
    """

    def __init__(self, path: str | os.PathLike, *, snapshot: bool = False, temp_dir: str | os.PathLike | None = None):
        self.path = Path(path)
        self.name = self.path.name
        if self.path.suffix.lower() in PICKLE_SUFFIXES:
            raise LycorisError(
                f"'{self.path.suffix}' files are Python pickles, which can run arbitrary code when loaded; "
                "only .safetensors files are read. Convert the file to .safetensors first.",
                file=self.name,
            )
        self._buffer = None  # the snapshot's bytes: a copy-on-write map (a buffer torch.frombuffer can view)
        self._file, self._source_stat = self._open()
        try:
            if snapshot:
                self._file = self._snapshot(os.fspath(temp_dir) if temp_dir else tempfile.gettempdir())
            self.size = os.fstat(self._file.fileno()).st_size
            self.entries, self.metadata, self._data_start = self._read_header()
            if snapshot:
                self.close()  # the map keeps the copy
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SafetensorsFile":  # noqa: PYI034 (no typing.Self on Python 3.10)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (a snapshot's map stays: the tensors are views of it, and it goes when they do)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _error(self, reason: str, key: str | None = None) -> LycorisError:
        return LycorisError(reason, file=self.name, key=key)

    def _open(self) -> tuple[BinaryIO, os.stat_result]:
        try:
            fd = open_for_reading(self.path)
        except OSError as e:
            raise self._error(f"cannot open the file ({e.strerror or type(e).__name__})") from e
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            os.close(fd)
            raise self._error("not a regular file (a FIFO, device or directory); only .safetensors files are read")
        return os.fdopen(fd, "rb"), opened

    # --- the snapshot ---

    def _snapshot(self, temp_dir: str) -> BinaryIO:
        """The file copied into a temporary file of our own and mapped (self._buffer); the source is closed. Returns
        the copy, open for reading its header."""
        if PLATFORM.map_without_descriptor:
            return self._snapshot_mapped_by_name(temp_dir)
        return self._snapshot_mapped_by_descriptor(temp_dir)

    def _snapshot_mapped_by_name(self, temp_dir: str) -> BinaryIO:
        """POSIX: a named copy, mapped by name (no descriptor kept) and unnamed at once."""
        try:
            fd, name = tempfile.mkstemp(prefix=SNAPSHOT_PREFIX, suffix=".safetensors", dir=temp_dir)
        except OSError as e:
            raise self._cannot("create a private copy in", temp_dir, e) from e
        copy = os.fdopen(fd, "w+b")
        try:
            size = self._copy_from_source(copy, temp_dir)
            self._buffer = self._map_by_name(name, size) if size else None
        except BaseException:
            copy.close()
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):  # the temp directory emptied meanwhile
                os.unlink(name)
        return copy

    def _snapshot_mapped_by_descriptor(self, temp_dir: str) -> BinaryIO:
        """Where a mapped file cannot be unnamed (Windows): a delete-on-close copy (unnamed at once where the OS
        can), kept by its Python mmap's own handle."""
        try:
            copy = tempfile.TemporaryFile(dir=temp_dir)  # noqa: SIM115 (it outlives this function, as the map's file)
        except OSError as e:
            raise self._cannot("create a private copy in", temp_dir, e) from e
        try:
            size = self._copy_from_source(copy, temp_dir)
            self._buffer = mmap.mmap(copy.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except BaseException:
            copy.close()
            raise
        return copy

    def _copy_from_source(self, copy: BinaryIO, temp_dir: str) -> int:
        """Copy the whole source into `copy` and close the source; refuse a file that changed meanwhile."""
        source, before = self._file, self._source_stat
        try:
            copied = _copy_bytes(source, copy)
            after = os.fstat(source.fileno())
        except OSError as e:
            raise self._cannot("copy the file into", temp_dir, e) from e
        finally:
            source.close()
            self._file = None
        if copied != before.st_size or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise self._error("the file changed while it was being read (is it still being written?); "
                              "run again once it is complete")
        return copied

    def _map_by_name(self, name: str, size: int) -> ctypes.Array:
        try:
            return _map_without_descriptor(name, size)
        except RuntimeError as e:  # torch's mapping error (out of address space, a file system without mmap)
            raise self._error(f"cannot map the private copy ({e})") from e

    def _cannot(self, what: str, temp_dir: str, e: OSError) -> LycorisError:
        return self._error(f"cannot {what} {temp_dir} ({e.strerror or type(e).__name__})")

    # --- the header ---

    def _read_exactly(self, start: int, length: int, key: str | None = None) -> bytearray:
        buffer = bytearray(length)
        view, done = memoryview(buffer), 0
        self._file.seek(start)
        while done < length:
            n = self._file.readinto(view[done:])
            if not n:
                raise self._error(f"the file changed while it was being read: it now ends before byte "
                                  f"{start + length}", key)
            done += n
        return buffer

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
        if self.size < 8:
            raise self._incomplete(f"not a safetensors file: {self.size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(self._read_exactly(0, 8), "little")
        # Not the number itself: it is 8 bytes of whatever the file is.
        no_header = (f"not a safetensors file, or truncated: its first 8 bytes are not the length of a header that "
                     f"fits in its {self.size} bytes")
        if header_len > _MAX_HEADER_BYTES:
            raise self._error(no_header)
        if 8 + header_len > self.size:
            raise self._incomplete(no_header)
        raw = self._read_exactly(8, header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:  # its text quotes the byte: say where instead
            raise self._error(f"corrupt safetensors header (not UTF-8 at byte {8 + e.start})") from e
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, or a 5000-digit number
            raise self._error(f"corrupt safetensors header ({type(e).__name__}: {e})") from e
        if not isinstance(header, dict):
            raise self._error("corrupt safetensors header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._error("corrupt safetensors header (__metadata__ is not an object)")
        data_start = 8 + header_len
        entries = {encodable(key): self._entry(key, info, data_start) for key, info in header.items()}
        self._check_layout(entries, data_start)
        return entries, {encodable(str(k)): encodable(_text(v)) for k, v in metadata.items()}, data_start

    def _incomplete(self, damage: str, key: str | None = None) -> LycorisError:
        """The error for a file that ends too early: `damage`, unless it looks like a file still being written."""
        age = time.time() - self._source_stat.st_mtime_ns / 1e9
        if abs(age) < _RECENT_WRITE_SECONDS:  # abs: a network file server's clock may be ahead of ours
            return self._error(f"the file is incomplete and was modified {max(age, 0):.0f} s ago: {_STILL_WRITING}",
                               key)
        time.sleep(_RECHECK_SECONDS)
        if self._source_moved():
            return self._error(f"the file is incomplete and changed while it was being read: {_STILL_WRITING}", key)
        return self._error(damage, key)

    def _source_moved(self) -> bool:
        """Whether the path no longer names the file as it was read (written to, replaced or removed since)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        then = self._source_stat
        return (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (then.st_dev, then.st_ino, then.st_size,
                                                                          then.st_mtime_ns)

    def _entry(self, key: str, info, data_start: int) -> TensorEntry:
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or info["dtype"] not in DTYPES:
            raise self._error(f"corrupt tensor entry: no dtype among {', '.join(DTYPES)}", key)
        try:
            shape = tuple(_integer(d) for d in info["shape"])
            begin, end = (_integer(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise self._error("corrupt tensor entry: 'shape' must be a list of integers and 'data_offsets' two "
                              "integers", key) from e
        dtype = DTYPES[info["dtype"]]
        entry = TensorEntry(dtype, shape, data_start + begin, data_start + end)
        expected = entry.numel * dtype.itemsize
        if any(d < 0 for d in shape) or begin < 0 or end - begin != expected:
            raise self._error(f"corrupt tensor entry: shape {list(shape)} needs {expected} bytes, offsets say "
                              f"{end - begin}", key)
        if entry.end > self.size:
            raise self._incomplete(
                f"file is truncated: tensor data ends at byte {entry.end} but the file has {self.size} bytes", key
            )
        return entry

    def _check_layout(self, entries: dict[str, TensorEntry], data_start: int) -> None:
        previous_end, previous_key = data_start, None
        for key, entry in sorted(entries.items(), key=lambda kv: kv[1].start):
            if entry.start < previous_end and entry.end > entry.start:
                raise self._error(f"corrupt file: tensor data overlaps '{previous_key}'", key)
            previous_end, previous_key = max(previous_end, entry.end), key

    # --- tensors ---

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, key: str) -> torch.Tensor:
        """A CPU tensor: a view of the snapshot's map (copy-on-write: writing to it changes nothing else), or a
        private copy read from the file now."""
        entry = self.entries[key]
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._buffer is None:
            if self._file is None:
                raise self._error("read after close()", key)
            data = self._read_exactly(entry.start, entry.end - entry.start, key)
            return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)
        if entry.start % entry.dtype.itemsize:
            # torch.frombuffer needs aligned storage; misaligned files (rare, old writers) get a copy.
            data = torch.frombuffer(self._buffer, dtype=torch.uint8, count=entry.end - entry.start,
                                    offset=entry.start).clone()
            return data.view(entry.dtype).reshape(entry.shape)
        # Each tensor its own storage over the map (the cache counts storages), each keeping the whole map alive.
        flat = torch.frombuffer(self._buffer, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return flat.reshape(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: self.tensor(key) for key in self.entries}

    def mapped_range(self) -> tuple[int, int] | None:
        """(first, end) addresses of the snapshot's map, to tell its views from private tensors; None unmapped."""
        if self._buffer is None:
            return None
        first = torch.frombuffer(self._buffer, dtype=torch.uint8, count=1).data_ptr()
        return first, first + len(self._buffer)

    def release_all(self) -> None:
        """`release` for the whole map: reading a scalar (alpha) faults in the pages around it too (the kernel's
        fault-around), which for a file of many modules adds up to a good part of it."""
        span = self.mapped_range()
        if span is not None:
            _drop_pages(*span)

    def release(self, tensor: torch.Tensor) -> None:
        """Let the OS take back the pages of a tensor of the snapshot's map once it has been read (checked at load):
        they leave this process's resident memory but stay in the page cache, and the next read faults them back in
        from the copy, which nobody else can write."""
        span = self.mapped_range()
        if span is None or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if start < span[0] or end > span[1]:
            return  # not a view of this map (a misaligned tensor's copy, or a tensor a converter replaced)
        _drop_pages(start, end)


def open_for_reading(path: str | os.PathLike) -> int:
    """A descriptor reading `path` that lets a trainer replace the file meanwhile (Windows: shares delete) and does
    not wait on a FIFO."""
    if PLATFORM.open_sharing_delete is not None:
        return PLATFORM.open_sharing_delete(os.fspath(path))
    return os.open(path, os.O_RDONLY | PLATFORM.nonblocking_open | getattr(os, "O_BINARY", 0))


def _map_without_descriptor(name: str, size: int) -> ctypes.Array:
    """A copy-on-write map of the file `name` holding no descriptor, as a buffer that keeps the map alive.

    A ctypes array is the buffer: torch.frombuffer keeps the object it views, and the array keeps the storage. Its
    type is made here rather than as `c_ubyte * size`, which ctypes caches for the life of the process.
    """
    storage = torch.UntypedStorage.from_file(name, shared=False, nbytes=size)
    snapshot_bytes = type("SnapshotBytes", (ctypes.Array,), {"_type_": ctypes.c_ubyte, "_length_": size})
    buffer = snapshot_bytes.from_address(storage.data_ptr())
    buffer.storage = storage
    return buffer


def _drop_pages(start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) over [start, end) of a snapshot's map, from the page holding `start`: the pages leave
    the process (a later read faults them back in from the copy). A no-op where there is no madvise."""
    madvise = PLATFORM.madvise
    if madvise is None:
        return
    first = start - start % mmap.PAGESIZE
    if madvise(first, end - first, mmap.MADV_DONTNEED) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise: {os.strerror(code)}")


def _integer(value) -> int:
    """A JSON integer; floats (1e400 parses as inf), booleans and strings are not sizes or offsets."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return value


def _text(value) -> str:
    """A metadata value as text: the format says strings; a nested value some writer left is kept as its JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (ValueError, RecursionError):  # nested too deep to write back: its meaning is lost either way
        return ""


# --- copying ---------------------------------------------------------------------------------------------------------

def _copy_bytes(source: BinaryIO, target: BinaryIO) -> int:
    """Copy `source` to its end into `target`; the number of bytes copied."""
    if PLATFORM.kernel_copy:
        copied = _copy_in_kernel(source.fileno(), target.fileno())
        if copied is not None:
            return copied
    return _copy_in_user_space(source, target)


def _copy_in_kernel(source_fd: int, target_fd: int) -> int | None:
    """copy_file_range to the end (a reflink where the file system shares blocks); None when the kernel cannot copy
    between these two files and nothing was copied yet."""
    copied = 0
    try:
        while n := os.copy_file_range(source_fd, target_fd, _KERNEL_COPY_CHUNK):
            copied += n
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY or copied:
            raise
        return None
    return copied


def _copy_in_user_space(source: BinaryIO, target: BinaryIO) -> int:
    """macOS and Windows (and Linux where the kernel cannot): reads into one reused buffer, written straight on."""
    source.seek(0)
    target.seek(0)
    buffer = memoryview(bytearray(_USER_COPY_CHUNK))
    copied = 0
    while n := source.readinto(buffer):
        target.write(buffer[:n])
        copied += n
    target.flush()
    return copied
