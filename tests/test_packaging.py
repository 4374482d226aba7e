"""The pack as the Comfy Registry and ComfyUI-Manager see it: pyproject (id, display name, icon), the publish workflow,
`comfy node validate` (with its ruff scan really running), lint, and a help page for every node."""

import asyncio
import os
import re
import struct
import subprocess
import sys

import lycoris_nodes
import tomllib
import yaml
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


def _registry_id_rules(node_id: str) -> bool:
    """The registry's rules for [project] name (its pyproject specification): under 100 characters of letters, digits,
    '-', '_' and '.', no two special characters in a row, starting with a letter."""
    return len(node_id) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", node_id) is not None


def test_registry_id_and_display_name_name_the_same_pack_and_no_other():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    node_id, display = project["project"]["name"], project["tool"]["comfy"]["DisplayName"]
    assert _registry_id_rules(node_id), node_id
    # What the Manager shows (DisplayName) and what a user types (`comfy node install <id>`) are the same words...
    assert re.sub(r"[^a-z0-9]", "", display.lower()) == re.sub(r"[^a-z0-9]", "", node_id.lower())
    # ...and the repository's name, so README, Manager and GitHub agree.
    assert project["project"]["urls"]["Repository"].rstrip("/").rsplit("/", 1)[-1] == node_id
    # The registry advises against "ComfyUI" in ids; it is also what the other LyCORIS pack is called by
    # (`comfyui-lycoris`), which a "LyCORIS" search lists beside ours.
    for name in (node_id, display):
        assert "comfyui" not in name.lower() and name.lower() not in {"comfyui-lycoris", "lycoris"}


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_icon_is_a_url_to_a_square_png_of_at_most_400px_shipped_in_this_repository():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    icon = project["tool"]["comfy"]["Icon"]
    # The registry takes a URL (its pyproject specification), not a path: the raw file of this repository's main branch.
    owner_repo = project["project"]["urls"]["Repository"].removeprefix("https://github.com/").rstrip("/")
    prefix = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    assert icon.startswith(prefix), icon
    path = icon.removeprefix(prefix)
    # Shipped: tracked by git, so the URL resolves once main is pushed and `comfy node publish` packs it too.
    tracked = _run("git", "ls-files", "--error-unmatch", path)
    assert tracked.returncode == 0, f"{path} is not tracked by git: {tracked.stderr}"
    width, height = _png_size((REPO_ROOT / path).read_bytes())
    assert width == height and width <= 400, (width, height)  # registry: square, at most 400 x 400
    assert (REPO_ROOT / path).stat().st_size < 150_000


def test_publish_workflow_is_the_registry_one():
    """The publish workflow as the registry's publishing guide gives it: on pyproject.toml changes on main and by hand,
    Comfy-Org/publish-node-action with the REGISTRY_ACCESS_TOKEN secret."""
    workflow = yaml.safe_load((REPO_ROOT / ".github" / "workflows" / "publish_action.yml").read_text(encoding="utf-8"))
    triggers = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads the key `on` as true
    assert "workflow_dispatch" in triggers
    assert triggers["push"]["branches"] == ["main"] and triggers["push"]["paths"] == ["pyproject.toml"]
    (job,) = workflow["jobs"].values()
    publish = [step for step in job["steps"] if step.get("uses", "").startswith("Comfy-Org/publish-node-action@")]
    assert len(publish) == 1
    assert publish[0]["with"]["personal_access_token"] == "${{ secrets.REGISTRY_ACCESS_TOKEN }}"
    # The action opens an issue when its eval/exec scan finds something; without the permission that step fails.
    assert workflow["permissions"]["issues"] == "write"
    assert job["steps"][0]["uses"].startswith("actions/checkout@")


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


# Python files that are not the pack's and are linted by their owners' rules: the benchmark and the demo script.
_NOT_THE_PACK = ("bench/", "scripts/")


def test_every_text_file_is_opened_with_an_explicit_encoding():
    """ruff's unspecified-encoding rule (PLW1514) on the tracked Python files: without `encoding=`, open() and
    Path.read_text() use the locale's code page, cp1252 on a Western Windows, and a UTF-8 file reads wrong there.
    The rule is still a preview rule in ruff, and turning preview on in pyproject would switch other rules to their
    preview behaviour as well, so it runs here on its own (`--select` replaces the project's rule set)."""
    files = [f for f in _run("git", "ls-files", "*.py").stdout.split() if not f.startswith(_NOT_THE_PACK)]
    assert "nodes/presets.py" in files and "lycoris_core/peft_config.py" in files  # the pack's own readers
    result = _run(sys.executable, "-m", "ruff", "check", "--preview", "--select", "PLW1514", "--no-cache", *files)
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
