"""The weight push's GPU risks, decided on CPU with fake groups: the send buffers in flight (the gather of the next
bucket overlaps the send of this one, on the device where the transfer can order the stream), a stalled bucket
naming the engines that never asked for it, and vLLM's NCCL communicator disabling itself."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from pipelinerl_fsdp.transport import device_waits, store_group
from pipelinerl_fsdp.transport.stalls import STALL_S, late_members, push_stall_s
from pipelinerl_fsdp.transport.store_group import StoreGroup
from pipelinerl_fsdp.transport.weights import IN_FLIGHT, WeightSender


class Model(torch.nn.Module):
    """An embedding (a bucket of one parameter, sent from the parameter itself) and four layers of two tensors."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Parameter(torch.randn(8, 4, generator=g))
        self.model.layers = torch.nn.ModuleList()
        for _ in range(4):
            layer = torch.nn.Module()
            layer.w = torch.nn.Parameter(torch.randn(4, 4, generator=g))
            layer.b = torch.nn.Parameter(torch.randn(4, generator=g))
            self.model.layers.append(layer)


class FakeWork:
    """A transfer in flight: it reads its buffer until it is released (waited for, or ordered after on the device),
    so a buffer overwritten before its release shows up as wrong content."""

    def __init__(self, group: FakeGroup, flat: torch.Tensor, bucket: int, completes: bool) -> None:
        self.group, self.flat, self.bucket, self.completes = group, flat, bucket, completes
        self.polls = 0  # `is_completed` calls so far: the transfer completes at the group's `completes_after`-th

    def _release(self, how: str) -> None:
        self.group.log.append((how, self.bucket))
        self.group.sent.setdefault(self.bucket, self.flat.clone())

    def wait(self) -> bool:
        while self.completes and not self.is_completed():  # gloo's wait blocks until the data has arrived
            pass
        self._release("wait")
        return True

    def is_completed(self) -> bool:
        self.polls += 1
        return self.completes and self.polls >= self.group.completes_after

    def get_future(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(add_done_callback=lambda fn: fn(None))


class OrderedWork(FakeWork):
    """A transfer on a CUDA stream of its own (`EventWork`): it can order the caller's stream after itself."""

    def order_after(self) -> None:
        self._release("order")


class FakeGroup(StoreGroup):
    """The bucket group's source end, its members' marks in a dict store."""

    def __init__(self, size: int = 3, ordered: bool = True, completes: bool = True, completes_after: int = 1) -> None:
        self.marks: dict[str, bytes] = {}
        store = types.SimpleNamespace(
            set=lambda k, v: self.marks.__setitem__(k, v.encode()),
            get=lambda k: self.marks[k],
            check=lambda keys: all(k in self.marks for k in keys),
        )
        super().__init__("vllm_weights", 0, size, torch.device("cpu"), 5.0, store)
        self.ordered, self.completes, self.completes_after = ordered, completes, completes_after
        self.works: list[FakeWork] = []
        self.log: list[tuple[str, int]] = []
        self.sent: dict[int, torch.Tensor] = {}
        self.ptrs: list[int] = []

    def broadcast(self, flat: torch.Tensor) -> FakeWork:
        b = sum(1 for how, _ in self.log if how == "send")
        self.log.append(("send", b))
        self.ptrs.append(flat.data_ptr())
        self.works.append((OrderedWork if self.ordered else FakeWork)(self, flat, b, self.completes))
        return self.works[-1]

    def mark(self, member: int, version: int, bucket: int, who: str) -> None:
        self.marks[f"{store_group.POSTED_KEY}{member}"] = f"{version} {bucket} {who}".encode()


def sender(group: FakeGroup, monkeypatch: pytest.MonkeyPatch, **kw) -> tuple[WeightSender, Model]:
    model = Model()
    monkeypatch.setattr(WeightSender, "_header", lambda self, kind, version: None)  # the gloo header: not here
    bucket_bytes = (16 + 4) * 4  # a layer a bucket
    s = WeightSender(model, None, 0, True, torch.float32, torch.device("cpu"), bucket_bytes, group, **kw)
    return s, model


@pytest.mark.parametrize("ordered", [True, False])
def test_buckets_keep_their_order_and_content_with_at_most_in_flight_buffers(monkeypatch, ordered):
    group = FakeGroup(ordered=ordered)
    s, model = sender(group, monkeypatch)
    assert len(s.buckets) == 5 and s._direct == [True, False, False, False, False]
    stats = s.push(7)
    assert stats is not None and stats.bytes == sum(p.numel() * 4 for p in model.parameters())
    # what each transfer read, in order, is the model's parameters in order: no buffer was overwritten early
    got = torch.cat([group.sent[b] for b in range(len(s.buckets))])
    torch.testing.assert_close(got, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    buffered = [b for b in range(len(s.buckets)) if not s._direct[b]]
    assert len({group.ptrs[b] for b in buffered}) <= IN_FLIGHT
    released: set[int] = set()
    for how, b in group.log:  # never more than IN_FLIGHT send buffers in flight
        if how == "send":
            assert len([x for x in buffered if x < b and x not in released]) < IN_FLIGHT or b not in buffered
        else:
            released.add(b)


def test_a_stream_ordered_transfer_never_blocks_the_host_during_the_push(monkeypatch):
    # the embedding, then 4 buckets of one layer in 2 buffers: the 4th and 5th reuse one
    group = FakeGroup(ordered=True)
    s, model = sender(group, monkeypatch)
    s.push(3, wait=False)
    # in the push, buffers are handed back on the device only, each before its next bucket is gathered
    assert [e for e in group.log if e[0] != "send"] == [("order", 1), ("order", 2)]
    assert group.log.index(("order", 1)) < group.log.index(("send", 3))
    s.finish()  # the host waits here, for what is still in flight
    assert sorted(b for how, b in group.log if how == "wait") == [0, 3, 4]
    torch.testing.assert_close(
        torch.cat([group.sent[b] for b in range(5)]), torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    )


def test_late_members_are_those_behind_the_furthest_member_in_this_update():
    a, b = "inference rank 2, vLLM worker 0", "inference rank 3, vLLM worker 0"
    late = (
        "inference rank 3, vLLM worker 0 (member 2, at bucket 30 of version 3; the furthest engine has posted bucket 2)"
    )
    assert late_members({1: (4, 2, a), 2: (3, 30, b)}, 4) == [late]
    assert late_members({1: (4, 2, a), 2: (4, 5, b)}, 4) == [
        f"{a} (member 1, at bucket 2 of version 4; the furthest engine has posted bucket 5)"
    ]
    assert late_members({1: (4, 2, a), 2: (4, 2, b)}, 4) == []  # together: the trainer's side, or the link
    assert late_members({1: (3, 9, a), 2: (3, 9, b)}, 4) == []  # nobody has reached it: nothing to compare with


def test_marks_travel_through_the_store():
    store = torch.distributed.HashStore()
    StoreGroup("g", 2, 3, torch.device("cpu"), 5, store)  # marks (-1, -1) when it joins
    member = StoreGroup("g", 1, 3, torch.device("cpu"), 5, store, who="inference rank 4, vLLM worker 1")
    member.mark_posted(3, 2)
    source = StoreGroup("g", 0, 3, torch.device("cpu"), 5, store)
    assert source.posted() == {1: (3, 2, "inference rank 4, vLLM worker 1"), 2: (-1, -1, "member 2 of group 'g'")}
    assert StoreGroup("g", 0, 4, torch.device("cpu"), 5, store).posted()[3] == (-1, -1, "member 3 of group 'g'")


@pytest.mark.parametrize("ordered", [True, False])
def test_an_engine_that_never_asks_fails_the_push_fast_and_named(monkeypatch, ordered):
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.01)
    group = FakeGroup(ordered=ordered, completes=False)
    group.mark(1, 7, 0, "inference rank 2, vLLM worker 0")  # took the update, waits paused
    group.mark(2, 6, 4, "inference rank 3, vLLM worker 0")  # never asked for version 7
    s, _ = sender(group, monkeypatch, timeout_s=30, stall_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"version 7 \(bucket \d of 5\).*inference rank 3, vLLM worker 0 \(member 2"):
        s.push(7)
    assert time.monotonic() - t0 < 5  # the stall limit, not world.timeout_s


def test_a_gpu_wait_on_a_stream_transfer_runs_the_stall_check(monkeypatch):
    # `EventWork.wait()` polls to its deadline without the check: the wait polls the transfer itself, then orders
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.0)
    ordered = []
    work = types.SimpleNamespace(is_completed=lambda: False, order_after=lambda: ordered.append(1), wait=None)

    def check(waited_s: float) -> None:
        raise TimeoutError("engine X is behind")

    with pytest.raises(TimeoutError, match="engine X is behind"):
        device_waits.wait_on_host(work, torch.device("cuda", 0), "bucket 0", 5, check=check)
    done = types.SimpleNamespace(is_completed=lambda: True, order_after=lambda: ordered.append(2), wait=None)
    device_waits.wait_on_host(done, torch.device("cuda", 0), "bucket 0", 5, check=check)
    assert ordered == [2]


def test_with_no_engine_ahead_the_push_waits_for_the_timeout(monkeypatch):
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.01)
    group = FakeGroup(completes=False)
    group.mark(1, 6, 4, "inference rank 2, vLLM worker 0")  # neither has reached version 7
    s, _ = sender(group, monkeypatch, timeout_s=0.2, stall_s=0.02)
    with pytest.raises(TimeoutError, match=r"the weight push of version 7 \(bucket 0 of 5\): not complete after"):
        s.push(7)


@pytest.mark.parametrize("stall_s", [None, 30.0])
def test_without_a_stall_limit_or_within_it_an_engine_behind_is_waited_for(monkeypatch, stall_s):
    """Engine 2 has not asked for version 7 yet and its buckets complete only after 20 polls: without a stall limit
    (async mode: gloo's blocking wait) or before the limit (the wait polls, asking the stall check every time) the
    push waits for every bucket to complete, and returns what each transfer read."""
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.0)
    group = FakeGroup(ordered=False, completes_after=20)
    group.mark(1, 7, 0, "inference rank 2, vLLM worker 0")
    group.mark(2, 6, 4, "inference rank 3, vLLM worker 0")
    s, model = sender(group, monkeypatch, timeout_s=30, stall_s=stall_s)
    assert s.push(7) is not None
    assert len(group.works) == len(s.buckets) and all(w.polls >= 20 for w in group.works), [
        w.polls for w in group.works
    ]
    torch.testing.assert_close(
        torch.cat([group.sent[b] for b in range(5)]), torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    )


class NcclWork:
    """A torch NCCL work: `wait()` only orders the caller's CUDA stream after the transfer and returns at once; the
    transfer completes at the `completes_after`-th `is_completed()`. No `order_after`: not a store group's work."""

    def __init__(self, completes_after: int) -> None:
        self.completes_after, self.log = completes_after, []

    def wait(self) -> bool:
        self.log.append("wait")
        return True

    def is_completed(self) -> bool:
        self.log.append("poll")
        return self.log.count("poll") >= self.completes_after


def test_a_gpu_wait_on_an_nccl_work_orders_the_stream_then_polls_it_to_completion(monkeypatch):
    """The NCCL branch of the device waits: `wait_on_host` orders the stream first (an error NCCL already knows of
    raises there), then blocks the host until the transfer has completed, against the time-out and the stall check;
    `free_for_reuse` orders the stream and never blocks the host."""
    cuda = torch.device("cuda", 0)
    work = NcclWork(completes_after=5)
    device_waits.wait_on_host(work, cuda, "bucket 3", 5, poll_s=0)
    assert work.log == ["wait"] + ["poll"] * 5
    with pytest.raises(TimeoutError, match=r"^bucket 3: not complete after 0 s"):
        device_waits.wait_on_host(NcclWork(10**9), cuda, "bucket 3", 0.05, poll_s=1e-3)
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.0)

    def check(waited_s: float) -> None:
        raise TimeoutError("engine X is behind")

    behind = NcclWork(10**9)
    with pytest.raises(TimeoutError, match="engine X is behind"):
        device_waits.wait_on_host(behind, cuda, "bucket 3", 5, poll_s=0, check=check)
    assert behind.log[0] == "wait"
    freed = NcclWork(completes_after=5)
    device_waits.free_for_reuse(freed, cuda, "bucket 3", 5, check=check)
    assert freed.log == ["wait"]


def test_the_stall_limit_is_off_in_async_mode_and_never_above_the_timeout():
    assert push_stall_s("pipeline", 600) == STALL_S < 600
    assert push_stall_s("conventional", 30) == 30
    assert push_stall_s("async", 600) is None


class FakeComm:
    """vLLM's `PyNcclCommunicator` after its constructor gave up (`self.disabled = True`, `available = False`)."""

    def __init__(self, group, device) -> None:
        self.disabled, self.available = True, False


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's communicator modules, faked (no real vLLM import, no CUDA)."""
    made = {}

    class FakeSPG:
        def __init__(self, rank, world_size, store):
            made["spg"] = (rank, world_size)

    utils = types.ModuleType("vllm.distributed.utils")
    utils.StatelessProcessGroup = FakeSPG
    pynccl = types.ModuleType("vllm.distributed.device_communicators.pynccl")
    pynccl.PyNcclCommunicator = FakeComm
    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm", types.ModuleType("vllm")))
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", utils)
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", pynccl)
    monkeypatch.setattr(store_group.torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(store_group.torch.cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(store_group.torch.cuda, "Stream", lambda device: "stream")
    return pynccl


def test_a_disabled_vllm_communicator_is_refused_at_construction_named(fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_DISABLE_PYNCCL", raising=False)
    with pytest.raises(RuntimeError, match=r"'vllm_weights', rank 2 of 3: .*disabled \(the NCCL library does not load"):
        store_group.PyNcclStoreGroup(torch.distributed.HashStore(), "vllm_weights", 2, 3, torch.device("cuda", 1), 5)
    monkeypatch.setenv("VLLM_DISABLE_PYNCCL", "1")
    with pytest.raises(RuntimeError, match=r"rank 0 of 3: .*\(VLLM_DISABLE_PYNCCL is set\).*keep their old weights"):
        store_group.PyNcclStoreGroup(torch.distributed.HashStore(), "vllm_weights", 0, 3, torch.device("cuda", 0), 5)
    with pytest.raises(RuntimeError, match=r"rank 0 of 1: .*\(a group of one member"):
        store_group.PyNcclStoreGroup(torch.distributed.HashStore(), "vllm_weights", 0, 1, torch.device("cuda", 0), 5)


def test_a_communicator_disabled_later_refuses_to_broadcast(fake_vllm, monkeypatch):
    fake_vllm.PyNcclCommunicator = lambda group, device: types.SimpleNamespace(disabled=False, available=True)
    g = store_group.PyNcclStoreGroup(torch.distributed.HashStore(), "vllm_weights", 1, 3, torch.device("cuda", 0), 5)
    assert g.posted() == {
        1: (-1, -1, "member 1 of group 'vllm_weights'"),
        2: (-1, -1, "member 2 of group 'vllm_weights'"),
    }
    g.comm.disabled = True  # what vLLM's `destroy()` does
    with pytest.raises(RuntimeError, match="rank 1 of 3: vLLM's NCCL communicator is disabled"):
        g.broadcast(torch.zeros(2))
