"""`benchmarks/packed_attention.py` (the GPU check's `attention` part) rehearsed on CPU: its document mix, and its
whole run with a CPU stand-in for the flash kernel (per-segment SDPA), so that the branch a GPU takes runs here."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from benchmarks import packed_attention
from pipelinerl_fsdp.models import documents


def test_the_rl_mix_fills_the_row_with_one_longest_document():
    for seed in range(5):
        lengths = packed_attention.rl_lengths(32768, 8192, seed)
        assert sum(lengths) == 32768 and max(lengths) == 8192 and min(lengths) >= 1 and len(lengths) > 8


def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
    assert tuple(window_size) == (-1, 0)
    b = cu_q.tolist()
    parts = [
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        for s, e in zip(b[:-1], b[1:])
    ]
    return torch.cat(parts)


def test_the_benchmark_runs_both_paths_and_they_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "varlen_attn", stand_in)
    out = tmp_path / "pa.json"
    argv = ["packed_attention", "--device", "cpu", "--tokens", "384", "--max-doc", "128", "--heads", "4"]
    argv += ["--kv-heads", "2", "--head-dim", "16", "--iters", "1", "--warmup", "0", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    packed_attention.main()
    data = json.loads(out.read_text())
    assert data["varlen_status"] == "ok" and data["agree"] is True and data["varlen_ms"] > 0
    assert data["loop_err"] == 0 and data["varlen_err"] < 1e-5 and data["attn_docs"] == len(data["lengths"])
    # the kernel handed k, v with their own heads (the evidence run for torch 2.11): the stand-in groups them
    assert data["varlen_native_gqa_status"] == "ok" and data["varlen_native_gqa_err"] < 1e-5
