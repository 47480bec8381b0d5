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
