"""Busy time means the same for every engine: time holding an unfinished sequence, not paused, whoever collects."""

from __future__ import annotations

import pytest

from pipelinerl_fsdp.inference.busy import BusyClock
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.rl.step_metrics import StepTimes, step_metrics
from pipelinerl_fsdp.samples import EngineStats, Sample


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_engine_whose_loop_is_blocked_is_not_busy_once_its_sequences_are_done():
    # a fake engine: 2 sequences from t=0; one done at 1, the other at 2; its loop, blocked on a full send queue,
    # collects them only at 10. The old vLLM accounting counted busy until collection: 10 s, not 2.
    t = Clock()
    busy = BusyClock(t)
    busy.enter(2)
    t.t = 1.0
    busy.leave()
    t.t = 2.0
    busy.leave()
    t.t = 10.0
    assert busy.read() == (pytest.approx(2.0), pytest.approx(3.0))  # 2 x 1 s + 1 x 1 s sequence-seconds


def test_update_pauses_are_not_busy():
    t = Clock()
    busy = BusyClock(t)
    busy.enter()
    t.t = 1.0
    busy.pause()
    t.t = 1.5
    busy.resume()
    t.t = 3.0
    busy.leave()
    assert busy.read() == (pytest.approx(2.5), pytest.approx(2.5))


def sample() -> Sample:
    return Sample(0, [1, 2], [5, 6], [-1.0, -1.0], [3, 3], 1.0, 0.0, True)


SUMS = LossStats(sum_rho=2.0, sum_rho2=2.0, sum_w=2.0, sum_w2=2.0, tokens=2.0, kept=2.0, sequences=1, max_log_ratio=0.0)


def test_blocked_time_is_reported_beside_busy_not_inside_it():
    # a 10 s step: 2 s waiting for data, 8 s after it of which 3 s blocked on weight pushes
    times = StepTimes(start=0.0, data=2.0, end=10.0, previous_end=0.0, push_blocked_s=3.0)
    before = EngineStats(elapsed_s=0.0, send_blocked_s=1.0)
    now = EngineStats(busy_s=4.0, elapsed_s=10.0, send_blocked_s=6.0)
    m = step_metrics([sample()], 3, SUMS, now, before, times)
    assert m["trainer_busy_frac"] == pytest.approx(0.5) and m["trainer_push_blocked_frac"] == pytest.approx(0.3)
    assert m["inference_busy_frac"] == pytest.approx(0.4) and m["inference_send_blocked_frac"] == pytest.approx(0.5)
