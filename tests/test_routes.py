"""GET /lycoris/info?name=<file>: the handler on mocked requests, and the route in a real aiohttp app.

Only names ComfyUI lists for the loras folders are served, pickles are never opened, and errors are JSON naming the file.
The work runs off the event loop: a slow parse does not stall the app's other routes, a burst is answered (200 or
503, bounded), and a file read again unchanged is not parsed again.
(The route on the real ComfyUI server is checked in tests/e2e/test_info_route.py and test_route_server.py.)
"""

import asyncio
import json
import pickle
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import aiohttp
import folder_paths
import pytest
import test_nodes
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes.glue import routes
from safetensors.torch import save_file
from test_nodes import TE_Q, TO_Q, lora, write

loras = test_nodes.loras  # fixture: an empty loras folder that ComfyUI lists

SD_META = {"ss_base_model_version": "sd_v1", "modelspec.trigger_phrase": "lycotest"}


def strict_json(text: str):
    """JSON as a browser parses it: NaN/Infinity are not JSON."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


def get(query: str) -> tuple[int, dict, web.Response]:
    response = asyncio.run(routes.info(make_mocked_request("GET", f"/lycoris/info{query}")))
    assert response.content_type == "application/json"
    return response.status, strict_json(response.text), response


def get_name(name: str):
    return get("?name=" + quote(name, safe=""))


def test_listed_file_gives_its_summary(loras):
    sd = {**lora(TO_Q, 320, 320, seed=1), **lora("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768,
                                                  seed=2, rank=8, alpha=4.0)}
    name = write(loras, "style.safetensors", sd, SD_META)
    status, body, _ = get_name(name)
    assert status == 200
    assert body == json.loads(json.dumps(summarize(loras / name).to_json()))
    assert body["name"] == name and body["module_count"] == 2 and body["algorithms"] == {"LoRA": 2}
    assert body["rank"] == {"min": 4, "max": 8} and body["trigger_words"] == ["lycotest"]
    assert body["base_model"]["declared"] == "sd_v1" and "modules" not in body


def test_file_in_a_subfolder(loras):
    (loras / "styles").mkdir()
    write(loras / "styles", "ink.safetensors", lora(TO_Q, 320, 320, seed=1))
    assert "styles/ink.safetensors" in folder_paths.get_filename_list("loras")
    status, body, _ = get_name("styles/ink.safetensors")
    assert status == 200 and body["name"] == "ink.safetensors"


@pytest.mark.parametrize("query", [
    "?name=../../etc/passwd",
    "?name=..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    "?name=%2Fetc%2Fpasswd",
    "?name=nope.safetensors",
    "?name=",
    "",
])
def test_names_not_listed_are_404(query, loras):
    write(loras, "real.safetensors", lora(TO_Q, 320, 320, seed=1))
    status, body, _ = get(query)
    assert status == 404 and "is not a file in the loras folders" in body["error"]


def test_paths_to_real_files_are_404(loras, tmp_path):
    """Even paths that lead to a real safetensors file: only the names ComfyUI lists are served."""
    name = write(loras, "real.safetensors", lora(TO_Q, 320, 320, seed=1))
    outside = write(tmp_path, "outside.safetensors", lora(TO_Q, 320, 320, seed=2))
    (loras / "sub").mkdir()
    for path in (str(loras / name), str(tmp_path / outside), f"../{outside}", f"sub/../{name}", f"./{name}"):
        status, body, _ = get_name(path)
        assert status == 404, path
        assert body == {"error": f"'{path}' is not a file in the loras folders"}


class _Marker:
    """Unpickling this creates a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _pickle(marker: Path) -> bytes:
    return pickle.dumps({"lora_unet_x.lora_up.weight": torch.zeros(1), "payload": _Marker(marker)})


def test_marker_trick_works(tmp_path):
    marker = tmp_path / "unpickled"
    pickle.loads(_pickle(marker))
    assert marker.exists()


@pytest.mark.parametrize("filename", ["evil.pt", "evil.ckpt", "evil.bin", "evil.pth", "evil.pkl", "evil.pt2",
                                      "EVIL.PT"])
def test_pickle_is_refused_and_never_loaded(filename, loras, tmp_path):
    marker = tmp_path / "unpickled"
    (loras / filename).write_bytes(_pickle(marker))
    assert filename in folder_paths.get_filename_list("loras")  # ComfyUI lists it: the route must refuse it itself
    status, body, _ = get_name(filename)
    assert status == 400 and filename in body["error"] and "pickle" in body["error"]
    assert not marker.exists()


def test_pickle_named_safetensors_is_not_loaded(loras, tmp_path):
    marker = tmp_path / "unpickled"
    (loras / "disguised.safetensors").write_bytes(_pickle(marker))
    status, body, _ = get_name("disguised.safetensors")
    assert status == 422 and body["error"].startswith("disguised.safetensors: ")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty", "bad-header", "not-an-object"])
def test_corrupt_safetensors_is_422_naming_the_file(kind, loras):
    path = loras / f"{kind}.safetensors"
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 16)
    elif kind == "truncated":
        write(loras, path.name, lora(TO_Q, 320, 320, seed=1))
        path.write_bytes(path.read_bytes()[:-1000])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "bad-header":
        header = b'{"a": {"dtype": "F32", "shape": [2,'
        path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    else:
        header = b"[1, 2, 3]"
        path.write_bytes(len(header).to_bytes(8, "little") + header)
    status, body, _ = get_name(path.name)
    assert status == 422
    assert body["error"].startswith(f"{path.name}: ") and len(body["error"]) > len(path.name) + 10


def test_inf_alpha_answers_json(loras):
    """A file whose only module has an infinite alpha (the loaders refuse it): /lycoris/info answers 200 in strict
    JSON (no `Infinity` token for the panel's response.json() to choke on), the module counted as damaged: no
    module, no alpha range, its three keys unused, and the warning naming the alpha key.
    See test_summary.test_non_finite_alpha_gives_valid_json."""
    sd = lora(TO_Q, 320, 320, seed=1)
    sd[f"{TO_Q}.alpha"] = torch.tensor(float("inf"))
    status, body, _ = get_name(write(loras, "inf_alpha.safetensors", sd))
    assert status == 200
    assert (body["module_count"], body["alpha"], body["unused_keys"]) == (0, None, 3)
    assert body["warnings"] == [f"1 damaged module: the loader refuses this file ('{TO_Q}.alpha': alpha is NaN or Inf)"]


def test_route_in_an_aiohttp_app(loras):
    """register() on a RouteTableDef, served by a real aiohttp server: routing, query decoding, status codes."""
    table = web.RouteTableDef()
    routes.register(table)
    assert [(r.method, r.path, r.handler) for r in table] == [
        ("GET", "/lycoris/info", routes.info),
        *[("GET", prefix + "/{node}/{locale}.md", routes.node_doc) for prefix in routes.docs_prefixes()],
    ]
    name = write(loras, "served file.safetensors", lora(TO_Q, 320, 320, seed=1), SD_META)
    (loras / "evil.pt").write_bytes(b"not even a pickle")

    async def requests():
        app = web.Application()
        app.add_routes(table)
        async with TestClient(TestServer(app)) as client:
            answers = []
            for params in ({"name": name}, {"name": "../../etc/passwd"}, {"name": "evil.pt"}, {}):
                response = await client.get("/lycoris/info", params=params)
                answers.append((response.status, strict_json(await response.text())))
            response = await client.post("/lycoris/info", params={"name": name})
            answers.append((response.status, None))
            return answers

    ok, traversal, pickled, missing, post = asyncio.run(requests())
    assert ok[0] == 200 and ok[1]["name"] == name and ok[1]["trigger_words"] == ["lycotest"]
    assert traversal[0] == 404 and pickled[0] == 400 and missing[0] == 404
    assert post[0] == 405


# --- Off the event loop, bounded, and cheap on repeats ---------------------------------------------------------------

# Tiny LoRA modules (up, down, alpha: ~108k tensors): summarize takes ~3 s on this 2-core machine (10 s with both cores
# busy elsewhere), so "the other route answered while this parsed" is real.
SLOW_MODULES = 36_000


def answers_during_parse(latencies: list[float], parse_seconds: float) -> None:
    """The other route kept answering while the file was parsed. Its latency is not zero: Python's full garbage
    collections, which the parse's ~500k new objects set off a few times, hold the GIL ~0.3-0.5 s each (1-1.5 s with
    both cores busy elsewhere) and stop every thread. So the bound is relative: without the fix the first answer
    waits for the whole parse; with it, no answer takes half of it (and never more than a few GC pauses)."""
    assert len(latencies) >= 3, f"only {len(latencies)} answers during a {parse_seconds:.1f} s parse: {latencies}"
    assert max(latencies) < parse_seconds / 2, f"an answer took {max(latencies):.2f} s of a {parse_seconds:.1f} s parse"


def slow_lora_file(tmp_path_factory) -> Path:
    """One slow-to-summarize file per session (also used by tests/e2e/test_route_server.py); ~3 s to write."""
    path = tmp_path_factory.getbasetemp() / "slow_lora.safetensors"
    if not path.exists():
        sd = {}
        for i in range(SLOW_MODULES):
            prefix = f"lora_unet_slow_{i}"
            sd.update({f"{prefix}.lora_up.weight": torch.zeros(1, 1), f"{prefix}.lora_down.weight": torch.zeros(1, 1),
                       f"{prefix}.alpha": torch.tensor(1.0)})
        partial = path.with_suffix(".part")
        save_file(sd, str(partial))
        partial.rename(path)  # complete or absent: a crashed session never leaves a half file to reuse
    return path


@pytest.fixture(scope="session")
def slow_file(tmp_path_factory) -> Path:
    return slow_lora_file(tmp_path_factory)


class Watched:
    """summarize, counting its calls and telling when one is running (so a test knows the parse is under way)."""

    def __init__(self):
        self.calls = 0
        self.started, self.ended = threading.Event(), threading.Event()
        self.seconds = None

    def __call__(self, path):
        self.calls += 1
        self.started.set()
        start = time.monotonic()
        try:
            return summarize(path)
        finally:
            self.seconds = time.monotonic() - start
            self.ended.set()


@pytest.fixture
def watched(monkeypatch) -> Watched:
    spy = Watched()
    monkeypatch.setattr(routes, "summarize", spy)
    return spy


async def ping(request: web.Request) -> web.Response:
    """Stands in for ComfyUI's /system_stats: a route that does no file work."""
    return web.json_response({"ok": True})


def app() -> web.Application:
    table = web.RouteTableDef()
    routes.register(table)
    application = web.Application()
    application.add_routes(table)
    application.router.add_get("/ping", ping)
    return application


def ping_while_parsing(watched: Watched, url: str) -> list[float]:
    """From another thread, from the parse's start to its end: how long each /ping took (answered during the parse)."""
    assert watched.started.wait(60), "the parse never started"
    latencies = []
    while not watched.ended.is_set():
        start = time.monotonic()
        with urllib.request.urlopen(url, timeout=60) as response:
            assert json.loads(response.read()) == {"ok": True}
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    return latencies


def test_a_slow_parse_does_not_stall_other_routes(loras, slow_file, watched):
    name = Path(shutil.copy(slow_file, loras)).name

    async def scenario():
        async with TestClient(TestServer(app())) as client:
            slow = asyncio.create_task(client.get("/lycoris/info", params={"name": name}))
            latencies = await asyncio.to_thread(ping_while_parsing, watched, str(client.make_url("/ping")))
            response = await slow
            return latencies, response.status, await response.json()

    latencies, status, body = asyncio.run(scenario())
    answers_during_parse(latencies, watched.seconds)
    assert status == 200 and body["name"] == name and body["module_count"] == SLOW_MODULES


def test_a_burst_is_answered_bounded_and_the_server_answers_after(loras, slow_file, watched):
    """200 concurrent requests for a slow file: WORKERS + QUEUED are taken and share one read, the rest are refused
    with a JSON 503 while that read still runs (not after it); /ping answers meanwhile; the server answers after."""
    name = Path(shutil.copy(slow_file, loras)).name
    taken = routes.WORKERS + routes.QUEUED

    async def scenario():
        connector = aiohttp.TCPConnector(limit=0)  # 200 connections at once, not the client's default 100
        async with TestClient(TestServer(app()), connector=connector,
                              timeout=aiohttp.ClientTimeout(total=60)) as client:
            async def one():
                response = await client.get("/lycoris/info", params={"name": name})
                return response.status, await response.json()

            burst = [asyncio.create_task(one()) for _ in range(200)]
            pending = set(burst)
            while len(pending) > taken:  # every refusal is in: was the read still running?
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            refused_while_reading = not watched.ended.is_set()
            pinged = await client.get("/ping")
            ping = (pinged.status, not watched.ended.is_set())
            answers = await asyncio.gather(*burst)
            after = await client.get("/lycoris/info", params={"name": name})
            return answers, refused_while_reading, ping, (after.status, await after.json())

    answers, refused_while_reading, ping, after = asyncio.run(scenario())
    statuses = [status for status, _ in answers]
    assert sorted(set(statuses)) == [200, 503], statuses
    served = [body for status, body in answers if status == 200]
    busy = [body for status, body in answers if status == 503]
    assert len(served) == taken and len(busy) == 200 - taken
    assert all(set(body) == {"error"} and "busy" in body["error"] for body in busy)
    assert refused_while_reading, "the refusals waited for the read"
    assert ping == (200, True)  # answered while the read ran
    assert all(body == served[0] for body in served) and served[0]["module_count"] == SLOW_MODULES
    assert after == (200, served[0])
    assert watched.calls == 1  # the requests taken shared one read, and the one after reused it


def test_an_unchanged_file_is_parsed_once_and_a_changed_one_again(loras, watched):
    name = write(loras, "style.safetensors", lora(TO_Q, 320, 320, seed=1), SD_META)
    first = get_name(name)
    assert get_name(name)[:2] == first[:2] and watched.calls == 1
    write(loras, name, {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2)}, SD_META)
    status, body, _ = get_name(name)
    assert watched.calls == 2 and status == 200 and body["module_count"] == 2
    (loras / "adapter_config.json").write_text("{not json")  # the sibling PEFT config is part of what is read
    status, body, _ = get_name(name)
    assert watched.calls == 3 and status == 422 and "adapter_config.json" in body["error"]


def test_a_file_rewritten_during_its_read_is_read_again(loras, watched, monkeypatch):
    """The answer read while the file changed is not kept: the next request reads the new file."""
    name = write(loras, "style.safetensors", lora(TO_Q, 320, 320, seed=1))

    def rewritten_during_read(path):
        summary = watched(path)
        if watched.calls == 1:
            write(loras, name, {**lora(TO_Q, 320, 320, seed=1), **lora(TE_Q, 768, 768, seed=2)})
        return summary

    monkeypatch.setattr(routes, "summarize", rewritten_during_read)
    assert get_name(name)[1]["module_count"] == 1
    assert get_name(name)[1]["module_count"] == 2 and watched.calls == 2


def test_same_file_under_two_names_keeps_each_name(loras, watched):
    name = write(loras, "style.safetensors", lora(TO_Q, 320, 320, seed=1))
    (loras / "alias.safetensors").symlink_to(loras / name)
    assert get_name(name)[1]["name"] == name and get_name("alias.safetensors")[1]["name"] == "alias.safetensors"
