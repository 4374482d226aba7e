"""Finding a file in ComfyUI's `loras` folders by the name a workflow gives.

ComfyUI lists files in subfolders with the platform's separator, so a workflow saved on Windows names them
`sub\\file.safetensors`. Where `\\` is no separator (Linux, macOS) such a name is read as `sub/file.safetensors`, so
the workflow loads there too (ComfyUI's own loaders refuse it). A file whose name really holds a backslash is found
first, as given.
"""

import os

import folder_paths

FOLDER = "loras"


def _posix_form(name: str) -> str | None:
    """The name with Windows separators as `/`, where that differs and `\\` is no separator here."""
    if os.sep == "\\" or "\\" not in name:
        return None
    return name.replace("\\", "/")


def full_path(name: str) -> str | None:
    """The file's path, or None when no loras folder holds it."""
    found = folder_paths.get_full_path(FOLDER, name)
    posix = _posix_form(name) if found is None else None
    return folder_paths.get_full_path(FOLDER, posix) if posix else found


def listed_name(name: str) -> str | None:
    """The name as ComfyUI lists it (the list the loader's menu shows), or None when it is not listed."""
    listed = folder_paths.get_filename_list(FOLDER)
    if name in listed:
        return name
    posix = _posix_form(name)
    return posix if posix in listed else None


def validate_name(cls, lycoris_name) -> bool | str:
    """A node's `validate_inputs`: it replaces ComfyUI's own check of the name (one of the listed names) by one that
    also takes a name saved on Windows."""
    if isinstance(lycoris_name, str) and full_path(lycoris_name) is not None:
        return True
    return f"'{lycoris_name}' is not a file in the {FOLDER} folders"
