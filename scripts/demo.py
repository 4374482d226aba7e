"""Demo: a real ComfyUI with this pack, running example_workflows/lycoris_loader.json on a tiny SD1.5.

Run through ``make demo`` (which runs scripts/setup.sh first). It
1. writes the tiny checkpoint and the demo LyCORIS files (LoKr+DoRA, and the LoHa one the stack and schedule
   examples use) into the base directory (once; they are cached),
2. starts ComfyUI with comfy-cli (``comfy launch --background``) like a user would, or directly with
   ``python main.py`` if comfy-cli is missing or fails,
3. converts the example workflow to the API format on the demo files (example_models.for_demo: the tiny checkpoint
   and the demo LyCORIS file in place of the standard names the example shows users), queues it and waits for the
   image,
4. checks the server log for LoRA keys ComfyUI did not load,
5. keeps serving the UI until Ctrl-C (``--once``: stops right away).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import comfy_server
from comfy_server import ComfyClient, ComfyServer, ui_to_api
from example_models import DEMO_FILES, SD15_CHECKPOINT, YOUR_LYCORIS, YOUR_SECOND_LYCORIS, for_demo

CHECKPOINT = DEMO_FILES[SD15_CHECKPOINT["name"]]
LYCORIS = DEMO_FILES[YOUR_LYCORIS]
LYCORIS_LOHA = DEMO_FILES[YOUR_SECOND_LYCORIS]
WORKFLOW = REPO_ROOT / "example_workflows" / "lycoris_loader.json"
BAD_LOG_LINES = ("lora key not loaded", "NOT LOADED")
DEFAULT_PORT = 8188


def ensure_assets(base_dir: Path) -> None:
    """Tiny checkpoint + demo LyCORIS files in the base dir's model folders (skipped when up to date)."""
    import make_demo_lycoris
    import make_tiny_sd15

    ckpt = base_dir / "models" / "checkpoints" / CHECKPOINT
    lycoris = base_dir / "models" / "loras" / LYCORIS
    loha = base_dir / "models" / "loras" / LYCORIS_LOHA
    start = time.perf_counter()
    make_tiny_sd15.write_tiny_sd15(ckpt)
    make_demo_lycoris.write_demo_lycoris(lycoris, ckpt)
    make_demo_lycoris.write_demo_loha(loha, ckpt)
    print(f"demo: models ready in {time.perf_counter() - start:.1f} s: {ckpt.name}, {lycoris.name}, {loha.name}")


class CliServer(ComfyClient):
    """ComfyUI started and stopped by comfy-cli (``comfy launch --background`` / ``comfy stop``)."""

    def __init__(self, comfy_exe: str, comfy_dir: Path, base_dir: Path, port: int, cli_home: Path):
        super().__init__(port, base_dir)
        self.comfy_exe = comfy_exe
        self.comfy_dir = comfy_dir
        cli_home.mkdir(parents=True, exist_ok=True)
        venv = Path(sys.prefix)
        self.env = {
            **os.environ,
            # comfy-cli keeps its config (and the background server's pid) under ~/.config/comfy-cli.
            "HOME": str(cli_home),
            # comfy-cli runs main.py with the python of $VIRTUAL_ENV: the venv that holds ComfyUI's requirements.
            "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "DO_NOT_TRACK": "1",
            # Its launcher refreshes a "knowledge" bundle from a web service; a set file path skips that.
            "COMFY_KNOWLEDGE_FILE": str(cli_home / "no-knowledge-bundle.json"),
        }
        # comfy-cli writes ComfyUI's output here (it names the file after the port).
        self.log_path = comfy_dir / "user" / f"comfyui_{port}.log"
        self.started = False

    def _comfy(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        cmd = [self.comfy_exe, "--skip-prompt", "--workspace", str(self.comfy_dir), *args]
        return subprocess.run(
            cmd, check=False, env=self.env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def start(self, timeout: float = 120) -> None:
        result = self._comfy(
            "launch", "--background", "--", *comfy_server.server_args(self.port, self.base_dir), timeout=timeout
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"comfy launch exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
        self.started = True
        comfy_server.wait_until_ready(self, timeout)

    def stop(self) -> None:
        if not self.started:
            return
        self.started = False
        result = self._comfy("stop", timeout=60)
        if result.returncode != 0:
            print(f"demo: comfy stop exited {result.returncode}: {result.stdout.strip()} {result.stderr.strip()}")

    def check_alive(self) -> None:
        """comfy-cli owns the process; a dead server shows up as refused connections instead."""

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def start_server(base_dir: Path, port: int, cli_home: Path, use_cli: bool):
    """comfy-cli first (what users run); python main.py directly if that is not possible."""
    comfy_exe = shutil.which("comfy", path=str(Path(sys.executable).parent)) or shutil.which("comfy")
    comfy_dir = comfy_server.find_comfyui()
    if use_cli and comfy_exe:
        server = CliServer(comfy_exe, comfy_dir, base_dir, port, cli_home)
        start = time.perf_counter()
        try:
            server.start()
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as err:
            server.stop()
            print(f"demo: comfy-cli could not start ComfyUI ({err}); falling back to python main.py")
        else:
            print(f"demo: ComfyUI started with comfy-cli ({comfy_exe}) in {time.perf_counter() - start:.1f} s")
            return server
    elif use_cli:
        print("demo: comfy-cli not found; starting python main.py directly")
    server = ComfyServer(base_dir, port=port, comfy_dir=comfy_dir)
    server.start()
    print(f"demo: ComfyUI started directly (python main.py) in {server.startup_seconds:.1f} s")
    return server


def run_workflow(server: ComfyClient, workflow_path: Path) -> Path:
    prompt = ui_to_api(for_demo(json.loads(workflow_path.read_text(encoding="utf-8"))), server.object_info())
    start = time.perf_counter()
    entry = server.wait(server.queue(prompt), timeout=300)
    image = server.image_path(entry)
    print(f"demo: workflow {workflow_path.name} ran in {time.perf_counter() - start:.1f} s")
    return image


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def serve_until_interrupted(server: ComfyClient) -> None:
    print(f"demo: serving {server.url} - press Ctrl-C to stop")
    # SIGTERM (e.g. from a process manager) stops the demo as cleanly as Ctrl-C.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            time.sleep(2)
            try:
                server.get_json("system_stats")
            except (urllib.error.URLError, ConnectionError):
                print("demo: the server stopped answering")
                return
    except KeyboardInterrupt:
        print("\ndemo: stopping")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the LyCORIS Nodes demo workflow on a real ComfyUI.")
    parser.add_argument("--once", action="store_true", help="stop the server after the workflow ran")
    parser.add_argument(
        "--base-dir",
        type=Path,
        default=REPO_ROOT / ".deps" / "demo",
        help="ComfyUI --base-directory (models, output, custom_nodes); default .deps/demo",
    )
    parser.add_argument("--port", type=int, default=None, help=f"default {DEFAULT_PORT}, or a free one if taken")
    parser.add_argument(
        "--cli-home",
        type=Path,
        default=REPO_ROOT / ".deps" / "comfy-cli-home",
        help="HOME for comfy-cli's config (keeps it out of your own ~/.config)",
    )
    parser.add_argument("--no-comfy-cli", action="store_true", help="start python main.py directly")
    parser.add_argument("--workflow", type=Path, default=WORKFLOW)
    opts = parser.parse_args(argv)

    base_dir = comfy_server.prepare_base_dir(opts.base_dir)
    port = opts.port or (DEFAULT_PORT if comfy_server.port_is_free(DEFAULT_PORT) else comfy_server.free_port())
    ensure_assets(base_dir)

    server = start_server(base_dir, port, opts.cli_home.resolve(), use_cli=not opts.no_comfy_cli)
    try:
        try:
            image = run_workflow(server, opts.workflow)
        except comfy_server.ComfyError as err:
            print(f"demo: FAILED: {err}\n--- server log tail ---\n{server.log_tail()}")
            return 1
        bad = [line for line in server.log_text().splitlines() if any(b in line for b in BAD_LOG_LINES)]
        if bad:
            print("demo: FAILED: ComfyUI did not load every key of the LyCORIS file:\n" + "\n".join(bad[:20]))
            return 1
        print(f"demo: image: {image}")
        print(f"demo: UI: {server.url}")
        if not opts.once:
            serve_until_interrupted(server)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
