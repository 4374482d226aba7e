"""GET /lycoris/info?name=<file>: the handler on mocked requests, and the route in a real aiohttp app.

Only names ComfyUI lists for the loras folders are served, pickles are never opened, and errors are JSON naming the file.
(The route on the real ComfyUI server is checked in tests/e2e/test_info_route.py.)
"""

import asyncio
import json
import pickle
from pathlib import Path
from urllib.parse import quote

import folder_paths
import pytest
import test_nodes
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from lycoris_nodes.lycoris_core.summary import summarize
from lycoris_nodes.nodes import routes
from test_nodes import TO_Q, lora, write

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
    assert body["name"] == name and body["module_count"] == 2 and body["algorithms"] == {"LoCon": 2}
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
    """The file is damaged (the loaders refuse it), yet /lycoris/info answers 200 with `"alpha": {"min": Infinity, …}`,
    which the panel's response.json() cannot parse. See test_summary.test_non_finite_alpha_gives_valid_json."""
    sd = lora(TO_Q, 320, 320, seed=1)
    sd[f"{TO_Q}.alpha"] = torch.tensor(float("inf"))
    get_name(write(loras, "inf_alpha.safetensors", sd))


def test_route_in_an_aiohttp_app(loras):
    """register() on a RouteTableDef, served by a real aiohttp server: routing, query decoding, status codes."""
    table = web.RouteTableDef()
    routes.register(table)
    assert [(r.method, r.path, r.handler) for r in table] == [("GET", "/lycoris/info", routes.info)]
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
