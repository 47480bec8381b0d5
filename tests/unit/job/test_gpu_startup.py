"""The GPU start-up path, decided on CPU: a simulated GPU node (GPU count, CUDA and torch.distributed patched).

What no CPU run can show by running it: which arguments the process groups get on a node where CUDA trainers and
CPU-only vLLM ranks meet, that an inference rank never calls into CUDA, which vLLM runner state the weight update
reads, how vLLM's processes are started, and how GPU waits behave.
"""

from __future__ import annotations

import sys
import types
from unittest import mock

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference import vllm_process
from pipelinerl_fsdp.inference.placement import VLLMPlacement
from pipelinerl_fsdp.inference.vllm_extension import output_token_counts
from pipelinerl_fsdp.job import world
from pipelinerl_fsdp.runtime import gpus
from pipelinerl_fsdp.transport import store_group
from pipelinerl_fsdp.transport.device_waits import wait_on_host

CUDA_CALLS = ("is_available", "device_count", "set_device", "current_device", "init", "_lazy_init", "synchronize")


class Recorder:
    """torch.distributed and torch.cuda as one rank sees them, recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, forbid_cuda: bool) -> None:
        self.calls: list[tuple] = []
        self.cuda_calls: list[str] = []
        d = world.dist
        monkeypatch.setattr(d, "is_initialized", lambda: False)
        monkeypatch.setattr(d, "init_process_group", lambda backend, **kw: self.calls.append(("init", backend, kw)))
        monkeypatch.setattr(d, "new_group", self._new_group)
        monkeypatch.setattr(world.DeviceMesh, "from_group", lambda g, dev, **kw: ("mesh", dev))
        monkeypatch.setattr(world, "_attempt_store", lambda *a: "store")
        monkeypatch.setattr(world.torch, "set_num_threads", lambda n: None)
        monkeypatch.setattr(world, "gpu_count", lambda: 8)  # NVML: a GPU node
        for name in CUDA_CALLS:
            monkeypatch.setattr(torch.cuda, name, self._cuda(name, forbid_cuda))

    def _new_group(self, ranks, backend=None, device_id=None, **kw):
        self.calls.append(("new_group", tuple(ranks), backend, device_id))
        return f"group{tuple(ranks)}"

    def _cuda(self, name: str, forbid: bool):
        def call(*args, **kwargs):
            self.cuda_calls.append(name)
            if forbid:
                raise AssertionError(f"torch.cuda.{name} called on a rank that must never initialise CUDA")
            return {"is_available": True, "device_count": 8, "current_device": 0}.get(name)

        return call


def init_rank(monkeypatch: pytest.MonkeyPatch, rank: int, args: list[str], forbid_cuda: bool) -> tuple:
    """init_world for global `rank` of a one-node, 4-process job (3 trainers, 1 engine) on an 8-GPU node."""
    env = dict(RANK=rank, WORLD_SIZE=4, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=4, MASTER_ADDR="h", MASTER_PORT=1)
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    rec = Recorder(monkeypatch, forbid_cuda)
    cfg = load_config(["--job.stage=rl", "--world.inference_ranks=1", *args])
    w = world.init_world(cfg)
    return w, rec


def test_mixed_gpu_node_default_group_is_gloo_without_device_id(monkeypatch):
    # the landed code passed device_id=cuda:i and "cpu:gloo,cuda:nccl": NCCL eagerly over every rank, and the
    # CPU-only vLLM rank never joins (a certain hang)
    trainer, rec_t = init_rank(monkeypatch, 0, [], forbid_cuda=False)
    init = rec_t.calls[0]
    assert init[0] == "init" and init[1] == "gloo" and init[2].get("device_id") is None
    assert trainer.device == torch.device("cuda", 0) and trainer.backend == "nccl"
    # trainers connect NCCL among themselves at once (device_id on their group only), with gloo beside it
    assert rec_t.calls[1] == ("new_group", (0, 1, 2), "cpu:gloo,cuda:nccl", torch.device("cuda", 0))


def test_a_vllm_rank_never_touches_cuda_and_builds_the_same_groups(monkeypatch):
    inference, rec_i = init_rank(monkeypatch, 3, [], forbid_cuda=True)
    assert rec_i.cuda_calls == []
    assert inference.device == torch.device("cpu")
    monkeypatch.undo()
    _, rec_t = init_rank(monkeypatch, 0, [], forbid_cuda=False)
    # same groups, same order, same backends on every rank (the device_id is a member's own business)
    strip = [c[:3] for c in rec_i.calls if c[0] == "new_group"]
    assert strip == [c[:3] for c in rec_t.calls if c[0] == "new_group"]
    assert strip[1:] == [("new_group", (0, 3), "gloo"), ("new_group", (0, 3), "gloo")]  # weight headers, rollouts


def test_reference_engine_on_gpu_or_kept_on_cpu(monkeypatch):
    gpu, rec = init_rank(monkeypatch, 3, ["--inference.engine=reference"], forbid_cuda=False)
    assert gpu.device == torch.device("cuda", 3)
    assert rec.calls[2] == ("new_group", (0, 3), "cpu:gloo,cuda:nccl", None)  # buckets over NCCL
    monkeypatch.undo()
    cpu, rec = init_rank(monkeypatch, 3, ["--inference.engine=reference", "--inference.device=cpu"], forbid_cuda=True)
    assert cpu.device == torch.device("cpu") and rec.calls[2][2] == "gloo"


def test_cuda_requested_without_gpus_is_a_named_error(monkeypatch):
    monkeypatch.setattr(world, "gpu_count", lambda: 0)
    cfg = load_config(["--job.device=cuda"])
    assert world.job_backend(cfg.world, cfg.job) == "gloo"
    for k, v in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1).items():
        monkeypatch.setenv(k, str(v))
    with pytest.raises(ConfigError, match="job.device = 'cuda' but no GPU is visible"):
        world.init_world(cfg)


def test_gpu_count_asks_nvml_and_never_cuda(monkeypatch):
    def forbidden(*a):
        raise AssertionError("CUDA runtime asked")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", forbidden)
    monkeypatch.setattr(torch.cuda, "is_available", forbidden)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", forbidden, raising=False)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 4)
    gpus.gpu_count.cache_clear()
    assert gpus.gpu_count() == 4
    # NVML cannot answer: a child process asks CUDA, this one stays clean
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    child = mock.Mock(returncode=0, stdout="2\n", stderr="")
    with mock.patch.object(gpus.subprocess, "run", return_value=child) as run:
        gpus.gpu_count.cache_clear()
        assert gpus.gpu_count() == 2
    assert run.call_args.args[0][0] == sys.executable
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    gpus.gpu_count.cache_clear()
    assert gpus.gpu_count() == 0
    gpus.gpu_count.cache_clear()


def test_vllm_starts_its_processes_with_spawn_the_v1_runner_and_without_torchrun_env(monkeypatch):
    env = vllm_process.engine_env(VLLMPlacement(cpu_cores=None, gpu_ids=[4, 5]), {})
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    # a user's explicit choice stands (the extension reads either runner)
    assert (
        vllm_process.engine_env(VLLMPlacement(None, [0]), {"VLLM_USE_V2_MODEL_RUNNER": "1"})["VLLM_USE_V2_MODEL_RUNNER"]
        == "1"
    )
    cpu = vllm_process.engine_env(VLLMPlacement(cpu_cores="1", gpu_ids=None), {})
    assert cpu == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with vllm_process.without_torchrun_env():
        import os

        seen = dict(os.environ)
    assert "RANK" not in seen and "MASTER_ADDR" not in seen and "TORCHELASTIC_RESTART_COUNT" not in seen
    assert seen["OMP_NUM_THREADS"] == "1"
    assert os.environ["RANK"] == "5" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "2"


class _V1Request:
    def __init__(self, ids):
        self.output_token_ids = ids


class _Uva:
    def __init__(self, values):
        self.np = values


def test_version_boundaries_read_from_either_vllm_runner():
    # V1: output_token_ids, -1 = async placeholder
    v1 = types.SimpleNamespace(requests={"a-1": _V1Request([5, 6, 7, -1]), "b-2": _V1Request([])})
    assert output_token_counts(v1) == {"a-1": 3, "b-2": 0}
    # V2: no `requests`; an index per request, host prompt lengths, device total lengths (prompt + output)
    states = types.SimpleNamespace(
        req_id_to_index={"a-1": 2, "b-2": 0},
        prompt_len=_Uva([10, 0, 4]),
        total_len=types.SimpleNamespace(gpu=torch.tensor([13, 0, 9])),
    )
    v2 = types.SimpleNamespace(req_states=states)
    assert not hasattr(v2, "requests")
    assert output_token_counts(v2) == {"a-1": 5, "b-2": 3}
    with pytest.raises(RuntimeError, match="neither `requests` \\(V1\\) nor `req_states` \\(V2\\)"):
        output_token_counts(types.SimpleNamespace())


def test_gpu_bucket_group_is_vllms_own_nccl(monkeypatch):
    made = {}

    class FakeSPG:
        def __init__(self, rank, world_size, store):
            made["spg"] = (rank, world_size, store)

    class FakeComm:
        def __init__(self, group, device):
            made["comm"] = (group, device)

    fake_utils = types.ModuleType("vllm.distributed.utils")
    fake_utils.StatelessProcessGroup = FakeSPG
    fake_pynccl = types.ModuleType("vllm.distributed.device_communicators.pynccl")
    fake_pynccl.PyNcclCommunicator = FakeComm
    monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm", types.ModuleType("vllm")))  # no real import
    monkeypatch.setitem(sys.modules, "vllm.distributed.utils", fake_utils)
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.pynccl", fake_pynccl)
    monkeypatch.setattr(store_group.dist, "TCPStore", lambda *a, **k: "tcp")
    marks = {}

    class FakePrefixStore(tuple):
        def set(self, key, value):  # a worker's progress mark (`StoreGroup.mark_posted`)
            marks[key] = value

    monkeypatch.setattr(store_group.dist, "PrefixStore", lambda prefix, store: FakePrefixStore((prefix, store)))
    monkeypatch.setattr(store_group.torch.cuda, "Stream", lambda device: "stream")
    streams = []
    monkeypatch.setattr(store_group.torch.cuda, "current_stream", lambda device=None: "caller's stream")
    monkeypatch.setattr(store_group.torch.cuda, "set_stream", streams.append)

    def no_torch_nccl(*a, **k):
        raise AssertionError("a torch ProcessGroupNCCL inside vLLM's worker")

    monkeypatch.setattr(store_group.dist, "ProcessGroupNCCL", no_torch_nccl, raising=False)
    g = store_group.join_store_group("h", 1, "vllm_weights", 2, 3, "nccl", torch.device("cuda", 1), 5, "p/")
    assert isinstance(g, store_group.PyNcclStoreGroup)
    assert made["spg"] == (2, 3, ("p/vllm_weights/", "tcp"))
    assert made["comm"][1] == torch.device("cuda", 1)
    assert marks == {"posted/2": "-1 -1 member 2 of group 'vllm_weights'"}  # nothing posted yet
    assert streams == ["caller's stream"]  # vLLM's communicator set-up may switch the thread's stream: restored
    with pytest.raises(ValueError, match="NCCL needs a CUDA device"):
        store_group.join_store_group("h", 1, "g", 0, 2, "nccl", torch.device("cpu"), 5, "p/")


class _SlowWork:
    """An NCCL work: `wait()` returns at once (it only orders streams); done after `polls` checks."""

    def __init__(self, polls: int) -> None:
        self.left, self.waited = polls, False

    def wait(self):
        self.waited = True
        return True

    def is_completed(self):
        self.left -= 1
        return self.left < 0


def test_gpu_waits_block_the_host_until_done_and_fail_named():
    work = _SlowWork(polls=5)
    wait_on_host(work, torch.device("cuda", 0), "x", timeout_s=5, poll_s=0)
    assert work.waited and work.left < 0
    with pytest.raises(TimeoutError, match="the weight push of version 7: not complete after 0 s"):
        wait_on_host(_SlowWork(polls=10**9), torch.device("cuda", 0), "the weight push of version 7", 0.01, 0.001)
    cpu = _SlowWork(polls=10**9)  # gloo's wait blocks by itself
    wait_on_host(cpu, torch.device("cpu"), "x", timeout_s=0)
    assert cpu.waited


def test_event_work_never_completing_names_its_group():
    never = types.SimpleNamespace(query=lambda: False)
    work = store_group.EventWork(never, torch.device("cuda", 0), "weight bucket on group 'g'", 0.01, 0.001)
    with pytest.raises(TimeoutError, match="weight bucket on group 'g': not complete"):
        work.wait()
