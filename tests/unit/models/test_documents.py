"""Attention over packed documents in one kernel: the implementation each device gets, the one-kernel path's
layout (flattened rows, offsets, heads) against the per-document loop, and the model's forward with the packer's
offsets against the one that derives them from the positions.

`varlen_attn` (flash) has no CPU kernel, so the layout runs here through stand-in kernels written below: each
attends within every `cu_seqlens` segment by an explicit softmax (not SDPA, not the loop), with the keywords of one
torch release's signature. Tolerances: fp32, 1e-5 (the loop and the stand-in sum in different orders)."""

from __future__ import annotations

import functools
import inspect
import logging
import math

import pytest
import torch

from pipelinerl_fsdp.models import build_model, documents, flavour_args
from pipelinerl_fsdp.models.documents import (
    Documents,
    choose_attention,
    document_attention,
    varlen_document_attention,
)
from pipelinerl_fsdp.rl.packing import pack_row

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Causal attention within each segment of [N, H, hd] tensors; k, v have H heads or a divisor of H."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].transpose(0, 1)  # [H, n, hd]
        ks = k[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[s:e].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        out[s:e] = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
    return out


def _check(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    assert q.dim() == k.dim() == 3 and cu_q is cu_k and cu_q.dtype == torch.int32 and max_q == max_k
    lengths = cu_q[1:] - cu_q[:-1]
    assert max_q == int(lengths.max()) and int(cu_q[-1]) == q.shape[0]


def kernel_2_13(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, scale=None):
    """torch 2.12+: causal as window_size (-1, 0), fewer kv heads only with enable_gqa."""
    _check(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k)
    assert tuple(window_size) == (-1, 0)
    assert enable_gqa == (k.shape[1] != q.shape[1])
    return _segments(q, k, v, cu_seq_q)


def kernel_2_11(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    """torch 2.10/2.11: window_size, no enable_gqa (equal head counts)."""
    _check(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k)
    assert tuple(window_size) == (-1, 0) and k.shape[1] == q.shape[1]
    return _segments(q, k, v, cu_seq_q)


def kernel_2_9(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9: is_causal."""
    _check(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k)
    assert is_causal and k.shape[1] == q.shape[1]
    return _segments(q, k, v, cu_seq_q)


def projected(b: int, t: int, heads: int, kv_heads: int, hd: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v [B, H, T, hd] laid out as the projections leave them ([B, T, H, hd] memory), with gradients."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, h, hd, generator=g).transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("kernel", [kernel_2_13, kernel_2_11, kernel_2_9])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("rows", [[[5, 9, 1, 17]], [[7, 25], [16, 16]], [[32], [1, 30, 1]]])
def test_the_one_kernel_layout_equals_the_loop(kernel, kv_heads: int, rows: list[list[int]]):
    t = sum(rows[0])
    docs = Documents.from_lengths(rows)
    out = {}
    for name in ("loop", "varlen"):
        q, k, v = projected(len(rows), t, 4, kv_heads)
        if name == "loop":
            o = document_attention(q, k, v, docs, kv_heads != 4)
        else:
            o = varlen_document_attention(q, k, v, docs, kv_heads != 4, kernel=kernel)
        assert o.shape == q.shape
        g = torch.Generator().manual_seed(9)
        (o * torch.randn(o.shape, generator=g)).sum().backward()
        out[name] = (o.detach(), q.grad, k.grad, v.grad)
    for a, b in zip(out["varlen"], out["loop"]):
        torch.testing.assert_close(a, b, **TOL)


def test_the_one_kernel_path_reads_the_projections_without_a_copy():
    """q, k, v in the projections' memory order become the kernel's [B * T, H, hd] as views, and its output comes
    back as a view (the loop's `cat` and transpose copy are gone)."""
    q, k, v = projected(2, 12, 4, 4)
    seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        seen.extend(x.data_ptr() for x in (q, k, v))
        out = _segments(q, k, v, cu_q)
        seen.append(out.data_ptr())
        return out

    out = varlen_document_attention(q, k, v, Documents.from_lengths([[5, 7], [12]]), False, kernel=kernel)
    assert seen[:3] == [x.data_ptr() for x in (q, k, v)] and seen[3] == out.data_ptr()


def test_the_one_kernel_path_needs_offsets():
    q, k, v = projected(1, 4, 2, 2)
    with pytest.raises(ValueError, match="offsets"):
        varlen_document_attention(q, k, v, Documents(((0, 0, 2), (0, 2, 4))), False, kernel=kernel_2_13)


def test_each_device_gets_its_implementation(caplog):
    cuda, cpu, bf16 = torch.device("cuda", 0), torch.device("cpu"), torch.bfloat16
    h100 = {"capability": (9, 0), "varlen_available": True}
    assert choose_attention(cpu, bf16, 64, varlen_available=True) == "loop"
    assert choose_attention(cpu, torch.float32, 64, varlen_available=True) == "loop"
    assert choose_attention(cuda, bf16, 64, **h100) == "varlen"
    assert choose_attention(cuda, torch.float16, 128, **h100) == "varlen"
    assert choose_attention(cuda, torch.float32, 64, **h100) == "loop"  # flash takes half precision only
    assert choose_attention(cuda, bf16, 512, **h100) == "loop"  # past flash's head_dim limit
    assert choose_attention(cuda, bf16, 60, **h100) == "loop"
    assert choose_attention(cuda, bf16, 64, capability=(7, 5), varlen_available=True) == "loop"  # pre-Ampere
    with caplog.at_level(logging.WARNING, logger=documents.__name__):
        assert choose_attention(cuda, bf16, 64, capability=(9, 0), varlen_available=False) == "loop"
    assert "no torch.nn.attention.varlen" in caplog.text


def packed_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (6, 17, 2, 11, 9)]
    return pack_row(seqs)


def model_grads(model, row, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    mask = (torch.arange(row.targets.shape[1]) % 3 != 0)[None]
    logp, ent = model(row.input_ids, row.position_ids, targets=row.targets, logprob_positions=mask, **kw)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_forward_with_the_packers_offsets_equals_the_one_that_reads_positions(kv_heads: int, monkeypatch):
    model = build_model(flavour_args("debug", vocab_size=64, num_key_value_heads=kv_heads), seed=1)
    row = packed_batch()
    ref_logp, ref_grads = model_grads(model, row)

    def no_read(position_ids):
        raise AssertionError("the forward read the positions back although the packer gave the offsets")

    monkeypatch.setattr(Documents, "from_positions", classmethod(lambda cls, p: no_read(p)))
    logp, grads = model_grads(model, row, documents=row.documents)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # the same forward with the implementation a GPU gets (the kernel: the 2.11 stand-in): log-probs and gradients
    monkeypatch.setattr(documents, "_chosen", lambda device, dtype, head_dim: "varlen")
    monkeypatch.setattr(documents, "varlen_attn", kernel_2_11)
    logp, grads = model_grads(model, row, documents=row.documents)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


def test_cpu_attention_is_the_loop(monkeypatch):
    """On CPU the model never takes the one-kernel path (it has no CPU kernel)."""

    def fail(*args, **kwargs):
        raise AssertionError("varlen on CPU")

    monkeypatch.setattr(documents, "varlen_document_attention", fail)
    model = build_model(flavour_args("debug", vocab_size=64), seed=1)
    row = packed_batch(1)
    model(row.input_ids, row.position_ids, targets=row.targets, documents=row.documents)


def test_the_installed_varlen_attn_has_a_signature_call_varlen_adapts_to():
    """The stand-ins above carry the keywords of torch releases; the kernel this torch installs must be one of
    them as far as `call_varlen` reads it (causality, grouped kv heads), and what `call_varlen` passes it must
    bind to its real signature (7 positional arguments, then keywords it knows)."""
    installed = documents.varlen_attn
    assert installed is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    adapted = {"window_size", "is_causal", "enable_gqa"}

    def keys(kernel) -> set[str]:
        return set(inspect.signature(kernel).parameters) & adapted

    assert keys(installed) in [keys(k) for k in (kernel_2_13, kernel_2_11, kernel_2_9)], keys(installed)
    passed: list[dict[str, object]] = []

    @functools.wraps(installed)  # the installed kernel's signature, as `inspect.signature` reads it
    def spy(*args, **kw):
        passed.append(kw)
        return args[0]

    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    for gqa in (True, False):
        q, k, v = (torch.zeros(6, h, 8) for h in (4, 2 if gqa else 4, 2 if gqa else 4))
        documents.call_varlen(spy, q, k, v, cu, 4, gqa)
        inspect.signature(installed).bind(q, k, v, cu, cu, 4, 4, **passed[-1])  # a keyword it lacks: TypeError
        causal = {"window_size": (-1, 0)} if "window_size" in keys(installed) else {"is_causal": True}
        assert passed[-1] == {**causal, **({"enable_gqa": True} if gqa and "enable_gqa" in keys(installed) else {})}
