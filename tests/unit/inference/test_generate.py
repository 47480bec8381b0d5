"""Generation with the KV cache equals recomputing the full forward; sampled log-probs match the trainer's."""

import torch

from pipelinerl_fsdp.inference.generate import generate
from pipelinerl_fsdp.inference.sampling import sample_next
from pipelinerl_fsdp.models import build_model, flavour_args


def test_cached_greedy_equals_full_recompute():
    model = build_model(flavour_args("debug", vocab_size=40), seed=5).eval()
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11], [12]]
    outs = generate(model, prompts, max_new_tokens=6, eos_id=39, temperature=0.0)
    for p, o in zip(prompts, outs):
        seq = list(p)
        for _ in range(len(o.tokens)):
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert o.tokens == seq[len(p) :]


def test_sequences_finishing_at_different_steps_keep_their_own_completions():
    """Finished sequences leave the batch and the running ones are moved into their slots: every completion must
    still be the one its prompt gets alone (a mix-up of slots would hand one prompt another's tokens)."""
    model = build_model(flavour_args("debug", vocab_size=40), seed=7).eval()
    prompts = [[3 + i, 5 + 2 * i, 11 + i] for i in range(12)]
    free = generate(model, prompts, max_new_tokens=16, eos_id=[], temperature=0.0)
    # an EOS that completions reach at different steps: sequences leave the batch one after another
    first = {}
    for o in free:
        for t in set(o.tokens):
            first.setdefault(t, []).append(o.tokens.index(t))
    eos = max(first, key=lambda t: (len(set(first[t])), -len(first[t])))
    assert len(set(first[eos])) >= 3
    outs = generate(model, prompts, max_new_tokens=16, eos_id=eos, temperature=0.0)
    for p, o in zip(prompts, outs):
        (alone,) = generate(model, [p], max_new_tokens=16, eos_id=eos, temperature=0.0)
        assert o.tokens == alone.tokens and o.finished == alone.finished
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(alone.logprobs), rtol=1e-5, atol=1e-5)
    assert sum(o.finished for o in outs) == len(first[eos])


def test_sampled_logprobs_equal_trainer_logprobs():
    torch.manual_seed(0)
    model = build_model(flavour_args("debug-llama", vocab_size=40), seed=6).eval()
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11]]
    gen = torch.Generator().manual_seed(0)
    outs = generate(model, prompts, max_new_tokens=12, eos_id=0, temperature=0.7, generator=gen)
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.tokens])
        with torch.no_grad():
            lp, _ = model(seq[:, :-1], targets=seq[:, 1:], temperature=0.7)
        torch.testing.assert_close(lp[0, len(p) - 1 :], torch.tensor(o.logprobs), rtol=1e-5, atol=1e-5)


def test_top_p_logprob_is_of_the_renormalised_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(20):
        tok, lp = sample_next(logits, 1.0, top_p=0.7, generator=torch.Generator().manual_seed(seed))
        assert int(tok) in (0, 1)  # 0.5 + 0.3 reaches 0.7; the tail is cut
        expected = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[int(tok)]
        assert abs(float(lp.exp()) - expected) < 1e-6


def test_lengths_far_apart_attend_in_groups_and_give_the_full_forwards_logprobs():
    """One long sequence among many short ones: decode attends in groups of similar length (kv_cache.decode_groups)
    and every completion's log-probs still equal the trainer's full forward of that sequence alone."""
    from pipelinerl_fsdp.inference import kv_cache

    model = build_model(flavour_args("debug", vocab_size=40), seed=3).eval()
    prompts = [[3 + i % 30, 5, 7] for i in range(11)] + [[4 + i % 30 for i in range(300)]]
    widths = [len(p) for p in prompts]
    assert kv_cache.decode_groups(widths) is not None  # the case under test: the step really groups
    calls = []
    real = kv_cache.decode_groups
    kv_cache.decode_groups = lambda w, groups=kv_cache.DECODE_GROUPS: calls.append(real(w, groups)) or calls[-1]
    try:
        outs = generate(model, prompts, max_new_tokens=8, eos_id=[], temperature=1.0, generator=torch.Generator())
    finally:
        kv_cache.decode_groups = real
    assert calls and all(c is not None for c in calls)
    for p, o in zip(prompts, outs):
        seq = torch.tensor([p + o.tokens])
        with torch.no_grad():
            lp, _ = model(seq[:, :-1], targets=seq[:, 1:])
        torch.testing.assert_close(lp[0, len(p) - 1 :], torch.tensor(o.logprobs), rtol=1e-5, atol=1e-5)


def test_decode_groups_only_where_they_read_at_most_half_the_padded_keys():
    from pipelinerl_fsdp.inference.kv_cache import decode_groups

    assert decode_groups([5] * 16) is None  # equal lengths: padding costs nothing
    assert decode_groups([10, 1000]) is None  # too few rows to split in 4
    groups = decode_groups([100] * 15 + [1000])
    # 4 groups of 4 by length, the long one last: read 12 x 100 + 4 x 1000 = 5,200 keys of 16,000 padded
    assert groups is not None and [len(g) for g in groups] == [4, 4, 4, 4] and groups[-1][-1] == 15
    assert decode_groups([600] * 15 + [1000]) is None  # 12 x 600 + 4 x 1000 = 11,200 > 8,000
