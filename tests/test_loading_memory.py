"""Loading a file leaves its tensor pages in the page cache, not in the process: checked tensors are released.

Measured with the process's resident set (psutil), which counts the file pages this process has mapped in. Touching
every tensor afterwards brings them back, which shows the measure sees them (so the first check can fail) and that
the data read back is the file's.
"""

import psutil
import torch
from lycoris_nodes.lycoris_core import load
from safetensors.torch import save_file

MB = 1024 * 1024
MODULES, OUT, IN = 64, 1024, 1024  # 64 full diffs of 1024×1024 fp16: 128 MB


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_loading_keeps_checked_pages_out_of_the_process(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"lycoris_layer_{i}.diff": torch.randn(OUT, IN, generator=gen).half() for i in range(MODULES)}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    file_bytes = path.stat().st_size
    del tensors

    before = _rss()
    lfile = load(path)
    after_load = _rss()
    assert len(lfile.modules) == MODULES
    # every value was checked for NaN/Inf, yet the file did not stay resident
    assert after_load - before < file_bytes / 4, f"loading kept {(after_load - before) / MB:.0f} MB resident"

    checksum = sum(float(m.tensors["diff"].float().sum()) for m in lfile.modules.values())
    touched = _rss()
    assert touched - after_load > file_bytes / 2, "reading the tensors again should map the file back in"
    gen = torch.Generator().manual_seed(0)
    expected = sum(float(torch.randn(OUT, IN, generator=gen).half().float().sum()) for _ in range(MODULES))
    assert checksum == expected


def test_many_files_in_the_cache_cost_page_cache_not_process_memory(tmp_path, monkeypatch):
    """Issue #11: 50 files through the default budget grew the process by up to 492 MB, and the cache's report could
    not tell mapped pages from process memory. Both are measured here: resident set and the report's split."""
    from lycoris_nodes.nodes.glue import cache

    monkeypatch.delenv(cache.BUDGET_ENV, raising=False)
    cache.clear()
    gen = torch.Generator().manual_seed(1)
    paths = []
    for i in range(50):
        tensors = {}
        for j in range(16):
            tensors[f"lora_unet_b{j}.lora_up.weight"] = torch.randn(1024, 16, generator=gen)
            tensors[f"lora_unet_b{j}.lora_down.weight"] = torch.randn(16, 1024, generator=gen)
            tensors[f"lora_unet_b{j}.alpha"] = torch.tensor(8.0)
        paths.append(tmp_path / f"f{i}.safetensors")
        save_file(tensors, str(paths[-1]))
    total = sum(p.stat().st_size for p in paths)  # 100 MB
    before = _rss()
    for path in paths:
        cache.load_cached(path)
    grown = _rss() - before
    stats = cache.stats()
    assert stats.files == 50 and stats.mapped == stats.bytes > total * 0.99 and stats.private == 0
    assert grown < total / 4, f"50 cached files kept {grown / MB:.0f} MB of {total / MB:.0f} MB resident"
    cache.clear()
