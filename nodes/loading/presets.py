"""Block weight presets: the ones we ship (presets/block_weights.json) and the user's own, from
<ComfyUI user dir>/lycoris_nodes/block_weight_presets.json (same shape; a user preset replaces a shipped one of the
same name). Read on every call, so an edited file is picked up without a restart."""

import json
from pathlib import Path

import folder_paths

from ...lycoris_core import LycorisError
from ..glue.apply import log

SHIPPED = Path(__file__).resolve().parents[2] / "presets" / "block_weights.json"
CUSTOM = "custom"


def user_presets_path() -> Path:
    return Path(folder_paths.get_user_directory()) / "lycoris_nodes" / "block_weight_presets.json"


def _read(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LycorisError(f"block weight presets are not valid JSON: {e}", file=str(path)) from e
    if not isinstance(data, dict):
        raise LycorisError("block weight presets must be a JSON object of name -> text", file=str(path))
    return {str(k): str(v) for k, v in data.items() if not str(k).startswith("_")}


def presets() -> dict[str, str]:
    return {**_read(SHIPPED), **_read(user_presets_path())}


def preset_names() -> list[str]:
    """For the node's combo. A broken user file must not hide the node (ComfyUI asks for its inputs at start-up):
    list the shipped presets and say what is wrong; choosing a preset then raises the error naming the file."""
    try:
        return [CUSTOM, *presets()]
    except LycorisError as e:
        log.error("LyCORIS block weight presets: %s; only the shipped presets are listed", e)
        return [CUSTOM, *_read(SHIPPED)]


def block_weight_text(preset: str, text: str) -> str:
    """The preset's rules followed by the text's (later rules win, so the text refines the preset)."""
    if preset in ("", CUSTOM, None):
        return text
    table = presets()
    if preset not in table:
        raise LycorisError(f"no block weight preset named '{preset}' (known: {', '.join(table)})")
    base = table[preset]
    return f"{base}\n{text}" if text.strip() else base
