"""Peak host memory measured on CPU for scaled-down shapes, next to what the memory plan (`pipelinerl_fsdp/plan.py`,
`--job.stage=plan`) predicts for the same shapes. The plan sizes 7B jobs on GPUs no session can try; this checks
its formulas where they can be measured.

    python -m benchmarks.memory_vs_plan [--quick] [--out benchmarks/results/memory_vs_plan.json]

Each item runs in a fresh process (two ranks under torchrun where the item has two sides); the measured number is
the peak growth of the process's anonymous resident memory over the item (`pipelinerl_fsdp/runtime/host_memory.py`: the
page cache of memory-mapped files left out, freed heap given back before the baseline; large allocations go
through mmap so that a freed tensor leaves the process). Items, fp32:

- load: per-rank peak while `policy.load_sharded` fills 2 FSDP2 ranks from a 4-shard folder.
- step, activation checkpointing off / full: forward + backward of one packed micro-batch (4 documents) through a
  1-rank FSDP2 model with chunked log-probs, after a warm-up step (optimizer state exists, gradients freed).
- attention: one 16k-token row of 16 documents through `document_attention` (forward).
- weight sync, sender / receiver: the first update through the first trainer rank's `WeightSender` and through a
  vLLM worker's receive path (`WeightUpdateExtension`, with a stand-in for vLLM's model runner that keeps the
  vocabulary tensors until the end of the update, as vLLM's layerwise reload does).
- trained state, full fine-tuning / LoRA (rank 16, all seven linears): what a 1-rank FSDP2 trainer holds between
  steps at SmolLM2's shape (parameters or frozen base + adapters, gradients, AdamW state), resident growth after
  one optimizer step (not in `--quick`'s items, which the e2e test runs).
Prints a table (plan MB, measured MB, measured / plan) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import RESULTS, ROOT, report
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.args import ModelArgs
from pipelinerl_fsdp.plan import trainer_memory
from pipelinerl_fsdp.plan_sizes import attention_extra_bytes, load_host_memory, weight_sync_buffers
from pipelinerl_fsdp.runtime.host_memory import PeakAnon
from pipelinerl_fsdp.runtime.torchrun import torchrun_command

MB = 1 << 20
MODULE = "benchmarks.memory_vs_plan"  # each item runs this module again, in a fresh process
# the 1-process items run without torchrun; init_world makes a 1-rank gloo group
BASE_ARGS = [
    "--config",
    "arithmetic",
    "--job.stage=warmstart",
    "--job.threads_per_rank=1",
    "--trainer.param_dtype=float32",
    "--trainer.reduce_dtype=float32",
    "--trainer.fp32_head=off",
    "--trainer.defer_grad_sync=false",
    "--inference.dtype=float32",
]


def step_shape(quick: bool) -> tuple[ModelArgs, int]:
    """A model whose activations dominate a step (as at 7B with long rows), and the micro-batch's tokens."""
    args = flavour_args(
        "debug",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
    )
    return args, 2048 if quick else 4096


def sync_args(quick: bool) -> ModelArgs:
    return flavour_args("small", vocab_size=8192 if quick else 32768)


def result(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def item_step(checkpointing: str, quick: bool) -> None:
    from pipelinerl_fsdp.job.world import init_world
    from pipelinerl_fsdp.training.policy import build_policy, shard

    args, tokens = step_shape(quick)
    cfg = load_config(
        [
            *BASE_ARGS,
            "--world.inference_ranks=0",
            f"--trainer.micro_batch_tokens={tokens}",
            f"--trainer.activation_checkpointing={checkpointing}",
        ]
    )
    world = init_world(cfg)
    torch.set_num_threads(1)
    model = shard(build_model(args, seed=0), world, cfg.trainer)
    policy = build_policy(model, cfg.trainer.optimizer, 10)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (1, tokens), generator=gen)
    pos = torch.arange(tokens // 4).repeat(4)[None]  # 4 packed documents
    targets = torch.randint(0, args.vocab_size, (1, tokens), generator=gen)

    def fwd_bwd() -> None:
        logp, _ = model(ids, pos, targets=targets, logprob_chunk_size=cfg.trainer.logprob_chunk_size)
        logp.sum().backward()

    fwd_bwd()
    policy.step()
    policy.optimizer.zero_grad(set_to_none=True)
    with PeakAnon() as m:
        fwd_bwd()
    plan = trainer_memory(
        cfg.trainer,
        args,
        1,
        checkpointing == "full",
        engine_dtype=cfg.inference.dtype,
        bucket_mb=cfg.world.weight_bucket_mb,
        kl_reference=cfg.rl.kl_coef > 0,
    )
    in_step = [
        k
        for k in plan
        if k.startswith(("activations", "attention", "log-prob", "gradients", "gathered blocks", "root"))
    ]
    result(
        item=f"step, activation checkpointing {checkpointing} ({tokens} tokens)",
        plan_mb=sum(plan[k] for k in in_step) / MB,
        measured_mb=m.grown / MB,
        plan_items={k: round(plan[k] / MB, 1) for k in in_step},
    )


def item_attention(quick: bool) -> None:
    from pipelinerl_fsdp.models.decoder import Documents, document_attention

    torch.set_num_threads(1)
    tokens, docs = (8192 if quick else 16384), 16
    args = flavour_args("debug", hidden_size=512, num_attention_heads=8, num_key_value_heads=8, vocab_size=64)
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    q, k, v = (torch.randn(1, args.num_attention_heads, tokens, hd) for _ in range(3))
    pos = torch.arange(tokens // docs).repeat(docs)[None]
    spans = Documents.from_positions(pos)
    with torch.no_grad(), PeakAnon() as m:
        out = document_attention(q, k, v, spans, False)
    del out
    result(
        item=f"attention, one {tokens}-token row of {docs} documents",
        plan_mb=attention_extra_bytes(args, tokens, 4) / MB,
        measured_mb=m.grown / MB,
    )


def item_load(folder: Path, quick: bool) -> None:
    import torch.distributed as dist

    from pipelinerl_fsdp.job.world import init_world
    from pipelinerl_fsdp.models import save_hf_folder
    from pipelinerl_fsdp.training.policy import load_sharded

    cfg = load_config([*BASE_ARGS, "--world.inference_ranks=0"])
    world = init_world(cfg)
    args = sync_args(quick)
    if world.rank == 0:
        model = build_model(args, seed=3)
        save_hf_folder(folder, args, model.state_dict(), max_shard_bytes=args.num_params() * 4 // 3)
        del model
    else:  # the same one-time initialisations (torch's generator, safetensors) as rank 0, outside the measurement
        tiny = flavour_args("debug", vocab_size=64)
        save_hf_folder(folder.with_name("warm-up"), tiny, build_model(tiny, seed=3).state_dict())
    dist.barrier()
    with PeakAnon() as m:
        model = load_sharded(folder, world, cfg.trainer)
    n = world.trainer_mesh.size()
    plan = load_host_memory(args, n, 4, 4, on_gpu=False)
    files = len(list(folder.glob("*.safetensors")))
    result(
        item=f"load, rank {world.rank} of {n}, {files}-shard folder, {args.num_params() * 4 / MB:.0f} MB model",
        plan_mb=sum(plan.values()) / MB,
        measured_mb=m.grown / MB,
    )
    dist.barrier()
    dist.destroy_process_group()


class _ModelRunner:
    """Stands in for vLLM's model runner in `WeightUpdateExtension._load`: copies each streamed tensor into the
    engine's parameter, and (as vLLM's layerwise reload does) keeps the vocabulary tensors until the update ends."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.requests: dict = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        from pipelinerl_fsdp.transport.weights import in_decoder_layer

        held = []
        for name, t in weights_iterator:
            self.params[name].copy_(t)
            if not in_decoder_layer(name):
                held.append(t)
        held.clear()


def item_sync(quick: bool) -> None:
    import torch.distributed as dist

    from pipelinerl_fsdp.inference.vllm_extension import WeightUpdateExtension
    from pipelinerl_fsdp.job.world import init_world
    from pipelinerl_fsdp.training.parallelize import apply_fsdp
    from pipelinerl_fsdp.transport.store_group import join_store_group, store_address
    from pipelinerl_fsdp.transport.weights import WeightReceiver, WeightSender

    cfg = load_config([*BASE_ARGS, "--world.inference_ranks=1"])
    world = init_world(cfg)
    torch.set_num_threads(1)
    args = sync_args(quick)
    bucket = cfg.world.weight_bucket_mb * MB
    model = build_model(args, seed=0)
    layout = [(n, list(p.shape)) for n, p in model.named_parameters()]
    send, receive, _ = weight_sync_buffers(args, cfg.inference.dtype, cfg.world.weight_bucket_mb, sent_as_is=True)
    root = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("model.layers."))
    if world.is_trainer:
        apply_fsdp(model, world.trainer_mesh, torch.float32, torch.float32)
        with PeakAnon() as m:
            group = join_store_group(*store_address(), "mem_sync", 0, 2, "gloo", torch.device("cpu"), 120)
            sender = WeightSender(model, world.weight_group, 0, True, torch.float32, torch.device("cpu"), bucket, group)
            sender.push(1)
        result(item="weight sync, sender (first trainer rank)", plan_mb=send / MB, measured_mb=m.grown / MB)
    else:
        # the inference rank takes the header on the weight group; the worker (here the same process) the buckets
        headers = WeightReceiver(layout, world.weight_group, 0, torch.float32, torch.device("cpu"), bucket)
        worker = WeightUpdateExtension()
        worker.model_runner = _ModelRunner(dict(model.named_parameters()))  # type: ignore[attr-defined]
        with torch.no_grad(), PeakAnon() as m:
            worker.join_weight_group(*store_address(), 1, 2, "gloo", 120, layout, "float32", bucket, "mem_sync")
            headers.wait_header()
            worker.receive_weight_update(load=True)
        result(
            item="weight sync, receiver (a vLLM worker)",
            plan_mb=(receive + root) / MB,
            measured_mb=m.grown / MB,
        )
    dist.barrier()
    dist.destroy_process_group()


def smollm2_shape(quick: bool) -> ModelArgs:
    """SmolLM2-135M's shape (hidden 576, 9 / 3 heads, tied embeddings); `quick`: 6 of its 30 layers."""
    return flavour_args(
        "debug",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=6 if quick else 30,
        tie_word_embeddings=True,
    )


def item_state(variant: str, quick: bool) -> None:
    """What a trainer rank holds between steps (1-rank FSDP2, fp32), full fine-tuning against `[lora]` (rank 16,
    all seven linears): parameters (or the frozen base and the adapters), the gradients and AdamW's state of what
    trains. Measured: resident growth from before the model is built to after one optimizer step on a 64-token
    batch, gradients kept (the step's temporaries freed)."""
    from pipelinerl_fsdp.config import LoRAConfig
    from pipelinerl_fsdp.job.world import init_world
    from pipelinerl_fsdp.models.lora import apply_lora, init_adapters
    from pipelinerl_fsdp.runtime.host_memory import anon_bytes, release_free_heap
    from pipelinerl_fsdp.training.policy import build_policy, shard

    args = smollm2_shape(quick)
    lora = LoRAConfig(enabled=variant == "lora", rank=16)
    cfg = load_config([*BASE_ARGS, "--world.inference_ranks=0", "--trainer.micro_batch_tokens=64"])
    world = init_world(cfg)
    torch.set_num_threads(1)
    release_free_heap()
    base = anon_bytes()
    model = build_model(args, seed=0)
    if lora.enabled:
        apply_lora(model, lora)
    model = shard(model, world, cfg.trainer)
    if lora.enabled:
        init_adapters(model, seed=0)
    policy = build_policy(model, cfg.trainer.optimizer, 10)
    ids = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    logp, _ = model(ids, torch.arange(64)[None], targets=ids)
    logp.sum().backward()
    policy.optimizer.step()  # AdamW's state exists from here; the gradients are kept
    del logp
    release_free_heap()
    held = anon_bytes() - base
    plan = trainer_memory(cfg.trainer, args, 1, False, engine_dtype="float32", lora=lora)
    state = [k for k in plan if k.startswith(("parameters", "base parameters", "LoRA adapters", "gradients", "AdamW"))]
    result(
        item=f"trained state, {'LoRA rank 16' if lora.enabled else 'full fine-tuning'}, SmolLM2 shape"
        + (" (6 layers)" if quick else ""),
        plan_mb=sum(plan[k] for k in state) / MB,
        measured_mb=held / MB,
        plan_items={k: round(plan[k] / MB, 1) for k in state},
    )


def run_item(name: str, quick: bool, tmp: Path) -> list[dict]:
    """Run one item in a fresh process (under torchrun for the two-rank ones); its RESULT lines."""
    me = ["--item", name, "--tmp", str(tmp)] + (["--quick"] if quick else [])
    if name in ("load", "sync"):
        cmd, env = torchrun_command(2, MODULE, *me, module=True)
    else:
        cmd, env = [sys.executable, "-m", MODULE, *me], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # large allocations through mmap: a freed tensor leaves the process
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines() if "RESULT " in line]
    if r.returncode or not rows:
        raise RuntimeError(f"{name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return rows


ITEMS = ("load", "step_off", "step_full", "attention", "sync")
# full fine-tuning against LoRA (`python -m benchmarks.memory_vs_plan`, not the e2e test's quick run)
STATE_ITEMS = ("state_full", "state_lora")


def measure(quick: bool, items: tuple[str, ...] = ITEMS) -> list[dict]:
    """Every item's rows, each with plan_mb, measured_mb and ratio (measured / plan)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in items:
            for row in run_item(name, quick, Path(tmp)):
                row["ratio"] = row["measured_mb"] / row["plan_mb"]
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes (the test's)")
    ap.add_argument("--item", choices=ITEMS + STATE_ITEMS, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "memory_vs_plan.json")
    a = ap.parse_args()
    if a.item:
        if a.item == "load":
            item_load(a.tmp / "load_folder", a.quick)
        elif a.item == "sync":
            item_sync(a.quick)
        elif a.item == "attention":
            item_attention(a.quick)
        elif a.item.startswith("state_"):
            item_state(a.item.removeprefix("state_"), a.quick)
        else:
            item_step(a.item.removeprefix("step_"), a.quick)
        return
    rows = measure(a.quick, ITEMS + STATE_ITEMS)
    report(
        a.out,
        "Memory: the plan's formulas against memory measured on CPU",
        ["item", "plan MB", "measured MB", "measured / plan"],
        [[r["item"], round(r["plan_mb"], 1), round(r["measured_mb"], 1), round(r["ratio"], 3)] for r in rows],
        {"quick": a.quick, "rows": rows},
    )


if __name__ == "__main__":
    main()
