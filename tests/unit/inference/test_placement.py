"""Engine placement: cores (CPU) or GPUs (a simulated GPU node: device count and CUDA availability patched)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference.placement import rank_cores, vllm_placement
from pipelinerl_fsdp.job.weight_sync import engine_dtype
from pipelinerl_fsdp.job.world import World, job_backend
from pipelinerl_fsdp.runtime.cpu_binding import engine_slice, trainer_slice


def world(rank: int, local_rank: int, local_size: int, n_trainers: int, n_inf: int, backend: str) -> World:
    size = n_trainers + n_inf
    return World(
        rank,
        size,
        local_rank,
        local_size,
        torch.device("cpu"),
        backend,
        list(range(n_trainers)),
        list(range(n_trainers, size)),
        None,
        None,
        None,
        None,
    )


def _wj(cfg):
    """`job_backend`'s arguments: the world and job sections."""
    return cfg.world, cfg.job


def cores(n: int, first: int = 0):
    """A node whose job may use cores first..first+n-1 (its affinity, as a container's cpuset gives it)."""
    return mock.patch("pipelinerl_fsdp.runtime.cpu_binding.node_cores", return_value=tuple(range(first, first + n)))


def test_core_slices():
    node = tuple(range(8))
    assert [engine_slice(node, i, 2) for i in range(3)] == [[6, 7], [4, 5], [2, 3]]
    assert [trainer_slice(node, i, 2, 2, 2) for i in range(2)] == [[0, 1], [2, 3]]
    assert [trainer_slice(node, i, 3, 1, 2) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [trainer_slice(node, i, 4, 1, 1) for i in range(4)] == [[0], [1], [2], [3, 4, 5, 6]]  # remainder: last
    assert trainer_slice(node, 0, 3, 3, 2) is None  # 2 cores left for 3 trainers


def test_every_rank_of_a_cpu_node_gets_disjoint_cores_covering_the_node():
    """The default 2-core job (1 trainer, 1 engine), and an 8-core node with 2 trainers and 2 engines: each rank's
    slice, the engines' from the top, no core shared, every core used; the engine's OpenMP binding is its slice."""
    for n, n_tr, n_inf, per_engine, want in [
        (2, 1, 1, 0, [[0], [1]]),
        (8, 2, 2, 0, [[0, 1], [2, 3], [6, 7], [4, 5]]),
        (8, 2, 2, 3, [[0], [1], [5, 6, 7], [2, 3, 4]]),
    ]:
        cfg = load_config([f"--world.inference_ranks={n_inf}", f"--inference.cpu_cores_per_engine={per_engine}"])
        size = n_tr + n_inf
        with cores(n, first=4):  # a cpuset that does not start at 0
            got = [
                rank_cores(cfg.inference, cfg.job.threads_per_rank, world(r, r, size, n_tr, n_inf, "gloo"))
                for r in range(size)
            ]
            binds = [
                vllm_placement(
                    cfg.inference, cfg.job.threads_per_rank, world(r, r, size, n_tr, n_inf, "gloo")
                ).cpu_cores
                for r in range(n_tr, size)
            ]
        assert got == [[c + 4 for c in s] for s in want]
        assert binds == [f"{s[0]}-{s[-1]}" for s in got[n_tr:]]


def test_an_oversubscribed_node_binds_nothing(capsys):
    cfg = load_config(["--world.inference_ranks=2"])
    with cores(2):  # the 4-rank test job on a 2-core machine
        assert [
            rank_cores(cfg.inference, cfg.job.threads_per_rank, world(r, r, 4, 2, 2, "gloo")) for r in range(4)
        ] == [None] * 4


def test_cpu_engines_bind_from_the_top_core_down(capsys):
    cfg = load_config(["--world.inference_ranks=2", "--inference.cpu_cores_per_engine=2"])
    with cores(8):
        a = vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(2, 2, 4, 2, 2, "gloo"))
        b = vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(3, 3, 4, 2, 2, "gloo"))
    assert (a.cpu_cores, b.cpu_cores) == ("6-7", "4-5") and a.gpu_ids is None
    assert "oversubscribed" not in capsys.readouterr().out


def test_cpu_oversubscription_warns_and_shares(capsys):
    cfg = load_config(["--world.inference_ranks=1"])
    with cores(2):
        p = vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(2, 2, 3, 2, 1, "gloo"))
    assert p.cpu_cores == "1-1" and "oversubscribed" in capsys.readouterr().out


def test_cpu_tensor_parallel_splits_the_slice():
    cfg = load_config(
        ["--world.inference_ranks=1", "--inference.cpu_cores_per_engine=4", "--inference.tensor_parallel_size=2"]
    )
    with cores(8):
        assert (
            vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(1, 1, 2, 1, 1, "gloo")).cpu_cores == "4-5|6-7"
        )
    bad = load_config(
        ["--world.inference_ranks=1", "--inference.cpu_cores_per_engine=3", "--inference.tensor_parallel_size=2"]
    )
    with cores(8), pytest.raises(ConfigError, match="not a multiple"):
        vllm_placement(bad.inference, bad.job.threads_per_rank, world(1, 1, 2, 1, 1, "gloo"))


def test_gpu_node_engines_take_the_gpus_after_the_trainers():
    # an 8-GPU node: 4 trainer ranks, 2 engines with tensor parallelism 2
    cfg = load_config(["--world.inference_ranks=2", "--inference.tensor_parallel_size=2"])
    with mock.patch("pipelinerl_fsdp.inference.placement.gpu_count", return_value=8):
        ids = [
            vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(r, r, 6, 4, 2, "nccl")).gpu_ids
            for r in (4, 5)
        ]
    assert ids == [[4, 5], [6, 7]]


def test_gpu_node_too_small_is_a_named_error():
    cfg = load_config(["--world.inference_ranks=2", "--inference.tensor_parallel_size=4"])
    with (
        mock.patch("pipelinerl_fsdp.inference.placement.gpu_count", return_value=8),
        pytest.raises(ConfigError, match=r"rank 5: its vLLM engine needs GPUs \[8, 9, 10, 11\]"),
    ):
        vllm_placement(cfg.inference, cfg.job.threads_per_rank, world(5, 5, 6, 4, 2, "nccl"))


def test_engine_dtype_follows_the_device():
    cfg = load_config([])
    assert engine_dtype(cfg.inference.dtype, torch.device("cpu")) == torch.float32
    assert engine_dtype(cfg.inference.dtype, torch.device("cuda")) == torch.bfloat16
    assert (
        engine_dtype(load_config(["--inference.dtype=float16"]).inference.dtype, torch.device("cpu")) == torch.float16
    )


def test_every_rank_of_a_gpu_job_picks_the_same_backend():
    # vLLM inference ranks stay on CPU; they must still choose NCCL like the trainers, or the group order differs
    cfg = load_config(["--job.stage=rl", "--world.inference_ranks=1"])
    with mock.patch("pipelinerl_fsdp.job.world.gpu_count", return_value=8):
        assert job_backend(*_wj(cfg)) == "nccl"
        assert job_backend(*_wj(load_config(["--job.device=cpu"]))) == "gloo"
        assert job_backend(*_wj(load_config(["--world.backend=gloo"]))) == "gloo"
    with mock.patch("pipelinerl_fsdp.job.world.gpu_count", return_value=0):
        assert job_backend(*_wj(cfg)) == "gloo"
