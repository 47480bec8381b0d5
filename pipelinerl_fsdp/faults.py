"""Fault injection for tests of failure handling: PIPELINERL_FAULT="RANK:STEP" makes that rank raise at that step
(the trainer's optimizer step, or the engine's decode step on an inference rank)."""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def maybe_fail(rank: int, step: int) -> None:
    spec = os.environ.get("PIPELINERL_FAULT")
    if not spec:
        return
    want_rank, want_step = (int(x) for x in spec.split(":"))
    if rank == want_rank and step == want_step:
        raise InjectedFault(f"injected fault on rank {rank} at step {step} (PIPELINERL_FAULT={spec})")
