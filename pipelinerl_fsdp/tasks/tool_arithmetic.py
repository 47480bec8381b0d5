"""Tool-integrated arithmetic: a chain sum the model may hand to a Python tool before giving the final answer.

Prompt "12+34+56=". A model turn is either a tool call, "C:" and a Python expression ("C:12+34+56"), which the
environment evaluates as `print(<expression>)` in the sandbox (tools/sandbox.py: a deadline, an output cap, an
operating-system boundary: no network, nothing of the machine but a read-only system, a capped scratch folder) and
answers "R:102\\n" (or "R:?\\n" when the call failed or printed something other than an integer; the outcome is
counted per step), or the final answer, worked or not ("12+34=46\\n46+56=102\\nA:102"), which ends the episode.
Reward: 1 when the last "A:" of the transcript gives the sum.

The warm start's reference transcripts call the tool for `task.warm_tool_frac` of the problems and work the sum
line by line for the rest (as the `chain_sum` task does), so the warm policy does both: the worked sums of many
terms are where the small model errs, and RL can learn that the tool pays.
"""

from __future__ import annotations

import atexit
import itertools
import random
import re
from dataclasses import dataclass

from pipelinerl_fsdp.episodes import Episode, Reply
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET as ARITHMETIC_ALPHABET
from pipelinerl_fsdp.tasks.arithmetic import _number
from pipelinerl_fsdp.tasks.base import EnvironmentConfig, GeneratedTask, Problem, register_task
from pipelinerl_fsdp.tools.sandbox import ToolLimits, ToolMailbox, ToolRunner, boundary_missing

CALL, RESULT, ANSWER = "C:", "R:", "A:"
# a reference transcript's turns are joined with this in `Problem.solution` (never tokenized)
_TURN_SEP = "|"
_INTEGER = re.compile(r"-?\d{1,30}")


@dataclass
class ToolArithmeticConfig(EnvironmentConfig):
    digits: int = 2
    min_terms: int = 3
    max_terms: int = 8
    max_turns: int = 3
    turn_tokens: int = 80  # a worked answer of max_terms terms
    max_new_tokens: int = 128
    warm_tool_frac: float = 0.5  # reference transcripts that call the tool
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 256
    tool_output_bytes: int = 4096
    tool_workers: int = 2  # tool processes at a time per inference rank

    def check(self) -> list[tuple[str, str]]:
        bad = super().check()
        if not 1 <= self.digits <= 9:
            bad.append(("digits", "between 1 and 9"))
        if self.min_terms < 2:
            bad.append(("min_terms", ">= 2"))
        if self.max_terms < max(self.min_terms, 2):
            bad.append(("max_terms", f">= task.min_terms = {self.min_terms}"))
        if not 0 <= self.warm_tool_frac <= 1:
            bad.append(("warm_tool_frac", "in [0, 1]"))
        for key in ("tool_timeout_s", "tool_memory_mb", "tool_output_bytes", "tool_workers"):
            if getattr(self, key) <= 0:
                bad.append((key, "> 0"))
        return bad


class ToolEpisode(Episode):
    """Answers a tool call with its result once the sandboxed call has ended; any other turn ends the episode."""

    def __init__(self, tools: ToolMailbox, call_id: int) -> None:
        super().__init__()
        self.tools, self.call_id = tools, call_id
        self._calls = 0
        self._waiting: tuple[int, int] | None = None  # the call in flight: (episode, call number)

    def would_reply(self, turn: str, finished: bool) -> bool:
        return finished and turn.startswith(CALL)  # a tool call, not run: the episode ends there, cut short

    def submit(self, turn: str, finished: bool) -> None:
        if not self.would_reply(turn, finished):
            self._reply = Reply(None)  # the final answer (or a turn cut at its budget): the episode ends
            return
        key = (self.call_id, self._calls)
        self._calls += 1
        self.tools.submit(key, f"print({turn[len(CALL) :]})")
        self._waiting = key

    def poll(self) -> Reply | None:
        if self._waiting is None:
            return super().poll()
        result = self.tools.take(self._waiting)
        if result is None:
            return None
        self._waiting = None
        out = result.output.strip()
        value = out if result.outcome == "ok" and _INTEGER.fullmatch(out) else "?"
        return Reply(f"{RESULT}{value}\n", tool_outcome=result.outcome)

    def close(self) -> None:
        if self._waiting is not None:
            self.tools.forget(self._waiting)
            self._waiting = None


@register_task("tool_arithmetic")
class ToolArithmetic(GeneratedTask):
    """Chain sums with a Python tool (see the module docstring)."""

    config_class = ToolArithmeticConfig
    alphabet = ARITHMETIC_ALPHABET + "CR?-"
    cfg: ToolArithmeticConfig

    def __init__(self, cfg: ToolArithmeticConfig) -> None:
        super().__init__(cfg)
        self._tools: ToolMailbox | None = None  # started by the first episode, in the process that runs them
        self._ids = itertools.count()

    def sample(self, rng: random.Random) -> Problem:
        c = self.cfg
        terms = [_number(rng, c.digits) for _ in range(rng.randint(c.min_terms, c.max_terms))]
        expr, total = "+".join(map(str, terms)), sum(terms)
        if rng.random() < c.warm_tool_frac:
            turns = [f"{CALL}{expr}", f"{RESULT}{total}\n", f"{ANSWER}{total}"]
        else:
            lines, acc = [], terms[0]
            for t in terms[1:]:
                lines.append(f"{acc}+{t}={acc + t}")
                acc += t
            turns = ["\n".join(lines) + f"\n{ANSWER}{total}"]
        return Problem(prompt=f"{expr}=", answer=str(total), solution=_TURN_SEP.join(turns))

    def supervised_turns(self, problem: Problem) -> list[str]:
        return problem.solution.split(_TURN_SEP)

    def environment_missing(self) -> list[str]:
        return boundary_missing()

    def start_episode(self, answer: str) -> Episode:
        if self._tools is None:
            c = self.cfg
            limits = ToolLimits(c.tool_timeout_s, c.tool_memory_mb, c.tool_output_bytes)
            runner = ToolRunner(limits, c.tool_workers)
            atexit.register(runner.close)  # an ordinary exit ends the calls at once; a killed rank takes them too
            self._tools = ToolMailbox(runner)
        return ToolEpisode(self._tools, next(self._ids))

    def reward(self, completion: str, answer: str) -> float:
        if ANSWER not in completion:
            return 0.0
        return float(completion.rsplit(ANSWER, 1)[1].strip() == answer)

    def longest_prompt(self) -> str:
        return "+".join(["9" * self.cfg.digits] * self.cfg.max_terms) + "="
