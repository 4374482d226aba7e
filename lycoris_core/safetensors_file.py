"""A safetensors reader that validates the header before trusting it and never memory-maps the user's file.

Why not `safetensors.safe_open`: we want (1) the header and metadata without touching tensor data, (2) an error that
names the file and the key for every way a file can be broken (truncated, overlapping or out-of-range offsets, bad
JSON), and (3) a process that survives the file being rewritten under it. A memory map of a file that is truncated
and rewritten in place (`cp new.safetensors old.safetensors`) kills the process with SIGBUS on the next read of a
page past the new end, and one that keeps its size silently serves the new bytes, unchecked. So the user's file is
only ever read with ordinary reads, which end short instead:
- by default each `tensor()` is a private copy read on demand (the summary reads a few scalars this way);
- with `snapshot=True` (the loader) the whole file is first copied, in the kernel where it can (copy_file_range; a
  reflink on btrfs/xfs), into an unnamed temporary file of our own. The header and values checked are the copy's,
  and tensors are views of a map of the copy: nobody else can write it, so every later patch reads exactly the
  bytes that were validated, and a large file costs reclaimable page cache and temporary disk space, not process
  memory.
Pickle formats are refused: loading them runs arbitrary code. Errors never quote the file's bytes (a symlink may
point anywhere): they say what is wrong and where.
"""

import errno
import json
import math
import mmap
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import LycorisError, encodable

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
_COPY_CHUNK = 1 << 30
# copy_file_range is not supported on this pair of files (old kernel, other file systems): copy in user space.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}

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
        self._map: mmap.mmap | None = None
        self._file: BinaryIO | None = self._open()
        try:
            if snapshot:
                self._file = self._snapshot(temp_dir)
            self.size = os.fstat(self._file.fileno()).st_size
            self.entries, self.metadata, self._data_start = self._read_header()
            if snapshot:
                self._map_snapshot()
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

    def _open(self) -> BinaryIO:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it has no effect on a regular file's reads).
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(self.path, flags)
        except OSError as e:
            raise self._error(f"cannot open the file ({e.strerror or type(e).__name__})") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._error("not a regular file (a FIFO, device or directory); only .safetensors files are read")
        return os.fdopen(fd, "rb")

    def _snapshot(self, temp_dir: str | os.PathLike | None) -> BinaryIO:
        """The file copied into an unnamed temporary file of our own; the source is closed."""
        source = self._file
        before = os.fstat(source.fileno())
        try:
            copy = tempfile.TemporaryFile(dir=temp_dir)  # noqa: SIM115 (it outlives this function, as the map's file)
        except OSError as e:
            raise self._error(f"cannot create a private copy in {temp_dir or tempfile.gettempdir()} "
                              f"({e.strerror or type(e).__name__})") from e
        try:
            copied = _copy_bytes(source, copy)
            after = os.fstat(source.fileno())
        except OSError as e:
            copy.close()
            raise self._error(f"cannot copy the file into {temp_dir or tempfile.gettempdir()} "
                              f"({e.strerror or type(e).__name__})") from e
        finally:
            source.close()
        if copied != before.st_size or (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            copy.close()
            raise self._error("the file changed while it was being read (is it still being written?); "
                              "run again once it is complete")
        return copy

    def _map_snapshot(self) -> None:
        # The map keeps the copy alive (and, unnamed or delete-on-close, it is gone once the map is).
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        self.close()

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
            raise self._error(f"not a safetensors file: {self.size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(self._read_exactly(0, 8), "little")
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > self.size:
            # Not the number itself: it is 8 bytes of whatever the file is.
            raise self._error(f"not a safetensors file, or truncated: its first 8 bytes are not the length of a "
                              f"header that fits in its {self.size} bytes")
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
            raise self._error(
                f"file is truncated: tensor data ends at byte {entry.end} but the file has {self.size} bytes", key
            )
        return entry

    def _check_layout(self, entries: dict[str, TensorEntry], data_start: int) -> None:
        previous_end, previous_key = data_start, None
        for key, entry in sorted(entries.items(), key=lambda kv: kv[1].start):
            if entry.start < previous_end and entry.end > entry.start:
                raise self._error(f"corrupt file: tensor data overlaps '{previous_key}'", key)
            previous_end, previous_key = max(previous_end, entry.end), key

    def keys(self) -> list[str]:
        return list(self.entries)

    def tensor(self, key: str) -> torch.Tensor:
        """A CPU tensor: a view of the snapshot's map (copy-on-write: writing to it changes nothing else), or a
        private copy read from the file now."""
        entry = self.entries[key]
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._map is None:
            if self._file is None:
                raise self._error("read after close()", key)
            data = self._read_exactly(entry.start, entry.end - entry.start, key)
            return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)
        if entry.start % entry.dtype.itemsize:
            # torch.frombuffer needs aligned storage; misaligned files (rare, old writers) get a copy.
            data = bytearray(self._map[entry.start:entry.end])
            return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return flat.reshape(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: self.tensor(key) for key in self.entries}

    def mapped_range(self) -> tuple[int, int] | None:
        """(first, end) addresses of the snapshot's map, to tell its views from private tensors; None unmapped."""
        if self._map is None or not len(self._map):
            return None
        first = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        return first, first + len(self._map)

    def release_all(self) -> None:
        """`release` for the whole map: reading a scalar (alpha) faults in the pages around it too (the kernel's
        fault-around), which for a file of many modules adds up to a good part of it."""
        if self._map is not None and hasattr(self._map, "madvise") and len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED)

    def release(self, tensor: torch.Tensor) -> None:
        """Let the OS take back the pages of a tensor of the snapshot's map once it has been read (checked at load):
        they leave this process's resident memory but stay in the page cache, and the next read faults them back in
        from the copy, which nobody else can write."""
        span = self.mapped_range()
        if span is None or not hasattr(self._map, "madvise") or tensor.numel() == 0:
            return
        start = tensor.data_ptr() - span[0]
        end = start + tensor.numel() * tensor.element_size()
        if start < 0 or end > len(self._map):
            return  # not a view of this map (a misaligned tensor's copy, or a tensor a converter replaced)
        first_page = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first_page, end - first_page)


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


def _copy_bytes(source: BinaryIO, target: BinaryIO) -> int:
    """Copy `source` to its end into `target`; the number of bytes copied."""
    if hasattr(os, "copy_file_range"):
        copied = 0
        try:
            while n := os.copy_file_range(source.fileno(), target.fileno(), _COPY_CHUNK):
                copied += n
            return copied
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY or copied:
                raise
    source.seek(0)
    shutil.copyfileobj(source, target, 16 * 1024 * 1024)
    target.flush()
    return target.tell()
