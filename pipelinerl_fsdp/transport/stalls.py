"""A weight push that one engine holds up fails fast, naming the engine.

A broadcast completes only once every member of the bucket group has posted its receive, so one dead or stuck
engine holds every bucket of a push, and every other engine waits in it, paused, until `world.timeout_s`. Each
vLLM worker marks in the store which bucket of which update it has posted (`StoreGroup.mark_posted`); when a
bucket is not through after `STALL_S`, the first trainer rank reads the marks and fails naming the engines behind
the furthest one (inference rank, worker, where each is).
"""

from __future__ import annotations

from pipelinerl_fsdp.transport.device_waits import Check
from pipelinerl_fsdp.transport.store_group import StoreGroup

# How long a bucket may wait for engines left behind before the push fails naming them. An engine takes an update
# between two of its steps (milliseconds to seconds), so a minute is slack enough, and ten times sooner than
# world.timeout_s's default.
STALL_S = 60.0


def push_stall_s(mode: str, timeout_s: float) -> float | None:
    """The sender's stall limit for `rl.mode`: None in async mode, where an engine may hold the next update back,
    legitimately and for as long as its requests take to finish, until the version it holds is evaluated
    (`inference/worker.py`, `_holding_for_eval`); else `STALL_S`, at most `world.timeout_s`."""
    return None if mode == "async" else min(STALL_S, timeout_s)


def late_members(posted: dict[int, tuple[int, int, str]], version: int) -> list[str]:
    """The receiving members behind the furthest one in the update of `version`: they hold up a broadcast that the
    others wait in, paused. A member posts a bucket only once the one before it has arrived, so in a live update
    all are within a bucket of each other, and a member left behind for long is dead, or stuck (in its step, its
    loader, its GPU). Empty when no member has posted a bucket of `version`: nothing then tells a dead engine from
    one that has not reached the update yet. `posted`: member rank -> (version, bucket, who), each member's last
    mark (`StoreGroup.posted`)."""
    ahead = max(((v, b) for v, b, _ in posted.values() if v == version), default=None)
    if ahead is None:
        return []
    return [
        f"{who} (member {r}, at bucket {b} of version {v}; the furthest engine has posted bucket {ahead[1]})"
        for r, (v, b, who) in sorted(posted.items())
        if (v, b) < ahead
    ]


def stall_check(group: StoreGroup | None, stall_s: float | None, version: int, what: str) -> Check | None:
    """The check (`device_waits.poll_until`) of the source's wait for a bucket of `version` (`what` names it):
    once it has waited `stall_s`, read the members' marks and fail naming those behind. None without a store
    group (no marks) or a limit."""
    if group is None or stall_s is None:
        return None

    def check(waited_s: float) -> None:
        if waited_s < stall_s:
            return
        late = late_members(group.posted(), version)
        if late:
            raise TimeoutError(
                f"{what}: not through after {waited_s:.0f} s; behind the other engines, which wait paused: "
                f"{'; '.join(late)}: dead or stuck (stall limit {stall_s:.0f} s)"
            )

    return check
