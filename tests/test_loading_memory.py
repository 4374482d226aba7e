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
