"""The metrics logger: evaluations that complete within one step are all kept (evals.jsonl and TensorBoard), the
step's record carries the newest of each set, and a resumed run drops the stopped attempt's later evaluations."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipelinerl_fsdp.training.metrics import MetricsLogger


def ev(name: str, version: int, acc: float) -> dict[str, float]:
    return {f"eval/{name}/version": float(version), f"eval/{name}/pass@1": acc, f"eval/{name}/problems": 8.0}


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_two_evaluations_in_one_step_are_both_logged(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=True, total_steps=12)
    log.log(1, {"reward_mean": 0.1}, console=False, evals=[ev("heldout", 0, 0.25)])
    log.log(2, {"reward_mean": 0.2}, console=False)
    # version 6's evaluation finished together with the final one (12), at the last step
    log.log(
        12,
        {"reward_mean": 0.3},
        console=False,
        evals=[ev("heldout", 6, 0.5), ev("other", 6, 0.4), ev("heldout", 12, 0.75)],
    )
    log.close()
    recs = lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 12]  # still one record per step
    assert "eval/heldout/version" not in recs[1]
    assert recs[2]["eval/heldout/version"] == 12 and recs[2]["eval/heldout/pass@1"] == 0.75
    assert recs[2]["eval/other/version"] == 6 and recs[2]["reward_mean"] == 0.3
    evals = lines(tmp_path / "evals.jsonl")
    assert [(e["step"], e.get("eval/heldout/version"), e.get("eval/other/version")) for e in evals] == [
        (1, 0, None),
        (12, 6, None),
        (12, None, 6),
        (12, 12, None),
    ]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    points = [(s.step, s.value) for s in acc.Scalars("eval/heldout/pass@1")]
    assert points == [(1, 0.25), (12, 0.5), (12, 0.75)]
    assert [s.value for s in acc.Scalars("reward_mean")] == [pytest.approx(v) for v in (0.1, 0.2, 0.3)]


def test_a_resumed_logger_drops_later_evaluations(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=12)
    for step in range(1, 9):
        log.log(step, {"x": step}, console=False, evals=[ev("heldout", step - 1, 0.5)] if step % 3 == 1 else [])
    log.close()
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=12, resume_step=5)
    log.log(6, {"x": 6}, console=False)
    log.close()
    assert [e["step"] for e in lines(tmp_path / "evals.jsonl")] == [1, 4]  # step 7's was the stopped attempt's


def test_a_fresh_run_replaces_an_earlier_runs_records(tmp_path, capsys):
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=32, prefix="rl/")
    for step in range(1, 33):
        log.log(step, {"x": step}, console=False, evals=[ev("heldout", step, 0.5)] if step % 8 == 0 else [])
    log.close()
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=24, prefix="rl/")  # the same folder, from step 1
    for step in range(1, 4):
        log.log(step, {"x": 10 * step}, console=False)
    log.close()
    assert [(r["step"], r["x"]) for r in lines(tmp_path / "metrics.jsonl")] == [(1, 10), (2, 20), (3, 30)]
    assert lines(tmp_path / "evals.jsonl") == []
    assert "32 records of an earlier run in this folder replaced" in capsys.readouterr().out
