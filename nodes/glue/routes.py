"""GET /lycoris/info?name=<file>: the header-only summary of a file in the loras folders, for the web panel.

Only names that ComfyUI itself lists for the loras folders are served (no paths, so no traversal), and only
safetensors files are read (never pickles). With `&cache=1` the answer also has a "cache" object: the pack's file
cache (files, bytes, budget, hits, misses, evictions; see nodes/glue/cache.py). It is opt-in so that the plain answer stays
exactly the file's summary, which does not change while the file does not.

Off the event loop, and bounded. ComfyUI answers every request on one event loop, so a handler that reads a file
stalls the whole server while it reads (a file of 100k tiny tensors takes seconds to summarize; ComfyUI's listing of
the loras folders walks them, which is slow on big or network folders). So all of the answer's work (the listing,
the summary, the cache's stats) runs in a pool of WORKERS threads of its own, made on first use. At most
WORKERS + QUEUED requests are taken at a time, in this process (so per server: ComfyUI runs one); past that the
route answers 503 at once instead of queuing without end. A slot is freed when its work ends, not when its client
gives up, so abandoned requests cannot pile up work behind the pool. Other routes still wait out the parse's full
garbage collections (they hold the GIL, ~0.3-0.5 s each for a file of 100k tensors), not the parse.

Cheap repeats. The last SUMMARIES answers (200 or 422) are kept, keyed by the listed name's path, the file it resolves
to, its size, mtime_ns and inode, and the mtime of the adapter_config.json beside it (it sets a PEFT file's alpha).
An answer is kept only if that identity was the same before and after the read, so a file rewritten while it was read
is read again next time. A rewrite that keeps size and inode within the file system's timestamp granularity (a few
ms) is not seen; the loader's own checks do not depend on this memo. Requests for a file that is being read wait for
that read instead of reading it too (with the GIL, two reads of one file take twice as long, not half).
"""

import asyncio
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import folder_paths
from aiohttp import web

from ...lycoris_core import LycorisError
from ...lycoris_core.safetensors_file import PICKLE_SUFFIXES
from ...lycoris_core.summary import summarize
from . import cache, lora_files

WORKERS = 2  # reads are pure Python (GIL-bound): more threads would not read faster, only hold more memory
QUEUED = 8  # requests waiting for a worker; more are answered 503
SUMMARIES = 32  # answers kept (each a few KB: the summary without its per-module list)

Answer = tuple[int, dict]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_slots = threading.BoundedSemaphore(WORKERS + QUEUED)
_memo: OrderedDict[tuple, Answer] = OrderedDict()
_reading: dict[tuple, threading.Event] = {}  # identity -> set when its read ends
_memo_lock = threading.Lock()  # guards _memo and _reading


def _error(status: int, message: str) -> Answer:
    return status, {"error": message}


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="lycoris-info")
        return _pool


def _identity(path: str) -> tuple | None:
    """The listed path and the file's identity (cache.file_identity); None if it cannot be stat'ed (the read then
    says why, naming the file)."""
    identity = cache.file_identity(path)
    return None if identity is None else (path, *identity)


def _read(path: str) -> Answer:
    try:
        return 200, summarize(path).to_json()
    except LycorisError as e:
        return _error(422, str(e))


def _claim(key: tuple) -> Answer | threading.Event | None:
    """The kept answer; or the Event of a read of this file under way; or None: the caller reads it (and must
    _release the key)."""
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
        if key in _reading:
            return _reading[key]
        _reading[key] = threading.Event()
        return None


def _release(key: tuple, answer: Answer | None) -> None:
    with _memo_lock:
        if answer is not None:
            _memo[key] = answer
            while len(_memo) > SUMMARIES:
                _memo.popitem(last=False)
        _reading.pop(key).set()


def _summary(path: str) -> Answer:
    while True:
        key = _identity(path)
        if key is None:
            return _read(path)
        claimed = _claim(key)
        if isinstance(claimed, tuple):
            return claimed
        if claimed is not None:
            claimed.wait()  # then look again: kept, or (the file changed during that read) read it ourselves
            continue
        answer = None
        try:
            answer = _read(path)
            return answer
        finally:
            _release(key, answer if _identity(path) == key else None)


def _answer(name: str, with_cache: bool) -> Answer:
    """The whole answer, in a worker thread."""
    listed = lora_files.listed_name(name)
    if listed is None:
        return _error(404, f"'{name}' is not a file in the loras folders")
    if listed.lower().endswith(PICKLE_SUFFIXES):
        return _error(400, f"'{name}' is a pickle file; only .safetensors files are read")
    status, body = _summary(folder_paths.get_full_path("loras", listed))
    if status == 200 and with_cache:
        body = {**body, "cache": cache.stats().to_json()}  # a new dict: the kept answer stays the plain summary
    return status, body


def _submit(name: str, with_cache: bool) -> Future | None:
    """The work queued in the pool, or None when WORKERS + QUEUED requests are already taken."""
    if not _slots.acquire(blocking=False):
        return None
    try:
        future = _executor().submit(_answer, name, with_cache)
    except BaseException:
        _slots.release()
        raise
    future.add_done_callback(lambda _: _slots.release())
    return future


async def info(request: web.Request) -> web.Response:
    name = request.query.get("name", "")
    with_cache = request.query.get("cache", "").lower() in ("1", "true", "yes")
    future = _submit(name, with_cache)
    if future is None:
        status, body = _error(503, f"busy: {WORKERS + QUEUED} file requests are being answered; ask again shortly")
    else:
        status, body = await asyncio.wrap_future(future)
    return web.json_response(body, status=status)


# --- node help pages -----------------------------------------------------------------------------------------------
#
# The frontend's help panel asks for /extensions/<pack folder>/docs/<Node>/<locale>.md first, then for
# /extensions/<pack folder>/docs/<Node>.md (frontends 1.32 to 1.58). The pages are web/docs/<Node>.md, in English: the
# first request answers with that page for every locale, so no help page costs a 404 in the browser console.

PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # abspath: a symlinked folder keeps its name
DOCS_DIR = os.path.join(PACK_ROOT, "web", "docs")


def docs_prefixes() -> list[str]:
    """The URL prefixes of this pack's web folder as the frontend builds them from the node's python_module: the folder
    name ComfyUI imported the pack under (and, for a registry install named `<pack>@<version>`, the part before @)."""
    folder = os.path.basename(PACK_ROOT)
    names = dict.fromkeys([folder, folder.split("@")[0]])
    return [f"/extensions/{name}/docs" for name in names]


async def node_doc(request: web.Request) -> web.StreamResponse:
    node = request.match_info["node"]
    path = os.path.join(DOCS_DIR, f"{node}.md")
    if not node.isidentifier() or not os.path.isfile(path):
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"Content-Type": "text/markdown; charset=utf-8"})


def register(routes: web.RouteTableDef) -> None:
    routes.get("/lycoris/info")(info)
    # Added before ComfyUI adds the extensions' static folders, so these answer first for the locale paths only.
    for prefix in docs_prefixes():
        routes.get(prefix + "/{node}/{locale}.md")(node_doc)
