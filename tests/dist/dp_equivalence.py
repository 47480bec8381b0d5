"""torchrun script (2 processes): one batch, the RL step's loss and FSDP2 on 1 trainer rank and on 2, must give the
same gradients. FSDP averages gradients over ranks, so the loss carries a factor of the trainer count
(`train_step.rl_loss_fn`); AdamW's normalisation and gradient clipping would hide a wrong factor in any learning
test, so the gradients themselves are compared, before any optimizer.

Run: torchrun --nproc-per-node 2 tests/dist/dp_equivalence.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.training.parallelize import apply_fsdp
from pipelinerl_fsdp.rl.batching import rl_micro_batches, split_balanced
from pipelinerl_fsdp.rl.normalization import assign_loss_weights
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig
from pipelinerl_fsdp.training.train_step import forward_backward, rl_loss_fn
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.job.world import init_world

ARGS = flavour_args("debug", vocab_size=30)
BATCH = 8
CPU = torch.device("cpu")


LOSS = ReinforceTISConfig(is_clip=2.0, normalize="tokens")


def batch() -> list[Sample]:
    """8 samples of different lengths, stale enough that some weights are truncated (rho > c)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(BATCH):
        n = int(torch.randint(2, 12, (1,), generator=g))
        comp = torch.randint(0, 30, (n,), generator=g).tolist()
        behaviour = (-3 * torch.rand(n, generator=g)).tolist()
        out.append(Sample(i // 4, [3, 4, 5], comp, behaviour, [0] * n, 0.0, float(torch.randn(1, generator=g))))
    return out


def gradients(mesh: DeviceMesh, samples: list[Sample], n_ranks: int) -> dict[str, torch.Tensor]:
    """Full gradients after the RL step's forward/backward of `samples` on this rank (its share of the batch)."""
    model = build_model(ARGS, seed=0)
    apply_fsdp(model, mesh, torch.float32, torch.float32)
    micro = rl_micro_batches(samples, 32, CPU)  # several micro-batches per rank
    forward_backward(model, micro, rl_loss_fn(LOSS, 0.0, n_ranks), 1.0, mesh.get_group(), CPU)
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def main() -> None:
    world = init_world(load_config(["--job.stage=warmstart", "--job.threads_per_rank=1"]))
    samples = batch()
    # weights over the whole batch, before it is split (as the first trainer rank sets them): a mean over the step's
    # tokens, the normalisation a per-rank count would get wrong
    assign_loss_weights(samples, LOSS, BATCH, 4, 12)
    one = dist.new_group([0])  # every rank creates it; rank 0 trains the whole batch alone on it
    two = gradients(world.trainer_mesh, split_balanced(samples, 2)[world.trainer_rank], 2)
    if world.rank == 0:
        alone = gradients(DeviceMesh.from_group(one, "cpu", mesh_dim_names=("dp",)), samples, 1)
        worst = max(float((two[n] - alone[n]).abs().max() / alone[n].abs().max().clamp(min=1e-12)) for n in alone)
        assert worst < 1e-4, f"1-rank and 2-rank gradients differ: max relative difference {worst:.3g}"
        assert max(float(g.abs().max()) for g in alone.values()) > 0, "no gradient at all: the check checks nothing"
        print(f"DP_EQUIVALENCE_OK max relative difference {worst:.2g}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
