"""A multi-turn environment in the real job: guess_number with the vLLM engine, warm-started from scratch, PipelineRL
with in-flight updates landing between turns and within them. What it shows: episodes of several turns reach the
trainer with environment tokens (version -1) between the model's, episodes span policy versions, the engine and
the trainer agree on the model's tokens over that history (no re-tokenization, the same ids), and the engines
evaluate the same episodes at the promised versions."""

from __future__ import annotations

import json

import pytest

from conftest import torchrun

pytestmark = pytest.mark.slow

STEPS = 16


def test_guess_number_episodes_in_the_pipeline_job(tmp_path):
    r = torchrun(
        2,
        "--config",
        "guess_number",
        f"--job.output_dir={tmp_path / 'job'}",
        f"--warmstart.path={tmp_path / 'warm'}",
        "--warmstart.steps=150",
        "--warmstart.eval_every=150",
        "--warmstart.stop_at_accuracy=0",
        "--task.eval_size=32",
        "--eval.samples=2",
        f"--eval.every={STEPS // 2}",
        f"--rl.max_steps={STEPS}",
        "--rl.batch_size=32",
        "--rl.attempts=4",
        "--inference.max_num_seqs=32",
        "--metrics.log_every=4",
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    recs = [json.loads(x) for x in (tmp_path / "job" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, STEPS + 1))
    for x in recs:
        # several model turns with the environment's replies between them, within the task's limits
        assert 1 < x["turns_per_episode"] <= x["turns_max"] <= 8, x
        assert x["env_tokens_per_episode"] >= 2 * (x["turns_per_episode"] - 1) - 1e-9, x  # ">\n" or "<\n" per reply
        assert x["lag_turn/1"] >= 0 and x["tool_calls"] == 0
    # in-flight updates reach episodes: some episodes hold tokens of two or more versions
    assert max(x["versions_per_episode"] for x in recs) > 1
    # lag-0 tokens whose episode began under the same weights: engine and trainer compute the same log-probs over
    # the whole history (prompt, earlier turns as sampled, the environment's ids): no re-tokenization and no stale
    # cache; the k3 of these tokens, from the step's means
    fresh = []
    for x in recs:
        frac, all_k3 = x["lag0_after_update_frac"], x["mismatch_kl"]
        if all_k3 != all_k3 or frac != frac or frac >= 1:  # NaN: no lag-0 token this step
            continue
        after = x["mismatch_kl_after_update"] if frac > 0 else 0.0
        fresh.append((all_k3 - frac * after) / (1 - frac))
    assert fresh and max(fresh) < 1e-5, fresh  # fp32 on both sides: ~1e-6 per token (tests/e2e/test_metrics.py)
    evals = [json.loads(x) for x in (tmp_path / "job" / "rl" / "evals.jsonl").read_text().splitlines()]
    assert [e["eval/heldout/version"] for e in evals] == [0.0, STEPS / 2, STEPS]
    assert all(e["eval/heldout/problems"] == 32 for e in evals)
