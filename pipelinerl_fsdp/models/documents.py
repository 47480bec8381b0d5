"""Attention over packed documents: causal within each document of a packed row, never across.

Two implementations of the same thing, chosen in one place (`choose_attention`):
- the loop (`document_attention`): one SDPA call per document. The CPU path, fp32 on any device, and the
  reference the other path is tested against.
- one kernel (`varlen_document_attention`): torch's variable-length flash attention over the flattened rows with
  cumulative offsets (`cu_seqlens`), on CUDA in bf16/fp16: one launch per layer, whatever the document count.

`Documents` carries the spans for the loop (host integers) and the offsets for the kernel (a small int32 tensor on
the batch's device). The packer builds it on the host (`Documents.from_lengths`), so the training forward never
derives it from `position_ids` on the device (`Documents.from_positions`, a host sync, remains for callers without
a packer: generation prefill, scoring).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

try:  # torch >= 2.9 (prototype API; its keywords changed between releases, see `call_varlen`)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch: the loop everywhere
    varlen_attn = None

log = logging.getLogger(__name__)

AttentionImpl = Literal["varlen", "loop"]
# (q [N, Hq, hd], k, v [N, Hkv, hd], cu_seq_q, cu_seq_k, max_q, max_k, **keywords) -> [N, Hq, hd]
VarlenKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Documents:
    """The packed sequences of a batch [B, T] as (row, start, end) spans, in row-major order, tiling every row.

    Attention runs causally inside each span, so no [T, T] mask exists. `cu_seqlens` ([n + 1] int32, on the batch's
    device) are the span boundaries in the flattened [B * T] tokens and `max_len` the longest span: what a
    variable-length kernel takes. Memory grows with the sum of squared span lengths on kernels that materialise
    scores (CPU), linearly on flash / memory-efficient kernels (GPU)."""

    spans: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor | None = field(default=None, compare=False)
    max_len: int = 0

    @classmethod
    def from_lengths(cls, lengths_per_row: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Documents:
        """From the packer's document lengths per row (host integers, no device read). Every row must hold the same
        number of tokens T (the rows of one [B, T] tensor)."""
        totals = {sum(row) for row in lengths_per_row}
        if len(totals) != 1 or any(n < 1 for row in lengths_per_row for n in row):
            raise ValueError(f"document lengths must be >= 1 and fill rows of one length, got {lengths_per_row}")
        t = totals.pop()
        spans, cu = [], [0]
        for r, row in enumerate(lengths_per_row):
            start = 0
            for n in row:
                spans.append((r, start, start + n))
                start += n
                cu.append(r * t + start)
        return cls(
            tuple(spans),
            torch.tensor(cu, dtype=torch.int32, device=device),
            max(n for row in lengths_per_row for n in row),
        )

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor) -> Documents:
        """A sequence starts wherever `position_ids` is 0 (and at the start of every row), as `packed_causal_mask`.
        Reads the positions back to the host (a sync on a GPU): the reference for `from_lengths`."""
        b, t = position_ids.shape
        starts = (position_ids == 0).clone()
        starts[:, 0] = True
        rows, cols = starts.nonzero(as_tuple=True)
        rows_l, cols_l = rows.tolist(), cols.tolist()
        lengths: list[list[int]] = [[] for _ in range(b)]
        for row, start, nxt_row, nxt in zip(rows_l, cols_l, rows_l[1:] + [-1], cols_l[1:] + [t]):
            lengths[row].append((nxt if nxt_row == row else t) - start)
        return cls.from_lengths(lengths, position_ids.device)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, enable_gqa: bool
) -> torch.Tensor:
    """Causal attention within each document span of q, k, v: [B, H, T, hd], one SDPA call per document."""
    if len(docs.spans) == 1:  # one sequence per batch (generation prefill, unpacked rows)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    parts = [
        F.scaled_dot_product_attention(
            q[r : r + 1, :, s:e], k[r : r + 1, :, s:e], v[r : r + 1, :, s:e], is_causal=True, enable_gqa=enable_gqa
        )
        for r, s, e in docs.spans
    ]
    # spans are in row-major order and tile every row, so concatenating along T then splitting rows restores [B,...]
    out = torch.cat(parts, dim=2)
    b, t = q.shape[0], q.shape[2]
    return out.view(q.shape[1], b, t, q.shape[3]).transpose(0, 1) if b > 1 else out


@functools.lru_cache(maxsize=8)
def _keywords(kernel: VarlenKernel) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def call_varlen(
    kernel: VarlenKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal varlen attention on [N, H, hd] tensors through `kernel`, whichever of torch's signatures it has:
    torch 2.9 takes `is_causal`, 2.10 on `window_size=(-1, 0)` (causal) instead; `enable_gqa` exists from 2.12 on
    (docs/gpu.md). Without it, k and v are expanded to the query heads (query head i reads kv head i // group, as
    SDPA's `enable_gqa`)."""
    names = _keywords(kernel)
    kw: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
    if enable_gqa and "enable_gqa" in names:
        kw["enable_gqa"] = True
    elif enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)


def varlen_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: Documents,
    enable_gqa: bool,
    kernel: VarlenKernel | None = None,
) -> torch.Tensor:
    """The same as `document_attention` in one kernel call: q, k, v [B, H, T, hd] become [B * T, H, hd] (a view when
    their memory is [B, T, H, hd], as the projections leave it), the kernel attends within `docs.cu_seqlens`, and
    the result returns as a [B, H, T, hd] view of the kernel's [B * T, H, hd] output."""
    if docs.cu_seqlens is None:
        raise ValueError("varlen attention needs the documents' offsets (Documents.from_lengths / from_positions)")
    kernel = kernel or varlen_attn
    if kernel is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.9)")
    b, h, t, hd = q.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], hd)

    out = call_varlen(kernel, flat(q), flat(k), flat(v), docs.cu_seqlens, docs.max_len, enable_gqa)
    return out.view(b, t, h, hd).transpose(1, 2)


def choose_attention(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    varlen_available: bool | None = None,
    capability: tuple[int, int] | None = None,
) -> AttentionImpl:
    """Which implementation attends over packed documents: `varlen` (one flash kernel) on a CUDA device of compute
    capability >= 8.0 (flash attention's floor) in bf16/fp16 with head_dim <= 256 and a multiple of 8 (the flash
    kernel's limits) when torch has the varlen API; otherwise `loop` (per-document SDPA: the CPU path, fp32, older
    GPUs). A CUDA bf16 run on a torch without the API falls back to the loop with a warning (correct, slower)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim > 256 or head_dim % 8:
        return "loop"
    capability = capability or torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return "loop"
    if not (varlen_attn is not None if varlen_available is None else varlen_available):
        log.warning("torch %s has no torch.nn.attention.varlen: attention loops over documents", torch.__version__)
        return "loop"
    return "varlen"


@functools.lru_cache(maxsize=16)
def _chosen(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionImpl:
    return choose_attention(device, dtype, head_dim)


def attend_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, enable_gqa: bool
) -> torch.Tensor:
    """Causal attention within each document, q, k, v [B, H, T, hd] -> [B, H, T, hd], by `choose_attention`'s
    implementation (a single document is one SDPA call either way)."""
    if len(docs.spans) > 1 and docs.cu_seqlens is not None and _chosen(q.device, q.dtype, q.shape[-1]) == "varlen":
        return varlen_document_attention(q, k, v, docs, enable_gqa)
    return document_attention(q, k, v, docs, enable_gqa)
