"""The cost models: closed forms against loops, the fits against known coefficients, the spec rooflines against
hand-computed numbers from published shapes and datasheets, profiles round-tripped."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelinerl_fsdp.perf.costs import DecodeCost, PushCost, TrainCost
from pipelinerl_fsdp.perf.profile import (
    Profile,
    fit_decode,
    fit_train,
    load_profile,
    nonnegative_lstsq,
    read_profile,
    save_profile,
)
from pipelinerl_fsdp.perf.spec import H100_SXM, ModelShape, decode_from_spec, push_from_spec, train_from_spec

DECODE = DecodeCost(base_s=5e-3, per_seq_s=2e-5, per_kv_s=1.5e-8, prefill_per_token_s=3e-6)


def loop_steps(cost: DecodeCost, k: int, n: int, c: float, prefill: float) -> float:
    total = 0.0
    for i in range(k):
        total += cost.step_s(n, c + i * n, prefill if i == 0 else 0.0)
    return total


@pytest.mark.parametrize("k,n,c,prefill", [(0, 3, 10, 0), (1, 1, 0, 50), (7, 5, 300, 0), (1000, 64, 12345, 800)])
def test_k_steps_closed_form_equals_the_loop(k, n, c, prefill):
    assert DECODE.steps_s(k, n, c, prefill) == pytest.approx(loop_steps(DECODE, k, n, c, prefill), rel=1e-12)


@pytest.mark.parametrize("n,c,prefill", [(1, 0, 0), (64, 5000, 400), (256, 10**6, 0)])
def test_steps_within_is_the_first_boundary_at_or_after(n, c, prefill):
    for dt in [1e-9, 0.004, 0.0123, 0.5, 3.0]:
        k = DECODE.steps_within(dt, n, c, prefill)
        assert loop_steps(DECODE, k, n, c, prefill) >= dt
        assert k == 1 or loop_steps(DECODE, k - 1, n, c, prefill) < dt
    assert DECODE.steps_within(0.0, n, c) == 0


def test_bad_costs_are_refused_by_name():
    with pytest.raises(ValueError, match="per_kv_s"):
        DecodeCost(1e-3, 1e-5, per_kv_s=-1.0)
    with pytest.raises(ValueError, match="no time"):
        DecodeCost(0.0, 0.0)
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        PushCost(bytes=1e9, bucket_bytes=1e6, link_bytes_per_s=0.0)


def test_train_cost_terms():
    t = TrainCost(
        step_base_s=0.5,
        per_token_s=1e-5,
        per_micro_batch_s=0.01,
        per_token_ctx_s=1e-9,
        ranks=2,
        micro_batch_tokens=1000,
    )
    lengths = [700, 900, 1400]  # 3000 tokens over 2 ranks: 1500 a rank, 2 micro-batches of 1000
    assert t.micro_batches(3000) == 2
    expected = 0.5 + 1e-5 * 3000 + 0.01 * 2 + 1e-9 * (700**2 + 900**2 + 1400**2) / 2
    assert t.batch_s(lengths) == pytest.approx(expected)
    assert t.part_s(lengths) == pytest.approx(expected - 0.5)


def test_push_is_a_two_stage_pipeline():
    # 4 buckets of 1 GB: gather 2 s each (0.5 GB/s), broadcast 1 s each (1 GB/s) + 0.1 s latency
    p = PushCost(
        bytes=4e9,
        bucket_bytes=1e9,
        link_bytes_per_s=1e9,
        gather_bytes_per_s=0.5e9,
        per_bucket_s=0.1,
        load_base_s=0.2,
        load_per_byte_s=1e-10,
    )
    assert p.buckets == 4
    # the first gather, then three more gathers each overlapping a broadcast, then the last broadcast
    assert p.transfer_s() == pytest.approx(2 + 3 * 2 + 1.1)
    assert p.pause_s() == pytest.approx(9.1 + 0.2 + 0.4)


def test_spec_rooflines_from_the_published_qwen25_7b_shape():
    shape = ModelShape.flavour("qwen2.5-7b")
    # Qwen2.5-7B's model card: 7.61B parameters, 28 layers, 4 KV heads of 128
    assert shape.params == pytest.approx(7.61e9, rel=5e-3)
    kv = 2 * 28 * 4 * 128 * 2  # K and V, bf16
    d = decode_from_spec(shape, H100_SXM, step_overhead_s=1e-3)
    assert d.per_kv_s == pytest.approx(kv / 3.35e12)
    assert d.base_s == pytest.approx(shape.params * 2 / 3.35e12 + 1e-3)
    assert 5.4e-3 < d.base_s < 5.7e-3  # 15.2 GB at 3.35 TB/s: 4.5 ms, plus 1 ms
    matmul = shape.params - 152064 * 3584  # untied: the input embedding is a lookup
    assert d.per_seq_s == pytest.approx(2 * matmul / (989e12 * 0.5))
    t = train_from_spec(shape, H100_SXM, 80, mfu=0.4)
    assert t.per_token_s == pytest.approx(6 * matmul / (989e12 * 0.4 * 80))
    assert t.per_token_ctx_s == pytest.approx(3 * 4 * 28 * 28 * 128 / (989e12 * 0.4 * 80))
    p = push_from_spec(shape, H100_SXM, 80, bucket_mb=64)
    assert p.bytes == shape.params * 2 and p.link_bytes_per_s == 50e9
    # 15.2 GB over 50 GB/s: 0.30 s of broadcast; the gather runs at 50 * 80 / 79 GB/s, just faster
    assert 0.30 < p.transfer_s() < 0.30 + 0.3 + p.buckets * 1e-3


def test_nonnegative_lstsq_meets_the_kkt_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(12, 3))
        b = rng.normal(size=12)
        x = nonnegative_lstsq(a, b)
        g = a.T @ (a @ x - b)  # gradient of |ax - b|^2 / 2
        assert np.all(x >= 0)
        assert np.all(np.abs(g[x > 0]) < 1e-9) and np.all(g[x == 0] > -1e-9)


def test_fit_decode_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    live = rng.integers(1, 257, size=40)
    kv = live * rng.integers(100, 8000, size=40)
    points = [(n, c, DECODE.step_s(n, c)) for n, c in zip(live, kv)]
    cost, fit = fit_decode(points)
    assert cost.base_s == pytest.approx(DECODE.base_s, rel=1e-6)
    assert cost.per_seq_s == pytest.approx(DECODE.per_seq_s, rel=1e-6)
    assert cost.per_kv_s == pytest.approx(DECODE.per_kv_s, rel=1e-6)
    assert fit.max_rel < 1e-9
    noisy = [(n, c, s * (1 + 0.01 * rng.standard_normal())) for n, c, s in points]
    _, fit = fit_decode(noisy)
    assert 0.002 < fit.rms_rel < 0.02  # 1% noise shows as ~1% residuals


def test_fit_train_recovers_known_coefficients():
    true = TrainCost(step_base_s=0.3, per_token_s=2e-5, per_micro_batch_s=0.04, per_token_ctx_s=1e-10)
    rows = [
        (tok, mb, sq)
        for tok, mb, sq in [
            (1e4, 3, 1e7),
            (5e4, 13, 2e8),
            (2e5, 49, 1e9),
            (8e3, 2, 5e6),
            (1e5, 30, 3e8),
            (3e5, 70, 3e9),
        ]
    ]
    cost, fit = fit_train([(t, m, s, true.step_s(t, m, s)) for t, m, s in rows], ranks=4)
    for k in ("step_base_s", "per_token_s", "per_micro_batch_s", "per_token_ctx_s"):
        assert getattr(cost, k) == pytest.approx(getattr(true, k), rel=1e-6)
    assert cost.ranks == 4 and fit.max_rel < 1e-9


def test_profile_round_trip_and_fit_from_points(tmp_path):
    prof = Profile(DECODE, TrainCost(0.1, 1e-5), PushCost(1e9, 6.4e7, 5e10), "test", "none")
    path = tmp_path / "p.json"
    save_profile(path, prof)
    back = load_profile(path)
    assert (back.decode, back.train, back.push, back.hardware) == (prof.decode, prof.train, prof.push, "test")
    points = [[n, c, DECODE.step_s(n, c)] for n, c in [(1, 100), (8, 4000), (64, 9e4), (200, 1e6), (32, 5e3)]]
    fitted = read_profile({"decode": {"points": points, "prefill_per_token_s": 3e-6}})
    assert fitted.decode.per_seq_s == pytest.approx(DECODE.per_seq_s, rel=1e-6)
    assert fitted.decode.prefill_per_token_s == 3e-6 and fitted.fits["decode"].max_rel < 1e-9
    path.write_text(json.dumps({"train": {"per_token_s": "fast"}}))
    with pytest.raises(ValueError, match="p.json"):
        load_profile(path)
    with pytest.raises(ValueError, match="unknown sections"):
        read_profile({"decoder": {}})
