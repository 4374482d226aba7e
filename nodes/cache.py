"""Parsed files, shared by every node in the process (V3 nodes keep no instance state).

Keyed by path, size and mtime so an edited file is read again. Tensors are views of a memory map, so an entry costs
address space and page cache rather than process memory.
"""

import os
from collections import OrderedDict
from pathlib import Path

import comfy.lora_convert

from ..lycoris_core import LycorisFile, SafetensorsFile, parse_state_dict

_MAX_FILES = 16
_files: "OrderedDict[tuple, LycorisFile]" = OrderedDict()


def read(path: str | os.PathLike) -> LycorisFile:
    """Parse and check a file, after ComfyUI's own renames for special formats (BFL control, Wan-Fun, USO)."""
    reader = SafetensorsFile(path)
    state_dict = comfy.lora_convert.convert_lora(reader.tensors())
    return parse_state_dict(state_dict, reader.name, reader.metadata)


def load_cached(path: str | os.PathLike) -> LycorisFile:
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _files:
        _files.move_to_end(key)
        return _files[key]
    parsed = read(path)
    _files[key] = parsed
    while len(_files) > _MAX_FILES:
        _files.popitem(last=False)
    return parsed


def clear() -> None:
    _files.clear()
