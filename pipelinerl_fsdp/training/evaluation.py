"""Held-out evaluation: greedy accuracy on a local model (the warm start, which has no engines), and the pieces of
evaluation on the inference engines: unbiased pass@k and the join of the engines' reports."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.inference.generate import generate
from pipelinerl_fsdp.inference.reference_engine import ReferenceEngine
from pipelinerl_fsdp.inference.turns import TurnEngine
from pipelinerl_fsdp.models.decoder import Transformer
from pipelinerl_fsdp.samples import EvalReport
from pipelinerl_fsdp.tasks import Problem, Task
from pipelinerl_fsdp.tokenizer import completion_text, encode_prompt


@torch.no_grad()
def greedy_accuracy(
    model: Transformer,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    fmt: TokenizerConfig | None = None,
    rank: int = 0,
    world: int = 1,
    group: dist.ProcessGroup | None = None,
    stop_ids: list[int] | None = None,
    problems: list[Problem] | None = None,
) -> float:
    """Mean exact-match reward of greedy completions on the held-out split (or on `problems`).

    `model` is a local (unsharded) copy; with world > 1 each rank takes every world-th problem and the counts
    are summed over `group`. NaN when there are no problems.
    """
    problems = (task.eval_split() if problems is None else problems)[rank::world]
    fmt = fmt or TokenizerConfig()
    prompts = [encode_prompt(tokenizer, p.prompt, fmt) for p in problems]
    stops = stop_ids or [tokenizer.eos_token_id]
    if task.multi_turn:
        texts = greedy_episodes(model, task, tokenizer, problems, prompts, max_new_tokens, fmt, stops)
    else:
        outs = generate(model.eval(), prompts, max_new_tokens, stops, temperature=0.0) if prompts else []
        texts = [completion_text(tokenizer, o.tokens, stops) for o in outs]
    correct = sum(float(task.reward(text, p.answer) >= 1.0) for p, text in zip(problems, texts))
    if world > 1:
        device = next(model.parameters()).device
        t = torch.tensor([correct, len(problems)], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        correct, total = t.tolist()
    else:
        total = len(problems)
    return correct / total if total else float("nan")


def greedy_episodes(
    model: Transformer,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[Problem],
    prompts: list[list[int]],
    max_new_tokens: int,
    fmt: TokenizerConfig,
    stop_ids: list[int],
    max_in_flight: int = 256,
) -> list[str]:
    """The transcripts of a multi-turn task's greedy episodes, one per problem: the reference engine on `model`
    run turn by turn (`inference.turns.TurnEngine`), as the inference ranks run them."""
    if not problems:
        return []
    inner = ReferenceEngine(
        model.eval(), min(len(problems), max_in_flight), max(map(len, prompts)) + max_new_tokens, stop_ids, 0.0
    )
    cfg = task.cfg
    engine = TurnEngine(inner, tokenizer, fmt, stop_ids, cfg.max_turns, cfg.turn_tokens)  # type: ignore[attr-defined]
    for i, (p, ids) in enumerate(zip(problems, prompts)):
        engine.add(Request(i, ids, max_new_tokens, episode=task.start_episode(p.answer)))
    texts: dict[int, str] = {}
    while engine.num_unfinished():
        for r in engine.step():
            texts[r.request_id] = r.transcript or ""
    return [texts[i] for i in range(len(problems))]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class EvalAggregator:
    """Joins the engines' reports of each (set, version); complete once every engine has reported."""

    def __init__(self, set_names: list[str], n_engines: int, pass_k: list[int]) -> None:
        self.set_names, self.n_engines, self.pass_k = set_names, n_engines, pass_k
        self._parts: dict[tuple[int, int], list[EvalReport]] = {}
        self.done: set[tuple[int, int]] = set()

    def add(self, report: EvalReport) -> dict[str, float]:
        """Take a report; returns the set's metrics (`eval/<set>/pass@k`, `.../version`, `.../problems`) when the
        (set, version) it belongs to is complete, else {}."""
        key = (report.set_index, report.version)
        parts = self._parts.setdefault(key, [])
        parts.append(report)
        if len(parts) < self.n_engines:
            return {}
        del self._parts[key]
        self.done.add(key)
        name = self.set_names[report.set_index]
        counts = [(r.samples, c) for r in parts for c in r.correct]
        out = {f"eval/{name}/version": float(report.version), f"eval/{name}/problems": float(len(counts))}
        for k in self.pass_k:
            out[f"eval/{name}/pass@{k}"] = (
                sum(pass_at_k(n, c, k) for n, c in counts) / len(counts) if counts else float("nan")
            )
        return out

    def complete(self, version: int) -> bool:
        """Every set has been reported in full for `version`."""
        return all((i, version) in self.done for i in range(len(self.set_names)))
