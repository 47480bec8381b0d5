"""Rollouts a person can read: every `metrics.rollouts_every` steps the trained batch goes to
`<output_dir>/rl/rollouts/step-NNNNNNN.jsonl` (prompt, completion, gold answer, reward, outcome, the policy
versions of the completion as ranges, lag, the completion's token ids and the engine's log-prob of each: with the
exports of every version a reader can check which weights sampled each token), and a few per logged step to
TensorBoard's text tab.
`python scripts/show_rollouts.py OUTPUT_DIR` prints the latest ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.rewards.outcomes import OUTCOMES
from pipelinerl_fsdp.samples import Sample, model_versions
from pipelinerl_fsdp.tasks import Task


def version_ranges(versions: list[int]) -> list[list[int]]:
    """[[first token, last token, version], ...]: runs of equal versions (one run unless updated mid-sequence)."""
    out: list[list[int]] = []
    for i, v in enumerate(versions):
        if out and out[-1][2] == v:
            out[-1][1] = i
        else:
            out.append([i, i, v])
    return out


def rollout_record(
    s: Sample, tokenizer: PreTrainedTokenizerBase, task: Task, seed: int, trained_version: int
) -> dict[str, Any]:
    """One sample as a JSON-ready dict (the gold answer looked up from its problem's stream position)."""
    return {
        "group": s.group_id,
        "prompt": tokenizer.decode(s.prompt_ids),
        "completion": tokenizer.decode(s.completion_ids),
        "gold": task.train_problem(seed, s.group_id).answer,
        "reward": s.reward,
        "advantage": round(s.advantage, 6),
        "outcome": OUTCOMES[s.outcome],
        "finished": s.finished,
        "tokens": len(s.completion_ids),
        "versions": version_ranges(s.versions),
        "token_ids": list(s.completion_ids),
        "logprobs": [round(float(x), 7) for x in s.logprobs],
        "lag_max": trained_version - min(model_versions(s.versions), default=trained_version),
    }


class RolloutLog:
    def __init__(self, folder: Path, tokenizer: PreTrainedTokenizerBase, task: Task, seed: int, every: int) -> None:
        self.folder, self.tokenizer, self.task, self.seed, self.every = folder, tokenizer, task, seed, every

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def records(self, samples: list[Sample], trained_version: int) -> list[dict[str, Any]]:
        return [rollout_record(s, self.tokenizer, self.task, self.seed, trained_version) for s in samples]

    def write(self, step: int, records: list[dict[str, Any]]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:07d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path


def as_text(record: dict[str, Any]) -> str:
    """A record as markdown for TensorBoard's text tab (and the console script)."""
    return (
        f"**{record['outcome']}** reward {record['reward']} (gold `{record['gold']}`, versions "
        f"{record['versions']}, lag {record['lag_max']})\n\n    {record['prompt']}\n\n    {record['completion']}"
    )
