"""Fixtures shared by the e2e modules: the cached demo assets and ONE ComfyUI server (with this pack) for the session.

The constants and make_base_dir stay in test_server_demo.py, where test_browser_panel.py imports them from.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_demo_lycoris
import make_tiny_sd15
import make_tiny_wan
from comfy_server import ComfyServer, ui_to_api
from frontends import BUNDLED, FRONTENDS, frontend_args
from test_server_demo import ASSETS, CHECKPOINT, LYCORIS, LYCORIS_LOHA, WORKFLOW, make_base_dir


@pytest.fixture(scope="session")
def assets() -> dict[str, Path]:
    ckpt = make_tiny_sd15.write_tiny_sd15(ASSETS / CHECKPOINT)
    lycoris = make_demo_lycoris.write_demo_lycoris(ASSETS / LYCORIS, ckpt)
    return {"checkpoints": ckpt, "loras": lycoris}


@pytest.fixture(scope="session")
def loha_file(assets) -> Path:
    """The second demo file (LoHa, UNet + text encoder), cached next to the others."""
    return make_demo_lycoris.write_demo_loha(ASSETS / LYCORIS_LOHA, assets["checkpoints"])


@pytest.fixture(scope="session")
def tiny_wan() -> dict[str, list[Path]]:
    """Wan 2.2's two experts at a tiny width and a HIGH/LOW LoRA pair for them (scripts/make_tiny_wan.py), cached."""
    return make_tiny_wan.write_all(ASSETS / "tiny_wan")


@pytest.fixture(scope="session")
def model_files(assets, loha_file, tiny_wan) -> dict[str, list[Path]]:
    """What a server's base dir links: the checkpoint, every demo LyCORIS file and the tiny Wan experts with their
    pair (for make_base_dir)."""
    return {"checkpoints": [assets["checkpoints"]], "loras": [assets["loras"], loha_file, *tiny_wan["loras"]],
            "diffusion_models": tiny_wan["diffusion_models"]}


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_files):
    with ComfyServer(make_base_dir(tmp_path_factory.mktemp("comfy-base"), model_files)) as srv:
        yield srv


@pytest.fixture(scope="session")
def newer_frontend_servers(tmp_path_factory, model_files):
    """A server for each frontend other than the bundled one, started at its first test and kept for the session (a
    parametrized session fixture would be stopped and started again whenever the tests' order alternates between
    frontends, as the tours' own parametrization makes it)."""
    servers = {}

    def server_for(frontend: str) -> ComfyServer:
        if frontend not in servers:
            base = make_base_dir(tmp_path_factory.mktemp(f"comfy-frontend-{frontend}"), model_files)
            servers[frontend] = stack.enter_context(ComfyServer(base, extra_args=frontend_args(frontend)))
        return servers[frontend]

    with contextlib.ExitStack() as stack:
        yield server_for


@pytest.fixture
def frontend_server(request, newer_frontend_servers):
    """The session's server of a frontend of frontends.FRONTENDS: `server` for the bundled one."""
    return lambda frontend: (request.getfixturevalue("server") if frontend == BUNDLED
                             else newer_frontend_servers(frontend))


@pytest.fixture(params=FRONTENDS)
def browser_server(request, frontend_server):
    """The session's server for the bundled frontend; for another frontend, a server of its own serving it."""
    return frontend_server(request.param)


@pytest.fixture(scope="session")
def prompt(server) -> dict:
    return ui_to_api(json.loads(WORKFLOW.read_text()), server.object_info())
