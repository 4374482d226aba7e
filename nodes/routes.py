"""GET /lycoris/info?name=<file>: the header-only summary of a file in the loras folders, for the web panel.

Only names that ComfyUI itself lists for the loras folders are served (no paths, so no traversal), and only
safetensors files are read (never pickles). With `&cache=1` the answer also has a "cache" object: the pack's file
cache (files, bytes, budget, hits, misses, evictions; see nodes/cache.py). It is opt-in so that the plain answer stays
exactly the file's summary, which does not change while the file does not.
"""

import folder_paths
from aiohttp import web

from ..lycoris_core import LycorisError
from ..lycoris_core.safetensors_file import PICKLE_SUFFIXES
from ..lycoris_core.summary import summarize
from . import cache


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
        body = summarize(path).to_json()
    except LycorisError as e:
        return _error(422, str(e))
    if request.query.get("cache", "").lower() in ("1", "true", "yes"):
        body = {**body, "cache": cache.stats().to_json()}  # the lock is held briefly: files are read outside it
    return web.json_response(body)


def register(routes: web.RouteTableDef) -> None:
    routes.get("/lycoris/info")(info)
