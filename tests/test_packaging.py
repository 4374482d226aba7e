"""The pack as the Comfy Registry and ComfyUI-Manager see it: pyproject (id, display name, icon), the publish workflow,
`comfy node validate` (with its ruff scan really running), lint, and a help page for every node."""

import ast
import asyncio
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tokenize
from pathlib import Path

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


def test_every_text_file_is_opened_with_an_explicit_encoding():
    """ruff's unspecified-encoding rule (PLW1514) on every tracked Python file (the pack, tests, bench, scripts):
    without `encoding=`, open() and Path.read_text() use the locale's code page, cp1252 on a Western Windows, and a
    UTF-8 file reads wrong there.
    The rule is still a preview rule in ruff, and turning preview on in pyproject would switch other rules to their
    preview behaviour as well, so it runs here on its own (`--select` replaces the project's rule set)."""
    files = _run("git", "ls-files", "*.py").stdout.split()
    assert "nodes/loading/presets.py" in files and "lycoris_core/peft_config.py" in files  # the pack's own readers
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


def test_readme_names_each_node_as_the_node_library_does():
    """The README's node table lists every node under the name a user finds in the node library, and nothing else."""
    extension = asyncio.run(lycoris_nodes.comfy_entrypoint())
    names = {node.define_schema().display_name for node in asyncio.run(extension.get_node_list())}
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    table = re.findall(r"^\| \*\*(.+?)\*\* \|", readme, flags=re.MULTILINE)
    assert sorted(table) == sorted(names)


# --- comfy-test (PyPI comfy-test): its config, and its levels that run offline -----------------------------------

def _comfy_test(*args: str) -> dict:
    result = _run(os.path.join(VENV_BIN, "comfy-test"), *args, "--json")
    assert result.stdout.lstrip().startswith("{"), result.stdout + result.stderr
    return json.loads(result.stdout)


def test_comfy_test_reads_the_config():
    from comfy_test.common.config import TestLevel
    from comfy_test.common.config_file import load_config

    config = load_config(REPO_ROOT / "comfy-test.toml")  # raises on an unknown level, key or platform
    assert TestLevel.JAVASCRIPT in config.levels and TestLevel.SYNTAX not in config.levels
    assert config.windows_portable.enabled and config.linux.enabled
    assert "lycoris_nodes" in config.javascript.namespaces


def test_comfy_test_javascript_level_passes():
    """comfy-test's JAVASCRIPT level: no globals on window, nothing appended to the shared document, names under the
    pack's namespaces."""
    report = _comfy_test("lint", ".", "--check", "javascript")
    js = report["results"]["javascript"]
    assert js["namespaces"][0] == "lycorisnodes"  # from pyproject's DisplayName
    errors = [f for f in js["findings"] if f["level"] == "error"]
    assert report["passed"] and not errors, json.dumps(errors, indent=1)


_LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


def _set_aside_docstrings_and_comment_lines(source: str) -> str:
    """`source` with its docstrings and its comments on lines of their own blanked (line numbers kept): what is never
    executed and never reaches a console. A traceback prints the source lines of its frames, so a comment after
    code stays, and so does every string literal that is not a docstring. (Blanking docstrings also keeps SYNTAX's
    forbidden-pattern regexes off prose such as "a torch nn.Embedding() layer".)"""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    code_lines, comment_lines = set(), set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_lines.add(token.start[0])
        elif token.type not in _LAYOUT and not (token.type == tokenize.STRING and token.start[0] in docstrings):
            code_lines.update(range(token.start[0], token.end[0] + 1))
    blank = (docstrings | comment_lines) - code_lines
    return "".join("\n" if number in blank else line for number, line in enumerate(source.splitlines(True), 1))


# The pack as ComfyUI runs it; tests/, bench/ and scripts/ never run in a user's ComfyUI.
RUNTIME = ("__init__.py", "nodes", "lycoris_core")


def test_comfy_test_syntax_level_passes_on_what_the_pack_prints(tmp_path):
    """comfy-test's SYNTAX level (project files, cp1252 characters, forbidden device/autocast/nn patterns) on the
    pack's runtime code, with docstrings and comment-only lines set aside: the maths stays readable there, and
    every string that can reach the console (messages, and the source lines a traceback prints) is cp1252.
    comfy-test has no setting for this (its scan reads every character of every .py file), hence the copy."""
    pack = tmp_path / "lycoris-nodes"
    pack.mkdir()
    for name in ("pyproject.toml", "requirements.txt"):
        shutil.copy(REPO_ROOT / name, pack / name)
    files = [f for f in _run("git", "ls-files", *RUNTIME).stdout.split() if f.endswith(".py")]
    assert "nodes/glue/apply.py" in files and "lycoris_core/algos/lokr.py" in files
    for name in files:
        (pack / name).parent.mkdir(parents=True, exist_ok=True)
        source = (REPO_ROOT / name).read_text(encoding="utf-8")
        (pack / name).write_text(_set_aside_docstrings_and_comment_lines(source), encoding="utf-8")
    report = _comfy_test("lint", str(pack), "--check", "syntax")
    assert report["passed"], report["results"]["syntax"]["details"]


# nodes/: the node classes by family on top, the glue that binds lycoris_core to ComfyUI below them, lycoris_core
# at the bottom. An import may only go down (or stay inside its own family).
NODE_FAMILIES = ("loading", "inspection", "scheduling", "tools")


def pack_imports(path: Path) -> set[str]:
    """The pack modules a file under nodes/ imports, as 'nodes.<package>' or 'lycoris_core' (relative imports
    resolved against the file's own package)."""
    package = path.relative_to(REPO_ROOT).parent.parts  # e.g. ("nodes", "glue")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            parts = [*base, *(node.module.split(".") if node.module else [])]
            if parts[:1] == ["lycoris_core"]:
                found.add("lycoris_core")
            elif parts[:1] == ["nodes"] and len(parts) > 1:
                found.add(f"nodes.{parts[1]}")
            elif parts == ["nodes"]:
                found |= {f"nodes.{alias.name}" for alias in node.names}
    return found


def test_nodes_imports_only_go_down():
    """The glue imports no node family; a family imports the glue and lycoris_core, never another family; and
    nothing but packages lives on nodes/' own floor."""
    nodes = REPO_ROOT / "nodes"
    assert sorted(p.name for p in nodes.iterdir() if p.suffix == ".py") == ["__init__.py"]
    assert sorted(p.name for p in nodes.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        [*NODE_FAMILIES, "glue"])
    for path in sorted(nodes.rglob("*.py")):
        own = path.relative_to(REPO_ROOT).parts[1]
        imported = pack_imports(path) - {f"nodes.{own}", "lycoris_core"}
        allowed = set() if own == "glue" else {"nodes.glue"}
        assert imported <= allowed, f"{path.relative_to(REPO_ROOT)} imports {sorted(imported - allowed)}"


# What ComfyUI puts on sys.path: lycoris_core is pure torch + safetensors and must import none of it.
COMFY_MODULES = ("comfy", "comfy_api", "comfy_execution", "comfy_extras", "folder_paths", "server", "nodes",
                 "execution", "node_helpers", "latent_preview", "app", "utils")


def test_lycoris_core_never_imports_comfy():
    """Read (every import statement of lycoris_core/) and run (every module imported as a top-level package in a
    fresh interpreter where importing any of COMFY_MODULES raises): lycoris_core stays usable without ComfyUI, and a
    relative import cannot climb out of it into the pack."""
    core = REPO_ROOT / "lycoris_core"
    for path in sorted(core.rglob("*.py")):
        depth = len(path.relative_to(core).parts) - 1  # 0 for lycoris_core/x.py
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not [n for n in names if n.split(".")[0] in COMFY_MODULES], f"{path} imports {names}"
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level <= depth + 1, f"{path}: a relative import above lycoris_core ({node.module})"
    script = (
        "import importlib, importlib.abc, pkgutil, sys\n"
        f"BLOCKED = {COMFY_MODULES!r}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ImportError(f'lycoris_core imported {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lycoris_core\n"
        "names = [m.name for m in pkgutil.walk_packages(lycoris_core.__path__, 'lycoris_core.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=False,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) >= 20  # every module was imported, algorithms and tools included
