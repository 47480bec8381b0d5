"""Engine placement: cores (CPU) or GPUs (a simulated GPU node: device count and CUDA availability patched)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError, load_config
from pipelinerl_fsdp.inference.placement import engine_dtype, vllm_placement
from pipelinerl_fsdp.world import World, job_backend


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
        None,
    )


def test_cpu_engines_bind_from_the_top_core_down(capsys):
    cfg = load_config(["--world.inference_ranks=2", "--inference.cpu_cores_per_engine=2"])
    with mock.patch("os.cpu_count", return_value=8):
        a = vllm_placement(cfg, world(2, 2, 4, 2, 2, "gloo"))
        b = vllm_placement(cfg, world(3, 3, 4, 2, 2, "gloo"))
    assert (a.cpu_cores, b.cpu_cores) == ("6-7", "4-5") and a.gpu_ids is None
    assert "oversubscribed" not in capsys.readouterr().out


def test_cpu_oversubscription_warns_and_shares(capsys):
    cfg = load_config(["--world.inference_ranks=1"])
    with mock.patch("os.cpu_count", return_value=2):
        p = vllm_placement(cfg, world(2, 2, 3, 2, 1, "gloo"))
    assert p.cpu_cores == "1-1" and "oversubscribed" in capsys.readouterr().out


def test_cpu_tensor_parallel_splits_the_slice():
    cfg = load_config(
        ["--world.inference_ranks=1", "--inference.cpu_cores_per_engine=4", "--inference.tensor_parallel_size=2"]
    )
    with mock.patch("os.cpu_count", return_value=8):
        assert vllm_placement(cfg, world(1, 1, 2, 1, 1, "gloo")).cpu_cores == "4-5|6-7"
    bad = load_config(
        ["--world.inference_ranks=1", "--inference.cpu_cores_per_engine=3", "--inference.tensor_parallel_size=2"]
    )
    with mock.patch("os.cpu_count", return_value=8), pytest.raises(ConfigError, match="not a multiple"):
        vllm_placement(bad, world(1, 1, 2, 1, 1, "gloo"))


def test_gpu_node_engines_take_the_gpus_after_the_trainers():
    # an 8-GPU node: 4 trainer ranks, 2 engines with tensor parallelism 2
    cfg = load_config(["--world.inference_ranks=2", "--inference.tensor_parallel_size=2"])
    with mock.patch("torch.cuda.device_count", return_value=8):
        ids = [vllm_placement(cfg, world(r, r, 6, 4, 2, "nccl")).gpu_ids for r in (4, 5)]
    assert ids == [[4, 5], [6, 7]]


def test_gpu_node_too_small_is_a_named_error():
    cfg = load_config(["--world.inference_ranks=2", "--inference.tensor_parallel_size=4"])
    with (
        mock.patch("torch.cuda.device_count", return_value=8),
        pytest.raises(ConfigError, match=r"rank 5: its vLLM engine needs GPUs \[8, 9, 10, 11\]"),
    ):
        vllm_placement(cfg, world(5, 5, 6, 4, 2, "nccl"))


def test_engine_dtype_follows_the_device():
    cfg = load_config([])
    assert engine_dtype(cfg, torch.device("cpu")) == torch.float32
    assert engine_dtype(cfg, torch.device("cuda")) == torch.bfloat16
    assert engine_dtype(load_config(["--inference.dtype=float16"]), torch.device("cpu")) == torch.float16


def test_every_rank_of_a_gpu_job_picks_the_same_backend():
    # vLLM inference ranks stay on CPU; they must still choose NCCL like the trainers, or the group order differs
    cfg = load_config(["--job.stage=rl", "--world.inference_ranks=1"])
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert job_backend(cfg) == "nccl"
        assert job_backend(load_config(["--job.device=cpu"])) == "gloo"
        assert job_backend(load_config(["--world.backend=gloo"])) == "gloo"
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert job_backend(cfg) == "gloo"
