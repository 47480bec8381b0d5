"""Weight-update pause of a vLLM engine inside a torchrun job, against model size, next to a memcpy of the bytes.

Exactly the job's arrangement: rank 0 plays the first trainer rank (bucketed broadcast over the store-built group),
rank 1 runs `VLLMEngine` (engine core and worker in their own processes) and keeps generating while updates
arrive. The pause is the engine's stall per update: scheduler paused -> the worker receives every bucket and
loads it -> resumed (`VLLMEngine.load_update`, timed on rank 1); "in the worker" is the receive-and-load call
inside it, of which "bucket waits" is the time spent waiting for buckets to arrive. Each load way
(`inference.vllm_weight_load`, see pipelinerl_fsdp/inference/vllm_load.py) takes `--updates` updates in turn on
the same engine, then the engine's generation speed with the weights as that way leaves them: 16 requests of 128
tokens submitted together to the idle engine.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.vllm_update --flavour debug
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.vllm_update --flavour small
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.vllm_update \
        --model outputs/models/SmolLM2-135M-Instruct --loads reload,inplace --updates 3   # a real model, 538 MB

One model per job, as in the real job (a second AsyncLLM started in the same process after closing the first hung
here once; not investigated). Prints a table row per load way; writes benchmarks/results/vllm_update_<flavour>.json.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.config import Config
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.placement import VLLMPlacement, vllm_placement
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.inference.vllm_engine import VLLMEngine
from pipelinerl_fsdp.inference.vllm_load import LOADS
from pipelinerl_fsdp.job.world import init_world
from pipelinerl_fsdp.models import FLAVOURS, build_model, flavour_args, load_hf_model, save_hf_folder
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer, load_tokenizer
from pipelinerl_fsdp.transport.stalls import push_stall_s
from pipelinerl_fsdp.transport.store_group import join_store_group, store_address
from pipelinerl_fsdp.transport.weights import WeightReceiver, WeightSender

BUCKET = 64 * 1024**2


def memcpy_ms(nbytes: int) -> float:
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)
    t0 = time.perf_counter()
    b.copy_(a)
    return (time.perf_counter() - t0) * 1000


def bench(
    name: str,
    n_updates: int,
    loads: list[str],
    work: Path,
    world,
    cfg: Config,
    gpu: bool = False,
    real: Path | None = None,
) -> list[dict] | None:
    if real is not None:  # a real model folder (SmolLM2: 538 MB in fp32), its own weights and tokenizer
        tok, model, name = load_tokenizer(real), load_hf_model(real).eval(), real.name
    else:
        tok = build_char_tokenizer(ALPHABET)
        # the flavour's body with the character vocabulary ("small": 75.6M parameters then)
        args = flavour_args(name, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model = build_model(args, seed=0).eval()
    layout = [(n, p.shape) for n, p in model.named_parameters()]
    # --gpu: the engine on GPU 0 in bf16 (the weights travel in bf16); the buckets still go over gloo, since one GPU
    # cannot hold both ends of an NCCL group
    wire = torch.bfloat16 if gpu else torch.float32
    nbytes = sum(p.numel() for p in model.parameters()) * (2 if gpu else 4)
    folder = real or work / name
    if world.rank == 0 and real is None:
        save_hf_folder(folder, args, model.state_dict())
        tok.save_pretrained(str(folder))
    dist.barrier()
    if world.rank == 0:
        group = join_store_group(*store_address(), f"bench_{name}", 0, 2, "gloo", torch.device("cpu"), 600)
        stall_s = push_stall_s("pipeline", 600)  # as the job's sender: its waits poll for engines left behind
        cpu = torch.device("cpu")
        sender = WeightSender(model, world.weight_group, 0, True, wire, cpu, BUCKET, group, 600, stall_s)
        for v in range(1, n_updates * len(loads) + 1):
            dist.barrier()  # the engine is generating
            sender.push(v)
        dist.barrier()
        return None
    # Built by hand, not by the factory: each load way (`weight_load`) in turn, and the receive side (receiver,
    # bucket group) set up here with this benchmark's bucket size and wire dtype, which is what it measures.
    engine = VLLMEngine(
        folder,
        max_num_seqs=32,
        max_len=160,
        temperature=1.0,
        top_p=1.0,
        seed=0,
        dtype="bfloat16" if gpu else "float32",
        placement=VLLMPlacement(cpu_cores=None, gpu_ids=[0])
        if gpu
        else vllm_placement(cfg.inference, cfg.job.threads_per_rank, world),
        kv_cache_gib=1,
        ignore_eos=True,
        weight_load=loads[0],
    )
    receiver = WeightReceiver(layout, world.weight_group, 0, wire, torch.device("cpu"), BUCKET)
    engine.join_weight_group(
        *store_address(),
        1,
        2,
        "gloo",
        600,
        [(n, list(s)) for n, s in layout],
        str(wire).removeprefix("torch."),
        BUCKET,
        group_name=f"bench_{name}",
    )
    gen = torch.Generator().manual_seed(0)
    next_id = 0

    def top_up() -> None:
        nonlocal next_id
        while engine.num_unfinished() < 16:
            engine.add(Request(next_id, torch.randint(3, len(tok), (8,), generator=gen).tolist(), 128))
            next_id += 1

    def tokens_per_s(n: int = 16) -> float:
        """Completion tokens per second of `n` requests of 128 tokens submitted together to an idle engine."""
        nonlocal next_id
        while engine.num_unfinished():
            engine.step(timeout=0.05)
        tokens0 = engine.generated_tokens
        t0 = time.perf_counter()
        for _ in range(n):
            engine.add(Request(next_id, torch.randint(3, len(tok), (8,), generator=gen).tolist(), 128))
            next_id += 1
        while engine.num_unfinished():
            engine.step(timeout=0.01)
        return (engine.generated_tokens - tokens0) / (time.perf_counter() - t0)

    top_up()
    print(f"[{name}] engine up, generating", flush=True)
    while not engine.step(timeout=0.1):  # first requests done: past vLLM's warm-up
        top_up()
    print(f"[{name}] first requests done", flush=True)
    rows = []
    for load in loads:
        engine.set_weight_load(load)
        pauses, loads_ms, waits_ms = [], [], []
        for _ in range(n_updates):
            top_up()
            time.sleep(0.2)
            dist.barrier()
            _, version = receiver.wait_header()
            t0 = time.perf_counter()
            engine.load_update(receiver, version, kv_max_age=-1)
            pauses.append((time.perf_counter() - t0) * 1000)
            load_s, wait_s = engine.last_load_seconds()
            loads_ms.append(load_s * 1000)
            waits_ms.append(wait_s * 1000)
            print(
                f"[{name}] {load} update {version}: pause {pauses[-1]:.1f} ms, in the worker {loads_ms[-1]:.1f} "
                f"ms (waiting for buckets {waits_ms[-1]:.1f})",
                flush=True,
            )
            receiver.post()
            engine.step(timeout=0.01)
        rows.append(
            {
                "model": name,
                "load": load,
                "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                "mb": nbytes / 1e6,
                "pause_ms_median": statistics.median(pauses),
                "pause_ms_min": min(pauses),
                "pause_ms_max": max(pauses),
                "worker_load_ms_median": statistics.median(loads_ms),
                "bucket_wait_ms_median": statistics.median(waits_ms),
                "memcpy_ms": memcpy_ms(nbytes),
                # the engine's speed with the weights as this load leaves them ("unpacked" changes the CPU kernels)
                "tokens_per_s": tokens_per_s(),
            }
        )
    dist.barrier()
    engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--flavour", choices=sorted(FLAVOURS), default="debug")
    p.add_argument("--model", type=Path, default=None, help="a real HF model folder instead of --flavour")
    p.add_argument("--updates", type=int, default=5, help="updates per load way")
    p.add_argument("--loads", default=",".join(LOADS), help=f"load ways to compare, in this order ({LOADS})")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/vllm_update_<flavour>.json")
    p.add_argument("--gpu", action="store_true", help="the engine on GPU 0 in bf16 (scripts/gpu_check.sh)")
    a = p.parse_args()
    loads = a.loads.split(",")
    for load in loads:
        if load not in LOADS:
            p.error(f"--loads: {load!r} is not one of {LOADS}")
    cfg = Config(inference=VLLMInferenceConfig())  # the vLLM engine's own section (as load_config selects it)
    cfg.job.stage, cfg.world.inference_ranks = "rl", 1
    world = init_world(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        obj = [tmp]
        dist.broadcast_object_list(obj, src=0)  # one folder for both ranks
        rows = bench(a.flavour, a.updates, loads, Path(obj[0]), world, cfg, a.gpu, a.model)
    if world.rank == 1:
        assert rows is not None
        table = [
            [f"{r['model']} ({r['params_m']:.1f}M)", r["load"], round(r["mb"], 1),
             f"{r['pause_ms_median']:.1f} ({r['pause_ms_min']:.1f}..{r['pause_ms_max']:.1f})",
             f"{r['worker_load_ms_median']:.1f} ({r['bucket_wait_ms_median']:.1f})", round(r["memcpy_ms"], 2),
             f"{r['pause_ms_median'] / max(r['memcpy_ms'], 1e-9):.0f}x", round(r["tokens_per_s"])]
            for r in rows
        ]  # fmt: skip
        cols = ["model", "load", "MB", "pause ms (median, min..max)", "in the worker (bucket waits)", "memcpy ms",
                "pause / memcpy", "tokens/s after"]  # fmt: skip
        out = a.out or RESULTS / f"vllm_update_{a.model.name if a.model else a.flavour}.json"
        report(out, "A vLLM engine's pause per in-flight update", cols, table, {"rows": rows})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
