"""torchrun script: trainers (FSDP2) push weights twice; the inference rank checks them bit for bit.

Run: torchrun --nproc-per-node 3 tests/dist/weight_sync.py  (2 trainers + 1 inference rank)
     torchrun --nproc-per-node 2 tests/dist/weight_sync.py 1  (1 trainer; 1-byte buckets: one unit per bucket, so
     the embedding and the final norm go out from the parameter itself)
     torchrun --nproc-per-node 2 tests/dist/weight_sync.py BUCKET overlap  (as the trainer with rl.overlap_push: the
     push returns at once when its buckets fit the send buffers; the receiver takes it after a delay, the trainer
     finishes it after another (`DELAYS`) and only then changes the parameters, some of which go out as they are
     (BUCKET 1); the broadcast time must be the receiver's delay, not the trainer's)
"""

import sys
import time

import torch
import torch.distributed as dist

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.training.parallelize import apply_fsdp
from pipelinerl_fsdp.transport.weights import IN_FLIGHT, STOP, UPDATE, WeightReceiver, WeightSender
from pipelinerl_fsdp.job.world import init_world

# vocabulary 51: the embedding splits unevenly over 2 ranks (gathered with full_tensor), the rest evenly (gathered
# straight into the send buffer)
ARGS = flavour_args("debug", vocab_size=51, tie_word_embeddings=True)
VERSIONS = {False: (1, 2), True: (1, 2, 3)}
# overlap: (receiver's delay, trainer's delay before `finish`) per version. Version 2's receiver comes after the
# trainer has moved on to change the parameters for version 3: `finish` must hold that change back.
DELAYS = {1: (0.3, 1.0), 2: (1.0, 0.3), 3: (0.0, 0.0)}


def expected_weights(version: int) -> dict[str, torch.Tensor]:
    model = build_model(ARGS, seed=7)
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version * 1000 + i)))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main() -> None:
    cfg = load_config(["--world.inference_ranks=1", "--job.threads_per_rank=1"])
    world = init_world(cfg)
    # small buckets so that several (each of whole layers) are exercised; argv[1]: the bucket size in bytes
    bucket = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    overlap = len(sys.argv) > 2 and sys.argv[2] == "overlap"
    if world.is_trainer:
        model = build_model(ARGS, seed=7)
        apply_fsdp(model, world.trainer_mesh, torch.float32, torch.float32)
        sender = WeightSender(model, world.weight_group, world.trainer_ranks[0], world.is_main, torch.float32,
                              torch.device("cpu"), bucket)
        assert len(sender.buckets) > 1 or overlap
        if world.trainer_mesh.size() == 1 and bucket == 1:
            assert sender._direct[0] and not all(sender._direct), "the 1-trainer case must send some buckets as-is"
        for version in VERSIONS[overlap]:
            want = expected_weights(version)
            with torch.no_grad():
                for n, p in model.named_parameters():  # set the sharded params to the expected full values
                    p.copy_(torch.distributed.tensor.distribute_tensor(want[n], p.device_mesh, p.placements))
            if not overlap:
                sender.push(version)
                continue
            receiver_s, trainer_s = DELAYS[version]
            dist.barrier()  # the receiver's delay starts now
            t0 = time.perf_counter()
            assert sender.push(version, wait=False) is None
            posted_s = time.perf_counter() - t0
            if sum(not d for d in sender._direct) <= IN_FLIGHT and receiver_s:  # else it waits for send buffers
                assert posted_s < receiver_s / 2, "an overlapped push waited for the receiver"
            time.sleep(trainer_s)  # the trainer's next step
            stats = sender.finish()  # before the parameters change (the next version's copy above)
            # the transfer's own time, whichever side came last (version 1: the trainer, 0.7 s after the receiver)
            print(f"OVERLAP version {version}: posted in {posted_s:.4f} s, broadcast {stats and stats.broadcast_s:.4f} s")
            assert stats is not None and receiver_s - 0.1 < stats.broadcast_s < receiver_s + 0.5, stats
        sender.stop()
    else:
        local = build_model(ARGS, seed=99)
        params = dict(local.named_parameters())
        rx = WeightReceiver([(n, p.shape) for n, p in params.items()], world.weight_group, world.trainer_ranks[0],
                            torch.float32, torch.device("cpu"), bucket)
        before = {n: p.detach().clone() for n, p in params.items()}
        rx.bind(params)  # the production path: broadcasts land straight in the parameters
        assert all(torch.equal(before[n], p) for n, p in params.items())  # binding keeps the values
        for version in VERSIONS[overlap]:
            if overlap:
                dist.barrier()
                time.sleep(DELAYS[version][0])  # the engine comes round to the update later
            kind, got = rx.receive()
            assert (kind, got) == (UPDATE, version)
            want = expected_weights(version)
            for n, p in params.items():
                assert torch.equal(p, want[n]), f"{n} differs after update {version}"
            assert local.lm_head.weight is local.model.embed_tokens.weight
        kind, _ = rx.receive()
        assert kind == STOP
        print("WEIGHT_SYNC_OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
