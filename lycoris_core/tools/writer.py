"""Writing a .safetensors file whole or not at all, never over an existing file unless asked.

The tensors go to a temporary file in the target's own folder (same filesystem), which is fsync'ed and then moved
into place: with `overwrite` by `os.replace` (atomic), without it by `os.link` (fails if the name exists, so two
writers racing for one name cannot both win). Any failure removes the temporary file: no partial file is left.
Where the folder is chosen (never outside the loras folders for the nodes) is the caller's business.
"""

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import LycorisError


def metadata_text(metadata: Mapping[str, object]) -> dict[str, str]:
    """safetensors metadata is str -> str: other values are stored as JSON."""
    return {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in metadata.items()}


def write(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, object],
          overwrite: bool = False) -> Path:
    """Write `tensors` (contiguous copies are made as needed) with `metadata` to `path`; returns the path.
    LycorisError when the file exists and `overwrite` is off."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise LycorisError("the output name must end in .safetensors", file=str(path))
    if not overwrite and path.exists():
        raise LycorisError("a file of this name exists; choose another name or allow overwriting", file=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        save_file(_own_storage(tensors), temporary, metadata=metadata_text(metadata))
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            _link_new(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


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


def _link_new(temporary: str, path: Path) -> None:
    """Move `temporary` to a `path` that must not exist. A hard link refuses an existing name atomically; where the
    filesystem has no hard links, an exclusive create of the name reserves it first."""
    try:
        os.link(temporary, path)
    except FileExistsError as e:
        raise LycorisError("a file of this name exists; choose another name or allow overwriting",
                           file=str(path)) from e
    except OSError:  # no hard links here (some network and FAT filesystems): reserve the name, then replace it
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError as e:
            raise LycorisError("a file of this name exists; choose another name or allow overwriting",
                               file=str(path)) from e
        os.replace(temporary, path)
