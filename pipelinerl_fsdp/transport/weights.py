"""Weight sync: trainer ranks gather FSDP2 shards with DTensor `full_tensor()`; one trainer rank broadcasts them to
every inference rank over a dedicated weight group, in buckets of whole layers.

Protocol on the weight group (source = the first trainer rank):
  header  int64[3] = (kind, version, n_buckets)   kind 1: update, 2: stop
  then, for an update, n_buckets flat buffers, each the concatenation of whole layers' parameters in
  `named_parameters()` order (identical on both sides: the same model definition).
The receiver posts the header broadcast asynchronously and polls it between decode steps, so an engine never
blocks waiting for weights; once a header has arrived it receives the buckets and hands each one to a loader.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

UPDATE, STOP = 1, 2
_LAYER = re.compile(r"^(model\.layers\.\d+)\.")


def layer_buckets(names_and_numel: list[tuple[str, int]], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of whole layers (never splitting a layer), each <= bucket_bytes
    unless a single layer is larger. Non-layer parameters (embeddings, final norm, head) form their own units."""
    units: list[list[int]] = []
    last_key = None
    for i, (name, _) in enumerate(names_and_numel):
        m = _LAYER.match(name)
        key = m.group(1) if m else name
        if key != last_key:
            units.append([])
            last_key = key
        units[-1].append(i)
    buckets: list[list[int]] = []
    size = 0
    for unit in units:
        nbytes = sum(names_and_numel[i][1] for i in unit) * element_size
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].extend(unit)
            size += nbytes
        else:
            buckets.append(list(unit))
            size = nbytes
    return buckets


@dataclass
class PushStats:
    version: int
    bytes: int
    gather_s: float
    broadcast_s: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.broadcast_s, 1e-9)


class WeightSender:
    """On every trainer rank (the gather is collective); only `src` broadcasts."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None, src: int, is_src: bool,
                 dtype: torch.dtype, device: torch.device, bucket_bytes: int = 64 * 1024**2) -> None:
        """`device`: where the broadcast buffers live (CPU for gloo, the rank's GPU for NCCL)."""
        self.params = list(model.named_parameters())
        self.group, self.src, self.is_src, self.dtype, self.device = group, src, is_src, dtype, device
        sizes = [(n, p.numel()) for n, p in self.params]
        self.buckets = layer_buckets(sizes, torch.tensor([], dtype=dtype).element_size(), bucket_bytes)
        # Persistent send buffers: a fresh multi-100-MB tensor per push cost more (allocation, page faults)
        # than the broadcast itself (measured: benchmarks/weight_sync.py).
        self._flat = [torch.empty(sum(sizes[i][1] for i in b), dtype=dtype, device=device) for b in self.buckets] \
            if is_src else []

    def _header(self, kind: int, version: int) -> None:
        if self.is_src:
            header = torch.tensor([kind, version, len(self.buckets)], dtype=torch.long, device=self.device)
            dist.broadcast(header, self.src, group=self.group)

    @torch.no_grad()
    def push(self, version: int) -> PushStats:
        """Gather and broadcast all weights tagged with `version`.

        The header goes out only once the first bucket is gathered, so engines pause for the transfer, not for
        the trainers' all-gathers of that bucket."""
        nbytes, t_gather, t_bcast = 0, 0.0, 0.0
        for b, bucket in enumerate(self.buckets):
            t0 = time.perf_counter()
            full = []
            for i in bucket:
                p = self.params[i][1]
                full.append((p.full_tensor() if isinstance(p, DTensor) else p).detach())
            t1 = time.perf_counter()
            t_gather += t1 - t0
            if b == 0:
                self._header(UPDATE, version)
            if self.is_src:
                flat, off = self._flat[b], 0
                for t in full:
                    flat[off:off + t.numel()].copy_(t.reshape(-1))
                    off += t.numel()
                dist.broadcast(flat, self.src, group=self.group)
                nbytes += flat.numel() * flat.element_size()
                t_bcast += time.perf_counter() - t1
        return PushStats(version, nbytes, t_gather, t_bcast)

    def stop(self) -> None:
        """Tell every receiver that no more updates will come."""
        self._header(STOP, -1)


# (list of (hf_name, tensor view of the received buffer)) -> None; must copy what it keeps.
Loader = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """On each inference rank. `names_and_shapes` in the sender's `named_parameters()` order."""

    def __init__(self, names_and_shapes: list[tuple[str, torch.Size]], group: dist.ProcessGroup, src: int,
                 dtype: torch.dtype, device: torch.device, bucket_bytes: int = 64 * 1024**2) -> None:
        self.names_and_shapes = names_and_shapes
        self.group, self.src, self.dtype = group, src, dtype
        sizes = [(n, int(torch.Size(s).numel())) for n, s in names_and_shapes]
        self.buckets = layer_buckets(sizes, torch.tensor([], dtype=dtype).element_size(), bucket_bytes)
        self._sizes = [sum(sizes[i][1] for i in b) for b in self.buckets]
        self.dtype = dtype
        self._buf = torch.empty(max(self._sizes), dtype=dtype, device=device)
        self._header = torch.zeros(3, dtype=torch.long, device=device)
        self._work: dist.Work | None = None
        self._bound: list[torch.Tensor] = []
        self.post()

    @torch.no_grad()
    def bind(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Receive straight into the engine's weights: each parameter becomes a view of its bucket's receive
        buffer (values kept), so a broadcast overwrites the weights in place with no copy after arrival."""
        self._bound = []
        for bucket, size in zip(self.buckets, self._sizes):
            flat = torch.empty(size, dtype=self.dtype, device=self._buf.device)
            off = 0
            for i in bucket:
                name, shape = self.names_and_shapes[i]
                p = params[name]
                if p.dtype != self.dtype or tuple(p.shape) != tuple(shape):
                    raise ValueError(f"weight sync: {name} is {p.dtype} {tuple(p.shape)}, the stream carries "
                                     f"{self.dtype} {tuple(shape)}")
                n = p.numel()
                flat[off:off + n].copy_(p.reshape(-1))
                p.data = flat[off:off + n].view(shape)
                off += n
            self._bound.append(flat)
        self._buf = torch.empty(0, dtype=self.dtype, device=self._buf.device)  # no longer needed

    def post(self) -> None:
        """Start waiting (asynchronously) for the next header."""
        self._work = dist.broadcast(self._header, self.src, group=self.group, async_op=True)

    def pending(self) -> bool:
        """True when a header has arrived (an update or a stop); never blocks."""
        assert self._work is not None
        return self._work.is_completed()

    def wait_header(self) -> tuple[int, int]:
        """Block until the next header; returns (kind, version)."""
        assert self._work is not None
        self._work.wait()
        kind, version, n = self._header.tolist()
        if kind == UPDATE and n != len(self.buckets):
            raise RuntimeError(f"weight sync: sender has {n} buckets, receiver expects {len(self.buckets)}: "
                               "trainer and engine models differ")
        return kind, version

    @torch.no_grad()
    def receive(self, load: Loader | None = None) -> tuple[int, int]:
        """After `pending()` (or to block): receive a whole update; returns (kind, version).

        Each bucket lands in the bound parameters (see `bind`) or in a scratch buffer handed to `load`.
        On an update the next header is posted again; after a stop nothing more is posted.
        """
        kind, version = self.wait_header()
        if kind == STOP:
            self._work = None
            return kind, version
        for b, (bucket, size) in enumerate(zip(self.buckets, self._sizes)):
            buf = self._bound[b] if self._bound else self._buf[:size]
            dist.broadcast(buf, self.src, group=self.group)
            if load is None:
                continue
            views, off = [], 0
            for i in bucket:
                name, shape = self.names_and_shapes[i]
                n = int(torch.Size(shape).numel())
                views.append((name, buf[off:off + n].view(shape)))
                off += n
            load(views)
        self.post()
        return kind, version

