"""The simulator against cases solved by hand. Costs are powers of two (a decode step of 1/64 s, a token's
training 1/1024 s) so that every event time is exact in floating point and a boundary never rounds the wrong way.

The base case: one engine of 8 slots, groups of 8 attempts, batch 8 (one group a step), 64-token completions, no
prompt: a batch is generated in 64 steps x 1/64 s = 1 s; the trainer trains its 512 tokens in 0.5 s."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipelinerl_fsdp.perf.costs import DecodeCost, PushCost, TrainCost
from pipelinerl_fsdp.perf.lengths import PowerLaw, Uniform
from pipelinerl_fsdp.perf.simulate import SimConfig, SimCosts, simulate
from pipelinerl_fsdp.perf.spec import H100_SXM, ModelShape, decode_from_spec, push_from_spec, train_from_spec

STEP = 2.0**-6
GEN = 64 * STEP  # 1 s
DECODE = DecodeCost(base_s=STEP, per_seq_s=0.0)
FAST_TRAIN = TrainCost(step_base_s=0.0, per_token_s=2.0**-10)  # 512 tokens: 0.5 s
SLOW_TRAIN = TrainCost(step_base_s=0.0, per_token_s=2.0**-8)  # 512 tokens: 2 s
FIXED = Uniform(64, 64)


def run(mode: str, train: TrainCost = FAST_TRAIN, push: PushCost | None = None, lengths=FIXED, **kw):
    cfg = SimConfig(mode=mode, engines=1, attempts=8, **({"steps": 20, "slots": 8, "batch_size": 8} | kw))
    return simulate(cfg, SimCosts(DECODE, train, push), lengths, seed=0)


@pytest.mark.parametrize("train,gen_bound", [(FAST_TRAIN, True), (SLOW_TRAIN, False)])
def test_conventional_adds_the_two_sides_pipeline_takes_the_larger(train, gen_bound):
    t_train = 512 * train.per_token_s
    assert 1 / run("conventional", train).steps_per_s == pytest.approx(GEN + t_train)
    assert 1 / run("colocated", train).steps_per_s == pytest.approx(GEN + t_train)
    pipe = run("pipeline", train)
    assert 1 / pipe.steps_per_s == pytest.approx(max(GEN, t_train))
    # the side that sets the pace is busy all the time
    assert (pipe.engine_busy_frac if gen_bound else pipe.trainer_busy_frac) == pytest.approx(1.0)


def test_engine_bound_pipeline_lag_by_littles_law():
    """Little's law: mean lag = (tokens in flight, sampled but not yet taken by the trainer) / (tokens trained per
    version). Engine-bound, the trainer takes batch k the moment it is complete (at time k + 1), so the tokens in
    flight are batch k's own, growing from 0 to 512 over its second: 256 on average, against 512 tokens a version:
    mean lag 0.5. By hand: the trainer's step k - 1 ends at k + 0.5 and its weights land at once (no push cost),
    so batch k's first 32 tokens carry version k - 1 (lag 1 when step k trains them at version k), its last 32
    version k (lag 0); lag_by_tenth: tenths 1-5 at 1, tenths 6-10 at 0."""
    r = run("pipeline")
    assert r.lag_mean == pytest.approx(256 / 512)
    assert list(r.lag_hist) == [r.lag_hist.sum() // 2] * 2
    assert list(r.lag_by_tenth) == [1.0] * 5 + [0.0] * 5
    assert (r.lag_p50, r.lag_p90, r.lag_max) == (0, 1, 1)


def test_trainer_bound_pipeline_lag_by_littles_law():
    """Trainer-bound (2 s a step against 1 s of generation), every buffer between the engine and the trainer is
    full in the steady state: the trainer's receiver (one step's part, 1 group, + 1 its thread holds), the engine's
    send queue (inference.max_queued_groups = 2, + 1 its sender thread holds), and the group the engine's loop
    waits to send: 6 groups in flight ahead of the trainer, one trained per version, so by Little's law each token
    waits 6 versions. By hand: when the trainer takes a group, the chain moves up by one and the engine generates
    the next one at once, with the version just pushed; 6 takes later, 6 versions later, it is trained: lag 6.
    The buffers fill over the first steps (lags 2-5 then): the steady state is measured after 10."""
    r = run("pipeline", SLOW_TRAIN, steps=30, warmup_steps=10)
    assert (r.lag_p50, r.lag_max, r.lag_mean) == (6, 6, 6)
    assert r.engine_send_blocked_frac == pytest.approx(0.5)  # 1 s generating, 1 s waiting to send, per 2 s step
    assert r.trainer_data_wait_frac == 0.0
    # a smaller send queue: 2 + 2 + 1 = 5 groups in flight
    assert run("pipeline", SLOW_TRAIN, steps=30, warmup_steps=10, send_queue_groups=1).lag_mean == 5
    # max_lag below it: stale groups are dropped whole and counted; what is trained is within the bound
    capped = run("pipeline", SLOW_TRAIN, steps=30, max_lag=3)
    assert capped.dropped_samples > 0 and capped.dropped_samples % 8 == 0 and capped.lag_max <= 3


def test_waves_halve_the_trainer_bound_lag():
    """rl.waves = 2 with two groups a step (batch 16), trainer-bound (each group's part 2 s: a 4 s step against
    1 s a group of generation): the receiver holds one part (1 group) + 1, the send queue 2 + 1, the engine's loop
    1: 6 groups ahead of the trainer as with one wave, but it takes 2 of them a version, so each waits 6 takes =
    3 versions (it is generated just after a take, with the version then, and taken 6 takes later, at the same
    point of a step 3 steps on)."""
    r = run("pipeline", SLOW_TRAIN, batch_size=16, waves=2, steps=30, warmup_steps=10)
    assert 1 / r.steps_per_s == pytest.approx(4.0)
    assert (r.lag_p50, r.lag_max, r.lag_mean) == (3, 3, 3)


def test_prefill_and_kv_growth_in_the_step_time():
    """Conventional G = 1 with 100-token prompts: 64 steps of 8 sequences whose contexts sum to 8 (100 + i) at
    step i, the first step also prefilling the 8 prompts (once with a prefix cache: attempts share the prompt),
    then training 8 x 164 tokens."""
    decode = DecodeCost(base_s=1e-3, per_seq_s=1e-4, per_kv_s=1e-7, prefill_per_token_s=1e-5)
    kv = sum(8 * (100 + i) for i in range(64))
    gen = 64 * (1e-3 + 8e-4) + 1e-7 * kv
    for prefix_cache, prefill in ((False, 800), (True, 100)):
        cfg = SimConfig(
            mode="conventional",
            batch_size=8,
            attempts=8,
            slots=8,
            steps=5,
            prompt_tokens=100,
            prefix_cache=prefix_cache,
        )
        r = simulate(cfg, SimCosts(decode, FAST_TRAIN), FIXED, seed=0)
        assert 1 / r.steps_per_s == pytest.approx(gen + 1e-5 * prefill + 8 * 164 * 2.0**-10)


def test_vllm_decodes_while_its_loop_waits_to_send():
    """Trainer-bound, two groups of 32-96 tokens in the engine: the reference engine stops stepping while its loop
    waits to send (busy and send-blocked never overlap), vLLM's engine runs on (they do)."""
    kw = {"slots": 16, "lengths": Uniform(32, 96), "steps": 30, "warmup_steps": 10}
    ref = run("pipeline", SLOW_TRAIN, **kw)
    vllm = run("pipeline", SLOW_TRAIN, decode_while_blocked=True, **kw)
    assert ref.engine_busy_frac + ref.engine_send_blocked_frac <= 1 + 1e-9
    assert vllm.engine_busy_frac + vllm.engine_send_blocked_frac > 1.05


def test_conventional_g2_lags_and_step_time():
    """G = 2: the round's 2 batches (2 s of generation with one version), then 2 training steps (0.5 s each):
    3 s per 2 steps; the round's first step trains at lag 0, the second at lag 1 (shuffled: which group, not
    which lag)."""
    r = run("conventional", sync_every=2)
    assert 1 / r.steps_per_s == pytest.approx(1.5)
    assert r.lag_mean == pytest.approx(0.5) and (r.lag_p50, r.lag_max) == (0, 1)
    assert r.engine_idle_frac == pytest.approx(1 / 3)  # waiting for the round to be trained


def test_async_takes_updates_between_sequences():
    """Async, engine-bound: step k - 1's weights arrive mid-sequence (k + 0.5), are staged, and load once the
    engine has drained (k + 1): every batch is generated by one version and trained one version later."""
    r = run("async")
    assert 1 / r.steps_per_s == pytest.approx(GEN)
    assert (r.lag_p50, r.lag_max, r.lag_mean) == (1, 1, 1)
    # room for two groups of lengths 32-96: a staged update stops admissions, so the engine drains (its occupancy
    # drops) and loads (an engine that kept admitting would never be empty, never load, and fall max_lag behind)
    wide = run("async", slots=16, lengths=Uniform(32, 96))
    assert wide.updates >= 5 and wide.dropped_samples == 0 and wide.engine_occupancy < 0.9


def test_a_long_tail_drains():
    """One 1000-token completion among seven of 10 (all in one group): the conventional step waits for the long
    one, 10 steps with 8 live sequences then 990 with 1, at 1 ms + 0.25 ms per sequence, then trains."""

    class OneLong:
        def sample(self, rng, n):
            return np.array(([1000] + [10] * 7) * (n // 8 + 1), dtype=np.int64)[:n]

        def mean(self):
            return (1000 + 70) / 8

    decode = DecodeCost(base_s=1e-3, per_seq_s=2.5e-4)
    train = TrainCost(step_base_s=0.25, per_token_s=0.0)
    cfg = SimConfig(mode="conventional", engines=1, slots=8, batch_size=8, attempts=8, steps=10)
    r = simulate(cfg, SimCosts(decode, train), OneLong(), seed=0)
    drain = 10 * (1e-3 + 8 * 2.5e-4) + 990 * (1e-3 + 2.5e-4)
    assert 1 / r.steps_per_s == pytest.approx(drain + 0.25)
    assert r.engine_mean_live == pytest.approx((10 * 3e-3 * 8 + 990 * 1.25e-3) / drain)
    assert r.engine_occupancy == pytest.approx(r.engine_mean_live / 8)


def test_the_pause_share_for_a_push_size_and_bandwidth():
    """Pipeline, engine-bound: each version's push (1 GB at 8 GB/s: 0.125 s, then a 0.125 s load) pauses the
    engine once per batch it generates: a 1 s batch and a 0.25 s pause, 1.25 s a step, a pause share of 0.2."""
    push = PushCost(bytes=1e9, bucket_bytes=1e9, link_bytes_per_s=8e9, load_base_s=0.125)
    r = run("pipeline", push=push, steps=30)
    assert 1 / r.steps_per_s == pytest.approx(1.25)
    assert r.engine_paused_frac == pytest.approx(0.25 / 1.25)
    assert r.engine_busy_frac == pytest.approx(1 / 1.25)
    assert r.updates == 29  # the last step's push is still in flight when the run ends


def test_determinism_for_a_seed():
    cfg = SimConfig(mode="pipeline", engines=3, slots=32, batch_size=64, attempts=8, steps=20, prompt_tokens=16)
    costs = SimCosts(DecodeCost(1e-3, 1e-5, 1e-8, 1e-6), TrainCost(0.05, 2e-5), PushCost(1e8, 1e7, 1e9))
    a, b = (simulate(cfg, costs, PowerLaw(1.2, 4, 512), seed=7) for _ in range(2))
    c = simulate(cfg, costs, PowerLaw(1.2, 4, 512), seed=8)
    assert a.time_s == b.time_s and np.array_equal(a.lag_hist, b.lag_hist)
    assert a.time_s != c.time_s


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="waves"):
        SimConfig(batch_size=64, attempts=8, waves=3).check()
    with pytest.raises(ValueError, match="slots"):
        SimConfig(slots=4, attempts=8).check()


def test_the_papers_scale_in_seconds():
    """48 engines of 256 slots and 80 trainer GPUs (spec costs of Qwen2.5-7B on H100s), batch 4,096, 100 steps,
    completions up to 8k tokens."""
    shape = ModelShape.flavour("qwen2.5-7b")
    costs = SimCosts(
        decode_from_spec(shape, H100_SXM), train_from_spec(shape, H100_SXM, 80), push_from_spec(shape, H100_SXM, 80)
    )
    cfg = SimConfig(
        engines=48, slots=256, batch_size=4096, attempts=16, steps=100, prompt_tokens=256, max_new_tokens=8192
    )
    t0 = time.perf_counter()
    r = simulate(cfg, costs, PowerLaw(1.0, 64, 8192), seed=0)
    took = time.perf_counter() - t0
    assert took < 10, took
    assert r.steps == 100 and r.samples_per_s > 0 and r.engine_occupancy > 0.5
