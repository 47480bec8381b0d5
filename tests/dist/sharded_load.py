"""torchrun script (2 FSDP ranks): load an HF folder of 4 safetensors shards straight into FSDP2 shards
(`policy.load_sharded`): every parameter equals the file's tensor, and each rank's peak host memory grows by about
its half of the model, not by the whole model. Prints one `RESULT {json}` line per rank.

Run: torchrun --nproc-per-node 2 tests/dist/sharded_load.py FOLDER
"""

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.models.hf_io import read_state_dict
from pipelinerl_fsdp.training.policy import load_sharded
from pipelinerl_fsdp.job.world import init_world


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0): rank 0's own model build, before
    the load, would otherwise hold the high-water mark, and the load's peak could not be seen."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main(folder: Path) -> None:
    cfg = load_config(["--config", "arithmetic", "--job.stage=warmstart", "--world.inference_ranks=0"])
    world = init_world(cfg)
    args = flavour_args("small")
    model_mb = args.num_params() * 4 / 2**20
    if world.rank == 0:
        model = build_model(args, seed=3)
        save_hf_folder(folder, args, model.state_dict(), max_shard_bytes=int(model_mb * 2**20 / 4) + 1)
        del model
    dist.barrier()
    reset_peak()
    before = rss_mb()
    sharded = load_sharded(folder, world, cfg.trainer)
    grown = peak_mb() - before
    stored = read_state_dict(folder)
    equal = all(torch.equal(p.full_tensor(), stored[n]) for n, p in sharded.named_parameters())
    shards = len(list(folder.glob("*.safetensors")))
    result = {"rank": world.rank, "model_mb": model_mb, "peak_growth_mb": grown, "equal": equal, "files": shards}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
