"""Our trainer step's speed on one device: tokens/s and MFU of forward + backward + AdamW on packed rows through
FSDP2 (one rank), the model built from a named shape with random weights, and the SDPA kernel that the packed
rows' document attention actually gets.

    python -m benchmarks.train_step_speed --flavour qwen2.5-0.5b --tokens 8192 --docs 8    # a GPU (bf16)
    python -m benchmarks.train_step_speed --flavour debug --tokens 1024 --docs 8           # CPU (fp32)

MFU = 6 x parameters x tokens/s / the device's peak dense bf16 FLOP/s (--peak-tflops; H100/H200 SXM: 989).
`plan_gib`: what `--job.stage=plan` predicts for this step on one rank (weight sync and CUDA context left out),
next to the measured `peak_mem_gib`.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.config import OptimizerConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.decoder import Documents, document_attention
from pipelinerl_fsdp.plan import trainer_memory
from pipelinerl_fsdp.training.optim import build_optimizer
from pipelinerl_fsdp.training.parallelize import apply_activation_checkpointing, apply_fsdp, resolve_fp32_head


def sdpa_kernel_for_packed_rows(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, hd: int) -> str:
    """The first SDPA backend (flash, memory-efficient, math) that runs our document attention on this device."""
    q = torch.randn(1, heads, 1024, hd, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, 1024, hd, device=device, dtype=dtype)
    docs = Documents.from_positions(torch.arange(256).repeat(4)[None])
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        try:
            with sdpa_kernel([backend]):
                document_attention(q, k, k, docs, enable_gqa=heads != kv_heads)
            return name
        except RuntimeError:
            continue
    return "none"


def planned_peak(args, tokens: int, checkpointing: bool, dtype: torch.dtype) -> float:
    """The plan's bytes for this step on one rank (`plan.trainer_memory`), less what this benchmark does not have
    (the weight sync's buffers, the CUDA context: `max_memory_allocated` does not see the context)."""
    cfg = load_config(
        [
            f"--trainer.micro_batch_tokens={tokens}",
            f"--trainer.param_dtype={str(dtype).removeprefix('torch.')}",
            "--trainer.ac_every=1",
            "--trainer.defer_grad_sync=false",  # this step has one micro-batch
        ]
    )
    items = trainer_memory(
        cfg.trainer,
        args,
        1,
        checkpointing,
        engine_dtype=cfg.inference.dtype,
        bucket_mb=cfg.world.weight_bucket_mb,
        kl_reference=cfg.rl.kl_coef > 0,
    )
    return sum(v for k, v in items.items() if not k.startswith(("weight sync", "CUDA context")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavour", default="debug")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per packed row (one micro-batch)")
    p.add_argument("--docs", type=int, default=8, help="documents per row")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", type=Path, default=RESULTS / "train_step_speed.json")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    args = flavour_args(a.flavour)
    model = build_model(args, device=device, seed=0)
    apply_activation_checkpointing(model, "full" if a.checkpointing else "off", 1)
    apply_fsdp(model, mesh, dtype, torch.float32, resolve_fp32_head("auto", dtype))
    opt, _ = build_optimizer(model.parameters(), OptimizerConfig(lr=1e-5), 100)
    pos = torch.arange(a.tokens // a.docs).repeat(a.docs)[None].to(device)
    ids = torch.randint(0, args.vocab_size, pos.shape, device=device)
    targets = torch.randint(0, args.vocab_size, pos.shape, device=device)
    times = []
    for step in range(a.steps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logp, _ = model(ids, pos, targets=targets)
        (-logp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step:  # the first step warms up
            times.append(time.perf_counter() - t0)
    secs = sorted(times)[len(times) // 2]
    tok_s = a.tokens / secs
    n = args.num_params()
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    row = {
        "flavour": a.flavour,
        "params_m": round(n / 1e6, 1),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": a.tokens,
        "docs": a.docs,
        "checkpointing": a.checkpointing,
        "step_s": round(secs, 4),
        "tokens_per_s": round(tok_s, 1),
        "mfu": round(6 * n * tok_s / (a.peak_tflops * 1e12), 4) if cuda else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "plan_gib": round(planned_peak(args, a.tokens, a.checkpointing, dtype) / 2**30, 2),
        "sdpa_kernel": sdpa_kernel_for_packed_rows(
            device, dtype, args.num_attention_heads, args.num_key_value_heads, hd
        ),
    }
    report(a.out, "Trainer step speed on one device", list(row), [list(row.values())], row)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
