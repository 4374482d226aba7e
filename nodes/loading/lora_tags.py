"""`<lora:name:strength>` text, as A1111 writes it in prompts and LoRA Manager's nodes emit it (issue #36).

    <lora:name>                    strength 1 on the model and the text encoder
    <lora:name:strength>           the same strength on both
    <lora:name:model:clip>         a strength each
    <lyco:name:...>                A1111's LyCORIS extension spelling, the same fields

LoRA Manager's text loader (willmiao/ComfyUI-Lora-Manager, py/nodes/lora_loader.py, LoraManagerTextLoader
.parse_lora_syntax) reads `<lora:([^:>]+):([^:>]+)(?::([^:>]+))?>` and looks the name up by file name without the
extension; A1111 takes the strength as optional. Both are read here. A name may also carry its extension or
subfolder as the loader's menu lists it (`wan/style.safetensors`); a base name found in two folders is ambiguous and
refused, naming both. Text between the tags (the rest of a prompt) is not ours and is left alone; a tag that is
not well formed is refused, naming the fragment, never skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from ...lycoris_core import LycorisError

# A tag's opening, wherever it is, and the whole tag when it is well formed.
OPENING = re.compile(r"<(?:lora|lyco):", re.IGNORECASE)
TAG = re.compile(r"<(?:lora|lyco):([^:<>\n]+)((?::[^:<>\n]*)*)>", re.IGNORECASE)  # on one line
EXTENSIONS = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft")


@dataclass(frozen=True)
class LoraTag:
    """One tag: the name as written, the listed file it names, and its strengths."""

    text: str
    written_name: str
    name: str
    strength_model: float
    strength_clip: float


def _strength(field: str, tag: str) -> float:
    try:
        return float(field)
    except ValueError:
        raise LycorisError(f"'{field}' is not a strength in {tag}") from None


def _stem(name: str) -> str:
    path = PurePosixPath(name.replace("\\", "/"))
    return path.stem if path.suffix.lower() in EXTENSIONS else path.name


def _without_extension(name: str) -> str:
    name = name.replace("\\", "/")
    suffix = PurePosixPath(name).suffix
    return name[: -len(suffix)] if suffix.lower() in EXTENSIONS else name


def resolve_name(written: str, listed: list[str], tag: str) -> str:
    """The listed file a tag names: the name as listed, else with its extension added, else by base name (in any
    subfolder) when exactly one file has it."""
    written = written.strip()
    wanted = written.replace("\\", "/")
    by_path = {name.replace("\\", "/"): name for name in listed}
    if wanted in by_path:
        return by_path[wanted]
    same_path = [name for path, name in by_path.items() if _without_extension(path) == wanted]
    same_stem = [name for path, name in by_path.items() if _stem(path) == _stem(wanted)]
    for found in (same_path, same_stem):
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise LycorisError(f"{tag} names {len(found)} files: {', '.join(sorted(found))}; write its subfolder "
                               "or extension to pick one")
    raise LycorisError(f"{tag}: no file '{written}' in the loras folders")


def parse_tags(text: str, listed: list[str]) -> list[LoraTag]:
    """Every `<lora:...>` / `<lyco:...>` tag in the text, in order, each resolved to a listed file."""
    tags = []
    for opening in OPENING.finditer(text or ""):
        match = TAG.match(text, opening.start())
        if match is None:
            fragment = text[opening.start(): opening.start() + 80].split("\n")[0]
            raise LycorisError(f"'{fragment}' is not a tag: write <lora:name>, <lora:name:strength> or "
                               "<lora:name:model strength:clip strength>")
        written, fields = match.group(1), match.group(2).split(":")[1:]
        if len(fields) > 2:
            raise LycorisError(f"{match.group(0)} has {len(fields)} strengths; a tag takes at most two "
                               "(model, then clip)")
        strength_model = _strength(fields[0], match.group(0)) if fields else 1.0
        strength_clip = _strength(fields[1], match.group(0)) if len(fields) > 1 else strength_model
        name = resolve_name(written, listed, match.group(0))
        tags.append(LoraTag(match.group(0), written.strip(), name, strength_model, strength_clip))
    return tags
