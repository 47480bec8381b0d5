"""The head's positions given as indices built on the host (`logprob_index`) instead of a mask the model reads back
from the device: the same log-probs, entropies and gradients (exactly: the same rows reach the same head)."""

from __future__ import annotations

import torch

from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.rl.packing import nonzero_index, pack_row


def run(model, row, **kw):
    model.zero_grad()
    logp, ent = model(row.input_ids, row.position_ids, targets=row.targets, documents=row.documents, **kw)
    g = torch.Generator().manual_seed(5)
    (logp * torch.randn(logp.shape, generator=g) + ent * torch.randn(ent.shape, generator=g)).sum().backward()
    return [logp.detach(), ent.detach(), *(p.grad.clone() for p in model.parameters())]


def test_indices_from_the_host_equal_the_mask():
    model = build_model(flavour_args("debug", vocab_size=64), seed=2)
    g = torch.Generator().manual_seed(0)
    row = pack_row([torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 3, 14)])
    mask = [float(i % 4 != 0 and i != 7) for i in range(row.targets.shape[1])]
    positions = torch.tensor(mask)[None]
    by_mask = run(model, row, logprob_positions=positions)
    by_index = run(model, row, logprob_positions=positions, logprob_index=nonzero_index(mask, "cpu"))
    for a, b in zip(by_index, by_mask):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and both equal the head at every position, masked (values; 0 off the mask)
    full_logp, full_ent = model(row.input_ids, row.position_ids, targets=row.targets)
    torch.testing.assert_close(by_index[0], full_logp.detach() * positions, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(by_index[1], full_ent.detach() * positions, rtol=1e-6, atol=1e-6)


def test_an_index_alone_selects_the_positions():
    model = build_model(flavour_args("debug", vocab_size=64), seed=2)
    row = pack_row([list(range(1, 12)), list(range(20, 26))])
    index = torch.tensor([0, 3, 9, 14])
    logp, _ = model(row.input_ids, row.position_ids, targets=row.targets, logprob_index=index)
    assert logp.shape == row.targets.shape
    assert set(logp[0].nonzero().squeeze(1).tolist()) <= set(index.tolist()) and bool((logp[0, index] < 0).all())
