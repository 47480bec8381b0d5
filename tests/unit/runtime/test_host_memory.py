"""`host_memory`: the peak counts what the process allocates and leaves out memory-mapped file pages."""

from __future__ import annotations

import mmap
import time

import torch

from pipelinerl_fsdp.runtime.host_memory import PeakAnon, anon_bytes

MB = 1 << 20


def test_a_freed_tensor_shows_in_the_peak_not_in_the_end_state():
    with PeakAnon() as m:
        x = torch.ones(16 * MB)  # 64 MB, above glibc's largest mmap threshold: returned on free
        time.sleep(0.05)  # a sampled peak: alive long enough to be sampled whole on a loaded machine
        del x
    assert 60 * MB <= m.grown <= 72 * MB, m.grown / MB
    assert anon_bytes() - m.base < 16 * MB


def test_pages_of_a_mapped_file_are_not_the_process_memory(tmp_path):
    path = tmp_path / "file.bin"
    path.write_bytes(b"\1" * (64 * MB))
    with open(path, "rb") as f, PeakAnon() as m:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        total = sum(mapped[i] for i in range(0, len(mapped), 4096))  # touch every page
        mapped.close()
    assert total == 64 * MB // 4096
    assert m.grown < 8 * MB, m.grown / MB
