"""Fault injection (a spec fires exactly at its rank, step and point, in the first attempt only), and failed waits
named by what they waited for."""

from __future__ import annotations

import pytest

from pipelinerl_fsdp.runtime.faults import InjectedFault, maybe_fail


@pytest.fixture
def fault(monkeypatch):
    def set_spec(spec: str, restart: str = "0") -> None:
        monkeypatch.setenv("PIPELINERL_FAULT", spec)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)

    return set_spec


def test_fires_only_at_its_rank_step_and_point(fault):
    fault("1:6:raise:core-update")
    for rank, step, point in [(0, 6, "core-update"), (1, 5, "core-update"), (1, 6, "step"), (1, 6, "update")]:
        maybe_fail(rank, step, point)  # nothing
    with pytest.raises(InjectedFault, match="rank 1 at core-update 6"):
        maybe_fail(1, 6, "core-update")


def test_the_default_point_is_the_step(fault):
    fault("0:3")
    maybe_fail(0, 3, "save")
    with pytest.raises(InjectedFault, match="rank 0 at step 3"):
        maybe_fail(0, 3)


def test_not_after_a_restart(fault):
    fault("0:3", restart="1")
    maybe_fail(0, 3)


@pytest.mark.parametrize("spec, msg", [("0:3:explode", "'raise' or 'kill'"), ("0:3:kill:nowhere", "one of step")])
def test_a_bad_spec_is_named(fault, spec, msg):
    fault(spec)
    with pytest.raises(ValueError, match=msg):
        maybe_fail(0, 0)


def test_a_failed_exchange_says_what_it_waited_for():
    from pipelinerl_fsdp.job.world import waiting_for

    with pytest.raises(
        RuntimeError,
        match=r"rank 3, waiting for the engines to receive weight version 7: "
        r"RuntimeError: Connection reset by peer",
    ) as e:
        with waiting_for("the engines to receive weight version 7", 3):
            raise RuntimeError("Connection reset by peer")
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(KeyError):  # not an exchange failure: passed through untouched
        with waiting_for("anything", 0):
            raise KeyError("x")


def test_vllm_processes_see_the_restart_count_under_our_name(fault, monkeypatch):
    """vLLM's processes start without torchrun's variables; a restarted job's engine core must not fire again."""
    fault("1:6:raise:core-update", restart="0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("PIPELINERL_RESTART_COUNT", "1")
    maybe_fail(1, 6, "core-update")  # nothing: a restarted attempt
    monkeypatch.setenv("PIPELINERL_RESTART_COUNT", "0")
    with pytest.raises(InjectedFault):
        maybe_fail(1, 6, "core-update")
