"""End to end: GET /lycoris/info and the loader's `lycoris` ui payload on the real ComfyUI server (the session server
of conftest.py, shared with test_server_demo.py)."""

from __future__ import annotations

import json
import urllib.error
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open
from test_server_demo import LYCORIS, loader_id

pytestmark = pytest.mark.e2e
REPO_ROOT = Path(__file__).resolve().parents[2]


def demo_modules(assets) -> Counter:
    """Module count of the demo file by its own keys: every LoKr module has one lokr_w1 and (DoRA) one dora_scale."""
    with safe_open(str(assets["loras"]), "pt") as f:
        keys = list(f.keys())
    return Counter(key.rsplit(".", 1)[1] for key in keys if key.endswith((".lokr_w1", ".dora_scale")))


def test_info_route(server, assets):
    counts = demo_modules(assets)
    assert counts["lokr_w1"] == counts["dora_scale"] == 65
    body = server.get_json(f"lycoris/info?name={LYCORIS}")
    assert body["name"] == LYCORIS and body["module_count"] == 65
    assert body["algorithms"] == {"LoKr+DoRA": 65}
    assert body["size_bytes"] == assets["loras"].stat().st_size
    assert body["base_model"] == {"declared": "sd_v1", "inferred": "SD1.x"} and body["trigger_words"] == ["lycodemo"]
    assert server.get_json(f"api/lycoris/info?name={LYCORIS}") == body  # the frontend calls it through /api
    for name in ("nope.safetensors", "../../etc/passwd"):
        with pytest.raises(urllib.error.HTTPError) as err:
            server.get_json(f"api/lycoris/info?name={name}")
        assert err.value.code == 404 and "not a file in the loras folders" in json.loads(err.value.read())["error"]


def test_loader_payload_in_history(server, prompt):
    entry = server.wait(server.queue(prompt), timeout=180)
    (payload,) = entry["outputs"][loader_id(prompt)]["lycoris"]
    assert payload["line"] == f"{LYCORIS}: 65/65 modules applied (LoKr+DoRA 65, 100% of parameters)"
    assert (payload["applied"], payload["total"], payload["verdict"], payload["problems"]) == (65, 65, "", [])
    assert payload["summary"]["algorithms"] == {"LoKr+DoRA": 65}
    assert payload["blocks"] and sum(b["modules"] for b in payload["blocks"]) == 65
    assert all(b["change"] > 0 for b in payload["blocks"])


def test_help_pages_answer_the_frontends_first_request(server):
    """Frontends 1.32 to 1.58 fetch a custom node's help at /extensions/<pack folder>/docs/<Node>/<locale>.md first,
    then at /extensions/<pack folder>/docs/<Node>.md: the first answers (English for every locale), so no help page
    costs the browser a 404. The folder is what the frontend reads from the node's python_module."""
    docs = REPO_ROOT / "web" / "docs"
    info = server.object_info()
    ours = sorted(name for name, node in info.items() if (docs / f"{name}.md").is_file())
    assert len(ours) == len(list(docs.glob("*.md")))
    for name in ours:
        folder = info[name]["python_module"].split(".")[1]
        page = (docs / f"{name}.md").read_bytes()
        for locale in ("en", "zh", "ja"):
            assert server._request(f"extensions/{folder}/docs/{name}/{locale}.md") == page, (name, locale)
        assert server._request(f"extensions/{folder}/docs/{name}.md") == page
    with pytest.raises(urllib.error.HTTPError) as err:
        server._request(f"extensions/{folder}/docs/NoSuchNode/en.md")
    assert err.value.code == 404
