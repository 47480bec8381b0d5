"""Cost models from a hardware spec and the model's shape: rooflines with every assumption a named parameter.

The spec (`GpuSpec`) is a GPU's datasheet numbers; the shape (`ModelShape`) the decoder's sizes, read from the
project's model flavours (`pipelinerl_fsdp.models.args`) or an HF config. Nothing here is measured: a profile from
the micro-benchmarks (`perf/profile.py`) replaces these numbers where one exists. Engines run on one GPU each
(tensor parallelism is left out: the paper's 7B engines each use one GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipelinerl_fsdp.perf.costs import DecodeCost, PushCost, TrainCost


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's datasheet numbers. Interconnect bandwidths are per GPU and per direction."""

    name: str
    bf16_flops: float  # dense (no sparsity) bf16 tensor-core peak, FLOP/s
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # NVLink
    inter_node_bytes_per_s: float  # the GPU's share of the network (one NIC per GPU)
    memory_gib: float
    gpus_per_node: int = 8


# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB, NVLink 4
# 900 GB/s bidirectional = 450 GB/s per direction; DGX H100: one 400 Gb/s ConnectX-7 (InfiniBand NDR) per GPU
# = 50 GB/s.
H100_SXM = GpuSpec("H100 SXM 80GB", 989e12, 3.35e12, 450e9, 50e9, 80)
# NVIDIA H200 SXM datasheet: the H100's compute, 4.8 TB/s HBM3e, 141 GB; same NVLink 4 and NDR network (DGX H200).
H200_SXM = GpuSpec("H200 SXM 141GB", 989e12, 4.8e12, 450e9, 50e9, 141)
# NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s bidirectional =
# 300 GB/s per direction; DGX A100: one 200 Gb/s HDR InfiniBand per GPU = 25 GB/s.
A100_80GB = GpuSpec("A100 SXM 80GB", 312e12, 2.039e12, 300e9, 25e9, 80)
GPUS = {"h100": H100_SXM, "h200": H200_SXM, "a100": A100_80GB}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the costs need, from a decoder's hyper-parameters."""

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_args(cls, args: Any) -> ModelShape:
        """From a `pipelinerl_fsdp.models.args.ModelArgs`."""
        return cls(
            params=args.num_params(),
            layers=args.num_hidden_layers,
            hidden=args.hidden_size,
            heads=args.num_attention_heads,
            kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim or args.hidden_size // args.num_attention_heads,
            vocab=args.vocab_size,
            tied_embeddings=args.tie_word_embeddings,
        )

    @classmethod
    def flavour(cls, name: str) -> ModelShape:
        """A named flavour of `pipelinerl_fsdp.models.args.FLAVOURS` ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")."""
        from pipelinerl_fsdp.models.args import flavour_args  # imports torch with the models package: only here

        return cls.from_args(flavour_args(name))

    @property
    def matmul_params(self) -> int:
        """Parameters in matrix products per token: all but the input embedding, which is a lookup (a tied
        embedding is the head too, so it counts)."""
        return self.params if self.tied_embeddings else self.params - self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """One token's K and V over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def attention_flops_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair over all layers: q.k and p.v, 2 x 2 x heads x head_dim each."""
        return 4 * self.layers * self.heads * self.head_dim


def decode_from_spec(
    shape: ModelShape,
    gpu: GpuSpec,
    *,
    dtype_bytes: int = 2,
    step_overhead_s: float = 1.5e-3,
    hbm_efficiency: float = 1.0,
    flops_efficiency: float = 0.5,
    per_seq_overhead_s: float = 0.0,
    prefill_mfu: float = 0.5,
) -> DecodeCost:
    """The decode roofline of one engine on one GPU.

    base_s = weight bytes / (HBM bandwidth x hbm_efficiency) + step_overhead_s: every step reads every weight once;
      step_overhead_s is the scheduler's and the launches' per-step host time, which a roofline misses (Vidur's
      blind spot). Default 1.5 ms, an assumption: a published 8B step at batch 1 (SGLang PR #1401, 7.06 ms with
      CUDA graphs) sits ~2.3 ms above its ~4.8 ms roofline.
    per_seq_s = 2 x matmul params / (bf16 peak x flops_efficiency) + per_seq_overhead_s: a sequence's matrix
      products at decode (skinny GEMMs: half the peak by default; they only matter once the batch is past the
      ridge point, a few hundred sequences on an H100) and its host-side cost (sampling, log-probs, output).
    per_kv_s = KV bytes per token / (HBM bandwidth x hbm_efficiency): attention reads each cached token once.
    prefill_per_token_s = 2 x matmul params / (bf16 peak x prefill_mfu): a prompt is compute bound."""
    for name, v in (
        ("hbm_efficiency", hbm_efficiency),
        ("flops_efficiency", flops_efficiency),
        ("prefill_mfu", prefill_mfu),
    ):
        if not 0 < v <= 1:
            raise ValueError(f"decode_from_spec: {name} = {v} must be in (0, 1]")
    hbm = gpu.hbm_bytes_per_s * hbm_efficiency
    return DecodeCost(
        base_s=shape.params * dtype_bytes / hbm + step_overhead_s,
        per_seq_s=2 * shape.matmul_params / (gpu.bf16_flops * flops_efficiency) + per_seq_overhead_s,
        per_kv_s=shape.kv_bytes_per_token(dtype_bytes) / hbm,
        prefill_per_token_s=2 * shape.matmul_params / (gpu.bf16_flops * prefill_mfu),
    )


def train_from_spec(
    shape: ModelShape,
    gpu: GpuSpec,
    gpus: int,
    *,
    mfu: float = 0.35,
    micro_batch_tokens: int = 32768,
    micro_batch_overhead_s: float = 5e-3,
    step_overhead_s: float = 0.05,
    grad_bytes: int = 4,
    optimizer_bytes_per_param: int = 36,
) -> TrainCost:
    """The trainer's step on `gpus` GPUs (FSDP2 data parallel).

    per_token_s = 6 x matmul params / (bf16 peak x mfu x gpus): forward and backward of the matrix products; mfu
      is an assumption (TorchTitan reports 33-39% for Llama-3-8B on 8 H100s: 0.35).
    per_token_ctx_s = 3 x attention FLOPs per (query, key) pair / (peak x mfu x gpus): causal attention, forward
      and backward, over sum(len^2) / 2 pairs.
    per_micro_batch_s = micro_batch_overhead_s: launches and FSDP2's per-micro-batch gathers not hidden behind
      compute (an assumption: 5 ms).
    step_base_s = step_overhead_s (an assumption: 50 ms of host work, the loss statistics' read, the schedule) +
      the gradients' reduce-scatter, grad_bytes per parameter over the slowest link a ring crosses (inter-node once
      gpus > gpus_per_node), counted whole (FSDP2 overlaps part of it with the last backward: an upper bound) +
      AdamW's optimizer_bytes_per_param of HBM traffic on each GPU's shard (fp32 master, gradient, two moments,
      read and written)."""
    if gpus < 1 or not 0 < mfu <= 1:
        raise ValueError(f"train_from_spec: gpus ({gpus}) >= 1 and mfu ({mfu}) in (0, 1]")
    rate = gpu.bf16_flops * mfu * gpus
    link = gpu.inter_node_bytes_per_s if gpus > gpu.gpus_per_node else gpu.intra_node_bytes_per_s
    ring = (gpus - 1) / gpus
    sync = grad_bytes * shape.params * ring / link if gpus > 1 else 0.0
    optim = shape.params / gpus * optimizer_bytes_per_param / gpu.hbm_bytes_per_s
    return TrainCost(
        step_base_s=step_overhead_s + sync + optim,
        per_token_s=6 * shape.matmul_params / rate,
        per_micro_batch_s=micro_batch_overhead_s,
        per_token_ctx_s=3 * shape.attention_flops_per_pair() / rate,
        ranks=gpus,
        micro_batch_tokens=micro_batch_tokens,
    )


def push_from_spec(
    shape: ModelShape,
    gpu: GpuSpec,
    trainer_gpus: int,
    *,
    dtype_bytes: int = 2,
    bucket_mb: int = 64,
    per_bucket_s: float = 1e-3,
    load_base_s: float = 0.02,
    load_copies: float = 2.0,
    engines_off_node: bool = True,
) -> PushCost:
    """The weight push: the model in the engines' dtype, in `job.weight_bucket_mb` buckets.

    Gather: each bucket all-gathered over the trainer ranks (ring: (g-1)/g of its bytes cross the slowest link,
      inter-node once the trainer spans nodes). Broadcast: from the first trainer rank to every engine, pipelined
      (a ring or tree broadcast moves the bytes once per link whatever the number of receivers), over the
      inter-node link when engines sit on other nodes (`engines_off_node`), else NVLink; per_bucket_s: a
      collective's launch and the loop around it (an assumption: 1 ms).
    Load: load_base_s (pausing and resuming the scheduler, an assumption: 20 ms) + load_copies passes of the bytes
      over HBM (a copy into place reads and writes each byte once)."""
    nbytes = shape.params * dtype_bytes
    inter = trainer_gpus > gpu.gpus_per_node
    gather_link = gpu.inter_node_bytes_per_s if inter else gpu.intra_node_bytes_per_s
    gather = gather_link * trainer_gpus / (trainer_gpus - 1) if trainer_gpus > 1 else 0.0
    return PushCost(
        bytes=nbytes,
        bucket_bytes=bucket_mb * 2**20,
        link_bytes_per_s=gpu.inter_node_bytes_per_s if engines_off_node else gpu.intra_node_bytes_per_s,
        gather_bytes_per_s=gather,
        per_bucket_s=per_bucket_s,
        load_base_s=load_base_s,
        load_per_byte_s=load_copies / gpu.hbm_bytes_per_s,
    )


def gpu_spec(name: str) -> GpuSpec:
    """A preset by name: h100, h200, a100."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose one of {sorted(GPUS)}") from None
