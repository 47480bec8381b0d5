"""Reference engine: continuous batching, exact per-token versions, in-flight updates keeping or recomputing KV."""

import copy

import pytest
import torch

from kv_reference import full_logprobs, logprobs_old_kv_then_new, run_to_end
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.generate import generate
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.models import build_model, flavour_args

ARGS = flavour_args("debug", vocab_size=40)
T = 0.8


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


def test_running_requests_stay_in_the_lowest_slots_and_decode_reads_a_view():
    """Requests leave in an order unrelated to their slots; the engine moves the highest running request into each
    freed slot, so every decode step reads the cache as a view, and outputs still equal isolated generation."""
    model = build_model(ARGS, seed=1)
    prompts = [[3 + i, 4, 5 + i % 3][: 1 + i % 3] for i in range(9)]
    max_tokens = [9, 2, 6, 3, 11, 4, 2, 7, 5]
    engine = ReferenceEngine(copy.deepcopy(model), max_num_seqs=4, max_len=32, eos_ids=[], temperature=0.0)
    views, begin = [], engine.cache.begin_decode

    def spy(slots: torch.Tensor) -> torch.Tensor:
        pos = begin(slots)
        views.append(engine.cache._span is not None)
        return pos

    engine.cache.begin_decode = spy
    reqs = [Request(i, p, max_tokens=m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        engine.add(r)
    moved = 0
    while engine.num_unfinished():
        before = {r.request_id: r.slot for r in engine.running.values()}
        engine.step()
        assert sorted(engine.running) == list(range(len(engine.running)))
        moved += sum(r.slot != before[r.request_id] for r in engine.running.values() if r.request_id in before)
    assert moved > 0 and views and all(views)  # requests were moved, and no decode step gathered
    assert (engine.cache.lengths == 0).all()
    for r, p in zip(reqs, prompts):
        ref = generate(model, [p], r.max_tokens, eos_id=[])[0]
        assert r.tokens == ref.tokens
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(ref.logprobs), rtol=1e-5, atol=1e-5)


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
        torch.testing.assert_close(lp[:m], full_logprobs(old, p, r.tokens, T)[:m], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp[m:], logprobs_old_kv_then_new(old, new, p, r.tokens, m, T), rtol=1e-5, atol=1e-5)
        # ...and it really is different from recomputing everything under the new weights
        assert (lp[m:] - full_logprobs(new, p, r.tokens, T)[m:]).abs().max() > 1e-3


def test_in_flight_update_with_recompute_matches_fresh_forward():
    old, new = build_model(ARGS, seed=1), build_model(ARGS, seed=2)
    engine = ReferenceEngine(copy.deepcopy(old), max_num_seqs=4, max_len=64, eos_ids=[], temperature=T, seed=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9]]
    reqs = [Request(i, p, max_tokens=10) for i, p in enumerate(prompts)]
    run_to_end(engine, reqs, update_after=3, new_model=new, recompute=True)
    for r, p in zip(reqs, prompts):
        m = r.versions.count(0)
        assert r.versions == [0] * m + [1] * (10 - m) and m == 3
        torch.testing.assert_close(
            torch.tensor(r.logprobs[m:]), full_logprobs(new, p, r.tokens, T)[m:], rtol=1e-5, atol=1e-5
        )


def test_sequence_seconds_give_the_mean_batch_and_show_a_draining_tail():
    model = build_model(ARGS, seed=1)

    def mean_batch(max_tokens: list[int]) -> float:
        engine = ReferenceEngine(copy.deepcopy(model), max_num_seqs=8, max_len=64, eos_ids=[], temperature=T)
        run_to_end(engine, [Request(i, [3, 4, 5], m) for i, m in enumerate(max_tokens)])
        tokens, busy, seq_s = engine.stats()
        assert tokens == sum(max_tokens)
        return seq_s / busy

    assert mean_batch([20] * 8) == pytest.approx(8.0)  # every step ran all 8 slots
    # half the batch stops after one token: 4 sequences decode alone for 19 of 20 steps
    assert mean_batch([1] * 4 + [20] * 4) < 0.75 * 8


def test_an_engine_outside_a_job_is_the_one_an_inference_rank_builds(tmp_path):
    """`factory.generation_engine` (tools and benchmarks): the config's kind, sampling and batch, the folder's
    weights, no receiver; it generates what an engine built by hand from the same pieces does."""
    from pipelinerl_fsdp.configure import load_config
    from pipelinerl_fsdp.inference.factory import generation_engine
    from pipelinerl_fsdp.models import save_hf_folder
    from pipelinerl_fsdp.models.hf_io import load_hf_model

    args = flavour_args("debug", vocab_size=32)
    save_hf_folder(tmp_path, args, build_model(args, seed=0).state_dict())
    cfg = load_config(["--inference.engine=reference", "--inference.max_num_seqs=8", "--inference.temperature=0.9"])
    engine = generation_engine(cfg.inference, cfg.job, cfg.world, str(tmp_path), 24, [1], seed=5)
    assert isinstance(engine, ReferenceEngine) and engine.dtype == torch.float32 and engine.temperature == 0.9
    assert len(engine.free_slots) == 8 and engine.eos == {1}
    by_hand = ReferenceEngine(load_hf_model(tmp_path, torch.device("cpu"), torch.float32), 8, 24, [1], 0.9, 1.0, 5)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    reqs = {e: [Request(i, p, 8) for i, p in enumerate(prompts)] for e in (engine, by_hand)}
    for e, rs in reqs.items():
        run_to_end(e, rs)
    assert [r.tokens for r in reqs[engine]] == [r.tokens for r in reqs[by_hand]]
    assert all(r.tokens for r in reqs[engine])
