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

    def _release(self, how: str) -> None:
        self.group.log.append((how, self.bucket))
        self.group.sent.setdefault(self.bucket, self.flat.clone())

    def wait(self) -> bool:
        self._release("wait")
        return True

    def is_completed(self) -> bool:
        return self.completes

    def get_future(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(add_done_callback=lambda fn: fn(None))


class OrderedWork(FakeWork):
    """A transfer on a CUDA stream of its own (`EventWork`): it can order the caller's stream after itself."""

    def order_after(self) -> None:
        self._release("order")


class FakeGroup(StoreGroup):
    """The bucket group's source end, its members' marks in a dict store."""

    def __init__(self, size: int = 3, ordered: bool = True, completes: bool = True) -> None:
        self.marks: dict[str, bytes] = {}
        store = types.SimpleNamespace(
            set=lambda k, v: self.marks.__setitem__(k, v.encode()),
            get=lambda k: self.marks[k],
            check=lambda keys: all(k in self.marks for k in keys),
        )
        super().__init__("vllm_weights", 0, size, torch.device("cpu"), 5.0, store)
        self.ordered, self.completes = ordered, completes
        self.log: list[tuple[str, int]] = []
        self.sent: dict[int, torch.Tensor] = {}
        self.ptrs: list[int] = []

    def broadcast(self, flat: torch.Tensor) -> FakeWork:
        b = sum(1 for how, _ in self.log if how == "send")
        self.log.append(("send", b))
        self.ptrs.append(flat.data_ptr())
        return (OrderedWork if self.ordered else FakeWork)(self, flat, b, self.completes)

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


def test_without_a_stall_limit_an_engine_behind_is_waited_for(monkeypatch):
    monkeypatch.setattr(device_waits, "CHECK_EVERY_S", 0.01)
    group = FakeGroup(completes=False)
    group.mark(1, 7, 0, "inference rank 2, vLLM worker 0")
    group.mark(2, 6, 4, "inference rank 3, vLLM worker 0")
    s, _ = sender(group, monkeypatch, timeout_s=0.2, stall_s=None)
    # on CPU the host wait is gloo's own (it has the group's time-out); these fake works return from it at once
    assert s.push(7) is not None  # async mode: a held update is waited for, as long as world.timeout_s allows


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
