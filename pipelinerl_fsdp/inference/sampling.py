"""Sampling the next token and its log-probability under the processed (temperature, top-p) distribution."""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (tokens [n], logprobs [n]).

    temperature == 0 is greedy (logprob of the argmax under the untempered distribution). Otherwise the
    logprob is of the sampled token under softmax(logits / T) restricted to the top-p nucleus and
    renormalised: exactly the distribution the token was drawn from.
    """
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(1, order, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
