"""Static-batch generation with the KV cache: used for evaluation (greedy) and as the engine's building block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelinerl_fsdp.inference.kv_cache import KVCache
from pipelinerl_fsdp.inference.sampling import sample_next
from pipelinerl_fsdp.models.decoder import Transformer


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finished: bool  # stopped on EOS (False: hit max_new_tokens)


@torch.no_grad()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | list[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
) -> list[Generation]:
    """Generate a completion for each prompt (token ids). EOS is included in `tokens` when produced."""
    eos = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id))
    out: list[Generation] = []
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    for b0 in range(0, len(prompts), batch_size):
        chunk = prompts[b0 : b0 + batch_size]
        n = len(chunk)
        cache = KVCache(model.args, n, max(map(len, chunk)) + max_new_tokens, device, dtype)
        _, pos = cache.begin_prefill(list(range(n)), [len(p) for p in chunk])
        ids = torch.tensor([t for p in chunk for t in p], device=device)[None]
        logits = model(ids, pos, cache=cache)[0]
        cache.end_prefill()
        last = torch.tensor([len(p) for p in chunk]).cumsum(0) - 1
        next_logits = logits[last]
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        # Running sequences stay in slots 0..m-1 (a finished one's slot is refilled from the top), so each decode
        # step reads the cache as a view; gathering scattered slots copied every layer's keys and values per token.
        owner = list(range(n))  # slot -> the chunk's prompt index
        m = n
        for _ in range(max_new_tokens):
            tok, lp = sample_next(next_logits, temperature, top_p, generator)
            stop = torch.isin(tok.cpu(), eos).tolist()
            for s, (t, logp) in enumerate(zip(tok.tolist(), lp.tolist())):
                tokens[owner[s]].append(t)
                logps[owner[s]].append(logp)
                done[owner[s]] = stop[s]
            kept = [s for s in range(m) if not stop[s]]
            if not kept:
                break
            m = len(kept)
            rows = list(range(m))  # the row of `tok` each slot 0..m-1 continues
            for hole, src in zip([s for s in range(m) if stop[s]], [s for s in kept if s >= m]):
                cache.move(src, hole)
                owner[hole], rows[hole] = owner[src], src
            tok = tok[torch.tensor(rows, device=tok.device)]
            pos = cache.begin_decode(torch.arange(m, device=device))
            next_logits = model(tok[:, None].to(device), pos, cache=cache)[:, 0]
            cache.end_decode()
        out.extend(Generation(t, lp, d) for t, lp, d in zip(tokens, logps, done))
    return out
