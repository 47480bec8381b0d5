"""The sizes the plan (`plan.py`) counts from, none of them a memory item yet: the model's shape, its parameters
in order, the activations a decoder block keeps per token, the weight sync's buffers from its exact bucket layout,
host memory while loading, and under `[lora]` the adapters and the base weights they target."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from pipelinerl_fsdp.config import ConfigError, LoRAConfig, ModelConfig
from pipelinerl_fsdp.inference.lora_merge import VLLM_PACKED, loaded_weights
from pipelinerl_fsdp.models.args import ModelArgs, flavour_args
from pipelinerl_fsdp.models.hf_io import read_model_args
from pipelinerl_fsdp.models.lora import adapted_weight_name, adapter_layout
from pipelinerl_fsdp.transport.weights import layer_buckets, slot_sizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan_model_args(model: ModelConfig) -> tuple[ModelArgs, str]:
    """The model's shape and where it came from: `model.path`'s config.json, else `model.flavour`."""
    config_json = Path(model.path) / "config.json" if model.path else None
    if config_json is not None and config_json.is_file():
        return read_model_args(model.path), str(config_json)
    try:
        return flavour_args(model.flavour), f"model.flavour = {model.flavour!r}"
    except ValueError as e:
        raise ConfigError(f"plan: model.path has no config.json and {e}") from None


def block_activation_elements(args: ModelArgs) -> int:
    """Elements autograd keeps per token for one decoder block (flash-style attention: no score matrix)."""
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    kv = args.num_key_value_heads * hd
    return 7 * args.hidden_size + 2 * kv + args.num_attention_heads + 4 * args.intermediate_size + 2 * hd + 2


def parameter_sizes(args: ModelArgs) -> list[tuple[str, int]]:
    """(name, elements) of every parameter in `named_parameters()` order: the model built on the meta device."""
    import torch

    from pipelinerl_fsdp.models.decoder import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return [(n, p.numel()) for n, p in model.named_parameters()]


class LoRASizes(NamedTuple):
    """What `[lora]` adds to a model of a shape, in elements (`lora_sizes`)."""

    adapters: list[tuple[str, int]]  # (name, elements) of every factor, in push order
    targeted: list[int]  # elements of each targeted base weight
    w0: int  # elements of the base weights a vLLM engine keeps to merge from (targets + fused siblings)
    w0_each: list[int]  # ... each of them (how pinned host memory packs them: `lora_merge.slab_layout`)
    widths: int  # the targeted linears' input widths summed over one block (what dropout keeps)


def lora_sizes(args: ModelArgs, lora: LoRAConfig) -> LoRASizes:
    """The sizes `[lora]` adds: the adapter layout (`models.lora.adapter_layout`), the targeted weights, and the
    weights W0 an engine keeps (`inference.lora_merge.loaded_weights` with vLLM's fused groups: targets q and v
    keep k too, since vLLM loads q, k and v into one parameter)."""
    layout = adapter_layout(args, lora)
    base = dict(parameter_sizes(args))
    a = [(adapted_weight_name(n), shape) for n, shape in layout if ".lora_A." in n]
    kept = loaded_weights([n for n, _ in layout], VLLM_PACKED)
    return LoRASizes(
        [(n, shape.numel()) for n, shape in layout],
        [base[w] for w, _ in a],
        sum(base[w] for w in kept),
        [base[w] for w in kept],
        sum(int(shape[1]) for _, shape in a) // args.num_hidden_layers,
    )


def weight_sync_buffers(
    args: ModelArgs, engine_dtype: str, bucket_mb: int, sent_as_is: bool, lora: LoRAConfig | None = None
) -> tuple[int, int, int]:
    """Bytes of (the first trainer's send buffers, an engine worker's receive buffers, the largest parameter) in
    the engine dtype, from the exact bucket layout (`transport/weights.py`). `sent_as_is`: one-tensor buckets go
    from the parameter itself (a single trainer whose parameters are in the engine dtype) and need no buffer.
    `engine_dtype`: `inference.dtype`; `bucket_mb`: `world.weight_bucket_mb`; `lora` enabled: the push carries the
    adapters, in fp32."""
    on = lora is not None and lora.enabled
    ebytes = 4 if on else engine_dtype_bytes(engine_dtype)
    sizes = lora_sizes(args, lora).adapters if on else parameter_sizes(args)
    buckets = layer_buckets(sizes, ebytes, bucket_mb * (1 << 20))
    elements = [sum(sizes[i][1] for i in b) for b in buckets]
    used = [not (sent_as_is and len(b) == 1) for b in buckets]
    return (
        sum(slot_sizes(elements, used)) * ebytes,
        sum(slot_sizes(elements)) * ebytes,
        max(n for _, n in sizes) * ebytes,
    )


def engine_dtype_bytes(dtype: str) -> int:
    """Bytes per element of the engines' weights (and of the weight sync), `inference.dtype`: "auto" is bf16 on
    GPU."""
    return 2 if dtype == "auto" else DTYPE_BYTES[dtype]


def file_dtype_bytes(model: ModelConfig) -> int:
    """Bytes per element in `model.path`'s safetensors (config.json's dtype); public checkpoints are bf16."""
    config_json = Path(model.path) / "config.json" if model.path else None
    if config_json is not None and config_json.is_file():
        import json

        meta = json.loads(config_json.read_text())
        return DTYPE_BYTES.get(meta.get("torch_dtype") or meta.get("dtype") or "bfloat16", 2)
    return 2


def load_host_memory(
    args: ModelArgs, n_ranks: int, file_bytes: int, param_bytes: int, on_gpu: bool
) -> dict[str, float]:
    """Host bytes per rank while `policy.load_sharded` fills its shards: its shard of every parameter when the
    shards live on the host (CPU), and, when the file's dtype differs from the parameters', the largest tensor's
    rows converted on the host. The rows as read are views of the memory-mapped files (page cache, shared and
    reclaimable), not this rank's memory (measured: `benchmarks/memory_vs_plan.py`)."""
    largest = max(n for _, n in parameter_sizes(args))
    rows = -(-largest // n_ranks)
    return {
        "shard of every parameter": 0.0 if on_gpu else args.num_params() * param_bytes / n_ranks,
        "largest tensor's rows, converted": rows * param_bytes if file_bytes != param_bytes else 0.0,
    }


def attention_extra_bytes(args: ModelArgs, tokens: int, pbytes: int) -> float:
    """Memory of attention over a packed row beyond q, k, v: each document's output, then their concatenation (the
    per-document kernels keep only a log-sum-exp per head and token besides)."""
    hd = args.head_dim or args.hidden_size // args.num_attention_heads
    return tokens * args.num_attention_heads * (2 * hd * pbytes + 4)
