"""Run a real ComfyUI server with this pack installed, and talk to it over its HTTP API (stdlib only).

    with ComfyServer(base_dir) as server:
        prompt = ui_to_api(json.load(open("example_workflows/lycoris_loader.json")), server.object_info())
        entry = server.wait(server.queue(prompt), timeout=120)
        png = server.image_bytes(entry)

``base_dir`` becomes ComfyUI's ``--base-directory`` (models/, custom_nodes/, input/, output/, temp/, user/);
the repository is symlinked into ``custom_nodes/lycoris_nodes`` so ComfyUI loads the working tree.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Self

REPO_ROOT = Path(__file__).resolve().parent.parent
PACK_DIR_NAME = "lycoris_nodes"
BASE_SUBDIRS = ("models/checkpoints", "models/diffusion_models", "models/loras", "custom_nodes", "input", "output", "temp", "user")


def stretched(seconds: float) -> float:
    """A deadline of `seconds` on a quiet machine, stretched by how busy this one is now: by twice the 1-minute load
    average per core, 1 to 8 times (tests/browser/common.mjs within() does the same in the browser scripts). The
    deadlines here end a hung server or prompt; a slow machine must not turn a slow pass into a failure (issue #38)."""
    load = os.getloadavg()[0] / max(1, os.cpu_count() or 1) if hasattr(os, "getloadavg") else 0.0
    return seconds * min(8.0, max(1.0, 2 * load))


class ComfyError(RuntimeError):
    """The server refused a prompt or its execution failed."""


class PortTaken(ComfyError):
    """Another ComfyUI answers on the port a server was started on."""


def find_comfyui() -> Path:
    if str(REPO_ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "tests"))
    from comfy_env import find_comfyui as find

    return find()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        # As aiohttp binds: a port in TIME_WAIT from a server that just stopped is usable.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def prepare_base_dir(base_dir: str | Path) -> Path:
    """Create ComfyUI's base-directory layout and link this repo in as the custom node pack."""
    base = Path(base_dir).resolve()
    for sub in BASE_SUBDIRS:
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_DIR_NAME
    if link.is_symlink() and link.resolve() != REPO_ROOT:
        link.unlink()  # left over from another checkout
    if not link.is_symlink():
        if link.exists():
            raise FileExistsError(f"{link} exists and is not our symlink; remove it")
        link.symlink_to(REPO_ROOT, target_is_directory=True)
    return base


def server_args(port: int, base_dir: Path) -> list[str]:
    return [
        "--cpu",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--base-directory",
        str(base_dir),
        "--disable-auto-launch",
        # ComfyUI's default database lives inside the ComfyUI folder; keep it in the base dir instead.
        # (sqlite:///:memory: works too, but every server thread then gets its own empty database and
        # SQLAlchemy logs "SQLite objects created in a thread can only be used in that same thread".)
        "--database-url",
        f"sqlite:///{base_dir / 'user' / 'comfyui.db'}",
    ]


class ComfyClient:
    """HTTP client for a ComfyUI server on 127.0.0.1:port whose base directory is base_dir."""

    def __init__(self, port: int, base_dir: str | Path):
        self.port = port
        self.base_dir = Path(base_dir).resolve()
        self.client_id = uuid.uuid4().hex

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def _request(self, path: str, data: dict | None = None, timeout: float = 30) -> bytes:
        body = None if data is None else json.dumps(data).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=body)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=stretched(timeout)) as resp:
            return resp.read()

    def get_json(self, path: str):
        return json.loads(self._request(path))

    def object_info(self) -> dict:
        return self.get_json("object_info")

    def queue(self, prompt_api: dict) -> str:
        """POST /prompt; returns the prompt id. A prompt that fails validation raises ComfyError."""
        try:
            reply = json.loads(self._request("prompt", {"prompt": prompt_api, "client_id": self.client_id}))
        except urllib.error.HTTPError as err:
            raise ComfyError(f"prompt rejected ({err.code}): {err.read().decode(errors='replace')}") from None
        if reply.get("node_errors"):
            raise ComfyError(f"prompt has node errors: {json.dumps(reply['node_errors'])}")
        return reply["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 120) -> dict:
        """Poll /history until the prompt finished (up to stretched(timeout)); returns its history entry, raises if it
        failed."""
        timeout = stretched(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            entry = self.get_json(f"history/{prompt_id}").get(prompt_id)
            status = (entry or {}).get("status", {})
            if status.get("status_str") == "error":
                raise ComfyError(f"prompt {prompt_id} failed: {execution_error(entry)}")
            if status.get("completed"):
                return entry
            time.sleep(0.1)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout:.0f} s")

    def clear_history(self) -> None:
        """POST /history {"clear": true}: the queue's history emptied, as on a server just started."""
        self._request("history", {"clear": True})

    def forget_outputs(self) -> None:
        """POST /free {"free_memory": true}: ComfyUI's worker drops every cached output (and unloads the models) when
        it next wakes, at once when it is idle; the next prompt runs every node again."""
        self._request("free", {"free_memory": True})

    def check_alive(self) -> None:
        """Overridden by ComfyServer: raise if the server process died."""

    def images(self, entry: dict) -> list[dict]:
        return [img for out in entry.get("outputs", {}).values() for img in out.get("images", [])]

    def image_bytes(self, entry: dict, index: int = 0) -> bytes:
        image = self.images(entry)[index]
        query = urllib.parse.urlencode({k: image[k] for k in ("filename", "subfolder", "type")})
        return self._request(f"view?{query}")

    def image_path(self, entry: dict, index: int = 0) -> Path:
        """Where an output image was written (type "output" images live under base_dir/output)."""
        image = self.images(entry)[index]
        return self.base_dir / image["type"] / image["subfolder"] / image["filename"]


def execution_error(entry: dict) -> str:
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return (
                f"{data.get('node_type')} (node {data.get('node_id')}): {data.get('exception_type')}: "
                f"{data.get('exception_message')}\n{''.join(data.get('traceback', []))}"
            )
    return json.dumps(entry.get("status"))


class ComfyServer(ComfyClient):
    """``python main.py`` of the ComfyUI folder, started on enter and stopped (SIGTERM, then kill) on exit."""

    def __init__(
        self,
        base_dir: str | Path,
        port: int | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        comfy_dir: str | Path | None = None,
        python: str | None = None,
        startup_timeout: float = 90,
    ):
        super().__init__(port or free_port(), base_dir)
        self.extra_args = list(extra_args)
        self.comfy_dir = Path(comfy_dir) if comfy_dir else find_comfyui()
        # The interpreter running us is the venv that holds ComfyUI's requirements.
        self.python = python or sys.executable
        self.startup_timeout = startup_timeout
        self.log_path = self.base_dir / "user" / f"comfyui_server_{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start and wait until it answers; on another server's port (check_answering_server), again on a new one."""
        for attempt in range(1, 4):
            try:
                return self._start_once()
            except ComfyError as err:
                # Both ways to meet another server on the port: it answers for ours, or ours exits, unable to bind.
                taken = isinstance(err, PortTaken) or "address already in use" in self.log_text().lower()
                if not taken or attempt == 3:
                    raise
                self.port = free_port()
                self.log_path = self.base_dir / "user" / f"comfyui_server_{self.port}.log"

    def _start_once(self) -> None:
        prepare_base_dir(self.base_dir)
        cmd = [self.python, "main.py", *server_args(self.port, self.base_dir), *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.comfy_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        try:
            wait_until_ready(self, self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - start

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise ComfyError(f"ComfyUI exited (code {code}); log tail:\n{self.log_tail()}")

    def stop(self, grace: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def check_answering_server(server: ComfyClient) -> None:
    """The server answering on the port is the one started with this base directory (its /system_stats argv). Two
    test runs at once on one machine (two checkouts, or both ComfyUIs' suites) each pick a free port; should both
    pick the same, one server fails to bind while the other answers for it, and its tests must not run against the
    other's."""
    argv = server.get_json("system_stats").get("system", {}).get("argv", [])
    if str(server.base_dir) not in argv:
        raise PortTaken(f"the ComfyUI answering on {server.url} is not the one started for {server.base_dir} "
                         f"(its arguments: {argv}); log tail:\n{server.log_tail() if hasattr(server, 'log_tail') else ''}")


def wait_until_ready(server: ComfyClient, timeout: float) -> None:
    """Until GET /object_info answers (up to stretched(timeout)); raises with the log tail if the server dies or never
    answers."""
    timeout = stretched(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            server.object_info()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
            continue
        check_answering_server(server)
        return
    tail = server.log_tail() if hasattr(server, "log_tail") else ""
    raise TimeoutError(f"ComfyUI did not answer on {server.url} within {timeout:.0f} s; log tail:\n{tail}")


# ---------------------------------------------------------------------------------------------------------
# UI workflow (litegraph JSON saved by the frontend) -> API prompt
# ---------------------------------------------------------------------------------------------------------

MUTED, BYPASSED = 2, 4
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# Frontend-only nodes: never sent to the server.
VIRTUAL_NODES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}


def _widget_names(info: dict) -> list[tuple[str, int]]:
    """(input name, number of widgets_values it takes) for the widget inputs, in the frontend's order."""
    names = []
    for section in ("required", "optional"):
        for name, spec in info["input"].get(section, {}).items():
            kind = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if not (isinstance(kind, list) or kind in WIDGET_TYPES) or opts.get("forceInput"):
                continue
            extra = 0
            # The frontend stores "fixed"/"randomize"/... right after a seed's value.
            if kind == "INT" and (opts.get("control_after_generate") or name in ("seed", "noise_seed")):
                extra += 1
            # Image/audio upload combos are followed by the upload button's value.
            if opts.get("image_upload") or opts.get("audio_upload") or opts.get("video_upload"):
                extra += 1
            names.append((name, 1 + extra))
    return names


def _widget_values(node: dict, info: dict) -> dict:
    values = node.get("widgets_values") or []
    if isinstance(values, dict):  # some nodes save widgets by name
        return dict(values)
    out, pos = {}, 0
    for name, width in _widget_names(info):
        if pos >= len(values):
            break
        out[name] = values[pos]
        pos += width
    return out


def ui_to_api(workflow_ui: dict, object_info: dict) -> dict:
    """Convert a frontend-saved (UI format) workflow to the API prompt format POST /prompt takes.

    Muted nodes (mode 2) are dropped along with the links out of them; bypassed nodes (mode 4) and Reroutes
    are passed through: a consumer gets the upstream input of the same type instead.
    """
    nodes = {node["id"]: node for node in workflow_ui["nodes"]}
    links = {link[0]: link for link in workflow_ui.get("links", [])}

    def source(link_id: int, seen: frozenset = frozenset()):
        """[origin node id, output slot] for a link, following reroutes and bypassed nodes; None if muted."""
        _, origin_id, origin_slot, _, _, link_type = links[link_id][:6]
        origin = nodes[origin_id]
        if origin_id in seen:
            raise ValueError(f"link cycle through node {origin_id}")
        if origin.get("mode") == MUTED:
            return None
        if origin["type"] == "Reroute" or origin.get("mode") == BYPASSED:
            for inp in origin.get("inputs", []):
                if inp.get("link") is not None and (origin["type"] == "Reroute" or inp.get("type") == link_type):
                    return source(inp["link"], seen | {origin_id})
            return None
        if origin["type"] == "PrimitiveNode":
            return None  # its value is already the consumer's widget value
        return [str(origin_id), origin_slot]

    prompt = {}
    for node_id, node in nodes.items():
        kind = node["type"]
        if node.get("mode") in (MUTED, BYPASSED) or kind in VIRTUAL_NODES:
            continue
        if kind not in object_info:
            raise KeyError(f"node {node_id}: type {kind!r} is not known to the server (missing custom node?)")
        inputs = _widget_values(node, object_info[kind])
        for inp in node.get("inputs", []):
            if inp.get("link") is None:
                continue
            src = source(inp["link"])
            if src is not None:
                inputs[inp["name"]] = src
            elif "widget" not in inp:
                inputs.pop(inp["name"], None)  # from a muted node: the server reports it if it was required
        prompt[str(node_id)] = {"class_type": kind, "inputs": inputs, "_meta": {"title": node.get("title", kind)}}
    return prompt
