"""Chunked token log-probabilities: values and gradients equal the direct full-vocabulary computation."""

import pytest
import torch

from pipelinerl_fsdp.config import TrainerConfig
from pipelinerl_fsdp.models import logprobs
from pipelinerl_fsdp.models.args import FLAVOURS, flavour_args
from pipelinerl_fsdp.models.logprobs import fp32_product, product_route, token_logprobs


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


class _Before(torch.autograd.Function):
    """The chunked log-probs as they were before the head kept fewer passes (commit c4f3de2): the reference the
    new code must equal."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, t, chunk):
        logp = torch.empty(targets.shape[0], dtype=torch.float32)
        entropy, lse_all = torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            logits = (hidden[s:e] @ weight.t()).float() / t
            lse = torch.logsumexp(logits, dim=-1)
            lse_all[s:e] = lse
            logp[s:e] = logits.gather(1, targets[s:e, None]).squeeze(1) - lse
            entropy[s:e] = lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.t, ctx.chunk = t, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        t, chunk = ctx.t, ctx.chunk
        grad_hidden, grad_weight = torch.zeros_like(hidden), torch.zeros(weight.shape, dtype=torch.float32)
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            g = -torch.exp((hidden[s:e] @ weight.t()).float() / t - lse_all[s:e, None])
            g.scatter_add_(1, targets[s:e, None], torch.ones_like(g[:, :1]))
            g *= (grad_logp[s:e] / t)[:, None]
            grad_hidden[s:e] = g @ weight
            grad_weight += g.t() @ hidden[s:e]
        return grad_hidden, grad_weight, None, None, None


# (leading shape, D, V, chunk, temperature): chunk boundaries inside the batch, exactly one chunk, chunks of 1
SHAPES = [
    ((7,), 16, 11, 3, 0.7),
    ((2, 13), 32, 50, 8, 1.3),
    ((64,), 24, 300, 64, 0.6),
    ((33,), 8, 1000, 16, 1.0),
    ((5,), 8, 257, 1, 0.9),
]


@pytest.mark.parametrize(("shape", "d", "v", "chunk", "temperature"), SHAPES)
def test_fewer_passes_equal_the_previous_computation_in_fp32(shape, d, v, chunk, temperature):
    """Same log-probs, entropies and gradients as before the rewrite, fp32, logits up to ~30 in size. The entropy
    is closer to the fp64 value than before (no lse - sum(q x) cancellation): ~2e-6 against ~2e-5."""
    torch.manual_seed(0)
    h, w = torch.randn(*shape, d), torch.randn(v, d) * (4 / d**0.5)
    tgt, coeff = torch.randint(0, v, shape), torch.randn(shape)

    hn, wn = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = token_logprobs(hn, wn, tgt, temperature, chunk)
    (lp * coeff).sum().backward()
    hb, wb = h.reshape(-1, d).clone().requires_grad_(), w.clone().requires_grad_()
    lp_b, ent_b = _Before.apply(hb, wb, tgt.reshape(-1), temperature, chunk)
    (lp_b * coeff.reshape(-1)).sum().backward()

    torch.testing.assert_close(lp.reshape(-1), lp_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.reshape(-1), ent_b, rtol=0, atol=5e-5)
    torch.testing.assert_close(hn.grad.reshape(-1, d), hb.grad, rtol=1e-4, atol=1e-5 * hb.grad.abs().max().item())
    torch.testing.assert_close(wn.grad, wb.grad, rtol=1e-4, atol=1e-5 * wb.grad.abs().max().item())
    full = torch.log_softmax(h.double() @ w.double().t() / temperature, -1)
    exact_entropy = -(full.exp() * full).sum(-1)
    assert (ent.double() - exact_entropy).abs().max() < 5e-6


def test_the_product_route_switches_on_the_device_and_the_operand_dtype():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert product_route(torch.bfloat16, cuda) == product_route(torch.float16, cuda) == "mm_out_dtype"
    assert product_route(torch.bfloat16, cpu) == "upcast"
    assert product_route(torch.float32, cuda) == "native" and product_route(torch.float64, cpu) == "native"


def test_bf16_operands_give_the_exact_products_summed_in_fp32_where_bf16_output_rounds():
    """fp32_product on bf16 operands against the fp64 product of the same bf16 values: every product of two bf16
    values is exact in fp32, so the error is fp32 summation only, bounded by K * 2^-24 * (|a| @ |b|) for K terms
    in any order (here ~1e-6 at products of size ~4). A bf16-output product rounds each logit to 8 significant
    bits: ~1e-2 here, thousands of times that error."""
    g = torch.Generator().manual_seed(0)
    k = 576
    a = torch.randn(64, k, generator=g).bfloat16()
    b = (torch.randn(k, 300, generator=g) / k**0.5).bfloat16()
    exact = a.double() @ b.double()
    out = fp32_product(a, b)
    assert out.dtype == torch.float32
    err = (out.double() - exact).abs()
    assert (err <= k * 2**-24 * (a.double().abs() @ b.double().abs())).all()
    rounded = (a @ b).double()  # bf16 output
    rounded_err = (rounded - exact).abs()
    assert rounded_err.max() > 100 * err.max(), (rounded_err.max(), err.max())
    assert (rounded_err <= 2**-8 * exact.abs() + 1e-30).all()  # round to nearest: half an ulp of 8 bits
    # into=: accumulated in place in fp32
    acc = torch.ones(64, 300)
    assert fp32_product(a, b, into=acc) is acc
    torch.testing.assert_close(acc.double(), exact + 1, rtol=0, atol=1e-5)


def test_bf16_head_logprobs_keep_fp32_precision_unless_the_logits_are_rounded():
    """bf16 hidden states and head weight (the "auto" head under bf16 parameters): log-probs within 1e-5 of the
    fp64 computation from the same bf16 values (~1e-6), gradients within bf16 precision (~2e-3 relative); the
    rounded head ("off") is off by ~3e-2 at logits up to ~14 (an ulp of bf16 there is 0.0625)."""
    g = torch.Generator().manual_seed(1)
    n, d, v, t = 40, 64, 500, 0.8
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * (2.5 / d**0.5)).bfloat16()
    tgt, coeff = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)

    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    exact = torch.log_softmax(hd @ wd.t() / t, -1).gather(-1, tgt[:, None])[:, 0]
    (exact * coeff).sum().backward()

    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, _ = token_logprobs(hb, wb, tgt, t, chunk_size=16)
    (lp * coeff).sum().backward()
    assert (lp.double() - exact.detach()).abs().max() < 1e-5
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    for got, ref in ((hb.grad, hd.grad), (wb.grad, wd.grad)):
        assert (got.double() - ref).norm() / ref.norm() < 1e-2

    lp_rounded, _ = token_logprobs(h, w, tgt, t, chunk_size=16, round_logits=True)
    assert (lp_rounded.double() - exact.detach()).abs().max() > 1e-2


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_the_cuda_branch_runs_on_meta_tensors_for_every_flavours_head(flavour, monkeypatch):
    """The route a GPU takes ("mm_out_dtype": `torch.mm(a, b, out_dtype=torch.float32)`, the weight gradient summed
    into an fp32 accumulator) run for real, on meta tensors (shapes and dtypes only), forward and backward through
    `token_logprobs`: bf16 hidden states and head of each flavour, chunks of `trainer.logprob_chunk_size` (two
    whole, one partial). Every product takes bf16 operands (the tensor-core GEMM) and returns fp32; log-probs are
    fp32, the gradients bf16 in the parameters' shapes."""
    args = flavour_args(flavour)
    chunk = TrainerConfig().logprob_chunk_size
    n, d, v = 2 * chunk + 7, args.hidden_size, args.vocab_size
    real_route = logprobs.product_route

    def as_on_cuda(dtype: torch.dtype, dev: torch.device) -> logprobs.ProductRoute:
        return real_route(dtype, torch.device("cuda") if dev.type == "meta" else dev)

    monkeypatch.setattr(logprobs, "product_route", as_on_cuda)
    calls = []
    real_mm = torch.mm

    def mm(a, b, **kw):
        out = real_mm(a, b, **kw)
        calls.append((a.dtype, b.dtype, kw.get("out_dtype"), out.dtype, tuple(out.shape)))
        return out

    monkeypatch.setattr(torch, "mm", mm)
    h = torch.empty(n, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(v, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tgt = torch.empty(n, dtype=torch.long, device="meta")
    lp, ent = token_logprobs(h, w, tgt, 0.7, chunk)
    assert (lp.dtype, ent.dtype, lp.shape) == (torch.float32, torch.float32, (n,))
    lp.sum().backward()
    assert (h.grad.dtype, h.grad.shape, w.grad.dtype, w.grad.shape) == (torch.bfloat16, (n, d), torch.bfloat16, (v, d))
    rows = [chunk, chunk, 7]
    want = [(r, v) for r in rows]  # forward: the logits of each chunk
    want += [shape for r in rows for shape in ((r, v), (r, d), (v, d))]  # backward: logits, dh, dW per chunk
    assert [c[4] for c in calls] == want
    assert all(c[:4] == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32) for c in calls), calls
