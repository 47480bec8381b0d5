"""Per-token log-probabilities of given targets without materialising full-vocabulary log-softmax at once.

Logits are formed chunk by chunk in the forward pass and recomputed chunk by chunk in the backward pass, so the
peak extra memory is `chunk_size x vocab` instead of `tokens x vocab` (a 32k-token row of a 150k vocabulary
would otherwise need ~20 GB in fp32).

The head's matrix products take the operands in the parameters' dtype and return fp32 (`fp32_product`): bf16
operands on tensor cores with fp32 accumulation, and the logits are never rounded to bf16 (what the importance
ratios need). Everything after the products is fp32 and touches each [chunk x vocab] tile as few times as it can
(the counts are in `_ChunkedTokenLogprobs`).
"""

from __future__ import annotations

from typing import Literal

import torch

ProductRoute = Literal["mm_out_dtype", "upcast", "native"]
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def product_route(dtype: torch.dtype, device: torch.device) -> ProductRoute:
    """How `fp32_product` multiplies operands of `dtype` on `device`.

    "mm_out_dtype": 16-bit operands on CUDA: one cuBLAS GEMM on tensor cores, fp32 accumulation, fp32 output
    (`torch.mm(a, b, out_dtype=torch.float32)`, torch >= 2.8; the only input/output pair it takes on CUDA).
    "upcast": 16-bit operands elsewhere (aten's mm.dtype has no CPU kernel): the operands are cast to fp32 and
    multiplied in fp32, the same numbers (a product of two bf16 values is exact in fp32) summed in another order.
    "native": fp32 or fp64 operands, multiplied as they are.
    """
    if dtype not in _LOW_PRECISION:
        return "native"
    return "mm_out_dtype" if device.type == "cuda" else "upcast"


def fp32_product(a: torch.Tensor, b: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (2-D) in fp32 whatever the operands' precision: returned, or added in place to `into` (an fp32 or
    fp64 accumulator, e.g. a weight gradient summed over chunks). The one place the head's products switch on
    the device (`product_route`)."""
    route = product_route(a.dtype, a.device)
    if route == "mm_out_dtype":
        # addmm's out_dtype overload would accumulate in place, but its `out`/broadcast handling was still being
        # fixed after torch 2.9 (pytorch#167931): the GPU image runs 2.11, so the sum takes one [V x D] temp
        out = torch.mm(a, b, out_dtype=torch.float32)
        return out if into is None else into.add_(out)
    if route == "upcast":
        a, b = a.float(), b.float()
    if into is None:
        return (a @ b).float()  # fp32: no copy; fp64 (tests): the product rounded once
    return into.addmm_(a, b)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, round_logits: bool) -> torch.Tensor:
    """hidden @ weight.T as a fresh fp32 tile (callers modify it in place). `round_logits`: the logits rounded to
    the operands' dtype first (`trainer.fp32_head = "off"`, kept as the control of what that rounding costs)."""
    if round_logits:
        return (hidden @ weight.t()).float()
    return fp32_product(hidden, weight.t())


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Passes over each [chunk x V] fp32 tile (R: one read of the tile, W: one write; a GEMM's own write of the
    logits is not counted, nor anything over [chunk] or [chunk x D]). A bf16 operand tile costs half.

    Forward, before: x / T (R W), logsumexp (amax R, x - max R W, exp_ R W, sum R), x - lse (R W), exp (R W),
    probs * x (2R W), sum (R): 10 R + 6 W = 16, plus `.float()` of bf16 logits (R W) under the rounded head.
    Forward, now: amax (R); z = (x - max) / T in place, one op (R W); p = exp(z) (R W); s = sum(p) (R);
    z *= p in place (2R W: z is dead after the target's value is read); sum (R): 7 R + 3 W = 10.
    With q = p / s: logp = z[target] - log s, entropy = -sum q log q = log s - sum(p z) / s (z <= 0, so the
    entropy is not a difference of two large numbers, as lse - sum(q x) was).

    Backward, before: x / T (R W), x - lse (R W), exp (R W), negate (R W), * grad / T (R W): 10; with bf16
    weights also `.float()` of the logits (R W) and g in bf16 (R + half W), and the two GEMMs read g.
    Backward, now: q = exp(x / T - lse) - onehot: one scale-and-shift op in place (R W), exp_ in place (R W), a
    scatter at the targets: 4; bf16 weights add the cast of q (R + half W). The per-row factor -grad / T goes on
    the [chunk x D] side of both GEMMs (their output, their other operand) instead of over the tile.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        round_logits: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Outputs are allocated in the targets' shape (not views of flat buffers: FSDP2 hooks dislike views).
        out_logp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        out_entropy = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        logp, entropy = out_logp.view(-1), out_entropy.view(-1)
        ctx.hidden_shape = hidden.shape
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = targets.reshape(-1)
        n = hidden.shape[0]
        inv_t = 1.0 / temperature
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _chunk_logits(hidden[s:e], weight, round_logits)
            top = z.amax(-1, keepdim=True)
            # z = (x - max) / T in one pass: max(x / T) = max(x) / T for T > 0
            torch.add(top * -inv_t, z, alpha=inv_t, out=z)
            p = torch.exp(z)
            sum_p = p.sum(-1)
            log_s = sum_p.log()
            lse_all[s:e] = top.squeeze(1) * inv_t + log_s
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - log_s
            entropy[s:e] = log_s - z.mul_(p).sum(-1) / sum_p
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.round_logits = round_logits
        ctx.mark_non_differentiable(out_entropy)
        return out_logp, out_entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):  # type: ignore[override]
        hidden, weight, targets, lse_all = ctx.saved_tensors
        inv_t, chunk = 1.0 / ctx.temperature, ctx.chunk_size
        # d logp / d x = (onehot(target) - softmax) / T for logits x = h W^T, so with q = softmax - onehot the
        # gradient is g = -(grad_logp / T) q: grad_hidden = g W, grad_weight = sum over chunks of g^T h
        neg_scale = (grad_logp.reshape(-1) * -inv_t)[:, None]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 at least, whatever the weight's dtype: the chunks' contributions are summed at full precision
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            q = _chunk_logits(hidden[s:e], weight, ctx.round_logits)
            torch.add(lse_all[s:e, None].neg(), q, alpha=inv_t, out=q)
            q.exp_()
            q.scatter_add_(1, targets[s:e, None], q.new_full((e - s, 1), -1.0))
            # the GEMMs' operand in the weight's dtype, cast after the one-hot: p - 1 at the target is formed in
            # fp32 (p rounded to bf16 first would lose it where p is near 1)
            q_op = q.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[s:e] = fp32_product(q_op, weight).mul_(neg_scale[s:e]).to(hidden.dtype)
            if grad_weight is not None:
                fp32_product(q_op.t(), (hidden[s:e] * neg_scale[s:e]).to(weight.dtype), into=grad_weight)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(ctx.hidden_shape)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    round_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and entropy under softmax(hidden @ weight.T / temperature).

    hidden: [..., D]; weight: [V, D]; targets: [...] token ids. Returns (logp, entropy) shaped like targets, in
    fp32; only logp carries a gradient (entropy is for logging). The logits are fp32 whatever the operands'
    dtype (bf16 operands, fp32 accumulation and output), unless `round_logits` rounds them to that dtype first.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_size), round_logits)
