"""Fault injection for tests of failure handling, read at well-defined points:

PIPELINERL_FAULT="RANK:STEP[:HOW[:POINT]]" makes that rank fail at that step. HOW is `raise` (default: an
exception, the job's error path) or `kill` (SIGKILL: the process vanishes without a word, as under the OOM killer).
POINT says where:
  step         (default) a trainer rank before its optimizer step STEP (0-based); an inference rank once its engine
               has loaded policy version STEP;
  update       an inference rank that has received the header of the update to version STEP, before the weights;
  core-update  the vLLM engine core of inference rank RANK, halfway through loading version STEP (after the first
               bucket; `raise` fails the RPC, `kill` takes the engine core down, as the OOM killer would);
  save         a trainer rank while saving the checkpoint of step STEP: its files written, meta.json not yet.
PIPELINERL_FAULT_NAN="STEP,STEP,..." makes the RL loss NaN at those optimizer steps (0-based) on every trainer rank.
PIPELINERL_FAULT_LOGPROB_SHIFT="X" adds X to every log-prob an inference rank sends with its rollouts, as an engine
that computes another distribution than the trainer would (the start-up check `rl.check_mismatch` must stop the job).

Faults fire in the first attempt of a job only: after torchrun restarts the workers (`--max-restarts`,
TORCHELASTIC_RESTART_COUNT > 0) the run goes on undisturbed, so a test sees the recovery.
"""

from __future__ import annotations

import os
import signal


class InjectedFault(RuntimeError):
    pass


def _first_attempt() -> bool:
    # vLLM's processes start without torchrun's variables (vllm_process.without_torchrun_env), which passes the
    # restart count on as PIPELINERL_RESTART_COUNT: a fault at `core-update` must not fire again after a restart
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("PIPELINERL_RESTART_COUNT") or "0"
    return count == "0"


def nan_loss_at(step: int) -> bool:
    spec = os.environ.get("PIPELINERL_FAULT_NAN")
    return bool(spec) and _first_attempt() and step in {int(x) for x in spec.split(",")}


def logprob_shift() -> float:
    """PIPELINERL_FAULT_LOGPROB_SHIFT (0.0 when unset)."""
    spec = os.environ.get("PIPELINERL_FAULT_LOGPROB_SHIFT")
    return float(spec) if spec and _first_attempt() else 0.0


POINTS = ("step", "update", "core-update", "save")


def maybe_fail(rank: int, step: int, point: str = "step") -> None:
    """Fail here if PIPELINERL_FAULT names this rank, step and point (first attempt only)."""
    spec = os.environ.get("PIPELINERL_FAULT")
    if not spec or not _first_attempt():
        return
    parts = spec.split(":")
    want_rank, want_step = int(parts[0]), int(parts[1])
    how = parts[2] if len(parts) > 2 else "raise"
    where = parts[3] if len(parts) > 3 else "step"
    if how not in ("raise", "kill"):
        raise ValueError(f"PIPELINERL_FAULT={spec}: the third field must be 'raise' or 'kill'")
    if where not in POINTS:
        raise ValueError(f"PIPELINERL_FAULT={spec}: the fourth field must be one of {', '.join(POINTS)}")
    if rank == want_rank and step == want_step and point == where:
        if how == "kill":
            print(f"[rank {rank}] injected SIGKILL at {point} {step} (PIPELINERL_FAULT={spec})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault on rank {rank} at {point} {step} (PIPELINERL_FAULT={spec})")
