"""Fault injection for tests of failure handling, read at well-defined points:

PIPELINERL_FAULT="RANK:STEP[:HOW]" makes that rank fail at that step (the trainer's optimizer step; on an
inference rank, once its engine has loaded that policy version). HOW is `raise` (default: an exception, the job's
error path) or `kill` (SIGKILL: the process vanishes without a word, as under the OOM killer).
PIPELINERL_FAULT_NAN="STEP,STEP,..." makes the RL loss NaN at those optimizer steps (0-based) on every trainer rank.

Faults fire in the first attempt of a job only: after torchrun restarts the workers (`--max-restarts`,
TORCHELASTIC_RESTART_COUNT > 0) the run goes on undisturbed, so a test sees the recovery.
"""

from __future__ import annotations

import os
import signal


class InjectedFault(RuntimeError):
    pass


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def nan_loss_at(step: int) -> bool:
    spec = os.environ.get("PIPELINERL_FAULT_NAN")
    return bool(spec) and _first_attempt() and step in {int(x) for x in spec.split(",")}


def maybe_fail(rank: int, step: int) -> None:
    spec = os.environ.get("PIPELINERL_FAULT")
    if not spec or not _first_attempt():
        return
    parts = spec.split(":")
    want_rank, want_step = int(parts[0]), int(parts[1])
    how = parts[2] if len(parts) > 2 else "raise"
    if how not in ("raise", "kill"):
        raise ValueError(f"PIPELINERL_FAULT={spec}: the third field must be 'raise' or 'kill'")
    if rank == want_rank and step == want_step:
        if how == "kill":
            print(f"[rank {rank}] injected SIGKILL at step {step} (PIPELINERL_FAULT={spec})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected fault on rank {rank} at step {step} (PIPELINERL_FAULT={spec})")
