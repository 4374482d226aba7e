"""Shared test setup: a real ComfyUI on the CPU, importable before any test module imports `comfy.*`."""

import os
import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from ci_strictness import fail_skip_outside_the_matrix
from comfy_env import IN_CI, setup_comfy

setup_comfy()  # sys.path + args.cpu = True, before anything imports comfy.model_management

import pytest
from pack import import_pack

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `make test`'s first pass: the cores are shared by the workers
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import_pack()  # so test modules can `from lycoris_nodes... import` at module level

# Files that keep one worker busy for minutes go first: pytest-xdist hands files to workers in collection order, and
# one started last is the pass's tail while the other worker idles (the GPU kit's build and dry run: ~280 s of the
# ~580 s ComfyUI 0.33 unit pass on 2 cores).
LONG_FILES_FIRST = ("test_gpu_kit.py",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_skip_outside_the_matrix(outcome.get_result(), IN_CI)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    fail_skip_outside_the_matrix(outcome.get_result(), IN_CI)  # a module skipped as a whole


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def pack():
    """The pack imported the way ComfyUI imports it (package `lycoris_nodes`)."""
    return import_pack()


@pytest.fixture(scope="session")
def reference_files(tmp_path_factory):
    """Reference-made files and their truth, one per factory variant, generated on first use and shared by every
    test module (generation is the slow part of the reference tables)."""
    from reference.lycoris_factory import BY_ID, Lazy, generate

    directory = tmp_path_factory.mktemp("lycoris_reference")
    return Lazy(lambda variant_id: generate(BY_ID[variant_id], directory))


@pytest.fixture(scope="session")
def bases():
    """The factory's base parameters rounded to each dtype."""
    from reference.lycoris_factory import Lazy, base_params

    return Lazy(base_params)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny tensors: with two busy cores, thread hand-offs cost ~10× the maths."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
