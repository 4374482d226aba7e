"""The pack as the Comfy Registry and ComfyUI-Manager see it: pyproject, `comfy node validate` (with its ruff scan
really running), lint, and a help page for every node."""

import asyncio
import os
import subprocess
import sys

import lycoris_nodes
import tomllib
from comfy_env import REPO_ROOT

VENV_BIN = os.path.dirname(sys.executable)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(REPO_ROOT / ".deps" / "comfy-cli-home"), "DO_NOT_TRACK": "1"}
    return subprocess.run(args, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_pyproject_has_registry_fields():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] and project["project"]["version"].count(".") == 2
    assert project["project"]["urls"]["Repository"]
    assert project["project"]["dependencies"] == []  # torch and safetensors come with ComfyUI
    comfy = project["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    # WEB_DIRECTORY registers web/; a [tool.comfy] web entry as well would make the frontend load our JS twice.
    assert "web" not in comfy and lycoris_nodes.WEB_DIRECTORY == "./web"


def test_comfy_node_validate_passes_with_its_ruff_scan():
    # comfy-cli silently skips its security scan when ruff is missing; make sure it is there.
    assert _run(sys.executable, "-m", "ruff", "--version").returncode == 0
    result = _run(os.path.join(VENV_BIN, "comfy"), "node", "validate")
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "Running security checks" in output and "All validation checks passed" in output, output
    assert "S102" not in output and "S307" not in output and "E702" not in output, output


def test_ruff_is_clean():
    result = _run(sys.executable, "-m", "ruff", "check", ".")
    assert result.returncode == 0, result.stdout


def test_every_node_has_a_help_page_and_tooltips():
    extension = asyncio.run(lycoris_nodes.comfy_entrypoint())
    for node in asyncio.run(extension.get_node_list()):
        schema = node.define_schema()
        doc = REPO_ROOT / "web" / "docs" / f"{schema.node_id}.md"
        assert doc.is_file() and doc.read_text().startswith(f"# {schema.display_name}"), doc
        assert schema.description
        assert all(i.tooltip for i in schema.inputs), schema.node_id
        assert all(o.tooltip for o in schema.outputs), schema.node_id
