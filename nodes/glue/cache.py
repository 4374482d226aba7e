"""Parsed files, shared by every node in the process (V3 nodes keep no instance state, so the cache is module level).

A stack of N nodes naming one file, a re-run with new strengths and two workflows using the same file all read it
once. Entries are keyed by (resolved path, size, mtime_ns), so an edited file is read again, and bounded by bytes: the
sum of the tensor bytes the cached files hold (each distinct storage once), at most `budget_bytes()`. A file larger
than the budget is returned and used but not kept. When the system runs short of memory the least recently used
entries are dropped before a new one is added, and whenever `trim()` is called.

Tensors are views of a map of the file's private snapshot (see lycoris_core/safetensors_file.py: a copy in
ComfyUI's temp directory that nobody else can write, so a file rewritten after it was read never changes what was
checked). The cache reports those bytes as `mapped`: they cost page cache that the OS reclaims under pressure (and
temporary disk space), not process memory. Tensors that are not views of it (a format converter's output, a
misaligned tensor's copy) are `private`: process memory. The budget bounds both together. Dropping an entry drops
the last reference to its map (unless a model still holds one), and the copy is then gone. Adapters already handed
to a ModelPatcher keep their own references to the tensors they use, so evicting a file never changes a model that
is already patched: the memory of those tensors is freed when that model is.

ComfyUI calls in from the prompt worker thread and from aiohttp handlers, so the table is guarded by a lock. Files are
read outside the lock: a slow read never blocks a route that only asks for `stats()`.
"""

import functools
import hashlib
import logging
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import comfy.lora_convert
import folder_paths
import psutil

from ...lycoris_core import LycorisFile, SafetensorsFile, parse_state_dict
from ...lycoris_core.peft_config import CONFIG_FILE, read_config
from ...lycoris_core.safetensors_file import open_for_reading

log = logging.getLogger("lycoris_nodes")

MB = 1024 * 1024
GIB = 1024 * MB
BUDGET_ENV = "LYCORIS_CACHE_MB"
# 1 GiB on a 16 GB machine: a dozen typical LoRAs, or one full-rank file, stay parsed between runs, while a
# workflow's own model still has the rest. Patched models keep what they use whatever the budget.
_DEFAULT_BUDGET_CAP = 1 * GIB
_DEFAULT_BUDGET_SHARE = 16  # at most 1/16 of total RAM
_FLOOR_CAP = 1 * GIB
_FLOOR_SHARE = 10  # under pressure while available memory < min(1 GiB, 10% of total)


@dataclass(frozen=True)
class CacheStats:
    files: int
    bytes: int  # mapped + private
    mapped: int  # views of the files' private snapshots: page cache, reclaimable
    private: int  # process memory
    budget: int
    hits: int
    misses: int
    evictions: int

    def line(self) -> str:
        return (f"LyCORIS cache: {self.files} {'file' if self.files == 1 else 'files'}, {_mb(self.bytes)} of "
                f"{_mb(self.budget)} ({_mb(self.mapped)} mapped, {_mb(self.private)} private); {self.hits} hits, "
                f"{self.misses} misses, {self.evictions} evicted")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Loaded:
    """A parsed file and what its tensors cost."""
    file: LycorisFile
    mapped: int
    private: int

    @property
    def nbytes(self) -> int:
        return self.mapped + self.private


_lock = threading.Lock()
_files: "OrderedDict[tuple, Loaded]" = OrderedDict()  # least recently used first
_counts = {"hits": 0, "misses": 0, "evictions": 0}


def _mb(nbytes: int) -> str:
    return f"{nbytes / MB:.1f} MB"


@functools.lru_cache(maxsize=8)  # one warning per distinct bad value, not one per load
def _parse_budget(value: str) -> int | None:
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0 or megabytes == float("inf"):
        log.warning("LyCORIS cache: %s=%r is not a number of megabytes >= 0; using the default budget", BUDGET_ENV,
                    value)
        return None
    return int(megabytes * MB)


def budget_bytes() -> int:
    """LYCORIS_CACHE_MB (read on every check, so it can change while ComfyUI runs; 0 keeps nothing), else
    min(1 GiB, 1/16 of total RAM)."""
    value = os.environ.get(BUDGET_ENV, "").strip()
    parsed = _parse_budget(value) if value else None
    if parsed is not None:
        return parsed
    return min(_DEFAULT_BUDGET_CAP, psutil.virtual_memory().total // _DEFAULT_BUDGET_SHARE)


def _under_pressure() -> bool:
    memory = psutil.virtual_memory()
    return memory.available < min(_FLOOR_CAP, memory.total // _FLOOR_SHARE)


def _storages(file: LycorisFile) -> dict[int, int]:
    """address -> bytes of each distinct storage the file's tensors use (modules of one key group can share a
    tensor, and a converted tensor can be a view of another)."""
    storages: dict[int, int] = {}
    for module in file.modules.values():
        for tensor in module.tensors.values():
            storage = tensor.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return storages


def file_bytes(file: LycorisFile) -> int:
    """The bytes of the tensors a parsed file holds, each distinct storage counted once."""
    return sum(_storages(file).values())


def memory_split(file: LycorisFile, mapped_range: tuple[int, int] | None) -> tuple[int, int]:
    """(mapped, private) bytes: storages inside the snapshot's map, and the others."""
    mapped = private = 0
    for address, nbytes in _storages(file).items():
        if mapped_range and mapped_range[0] <= address < mapped_range[1]:
            mapped += nbytes
        else:
            private += nbytes
    return mapped, private


def snapshot_dir() -> str:
    """Where a file's private copy goes: ComfyUI's temp directory (its --temp-directory), on ComfyUI's own disk
    rather than a /tmp that may be RAM. A copy has a name (`lycoris-snapshot-*`) only while it is being copied
    (delete-on-close on Windows); a process killed in that moment leaves it, and ComfyUI empties the folder at every
    start."""
    directory = folder_paths.get_temp_directory()
    os.makedirs(directory, exist_ok=True)
    return directory


def read(path: str | os.PathLike) -> LycorisFile:
    """Parse and check a file, after ComfyUI's own renames for special formats (BFL control, Wan-Fun, USO)."""
    return read_measured(path).file


def read_measured(path: str | os.PathLike) -> Loaded:
    """`read`, with what the parsed file's tensors cost."""
    reader = SafetensorsFile(path, snapshot=True, temp_dir=snapshot_dir())
    state_dict = comfy.lora_convert.convert_lora(reader.tensors())
    # Each tensor's pages are released once checked: a file in the cache costs page cache, not resident memory.
    parsed = parse_state_dict(state_dict, reader.name, reader.metadata, checked=reader.release,
                              config=read_config(path, reader.metadata))
    reader.release_all()
    return Loaded(parsed, *memory_split(parsed, reader.mapped_range()))


def _total_locked() -> int:
    return sum(entry.nbytes for entry in _files.values())


def _evict_locked(key: tuple) -> None:
    del _files[key]
    _counts["evictions"] += 1


def _trim_locked(bytes_needed: int) -> None:
    budget = budget_bytes()
    while _files and (_total_locked() + bytes_needed > budget or _under_pressure()):
        _evict_locked(next(iter(_files)))


def trim(bytes_needed: int = 0) -> None:
    """Drop least recently used files until `bytes_needed` more fit in the budget and the system is not short of
    memory (available memory at least min(1 GiB, 10% of total)), or nothing is left."""
    with _lock:
        _trim_locked(bytes_needed)


def clear() -> None:
    """Drop every file (the hit/miss/eviction counters are kept: they describe the process)."""
    with _lock:
        _files.clear()


def _stats_locked() -> CacheStats:
    mapped = sum(entry.mapped for entry in _files.values())
    private = sum(entry.private for entry in _files.values())
    return CacheStats(len(_files), mapped + private, mapped, private, budget_bytes(), **_counts)


def stats() -> CacheStats:
    with _lock:
        return _stats_locked()


# Bytes read from each end of a file for its identity: a retrained LoRA differs there (header, last tensor).
_SAMPLE_BYTES = 64 * 1024


def _ends_digest(path: str, size: int) -> str:
    """A digest of the file's first and last `_SAMPLE_BYTES`. Timestamps are coarse (FAT keeps mtimes to 2 s, and
    Linux stamps files from a clock that ticks every few ms), so a rewrite of the same size soon after the last one
    can keep size and mtime; its bytes still differ. From the page cache this costs some tens of microseconds."""
    digest = hashlib.blake2b(digest_size=16)
    with os.fdopen(open_for_reading(path), "rb") as f:  # a trainer may replace the file meanwhile (Windows)
        digest.update(f.read(_SAMPLE_BYTES))
        if size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def file_identity(path: str | os.PathLike) -> tuple | None:
    """What says a file is unchanged: (resolved path, size, mtime_ns, inode, mtime_ns of the adapter_config.json
    beside it or None, a digest of the file's two ends; that config sets a PEFT file's scale, and read_config looks
    beside the path as given). None when the file cannot be stat'ed or read: reading it then says why, naming it.
    The cache, the nodes' fingerprints and the info route all use this one identity."""
    try:
        resolved = os.path.realpath(path)
        st = os.stat(resolved)
        sibling = os.path.join(os.path.dirname(os.fspath(path)), CONFIG_FILE)
        config = os.stat(sibling).st_mtime_ns if os.path.isfile(sibling) else None
        ends = _ends_digest(resolved, st.st_size) if stat.S_ISREG(st.st_mode) else None
    except OSError:
        return None
    return resolved, st.st_size, st.st_mtime_ns, st.st_ino, config, ends


def load_cached(path: str | os.PathLike) -> LycorisFile:
    key = file_identity(path)
    if key is None:
        return read(path)  # a LycorisError naming the file (missing, unreadable)
    resolved = key[0]
    with _lock:
        entry = _files.get(key)
        if entry is not None:
            _files.move_to_end(key)
            _counts["hits"] += 1
            return entry.file
    loaded = read_measured(path)
    nbytes = loaded.nbytes
    with _lock:
        _counts["misses"] += 1
        entry = _files.get(key)
        if entry is not None:  # another thread read it meanwhile: keep one copy
            _files.move_to_end(key)
            return entry.file
        for stale in [k for k in _files if k[0] == resolved]:  # older versions of the file can never be hit again
            _evict_locked(stale)
        kept = nbytes <= budget_bytes()
        _trim_locked(nbytes if kept else 0)
        if kept:
            _files[key] = loaded
        current = _stats_locked()
    log.info("LyCORIS cache: read %s (%s)%s; %d files, %s of %s", Path(resolved).name, _mb(nbytes),
             "" if kept else ", not kept: larger than the budget", current.files, _mb(current.bytes),
             _mb(current.budget))
    return loaded.file
