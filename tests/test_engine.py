"""Reference engine: continuous batching, exact per-token versions, in-flight updates keeping or recomputing KV."""

import copy

import torch

from pipelinerl_fsdp.inference.engine import ReferenceEngine, Request
from pipelinerl_fsdp.inference.generate import generate
from pipelinerl_fsdp.inference.kv_cache import KVCache
from pipelinerl_fsdp.models import build_model, flavour_args

ARGS = flavour_args("debug", vocab_size=40)
T = 0.8


def run_to_end(engine, reqs, update_after=None, new_model=None, recompute=False):
    for r in reqs:
        engine.add(r)
    steps = 0
    while engine.num_unfinished():
        if steps == update_after:
            with torch.no_grad():
                for n, p in engine.params.items():
                    p.copy_(dict(new_model.named_parameters())[n])
            engine.set_version(1)
            if recompute:
                engine.recompute_kv()
        engine.step()
        steps += 1


def test_continuous_batching_equals_isolated_generation():
    model = build_model(ARGS, seed=1)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12], [13, 14]]
    engine = ReferenceEngine(copy.deepcopy(model), max_num_seqs=2, max_len=32, eos_ids=[39], temperature=0.0)
    reqs = [Request(i, p, max_tokens=5 + i) for i, p in enumerate(prompts)]
    run_to_end(engine, reqs)
    for r, p in zip(reqs, prompts):
        ref = generate(model, [p], r.max_tokens, eos_id=39)[0]
        assert r.tokens == ref.tokens
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref.logprobs), rtol=1e-5, atol=1e-5)


def _logprobs_old_kv_then_new(old, new, prompt, tokens, m):
    """Reference: KV of prompt + tokens[:m-1] under `old`, every later position under `new`."""
    cache = KVCache(ARGS, 1, 64)
    seq = prompt + tokens
    n_old = len(prompt) + m - 1
    with torch.no_grad():
        _, pos = cache.begin_prefill([0], [n_old])
        old(torch.tensor([seq[:n_old]]), pos, cache=cache)
        cache.end_prefill()
        out = []
        for i in range(n_old, len(seq) - 1):
            pos = cache.begin_decode(torch.tensor([0]))
            logits = new(torch.tensor([[seq[i]]]), pos, cache=cache)[0, 0]
            cache.end_decode()
            out.append(float(torch.log_softmax(logits / T, -1)[seq[i + 1]]))
    return torch.tensor(out)


def _full_logprobs(model, prompt, tokens):
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp, _ = model(seq[:, :-1], targets=seq[:, 1:], temperature=T)
    return lp[0, len(prompt) - 1:]


def test_in_flight_update_keeps_kv_and_tags_versions():
    old, new = build_model(ARGS, seed=1), build_model(ARGS, seed=2)
    engine = ReferenceEngine(copy.deepcopy(old), max_num_seqs=4, max_len=64, eos_ids=[], temperature=T, seed=3)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    reqs = [Request(i, p, max_tokens=12) for i, p in enumerate(prompts)]
    run_to_end(engine, reqs, update_after=4, new_model=new)
    for r, p in zip(reqs, prompts):
        assert len(r.tokens) == 12 and not r.finished  # in-progress sequences finish normally
        m = r.versions.count(0)
        assert m == 4 and r.versions == [0] * 4 + [1] * 8  # version changes inside the sequence
        lp = torch.tensor(r.logprobs)
        torch.testing.assert_close(lp[:m], _full_logprobs(old, p, r.tokens)[:m], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp[m:], _logprobs_old_kv_then_new(old, new, p, r.tokens, m), rtol=1e-5,
                                   atol=1e-5)
        # ...and it really is different from recomputing everything under the new weights
        assert (lp[m:] - _full_logprobs(new, p, r.tokens)[m:]).abs().max() > 1e-3


def test_in_flight_update_with_recompute_matches_fresh_forward():
    old, new = build_model(ARGS, seed=1), build_model(ARGS, seed=2)
    engine = ReferenceEngine(copy.deepcopy(old), max_num_seqs=4, max_len=64, eos_ids=[], temperature=T, seed=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    reqs = [Request(i, p, max_tokens=10) for i, p in enumerate(prompts)]
    run_to_end(engine, reqs, update_after=3, new_model=new, recompute=True)
    for r, p in zip(reqs, prompts):
        m = r.versions.count(0)
        assert r.versions == [0] * m + [1] * (10 - m) and m == 3
        torch.testing.assert_close(torch.tensor(r.logprobs[m:]), _full_logprobs(new, p, r.tokens)[m:],
                                   rtol=1e-5, atol=1e-5)
