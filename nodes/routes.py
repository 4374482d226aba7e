"""GET /lycoris/info?name=<file>: the header-only summary of a file in the loras folders, for the web panel.

Only names that ComfyUI itself lists for the loras folders are served (no paths, so no traversal), and only
safetensors files are read (never pickles).
"""

import folder_paths
from aiohttp import web

from ..lycoris_core import LycorisError
from ..lycoris_core.safetensors_file import PICKLE_SUFFIXES
from ..lycoris_core.summary import summarize


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def info(request: web.Request) -> web.Response:
    name = request.query.get("name", "")
    if name not in folder_paths.get_filename_list("loras"):
        return _error(404, f"'{name}' is not a file in the loras folders")
    if name.lower().endswith(PICKLE_SUFFIXES):
        return _error(400, f"'{name}' is a pickle file; only .safetensors files are read")
    path = folder_paths.get_full_path("loras", name)
    try:
        return web.json_response(summarize(path).to_json())
    except LycorisError as e:
        return _error(422, str(e))


def register(routes: web.RouteTableDef) -> None:
    routes.get("/lycoris/info")(info)
