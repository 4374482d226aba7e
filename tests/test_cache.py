"""The process-wide file cache (nodes/glue/cache.py): read once, re-read when edited, bounded by bytes, freed under memory
pressure, visible in stats, the log, the Info node and the route; and a real stack of nodes reading a file once.

Files are real safetensors written here; reads are counted by wrapping the module's own `read`.
"""

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import test_nodes
import torch
from aiohttp.test_utils import make_mocked_request
from lycoris_nodes.lycoris_core import parse_state_dict
from lycoris_nodes.nodes.glue import cache, routes
from lycoris_nodes.nodes.inspection.info import LycorisInfo
from lycoris_nodes.nodes.loading.loaders import LycorisLoader
from lycoris_nodes.nodes.scheduling.stack import LycorisApplyStack, LycorisStack
from test_block_weights import run as run_block
from test_coverage import run as run_with_ui
from test_nodes import TO_Q, lora, write

sd15 = test_nodes.sd15  # fixtures
loras = test_nodes.loras

MB = 1024 * 1024
GIB = 1024 * MB


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.delenv(cache.BUDGET_ENV, raising=False)
    cache.clear()
    yield
    cache.clear()


@pytest.fixture()
def reads(monkeypatch):
    """The names of the files `load_cached` actually read, in order."""
    names = []
    original = cache.read_measured

    def counting_read(path):
        names.append(os.path.basename(path))
        return original(path)

    monkeypatch.setattr(cache, "read_measured", counting_read)
    return names


def lora_file(folder, name, width=64, rank=4, seed=0):
    """A one-module LoRA file; its cached bytes are those of lora_up + lora_down (alpha is read as a number)."""
    write(folder, name, lora(TO_Q, width, width, seed=seed, rank=rank))
    return folder / name


def tensor_bytes(width=64, rank=4) -> int:
    return 2 * width * rank * 4  # fp32 up (width×rank) and down (rank×width)


def set_budget(monkeypatch, nbytes: float):
    monkeypatch.setenv(cache.BUDGET_ENV, repr(nbytes / MB))


def delta(before: cache.CacheStats, after: cache.CacheStats) -> tuple[int, int, int]:
    return after.hits - before.hits, after.misses - before.misses, after.evictions - before.evictions


def memory(available: int, total: int = 16 * GIB):
    return SimpleNamespace(total=total, available=available)


# --- read once, re-read when edited ------------------------------------------------------------------------------------

def test_a_file_is_read_once(tmp_path, reads):
    path = lora_file(tmp_path, "a.safetensors")
    before = cache.stats()
    first = cache.load_cached(path)
    again = [cache.load_cached(path) for _ in range(9)]
    assert reads == ["a.safetensors"]
    assert all(f is first for f in again)
    assert cache.load_cached(str(path)) is first  # str or Path, same key
    after = cache.stats()
    assert delta(before, after) == (9 + 1, 1, 0)
    assert (after.files, after.bytes) == (1, tensor_bytes())


def test_the_same_file_by_another_path_is_one_entry(tmp_path, reads):
    path = lora_file(tmp_path, "a.safetensors")
    (tmp_path / "sub").mkdir()
    first = cache.load_cached(path)
    assert cache.load_cached(tmp_path / "sub" / ".." / "a.safetensors") is first
    assert reads == ["a.safetensors"]


def up_weight(file):
    (module,) = file.modules.values()
    return module.tensors["lora_up.weight"]


def test_an_edited_file_is_read_again(tmp_path, reads):
    path = lora_file(tmp_path, "a.safetensors", seed=1)
    old = cache.load_cached(path)
    stat = path.stat()
    lora_file(tmp_path, "a.safetensors", seed=2)  # same size, new content and mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    new = cache.load_cached(path)
    assert reads == ["a.safetensors"] * 2
    assert not torch.equal(up_weight(new), up_weight(old))
    assert cache.stats().files == 1  # the old version can never be hit again, so it is not kept

    lora_file(tmp_path, "a.safetensors", width=32, seed=3)  # new size
    assert up_weight(cache.load_cached(path)).shape == (32, 4)
    assert len(reads) == 3 and (cache.stats().files, cache.stats().bytes) == (1, tensor_bytes(width=32))
    assert cache.load_cached(path) is cache.load_cached(path) and len(reads) == 3


def test_a_rewrite_that_keeps_size_mtime_and_inode_is_read_again(tmp_path, reads):
    """FAT keeps mtimes to 2 s and Linux stamps files from a coarse clock: a trainer saving the same file twice in
    that time, in place, leaves size, mtime and inode as they were. Its bytes differ, and the file is read again."""
    path = lora_file(tmp_path, "a.safetensors", seed=1)
    old = cache.load_cached(path)
    before = path.stat()
    fresh = tmp_path / "fresh.safetensors"
    lora_file(tmp_path, fresh.name, seed=2)
    with open(path, "r+b") as f:  # in place, as `cp` does: the inode stays
        f.write(fresh.read_bytes())
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    new = cache.load_cached(path)
    assert reads == ["a.safetensors", "a.safetensors"]
    assert torch.equal(up_weight(new), up_weight(cache.load_cached(fresh)))
    assert not torch.equal(up_weight(new), up_weight(old))


# --- bounded by bytes --------------------------------------------------------------------------------------------------

def test_the_byte_budget_evicts_the_least_recently_used(tmp_path, reads, monkeypatch):
    a, b, c = (lora_file(tmp_path, f"{n}.safetensors", seed=i) for i, n in enumerate("abc"))
    set_budget(monkeypatch, 2.5 * tensor_bytes())  # two files fit, three do not
    before = cache.stats()
    cache.load_cached(a)
    cache.load_cached(b)
    cache.load_cached(a)  # a is now the most recently used
    cache.load_cached(c)  # evicts b
    assert reads == ["a.safetensors", "b.safetensors", "c.safetensors"]
    after = cache.stats()
    assert (after.files, after.bytes, after.budget) == (2, 2 * tensor_bytes(), int(2.5 * tensor_bytes()))
    assert delta(before, after) == (1, 3, 1)
    cache.load_cached(a)
    cache.load_cached(c)
    assert len(reads) == 3  # both still cached
    cache.load_cached(b)  # read again, evicts a (c was used after it)
    cache.load_cached(c)
    assert reads[3:] == ["b.safetensors"]
    cache.load_cached(a)
    assert reads[3:] == ["b.safetensors", "a.safetensors"]


def test_the_budget_is_read_when_checked(tmp_path, reads, monkeypatch):
    a, b = lora_file(tmp_path, "a.safetensors"), lora_file(tmp_path, "b.safetensors", seed=5)
    cache.load_cached(a)
    cache.load_cached(b)
    assert cache.stats().files == 2
    set_budget(monkeypatch, tensor_bytes())  # lowered while running: the next check applies it
    assert cache.stats().budget == tensor_bytes()
    cache.trim()
    assert (cache.stats().files, cache.stats().bytes) == (1, tensor_bytes())
    cache.load_cached(b)  # b, the most recently used, is the one kept
    assert reads == ["a.safetensors", "b.safetensors"]
    cache.trim(1)  # one more byte does not fit next to b
    assert cache.stats().files == 0


def test_a_file_over_the_budget_is_used_but_not_kept(tmp_path, reads, monkeypatch, caplog):
    small = lora_file(tmp_path, "small.safetensors")
    big = lora_file(tmp_path, "big.safetensors", width=256, rank=16)
    set_budget(monkeypatch, 2 * tensor_bytes())
    cache.load_cached(small)
    with caplog.at_level(logging.INFO, logger="lycoris_nodes"):
        file = cache.load_cached(big)
    assert up_weight(file).shape == (256, 16)  # returned, usable
    assert "not kept: larger than the budget" in caplog.text
    stats = cache.stats()
    assert (stats.files, stats.bytes) == (1, tensor_bytes())  # small was not evicted for a file that is not kept
    cache.load_cached(big)
    cache.load_cached(small)
    assert reads == ["small.safetensors", "big.safetensors", "big.safetensors"]


def test_budget_zero_keeps_nothing(tmp_path, reads, monkeypatch):
    path = lora_file(tmp_path, "a.safetensors")
    monkeypatch.setenv(cache.BUDGET_ENV, "0")
    cache.load_cached(path)
    cache.load_cached(path)
    assert len(reads) == 2 and cache.stats().files == 0


def test_default_budget_and_a_bad_value(monkeypatch, caplog):
    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=8 * GIB, total=64 * GIB))
    assert cache.budget_bytes() == 1 * GIB
    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=8 * GIB, total=16 * GIB))
    assert cache.budget_bytes() == 1 * GIB  # the README's 16 GB machine
    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=3 * GIB, total=8 * GIB))
    assert cache.budget_bytes() == 512 * MB  # 1/16 of total RAM when that is smaller
    monkeypatch.setenv(cache.BUDGET_ENV, "300")
    assert cache.budget_bytes() == 300 * MB
    for bad in ("lots", "-5", "nan"):
        monkeypatch.setenv(cache.BUDGET_ENV, bad)
        with caplog.at_level(logging.WARNING, logger="lycoris_nodes"):
            assert cache.budget_bytes() == 512 * MB
            assert cache.budget_bytes() == 512 * MB
        warnings = [r for r in caplog.records if bad in r.getMessage()]
        assert len(warnings) == 1 and cache.BUDGET_ENV in warnings[0].getMessage()  # once per value, not per load


def test_each_storage_is_counted_once():
    shared = torch.randn(4, 32)
    sd = {**lora("lora_unet_a", 32, 32, seed=1), **lora("lora_unet_b", 32, 32, seed=3)}
    sd["lora_unet_a.lora_down.weight"] = sd["lora_unet_b.lora_down.weight"] = shared
    file = parse_state_dict(sd)
    assert len(file.modules) == 2
    assert cache.file_bytes(file) == 2 * 32 * 4 * 4 + shared.nbytes  # two ups, one shared down
    backing = torch.randn(2 * 32 + 2 * 32)
    views = {"lora_unet_a.lora_up.weight": backing[:64].view(32, 2),
             "lora_unet_a.lora_down.weight": backing[64:].view(2, 32), "lora_unet_a.alpha": torch.tensor(1.0)}
    assert cache.file_bytes(parse_state_dict(views)) == backing.nbytes  # two views of one storage


# --- memory pressure ---------------------------------------------------------------------------------------------------

def test_memory_pressure_evicts_on_trim_and_before_adding(tmp_path, reads, monkeypatch):
    a, b, c = (lora_file(tmp_path, f"{n}.safetensors", seed=i) for i, n in enumerate("abc"))
    set_budget(monkeypatch, 100 * MB)
    cache.load_cached(a)
    cache.load_cached(b)
    before = cache.stats()
    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=200 * MB))  # < min(1 GiB, 1.6 GiB)
    cache.trim()
    after = cache.stats()
    assert (after.files, after.bytes) == (0, 0) and delta(before, after) == (0, 0, 2)

    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=8 * GIB))
    cache.load_cached(a)
    cache.load_cached(b)
    # the pressure goes away once one file is dropped: only the least recently used one goes
    monkeypatch.setattr(cache.psutil, "virtual_memory",
                        lambda: memory(available=200 * MB if len(cache._files) >= 2 else 8 * GIB))
    cache.load_cached(c)
    assert cache.stats().files == 2
    cache.load_cached(b)
    cache.load_cached(c)
    assert reads == ["a.safetensors", "b.safetensors", "a.safetensors", "b.safetensors", "c.safetensors"]


def test_no_pressure_with_enough_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.psutil, "virtual_memory", lambda: memory(available=3 * GIB, total=64 * GIB))
    cache.load_cached(lora_file(tmp_path, "a.safetensors"))
    cache.trim()
    assert cache.stats().files == 1  # 3 GiB available is above the 1 GiB floor even though it is < 10% of 64 GiB


# --- visible ----------------------------------------------------------------------------------------------------------

def test_stats_and_the_log_line(tmp_path, monkeypatch, caplog):
    set_budget(monkeypatch, 64 * MB)
    a, b = lora_file(tmp_path, "a.safetensors"), lora_file(tmp_path, "b.safetensors", width=128, seed=4)
    before = cache.stats()
    with caplog.at_level(logging.INFO, logger="lycoris_nodes"):
        cache.load_cached(a)
        cache.load_cached(b)
        cache.load_cached(a)
    after = cache.stats()
    assert (after.files, after.bytes, after.budget) == (2, tensor_bytes() + tensor_bytes(128), 64 * MB)
    assert delta(before, after) == (1, 2, 0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LyCORIS cache:")]
    assert lines == ["LyCORIS cache: read a.safetensors (0.0 MB); 1 files, 0.0 MB of 64.0 MB",
                     "LyCORIS cache: read b.safetensors (0.0 MB); 2 files, 0.0 MB of 64.0 MB"]
    # plain safetensors files: every tensor is a view of the file's private snapshot, none is process memory
    assert after.to_json() == {"files": 2, "bytes": after.bytes, "mapped": after.bytes, "private": 0,
                               "budget": 64 * MB, "hits": after.hits, "misses": after.misses,
                               "evictions": after.evictions}
    assert after.line() == (f"LyCORIS cache: 2 files, 0.0 MB of 64.0 MB (0.0 MB mapped, 0.0 MB private); "
                            f"{after.hits} hits, {after.misses} misses, {after.evictions} evicted")


def test_concurrent_loads_keep_the_books_straight(tmp_path, monkeypatch):
    """The prompt worker and aiohttp handlers can call at once; the table and its byte count must stay consistent.
    Any exception in any worker fails the test (a race shows as KeyError or 'mutated during iteration', not only as
    a failed assertion): each worker's future holds what ended it."""
    paths = [lora_file(tmp_path, f"{i}.safetensors", seed=i) for i in range(4)]
    set_budget(monkeypatch, 2.5 * tensor_bytes())

    def worker(offset):
        for i in range(40):
            file = cache.load_cached(paths[(i + offset) % 4])
            assert up_weight(file).shape == (64, 4)
            cache.stats()

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(worker, k) for k in range(6)]
    raised = [future.exception() for future in futures]
    failures = [f"worker {k}: {type(e).__name__}: {e}" for k, e in enumerate(raised) if e is not None]
    if failures:  # every worker's exception named; the first one's traceback chained
        raise AssertionError("; ".join(failures)) from next(e for e in raised if e is not None)
    stats = cache.stats()
    assert stats.files <= 2 and stats.bytes == stats.files * tensor_bytes()


def test_info_node_shows_the_cache(sd15, loras):
    model, _clip = sd15
    name = write(loras, "info.safetensors", lora(TO_Q, 320, 320, seed=1))
    (text, _t, _coverage), ui = run_with_ui(LycorisInfo, lycoris_name=name)
    (shown,) = ui["cache"]
    assert text.splitlines()[-1] == cache.CacheStats(**shown).line() and shown["files"] == 0
    before = cache.stats()
    (text, _t, _coverage), ui = run_with_ui(LycorisInfo, lycoris_name=name, model=model)
    (shown,) = ui["cache"]
    assert shown["files"] == 1 and shown["bytes"] == 2 * 320 * 4 * 4 and shown["misses"] == before.misses + 1
    assert text.splitlines()[-1] == cache.CacheStats(**shown).line()
    assert text.splitlines()[-1].startswith("LyCORIS cache: 1 file, 0.0 MB of ")


def test_route_adds_the_cache_on_request(loras):
    name = write(loras, "route.safetensors", lora(TO_Q, 320, 320, seed=1))

    def get(query):
        response = asyncio.run(routes.info(make_mocked_request("GET", f"/lycoris/info?name={name}{query}")))
        assert response.status == 200
        return json.loads(response.text)

    assert "cache" not in get("")
    body = get("&cache=1")
    assert body["cache"] == cache.stats().to_json() and body["name"] == name


# --- a stack of nodes reads a file once --------------------------------------------------------------------------------

def test_a_stack_naming_one_file_three_times_reads_it_once(sd15, loras, reads):
    model, clip = sd15
    name = write(loras, "style.safetensors", lora(TO_Q, 320, 320, seed=1))
    (stack,) = run_block(LycorisStack, stack=f"{name} | 0.5\n{name} | 0.25 | 0\n{name} | -0.5")
    assert len(stack) == 3
    before = cache.stats()
    run_block(LycorisApplyStack, model=model, clip=clip, lora_stack=stack, strength_mode="linear")
    assert reads == ["style.safetensors"] and delta(before, cache.stats()) == (2, 1, 0)
    (stack,) = run_block(LycorisStack, stack=f"{name} | 0.7\n{name} | 0.1")  # a re-run with new strengths
    run_block(LycorisApplyStack, model=model, clip=clip, lora_stack=stack, strength_mode="linear")
    run_block(LycorisLoader, model=model, clip=clip, lycoris_name=name, strength_model=1.0, strength_clip=1.0)
    assert reads == ["style.safetensors"]

