"""Two test runs at once on one machine (two checkouts, or both ComfyUIs' suites) each start servers on a free
port; should both pick the same one, a server must not take the other's for its own (scripts/comfy_server.py
check_answering_server, ComfyServer.start). A stand-in main.py answers the two routes the start-up reads, as ComfyUI
does (/object_info and /system_stats with its argv), so no ComfyUI starts here."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import comfy_server

# ComfyUI's answers, reduced to what the start-up reads: /system_stats's system.argv is ComfyUI's sys.argv
# (server.py, system_stats), so it holds the --base-directory the server was started with.
STAND_IN = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/object_info": {}, "/system_stats": {"system": {"argv": sys.argv}}}.get(self.path)
        self.send_response(404 if body is None else 200)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), Handler).serve_forever()  # exits with "Address already in use" when taken
'''


class OtherComfyUI(BaseHTTPRequestHandler):
    """Another run's server, started with another base directory."""

    def do_GET(self):
        body = {"/object_info": {}, "/system_stats": {"system": {"argv": ["main.py", "--base-directory", "/other"]}}}
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(body.get(self.path)).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def other_server():
    server = HTTPServer(("127.0.0.1", 0), OtherComfyUI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def stand_in_comfyui(tmp_path: Path) -> Path:
    folder = tmp_path / "comfyui"
    folder.mkdir()
    (folder / "main.py").write_text(STAND_IN, encoding="utf-8")
    return folder


def test_a_server_started_on_another_servers_port_moves_to_a_free_one(tmp_path, other_server):
    server = comfy_server.ComfyServer(tmp_path / "base", port=other_server, comfy_dir=stand_in_comfyui(tmp_path),
                                      startup_timeout=30)
    with server:
        assert server.port != other_server
        assert str(server.base_dir) in server.get_json("system_stats")["system"]["argv"]
        assert server.log_path.name == f"comfyui_server_{server.port}.log"


def test_another_server_answering_is_not_taken_for_ours(tmp_path, other_server):
    client = comfy_server.ComfyClient(other_server, tmp_path / "base")
    with pytest.raises(comfy_server.PortTaken, match="not the one started for"):
        comfy_server.wait_until_ready(client, 5)
