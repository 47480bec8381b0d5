"""Shared by the engine tests: driving an engine through an in-flight update, and reference log-probs computed
directly with our decoder."""

from __future__ import annotations

import torch

from pipelinerl_fsdp.inference.kv_cache import KVCache
from pipelinerl_fsdp.models.decoder import Transformer


def logprobs_old_kv_then_new(
    old: Transformer, new: Transformer, prompt: list[int], tokens: list[int], m: int, temperature: float
) -> torch.Tensor:
    """Log-probs of tokens[m:] when the KV of prompt + tokens[:m-1] was computed by `old` and every later
    position by `new` (tokens[m-1] was sampled by `old` but fed to the model after the update)."""
    cache = KVCache(old.args, 1, len(prompt) + len(tokens) + 1)
    seq = prompt + tokens
    n_old = len(prompt) + m - 1
    out = []
    with torch.no_grad():
        _, pos = cache.begin_prefill([0], [n_old])
        old(torch.tensor([seq[:n_old]]), pos, cache=cache)
        cache.end_prefill()
        for i in range(n_old, len(seq) - 1):
            pos = cache.begin_decode(torch.tensor([0]))
            logits = new(torch.tensor([[seq[i]]]), pos, cache=cache)[0, 0]
            cache.end_decode()
            out.append(float(torch.log_softmax(logits / temperature, -1)[seq[i + 1]]))
    return torch.tensor(out)


def full_logprobs(model: Transformer, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of `tokens` given `prompt` from one full forward (every position under `model`)."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp, _ = model(seq[:, :-1], targets=seq[:, 1:], temperature=temperature)
    return lp[0, len(prompt) - 1 :]


def run_to_end(
    engine, reqs, update_after: int | None = None, new_model: Transformer | None = None, recompute: bool = False
) -> None:
    """Add `reqs` and step `engine` until all finish; before step number `update_after` load `new_model`'s
    weights as version 1 (optionally recomputing the KV cache). Works for any engine with the common interface."""
    for r in reqs:
        engine.add(r)
    steps = 0
    while engine.num_unfinished():
        if steps == update_after:
            assert new_model is not None
            engine.load_weights(list(new_model.state_dict().items()))
            engine.set_version(1)
            if recompute:
                engine.recompute_kv()
        engine.step()
        steps += 1
