"""Chunked token log-probabilities: values and gradients equal the direct full-vocabulary computation."""

import pytest
import torch

from pipelinerl_fsdp.models.logprobs import token_logprobs


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_match_log_softmax(chunk, temperature):
    torch.manual_seed(0)
    h = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 11, (2, 7))
    coeff = torch.randn(2, 7, dtype=torch.float64)

    lp, ent = token_logprobs(h, w, tgt, temperature, chunk)
    (lp.double() * coeff).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None

    full = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
    ref = full.gather(-1, tgt[..., None]).squeeze(-1)
    (ref * coeff).sum().backward()
    # logits are formed in (at least) fp32, outputs are fp32
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-5)
    assert lp.shape == ent.shape == tgt.shape
    assert not ent.requires_grad


def test_rejects_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 0.0)


def test_the_model_scores_only_the_positions_asked_for_with_the_same_values_and_gradients():
    from pipelinerl_fsdp.models import build_model, flavour_args

    args = flavour_args("debug")
    model = build_model(args, seed=0).double()
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # two packed documents
    targets = torch.roll(ids, -1, 1)
    where = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0]], dtype=torch.float32)  # completion tokens
    coeff = torch.randn(1, 12, dtype=torch.float64)

    full_lp, full_ent = model(ids, pos, targets=targets)
    (full_lp.double() * coeff * where).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp, ent = model(ids, pos, targets=targets, logprob_positions=where)
    (lp.double() * coeff * where).sum().backward()

    sel = where.bool()
    assert torch.allclose(lp[sel], full_lp[sel], atol=1e-6) and (lp[~sel] == 0).all()
    assert torch.allclose(ent[sel], full_ent[sel], atol=1e-6) and (ent[~sel] == 0).all()
    for g, p in zip(full_grads, model.parameters()):
        assert torch.allclose(p.grad, g, atol=1e-6)
