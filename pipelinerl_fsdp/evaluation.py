"""Held-out evaluation: greedy generation on a task's fixed split, exact-match reward, split across ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.inference.generate import generate
from pipelinerl_fsdp.models.decoder import Transformer
from pipelinerl_fsdp.tasks import Task
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
) -> float:
    """Mean exact-match reward of greedy completions on the held-out split.

    `model` is a local (unsharded) copy; with world > 1 each rank takes every world-th problem and the counts
    are summed over `group`. NaN when the task has no held-out problems.
    """
    problems = task.eval_split()[rank::world]
    fmt = fmt or TokenizerConfig()
    prompts = [encode_prompt(tokenizer, p.prompt, fmt) for p in problems]
    stops = stop_ids or [tokenizer.eos_token_id]
    outs = generate(model.eval(), prompts, max_new_tokens, stops, temperature=0.0) if prompts else []
    correct = sum(task.reward(completion_text(tokenizer, o.tokens, stops), p.answer) for p, o in zip(problems, outs))
    if world > 1:
        device = next(model.parameters()).device
        t = torch.tensor([correct, len(problems)], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        correct, total = t.tolist()
    else:
        total = len(problems)
    return correct / total if total else float("nan")
