"""Weight sync: trainer ranks gather FSDP2 shards with DTensor `full_tensor()`; one trainer rank broadcasts them to
every inference rank over a dedicated weight group, in buckets of whole layers.

Protocol on the weight group (source = the first trainer rank):
  header  int64[3] = (kind, version, n_buckets)   kind 1: update, 2: stop
  then, for an update, n_buckets flat buffers, each the concatenation of whole layers' parameters in
  `named_parameters()` order (identical on both sides: the same model definition).
The receiver posts the header broadcast asynchronously and polls it between decode steps, so an engine never
blocks waiting for weights; once a header has arrived it receives the buckets and hands each one to a loader.

With vLLM engines the buckets travel on a second group (`bucket_group`, built on the job's TCPStore, see
`transport/store_group.py`) whose members are the first trainer rank (rank 0 there) and the vLLM workers
themselves, so the weights land in the worker that loads them, with no hop through the inference rank's process.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from pipelinerl_fsdp.runtime import stopping
from pipelinerl_fsdp.transport.device_waits import Check, Stopwatch, free_for_reuse, wait_on_host
from pipelinerl_fsdp.transport.stalls import stall_check
from pipelinerl_fsdp.transport.store_group import StoreGroup

UPDATE, STOP = 1, 2
# send buffers per sender (and receive buffers per vLLM worker): one bucket in flight while the next is gathered
IN_FLIGHT = 2
_LAYER = re.compile(r"^(model\.layers\.\d+)\.")
# torch 2.13 renamed all_gather_into_tensor (which now warns on every call); older torch has only the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def in_decoder_layer(name: str) -> bool:
    """Whether parameter `name` belongs to a decoder layer (`model.layers.N.`): buckets never split those."""
    return _LAYER.match(name) is not None


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


def slot_sizes(sizes: list[int], used: list[bool] | None = None) -> list[int]:
    """Elements of each of the IN_FLIGHT buffers that bucket `b` (of `sizes[b]` elements) reuses as slot
    `b % IN_FLIGHT`: the largest bucket landing there (`used[b]` false: that bucket needs no buffer). Sized per
    slot, not all at the largest bucket, so one big unit (a 150k-row embedding) is held once, not twice."""
    n = min(IN_FLIGHT, len(sizes))
    return [
        max((size for b, size in enumerate(sizes) if b % n == slot and (used is None or used[b])), default=0)
        for slot in range(n)
    ]


class BucketLayout:
    """Which parameters travel in which flat bucket, and their views into a received bucket."""

    def __init__(self, names_and_shapes: list[tuple[str, torch.Size]], dtype: torch.dtype, bucket_bytes: int) -> None:
        self.names_and_shapes = [(n, torch.Size(s)) for n, s in names_and_shapes]
        self.dtype = dtype
        sizes = [(n, int(s.numel())) for n, s in self.names_and_shapes]
        self.buckets = layer_buckets(sizes, torch.tensor([], dtype=dtype).element_size(), bucket_bytes)
        self.sizes = [sum(sizes[i][1] for i in b) for b in self.buckets]

    def views(self, b: int, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every parameter of bucket `b` inside its flat buffer."""
        out, off = [], 0
        for i in self.buckets[b]:
            name, shape = self.names_and_shapes[i]
            n = int(shape.numel())
            out.append((name, flat[off : off + n].view(shape)))
            off += n
        return out


def broadcast_bucket(
    flat: torch.Tensor, group: dist.ProcessGroup | StoreGroup | None, src: int, raw: bool, wait: bool = True
) -> Any:
    """Broadcast one bucket; `raw`: `group` is a `store_group.StoreGroup` outside the default world (source = its
    rank 0). With `wait=False` returns the pending work (the buffer must not change until it completes)."""
    if raw:
        assert group is not None
        work = group.broadcast(flat)
    else:
        work = dist.broadcast(flat, src, group=group, async_op=True)
    if wait:
        work.wait()
        return None
    return work


@dataclass
class PushStats:
    version: int
    bytes: int
    gather_s: float
    broadcast_s: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.broadcast_s, 1e-9)


@dataclass
class _Pending:
    """A push whose buckets are posted but maybe not yet received."""

    version: int
    nbytes: int
    t_gather: float
    t_gather_first: float
    t_header: float
    works: list[Any]  # dist.Work, or a store group's work
    buckets: list[int]  # the bucket each work carries
    ends: list[float] = field(default_factory=list)  # perf_counter() at each work's completion (CPU)
    gathers: Stopwatch | None = None


class WeightSender:
    """On every trainer rank (the gather is collective); only `src` broadcasts."""

    def __init__(
        self,
        model: torch.nn.Module,
        group: dist.ProcessGroup | None,
        src: int,
        is_src: bool,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int = 64 * 1024**2,
        bucket_group: StoreGroup | None = None,
        timeout_s: float = 600,
        stall_s: float | None = None,
        params: list[tuple[str, torch.nn.Parameter]] | None = None,
    ) -> None:
        """`params`: the (name, parameter) pairs pushed in the receivers' order (None: `model.named_parameters()`).
        `device`: where the broadcast buffers live (CPU for gloo, the rank's GPU for NCCL).
        `bucket_group`: a store-built group for the buckets (vLLM workers); None: the buckets follow the header.
        `timeout_s`: how long a push may take to complete before the job fails, naming it; `stall_s`: sooner,
        naming the engines left behind (`transport/stalls.py`; None: never)."""
        self.params = list(model.named_parameters()) if params is None else list(params)
        self.timeout_s, self.stall_s = timeout_s, stall_s
        self.group, self.src, self.is_src, self.dtype, self.device = group, src, is_src, dtype, device
        self.bucket_group = bucket_group
        sizes = [(n, p.numel()) for n, p in self.params]
        self.buckets = layer_buckets(sizes, torch.tensor([], dtype=dtype).element_size(), bucket_bytes)
        # Streaming: IN_FLIGHT send buffers of the largest bucket's size, reused round robin; a bucket is gathered
        # (already cast to the engine dtype) while the previous one is still being broadcast. Persistent, because
        # a fresh multi-100-MB tensor per push cost more (allocation, page faults) than the broadcast itself
        # (measured: benchmarks/weight_sync.py); bounded, so that no rank ever holds a copy of the whole model.
        self.sizes = [sum(sizes[i][1] for i in b) for b in self.buckets]
        self._direct = [self._as_is(b) is not None for b in self.buckets]
        self._flat = (
            [torch.empty(n, dtype=dtype, device=device) for n in slot_sizes(self.sizes, [not d for d in self._direct])]
            if is_src
            else []
        )
        self._pending: _Pending | None = None

    def _header(self, kind: int, version: int) -> None:
        if self.is_src:
            # on CPU whatever the buckets' device: the weight group's gloo part carries it, which engines poll
            header = torch.tensor([kind, version, len(self.buckets)], dtype=torch.long)
            dist.broadcast(header, self.src, group=self.group)

    @torch.no_grad()
    def push(self, version: int, wait: bool = True) -> PushStats | None:
        """Gather and broadcast all weights tagged with `version`; with `wait` false, return once every bucket is
        posted (the engines receive them while the trainer goes on) and call `finish` before the parameters change.

        Each bucket's shards are cast to the engine dtype before the all-gather (half the bytes for bf16), gathered
        into a send buffer and broadcast asynchronously, so the next bucket's gather overlaps this broadcast; at
        most IN_FLIGHT buckets are in flight. The header goes out only once the first bucket is gathered, so
        engines pause for the transfer, not for the trainers' all-gathers of that bucket.
        When the job is stopping (stopping.py) the source sends nothing more, but keeps gathering in step with
        the other trainer ranks, and returns None: the engines are gone or going."""
        self.finish()  # the previous push's buffers are reused below
        nbytes, t_gather, t_gather_first = 0, 0.0, 0.0
        gathers = Stopwatch(self.params[0][1].device if self.params else self.device)
        t_header = time.perf_counter()
        works: list[tuple[Any, int] | None] = [None] * len(self._flat)  # per slot: (work, bucket) in flight
        group, raw = (self.bucket_group, True) if self.bucket_group is not None else (self.group, False)
        sending = self.is_src and stopping.requested() is None
        direct: list[tuple[Any, int]] = []  # buckets sent from the parameter itself
        for b, bucket in enumerate(self.buckets):
            slot = b % max(len(self._flat), 1)
            t0 = time.perf_counter()
            flat = self._as_is(bucket) if sending and self._direct[b] else None
            if flat is None:
                try:
                    if sending and works[slot] is not None:  # its bucket read: on GPU ordered on the device, so
                        w, held = works[slot]  # the host never stalls here (it did on all but IN_FLIGHT buckets)
                        free_for_reuse(
                            w, self.device, self._what(version, held), self.timeout_s, self._stall(version, held)
                        )
                except RuntimeError:
                    if not stopping.explains_failure():
                        raise
                    sending = False
                flat = self._flat[slot][: self.sizes[b]] if sending else None
                t0 = time.perf_counter()
                off = 0
                with gathers:
                    for i in bucket:
                        p = self.params[i][1]
                        out = flat[off : off + p.numel()].view(p.shape) if flat is not None else None
                        self._gather_into(p, out)
                        off += p.numel()
            t_gather += time.perf_counter() - t0
            if b == 0:
                t_gather_first, t_header = t_gather, time.perf_counter()  # the engines' pause starts here
            if not sending:
                continue
            try:
                if b == 0:
                    self._header(UPDATE, version)
                    t_header = time.perf_counter()
                work = broadcast_bucket(flat, group, self.src, raw=raw, wait=False)
                if self._direct[b]:
                    direct.append((work, b))
                else:
                    works[slot] = (work, b)
                nbytes += flat.numel() * flat.element_size()
            except RuntimeError:
                if not stopping.explains_failure():
                    raise
                sending = False
        if self.is_src and not sending:
            return None
        in_flight = [w for w in works if w is not None] + direct
        pending = _Pending(
            version, nbytes, t_gather, t_gather_first, t_header, [w for w, _ in in_flight], [b for _, b in in_flight]
        )
        pending.gathers = gathers
        if self.device.type == "cpu":  # when each transfer ends, even while the trainer is busy elsewhere
            for w in pending.works:
                w.get_future().add_done_callback(lambda _: pending.ends.append(time.perf_counter()))
        self._pending = pending
        return self.finish() if wait else None

    def finish(self) -> PushStats | None:
        """Wait until the last push has left this rank (every bucket received); its statistics, or None when there
        is none pending or the job is stopping. Its send buffers, and the parameters sent as they are, are free
        again."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        try:
            for b, w in sorted(zip(p.buckets, p.works), key=lambda bw: bw[0]):  # the earliest bucket first
                wait_on_host(w, self.device, self._what(p.version, b), self.timeout_s, check=self._stall(p.version, b))
        except RuntimeError:
            if stopping.explains_failure():
                return None
            raise
        # broadcast time: from the header to the last bucket's arrival, less the gathers done meanwhile. On GPU
        # the transfers are only known complete when the host sees them so (here), and the gathers' time comes
        # from CUDA events: a host clock around an NCCL call times its launch.
        t_end = max(p.ends) if p.ends and len(p.ends) == len(p.works) else time.perf_counter()
        t_gather = p.gathers.seconds() if p.gathers is not None and p.gathers.on_device else p.t_gather
        t_bcast = t_end - p.t_header - (p.t_gather - p.t_gather_first)
        return PushStats(p.version, p.nbytes, t_gather, max(t_bcast, 0.0))

    def _what(self, version: int, bucket: int) -> str:
        return f"the weight push of version {version} (bucket {bucket} of {len(self.buckets)})"

    def _stall(self, version: int, bucket: int) -> Check | None:
        """The check of a wait for `bucket`: the engines left behind, named after `stall_s` (`stalls.stall_check`)."""
        group = self.bucket_group if self.is_src else None
        return stall_check(group, self.stall_s, version, self._what(version, bucket))

    def _as_is(self, bucket: list[int]) -> torch.Tensor | None:
        """A bucket of one parameter that this rank holds whole, contiguous and in the engine dtype (a 1-rank
        trainer in fp32: the embeddings, the head) is broadcast from the parameter itself, with no copy; the
        parameters do not change until the push is finished (`finish`). None: gather it into a send buffer."""
        if len(bucket) != 1:
            return None
        p = self.params[bucket[0]][1].detach()
        if isinstance(p, DTensor):
            if p.device_mesh.size() != 1:
                return None
            p = p.to_local()
        if p.dtype != self.dtype or not p.is_contiguous() or p.device != self.device:
            return None
        return p.view(-1)

    def _gather_into(self, p: torch.Tensor, out: torch.Tensor | None) -> None:
        """Gather parameter `p` in the engine dtype (cast on the local shard, before the all-gather) into `out` (a
        view of the send buffer on the source; None elsewhere: a scratch tensor).

        An evenly dim-0-sharded DTensor is all-gathered straight into `out`, so the source copies each byte once
        (a `full_tensor()` and then a copy into the send buffer cost a second pass over the model, which on CPU
        showed up in the engines' pause: benchmarks/weight_sync.py). Other layouts go through `full_tensor()`."""
        if out is None:
            out = torch.empty(p.shape, dtype=self.dtype, device=p.device)
        if isinstance(p, DTensor):
            mesh, local = p.device_mesh, p.to_local()
            even = (
                mesh.ndim == 1
                and p.placements == (Shard(0),)
                and p.shape[0] % mesh.size() == 0
                and local.shape[0] == p.shape[0] // mesh.size()
            )
            if mesh.size() == 1:
                out.copy_(local.detach().view(p.shape))  # gloo's all-gather copies ~10x slower than a memcpy
            elif even and out.device == local.device:
                _all_gather(out, local.detach().to(self.dtype).contiguous(), group=mesh.get_group())
            elif even:  # GPU shards, CPU buffer (engines on CPU beside GPU trainers): gather there, then copy
                full = torch.empty(p.shape, dtype=self.dtype, device=local.device)
                _all_gather(full, local.detach().to(self.dtype).contiguous(), group=mesh.get_group())
                out.copy_(full)
            else:
                out.copy_(p.detach().to(self.dtype).full_tensor())
        else:
            out.copy_(p.detach())

    def stop(self) -> None:
        """Tell every receiver that no more updates will come."""
        self.finish()
        self._header(STOP, -1)


# (list of (hf_name, tensor view of the received buffer)) -> None; must copy what it keeps.
Loader = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """On each inference rank. `names_and_shapes` in the sender's `named_parameters()` order."""

    def __init__(
        self,
        names_and_shapes: list[tuple[str, torch.Size]],
        group: dist.ProcessGroup,
        src: int,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int = 64 * 1024**2,
        timeout_s: float = 600,
    ) -> None:
        """`device`: where the buckets land (the engine's device); `timeout_s`: how long an update's buckets may
        take once its header has arrived."""
        self.layout = BucketLayout(names_and_shapes, dtype, bucket_bytes)
        self.group, self.src, self.dtype, self.device = group, src, dtype, device
        self.timeout_s = timeout_s
        self._buf: torch.Tensor | None = None  # scratch bucket for `receive(load)`, made on first use
        self._header = torch.zeros(3, dtype=torch.long)  # CPU: the weight group's gloo part, polled between steps
        self._work: dist.Work | None = None
        self._bound: list[torch.Tensor] = []
        self.post()

    @torch.no_grad()
    def bind(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Receive straight into the engine's weights: each parameter becomes a view of its bucket's receive
        buffer (values kept), so a broadcast overwrites the weights in place with no copy after arrival."""
        self._bound = []
        for b, size in enumerate(self.layout.sizes):
            flat = torch.empty(size, dtype=self.dtype, device=self.device)
            for name, view in self.layout.views(b, flat):
                p = params[name]
                if p.dtype != self.dtype or p.shape != view.shape:
                    raise ValueError(
                        f"weight sync: {name} is {p.dtype} {tuple(p.shape)}, the stream carries "
                        f"{self.dtype} {tuple(view.shape)}"
                    )
                view.copy_(p)
                p.data = view
            self._bound.append(flat)

    def post(self) -> None:
        """Start waiting (asynchronously) for the next header."""
        self._work = dist.broadcast(self._header, self.src, group=self.group, async_op=True)

    def pending(self) -> bool:
        """True when a header has arrived (an update or a stop); never blocks."""
        assert self._work is not None
        return self._work.is_completed()

    def wait_header(self) -> tuple[int, int]:
        """Block until the next header; returns (kind, version). Call `post()` after taking an update."""
        assert self._work is not None, "no header posted (after a stop, nothing more comes)"
        self._work.wait()
        self._work = None
        kind, version, n = self._header.tolist()
        if kind == UPDATE and n != len(self.layout.buckets):
            raise RuntimeError(
                f"weight sync: sender has {n} buckets, receiver expects {len(self.layout.buckets)}: "
                "trainer and engine models differ"
            )
        return kind, version

    @torch.no_grad()
    def receive(self, load: Loader | None = None, staged: bool = False) -> tuple[int, int]:
        """After `pending()` (or to block): receive a whole update (see `receive_buckets`); returns (kind, version).
        After a stop nothing more is posted."""
        kind, version = self.wait_header()
        if kind == UPDATE:
            self.receive_buckets(load, staged)
            self.post()
        return kind, version

    @torch.no_grad()
    def receive_buckets(self, load: Loader | None = None, staged: bool = False) -> None:
        """After an update header: receive its buckets (then `post()` to wait for the next header).

        Each bucket lands in the bound parameters (see `bind`) or, with `staged` or when unbound, in a scratch
        buffer handed to `load`."""
        if self._bound and not staged and load is None:
            # every bucket has its own place: post them all, so no bucket waits for the previous one's wake-up
            works = [broadcast_bucket(buf, self.group, self.src, raw=False, wait=False) for buf in self._bound]
            for w in works:
                wait_on_host(w, self.device, "an update's weight buckets", self.timeout_s)
            return
        for b, size in enumerate(self.layout.sizes):
            if self._bound and not staged:
                buf = self._bound[b]
            else:
                if self._buf is None:
                    self._buf = torch.empty(max(self.layout.sizes), dtype=self.dtype, device=self.device)
                buf = self._buf[:size]
            work = broadcast_bucket(buf, self.group, self.src, raw=False, wait=False)
            wait_on_host(work, self.device, "an update's weight buckets", self.timeout_s)
            if load is not None:
                load(self.layout.views(b, buf))
