"""Fault injection for tests of failure handling, read at well-defined points:
PIPELINERL_FAULT="RANK:STEP" makes that rank raise at that step (the trainer's optimizer step, or the engine's
decode step on an inference rank); PIPELINERL_FAULT_NAN="STEP,STEP,..." makes the RL loss NaN at those optimizer
steps (0-based) on every trainer rank."""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def nan_loss_at(step: int) -> bool:
    spec = os.environ.get("PIPELINERL_FAULT_NAN")
    return bool(spec) and step in {int(x) for x in spec.split(",")}


def maybe_fail(rank: int, step: int) -> None:
    spec = os.environ.get("PIPELINERL_FAULT")
    if not spec:
        return
    want_rank, want_step = (int(x) for x in spec.split(":"))
    if rank == want_rank and step == want_step:
        raise InjectedFault(f"injected fault on rank {rank} at step {step} (PIPELINERL_FAULT={spec})")
