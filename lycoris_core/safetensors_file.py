"""A lazy, memory-mapped safetensors reader that validates the header before trusting it.

Why not `safetensors.safe_open`: we want (1) the header and metadata without touching tensor data, (2) tensors that
are views of a memory map, so a 1 GB file costs page cache, not process memory, and (3) an error that names the file
and the key for every way a file can be broken (truncated, overlapping or out-of-range offsets, bad JSON).
Pickle formats are refused: loading them runs arbitrary code.
"""

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LycorisError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl")
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

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
    """Header parsed and checked at construction; tensor bytes read only when `tensor()` is called."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.name = self.path.name
        if self.path.suffix.lower() in PICKLE_SUFFIXES:
            raise LycorisError(
                f"'{self.path.suffix}' files are Python pickles, which can run arbitrary code when loaded; "
                "only .safetensors files are read. Convert the file to .safetensors first.",
                file=self.name,
            )
        self.size = self.path.stat().st_size
        self.entries, self.metadata, self._data_start = self._read_header()
        self._map: mmap.mmap | None = None

    def _error(self, reason: str, key: str | None = None) -> LycorisError:
        return LycorisError(reason, file=self.name, key=key)

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
        if self.size < 8:
            raise self._error(f"not a safetensors file: {self.size} bytes, shorter than the 8-byte header length")
        with open(self.path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > self.size:
                raise self._error(
                    f"not a safetensors file, or truncated: header length {header_len} does not fit in {self.size} bytes"
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: bad JSON, or a 5000-digit number
            raise self._error(f"corrupt safetensors header ({type(e).__name__}: {e})") from e
        if not isinstance(header, dict):
            raise self._error("corrupt safetensors header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._error("corrupt safetensors header (__metadata__ is not an object)")
        data_start = 8 + header_len
        entries = {key: self._entry(key, info, data_start) for key, info in header.items()}
        self._check_layout(entries, data_start)
        return entries, {str(k): str(v) for k, v in metadata.items()}, data_start

    def _entry(self, key: str, info, data_start: int) -> TensorEntry:
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: a shape of 1e400
            raise self._error(f"corrupt tensor entry {info!r}", key) from e
        entry = TensorEntry(dtype, shape, data_start + begin, data_start + end)
        expected = entry.numel * dtype.itemsize
        if any(d < 0 for d in shape) or begin < 0 or end - begin != expected:
            raise self._error(f"corrupt tensor entry: shape {list(shape)} needs {expected} bytes, offsets say {end - begin}", key)
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
        """A CPU tensor backed by the memory map (copy-on-write: writing to it never touches the file)."""
        entry = self.entries[key]
        if entry.numel == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if entry.start % entry.dtype.itemsize:
            # torch.frombuffer needs aligned storage; misaligned files (rare, old writers) get a copy.
            data = bytearray(self._map[entry.start:entry.end])
            return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return flat.reshape(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {key: self.tensor(key) for key in self.entries}

    def release_all(self) -> None:
        """`release` for the whole map: reading a scalar (alpha) faults in the pages around it too (the kernel's
        fault-around), which for a file of many modules adds up to a good part of it."""
        if self._map is not None and hasattr(self._map, "madvise") and len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED)

    def release(self, tensor: torch.Tensor) -> None:
        """Let the OS take back the pages of a tensor of this map once it has been read (checked at load): they
        leave this process's resident memory but stay in the page cache, and the next read faults them back in
        from the file. The map is private and never written, so the data cannot change."""
        if self._map is None or not hasattr(self._map, "madvise") or tensor.numel() == 0:
            return
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        start = tensor.data_ptr() - base
        end = start + tensor.numel() * tensor.element_size()
        if start < 0 or end > len(self._map):
            return  # not a view of this map (a misaligned tensor's copy, or a tensor a converter replaced)
        first_page = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first_page, end - first_page)
