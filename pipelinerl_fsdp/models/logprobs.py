"""Per-token log-probabilities of given targets without materialising full-vocabulary log-softmax at once.

Logits are formed chunk by chunk in the forward pass and recomputed chunk by chunk in the backward pass, so the
peak extra memory is `chunk_size x vocab` instead of `tokens x vocab` (a 32k-token row of a 150k vocabulary
would otherwise need ~20 GB in fp32).
"""

from __future__ import annotations

import torch


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Outputs are allocated in the targets' shape (not views of flat buffers: FSDP2 hooks dislike views).
        out_logp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        out_entropy = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        logp, entropy = out_logp.view(-1), out_entropy.view(-1)
        ctx.hidden_shape = hidden.shape
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        n = hidden.shape[0]
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            logits = (hidden[s:e] @ weight.t()).float() / temperature
            lse = torch.logsumexp(logits, dim=-1)
            lse_all[s:e] = lse
            logp[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse
            probs = torch.exp(logits - lse[:, None])
            entropy[s:e] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(out_entropy)
        return out_logp, out_entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):  # type: ignore[override]
        hidden, weight, targets, lse_all = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk_size
        grad_logp = grad_logp.reshape(-1)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            logits = (hidden[s:e] @ weight.t()).float() / t
            # d logp / d logits = onehot(target) - softmax; the 1/T comes from logits = h W^T / T.
            g = -torch.exp(logits - lse_all[s:e, None])
            g.scatter_add_(1, targets[s:e, None], torch.ones_like(g[:, :1]))
            g *= (grad_logp[s:e] / t)[:, None]
            if grad_hidden is not None:
                grad_hidden[s:e] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += g.t() @ hidden[s:e].float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and entropy under softmax(hidden @ weight.T / temperature).

    hidden: [..., D]; weight: [V, D]; targets: [...] token ids. Returns (logp, entropy) shaped like targets, in
    fp32; only logp carries a gradient (entropy is for logging).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_size))
