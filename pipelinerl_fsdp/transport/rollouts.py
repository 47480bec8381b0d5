"""Rollout queues: finished groups travel inference rank -> first trainer rank over torch.distributed send/recv.

A message is a tensor header (tag 1) followed by two flat payloads (int64 tag 2, float32 tag 3), never pickled
objects (tensors are ~10x faster for this); the floats open with the sending engine's counters (`EngineStats`, its
fields in order). Each side runs the blocking send/recv in its own thread, the only
user of the rollout group on that rank, behind a bounded `queue.Queue`:
- the engine puts finished groups and keeps generating; `put` blocks only when the queue is full (backpressure);
- the trainer's receiver thread receives from any source (any-source recv on the header tag) into a bounded
  queue the trainer reads; the trainer waits only when it has no data.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipelinerl_fsdp.records import from_values, values
from pipelinerl_fsdp.runtime.stopping import StopRequested
from pipelinerl_fsdp.samples import EngineStats, EvalReport, Sample

HEADER_TAG, INTS_TAG, FLOATS_TAG = 1, 2, 3
DATA, DONE, EVAL = 1, 2, 3
_HEADER_LEN = 4  # kind, n_samples, n_ints, n_floats
# The engine's cumulative counters travel with every message, as the first floats of its payload.
_N_STATS = len(values(EngineStats()))


def encode_samples(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ragged samples into one int64 and one float32 tensor."""
    ints: list[int] = []
    floats: list[float] = []
    for s in samples:
        if not (len(s.completion_ids) == len(s.logprobs) == len(s.versions)):
            raise ValueError(f"sample of group {s.group_id}: completion, logprobs and versions differ in length")
        ints += [s.group_id, len(s.prompt_ids), len(s.completion_ids), int(s.finished), s.outcome]
        ints += s.prompt_ids + s.completion_ids + s.versions
        floats += [s.reward, s.advantage, s.loss_weight] + s.logprobs
    return torch.tensor(ints, dtype=torch.long), torch.tensor(floats, dtype=torch.float32)


def decode_samples(n: int, ints: torch.Tensor, floats: torch.Tensor) -> list[Sample]:
    """Inverse of encode_samples."""
    iv, fv = ints.tolist(), floats.tolist()
    out, i, f = [], 0, 0
    for _ in range(n):
        gid, lp, lc, fin, outcome = iv[i : i + 5]
        i += 5
        prompt, comp, vers = iv[i : i + lp], iv[i + lp : i + lp + lc], iv[i + lp + lc : i + lp + 2 * lc]
        i += lp + 2 * lc
        reward, adv, weight = fv[f : f + 3]
        logprobs = fv[f + 3 : f + 3 + lc]
        f += 3 + lc
        out.append(Sample(gid, prompt, comp, logprobs, vers, reward, adv, bool(fin), outcome, weight))
    if i != len(iv) or f != len(fv):
        raise RuntimeError("rollout message: payload longer than its samples (corrupt or mismatched message)")
    return out


def encode_message(
    payload: list[Sample] | EvalReport, stats: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A group (or an evaluation report) and the sender's counters (`values` of its `EngineStats`) as a message:
    (header, ints, floats)."""
    if isinstance(payload, EvalReport):
        kind, n = EVAL, len(payload.problems)
        ints = torch.tensor(
            [payload.set_index, payload.version, payload.samples, *payload.problems, *payload.correct], dtype=torch.long
        )
        floats = torch.tensor(stats, dtype=torch.float32)
    else:
        kind, n = DATA, len(payload)
        ints, floats = encode_samples(payload)
        floats = torch.cat([torch.tensor(stats, dtype=torch.float32), floats])
    header = torch.tensor([kind, n, ints.numel(), floats.numel()], dtype=torch.long)
    return header, ints, floats


def decode_message(
    kind: int, n: int, ints: torch.Tensor, floats: torch.Tensor
) -> tuple[list[Sample] | EvalReport, EngineStats]:
    """Inverse of encode_message, from the header's kind and count and the two payloads."""
    stats = from_values(EngineStats(), floats[:_N_STATS].tolist())
    if kind == EVAL:
        iv = ints.tolist()
        return EvalReport(iv[0], iv[1], iv[2], iv[3 : 3 + n], iv[3 + n :]), stats
    return decode_samples(n, ints, floats[_N_STATS:]), stats


def scatter_samples(
    parts: Sequence[Sequence[Sample]] | None, group: dist.ProcessGroup | None, src: int, me: int, stop: int = 0
) -> list[Sample]:
    """Each rank of `group` gets its own list of samples from rank `src` (group ranks), which holds `parts` (one
    list per rank): a header and two flat tensors per rank, point to point, so no rank receives what it does not
    train on and nothing is pickled. `stop` (a signal number, given on `src` in place of `parts`): every rank,
    `src` included, raises `StopRequested(stop)` instead, so that all stop at the same step."""
    if me == src:
        pending = []
        for r in range(len(parts) if parts is not None else dist.get_world_size(group)):
            if r == src:
                continue
            if stop:
                tensors = [torch.tensor([-1, stop, 0], dtype=torch.long)]
            else:
                assert parts is not None
                ints, floats = encode_samples(parts[r])
                tensors = [torch.tensor([len(parts[r]), ints.numel(), floats.numel()], dtype=torch.long), ints, floats]
            for t in tensors:  # the tensors stay referenced until their sends complete
                pending.append((t, dist.isend(t, group=group, group_dst=r)))
        for _, work in pending:
            work.wait()
        if stop:
            raise StopRequested(stop)
        assert parts is not None
        return list(parts[src])
    header = torch.empty(3, dtype=torch.long)
    dist.recv(header, group=group, group_src=src)
    n, n_ints, n_floats = header.tolist()
    if n < 0:
        raise StopRequested(n_ints)
    ints, floats = torch.empty(n_ints, dtype=torch.long), torch.empty(n_floats, dtype=torch.float32)
    dist.recv(ints, group=group, group_src=src)
    dist.recv(floats, group=group, group_src=src)
    return decode_samples(n, ints, floats)


class RolloutSender:
    """Inference side: a thread sends queued groups to `dst`; `put` applies backpressure when full."""

    def __init__(self, group: dist.ProcessGroup, dst: int, max_queued: int = 8) -> None:
        self.group, self.dst = group, dst
        self._q: queue.Queue[tuple[list[Sample] | EvalReport, list[float]] | None] = queue.Queue(maxsize=max_queued)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-sender", daemon=True)
        self._thread.start()

    def put(self, samples: list[Sample] | EvalReport, stats: EngineStats, timeout: float | None = None) -> bool:
        """Queue a group (or an evaluation report) with the engine's counters as they are now (copied) for sending;
        False if the queue stayed full for `timeout` seconds."""
        self._raise_if_failed()
        try:
            self._q.put((samples, values(stats)), timeout=timeout)
            return True
        except queue.Full:
            return False

    def qsize(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        """Send everything queued, then a DONE message; joins the thread."""
        self._q.put(None)
        self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError("rollout sender thread failed") from self.error

    def _run(self) -> None:
        try:
            while True:
                item = self._q.get()
                if item is None:
                    dist.send(
                        torch.tensor([DONE, 0, 0, 0], dtype=torch.long), self.dst, group=self.group, tag=HEADER_TAG
                    )
                    return
                header, ints, floats = encode_message(*item)
                dist.send(header, self.dst, group=self.group, tag=HEADER_TAG)
                dist.send(ints, self.dst, group=self.group, tag=INTS_TAG)
                dist.send(floats, self.dst, group=self.group, tag=FLOATS_TAG)
        except BaseException as e:  # surfaced to the engine loop on its next put/close
            self.error = e


class RolloutReceiver:
    """Trainer side (first trainer rank): a thread receives groups from any of `n_senders` until all said DONE."""

    def __init__(self, group: dist.ProcessGroup, n_senders: int, max_queued: int = 64) -> None:
        self.group, self.n_senders = group, n_senders
        self._q: queue.Queue[tuple[int, list[Sample] | EvalReport, EngineStats]] = queue.Queue(maxsize=max_queued)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-receiver", daemon=True)
        self._thread.start()

    def get(self, timeout: float) -> tuple[int, list[Sample] | EvalReport, EngineStats] | None:
        """(sender rank, a group's samples or an evaluation report, engine counters), or None if nothing arrived
        within `timeout` s."""
        if self.error is not None:
            raise RuntimeError("rollout receiver thread failed") from self.error
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None

    def qsize(self) -> int:
        return self._q.qsize()

    def finished(self) -> bool:
        """Every sender has said DONE and everything received has been taken."""
        return self.done.is_set() and self._q.empty()

    def drain(self) -> None:
        """After the trainer's last step: consume until every inference rank has said DONE (they may be blocked
        sending), then join the thread."""
        while not self.finished():
            self.get(timeout=0.2)
        self.join()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            remaining = self.n_senders
            header = torch.zeros(_HEADER_LEN, dtype=torch.long)
            while remaining:
                src = dist.recv(header, None, group=self.group, tag=HEADER_TAG)
                kind, n, n_ints, n_floats = header.tolist()
                if kind == DONE:
                    remaining -= 1
                    continue
                ints = torch.empty(n_ints, dtype=torch.long)
                floats = torch.empty(n_floats, dtype=torch.float32)
                dist.recv(ints, src, group=self.group, tag=INTS_TAG)
                dist.recv(floats, src, group=self.group, tag=FLOATS_TAG)
                payload, stats = decode_message(kind, n, ints, floats)
                self._q.put((src, payload, stats))
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()
