"""The KL reference under LoRA: the policy itself with its adapters off (no second copy of the base), whose
log-probs equal those of the separate frozen base a job without LoRA loads, exactly; the adapters are back on
after it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipelinerl_fsdp.config import LoRAConfig, TrainerConfig
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.models.lora import adapter_parameters
from pipelinerl_fsdp.rl.batching import rl_micro_batches
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.training.train_step import add_reference_logprobs

CPU = torch.device("cpu")
ARGS = flavour_args("debug-llama", vocab_size=32, num_hidden_layers=2)
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def world() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    from pipelinerl_fsdp.job.world import World

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    yield World(0, 1, 0, 1, CPU, "gloo", [0], [], None, mesh, None, None)
    dist.destroy_process_group()


def samples(seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(6):
        n = rng.randint(4, 30)
        prompt = [rng.randrange(2, 32) for _ in range(rng.randint(2, 8))]
        completion = [rng.randrange(2, 32) for _ in range(n)]
        out.append(Sample(i // 2, prompt, completion, [-1.0] * n, [1] * n, 1.0, advantage=1.0, loss_weight=1 / 6))
    return out


def reference_logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
    micro = rl_micro_batches(samples(), 64, CPU, 1)
    assert len(micro) > 1  # several micro-batches
    add_reference_logprobs(model, micro, 1.0, None, CPU)
    return [mb.loss_input.ref_logp for mb in micro]


def test_the_kl_reference_under_lora_is_the_policy_with_its_adapters_off(world, tmp_path: Path):
    from torch.distributed.tensor import DTensor

    from pipelinerl_fsdp.training.policy import load_sharded

    save_hf_folder(tmp_path / "base", ARGS, build_model(ARGS, seed=0).state_dict())
    policy = load_sharded(tmp_path / "base", world, TrainerConfig(), LORA, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: B != 0, so the adapted policy is not the base
        for _, p in adapter_parameters(policy):
            assert isinstance(p, DTensor)
            p.to_local().copy_(torch.randn(p.shape, generator=g) * 0.2)
    separate = load_sharded(tmp_path / "base", world, TrainerConfig()).requires_grad_(False)  # no LoRA: a copy
    got, want = reference_logprobs(policy), reference_logprobs(separate)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # the adapters are on again afterwards: the policy's own log-probs differ from the reference's
    mb = rl_micro_batches(samples(), 64, CPU, 1)[0]
    logp, _ = policy(mb.input_ids, mb.position_ids, targets=mb.targets, logprob_positions=mb.logprob_positions())
    assert (logp[0].detach() - got[0]).abs().max() > 1e-3
