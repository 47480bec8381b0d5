"""Attention over packed rows without a [T, T] mask: document spans equal the dense packed-causal mask (values and
gradients), and its memory grows with the documents, not with the row."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.decoder import Documents, packed_causal_mask


def packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def test_spans_follow_position_resets():
    pos = packed_positions([[3, 1, 4], [8]])
    assert Documents.from_positions(pos).spans == ((0, 0, 3), (0, 3, 4), (0, 4, 8), (1, 0, 8))
    # a row that starts mid-sequence still starts a span (as the dense mask treats it)
    assert Documents.from_positions(torch.tensor([[5, 6, 0, 1]])).spans == ((0, 0, 2), (0, 2, 4))


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("rows", [[[5, 9, 1, 17]], [[7, 25], [16, 16]]])
def test_document_attention_equals_the_dense_mask(kv_heads: int, rows: list[list[int]]):
    torch.manual_seed(0)
    args = flavour_args("debug", vocab_size=64, num_key_value_heads=kv_heads)
    model = build_model(args, seed=1)
    pos = packed_positions(rows)
    ids = torch.randint(0, 64, pos.shape)
    targets = torch.randint(0, 64, pos.shape)
    out = {}
    for name, mask in (("documents", None), ("dense", packed_causal_mask(pos))):
        model.zero_grad()
        logits = model(ids, pos, mask=mask)
        logp, _ = model(ids, pos, targets=targets, mask=mask)
        logp.sum().backward()
        out[name] = (logits, logp, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["documents"][0], out["dense"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["documents"][1], out["dense"][1], rtol=1e-5, atol=1e-5)
    for g_doc, g_dense in zip(out["documents"][2], out["dense"][2]):
        torch.testing.assert_close(g_doc, g_dense, rtol=1e-5, atol=1e-5)


def _peak_mb(code: str) -> float:
    script = (
        textwrap.dedent(
            """
        import resource, torch
        from pipelinerl_fsdp.models.decoder import Documents, document_attention
        torch.set_num_threads(1)
        T, H, D, DOCS = 16384, 2, 16, 16
        q = torch.randn(1, H, T, D); k = torch.randn(1, H, T, D); v = torch.randn(1, H, T, D)
        pos = torch.arange(T // DOCS).repeat(DOCS)[None]
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        """
        )
        + textwrap.dedent(code)
        + "\nprint((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def test_a_16k_row_of_documents_needs_no_row_squared_memory():
    # 16 documents of 1024 tokens: the per-document score matrices are 2 x 1024^2 fp32 = 8 MB each; the dense
    # path's boolean [T, T] mask alone is 256 MB and its scores 2 x 16384^2 fp32 = 2 GB
    docs = _peak_mb("document_attention(q, k, v, Documents.from_positions(pos), False)")
    assert docs < 64, f"document attention of a 16k-token row took {docs:.0f} MB extra"
