"""The long-generation regime at small scale: a pipeline run of the countdown task (train_configs/long_tail.toml,
shortened) from a short warm start. Sequences live through several optimizer steps, every token's recorded version
is the one whose weights sampled it (checked against the exported policy of every version, independently of the
engine), and the uniform twin's completions stay within its length band."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import torchrun
from pipelinerl_fsdp.checkpoint_layout import export_folder
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models.hf_io import load_hf_model
from pipelinerl_fsdp.tokenizer import encode_prompt, load_tokenizer

pytestmark = pytest.mark.slow

# the long preset with at most 40 lines (360 tokens) so that its warm start and runs fit CI; the reference engine
# (starts in a second; fp32 log-probs that a full forward of the same weights reproduces to ~1e-6, so that a token's
# version can be told from its neighbour's)
SMALL = (
    "--config",
    "long_tail",
    "--task.max_lines=40",
    "--task.max_new_tokens=360",
    "--task.eval_size=32",
    "--inference.engine=reference",
)
WARMSTART_STEPS = 300


@pytest.fixture(scope="module")
def countdown_warm(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("countdown_ws")
    r = torchrun(
        1,
        *SMALL,
        "--job.stage=warmstart",
        "--world.inference_ranks=0",
        f"--warmstart.path={d}/model",
        f"--job.output_dir={d}/out",
        f"--warmstart.steps={WARMSTART_STEPS}",
        f"--warmstart.eval_every={WARMSTART_STEPS}",
        "--warmstart.stop_at_accuracy=0",
        threads=2,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return d / "model"


def run(warm: Path, out: Path, *extra: str) -> list[dict]:
    """A short pipeline run (2 ranks, the reference engine); its rollout dumps (every step), one record per sample
    with the step it was trained at."""
    r = torchrun(
        2,
        *SMALL,
        f"--model.path={warm}",
        f"--job.output_dir={out}",
        "--rl.max_steps=10",
        "--rl.batch_size=16",
        "--inference.max_num_seqs=32",
        "--eval.every=0",
        "--metrics.rollouts_every=1",
        "--metrics.log_every=5",
        *extra,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    dumps = sorted((out / "rl" / "rollouts").glob("step-*.jsonl"))
    return [{**json.loads(x), "step": int(f.stem.split("-")[1])} for f in dumps for x in f.read_text().splitlines()]


def token_versions(rec: dict) -> list[int]:
    out = [0] * rec["tokens"]
    for a, b, v in rec["versions"]:
        out[a : b + 1] = [v] * (b - a + 1)
    return out


@torch.no_grad()
def logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logits = model(ids).float()[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def version_errors(recs: list[dict], warm: Path, out: Path, versions: int) -> tuple[float, int, int]:
    """Rescore the completions of the dumped samples that span versions with the exported policy of each token's
    recorded version: (largest |recorded log-prob - that version's|, tokens checked, tokens whose log-prob under the
    next version differs by more than 1e-4, i.e. where the check could tell the two versions apart)."""
    tok, fmt = load_tokenizer(warm), load_config(list(SMALL)).tokenizer
    # version v is the policy after v steps: exported every step, the last one as final/
    folders = {0: warm, **{v: export_folder(out, v) for v in range(1, versions)}, versions: out / "final"}
    models = {v: load_hf_model(f).eval() for v, f in folders.items()}
    worst, checked, gaps = 0.0, 0, 0
    for rec in [r for r in recs if len(r["versions"]) >= 2][:6]:
        prompt = encode_prompt(tok, rec["prompt"], fmt)
        per_token = token_versions(rec)
        by_version = {
            v: logprobs(models[v], prompt, rec["token_ids"])
            for v in set(per_token) | {max(per_token) + 1}
            if v in models
        }
        for i, (v, lp) in enumerate(zip(per_token, rec["logprobs"])):
            worst = max(worst, abs(by_version[v][i] - lp))
            gaps += v + 1 in by_version and abs(by_version[v + 1][i] - lp) > 1e-4
            checked += 1
    return worst, checked, gaps


def uniform_band() -> tuple[int, int]:
    """Completion tokens of the uniform twin of SMALL: the mean line count of P(L) ~ L^-1.5 on 3..40 (10.1), +-10%,
    9 tokens a line (computed here from the formula, not by the task's code)."""
    weights = {n: n**-1.5 for n in range(3, 41)}
    mean = sum(n * w for n, w in weights.items()) / sum(weights.values())
    return 9 * (round(mean) - round(0.1 * mean)), 9 * (round(mean) + round(0.1 * mean))


# kv_max_age 0: an update recomputes the cache of every sequence in flight, so each token's log-prob is exactly its
# version's (with a kept cache it would mix versions: the stale-KV effect); every version exported; a learning rate
# 20x the preset's, so that consecutive versions give measurably different log-probs even on the tokens the warm start
# is sure of (the check must be able to tell versions apart)
EXACT = ("--inference.kv_max_age=0", "--checkpoint.export_every=1", "--trainer.optimizer.lr=3e-4")


def test_long_sequences_span_versions_and_every_token_version_is_exact(countdown_warm, tmp_path):
    recs = run(countdown_warm, tmp_path, *EXACT)
    spans = sorted(len({v for _, _, v in r["versions"]}) for r in recs)
    assert spans[-1] >= 3, spans[-10:]  # measured 6-9 in 5 runs
    worst, checked, gaps = version_errors(recs, countdown_warm, tmp_path, 10)
    assert all(math.isfinite(x) for r in recs for x in r["logprobs"])
    # measured over 5 runs (job.seed 0-4, one warm start): longest span 6-9 versions, worst |difference| 2.6e-6 to
    # 9.5e-6, 270-594 tokens checked, 17-31% of them with a log-prob under the next version more than 1e-4 away
    assert worst < 1e-4 and checked > 100 and gaps > 0.05 * checked, (worst, checked, gaps)


def test_uniform_twin_lengths_stay_in_their_band(countdown_warm, tmp_path):
    recs = run(countdown_warm, tmp_path, "--task.lengths=uniform")
    lo, hi = uniform_band()
    gold = [len(r["gold"]) + 1 for r in recs]
    assert lo <= min(gold) and max(gold) <= hi  # the twin's problems
    # the policy's completions: within a line of the band, for nearly all of them (measured over 5 runs: 0.975-1.0
    # of the 160 completions; the misses are the warm start's occasional missed stop)
    inside = sum(lo - 9 <= r["tokens"] <= hi + 9 for r in recs) / len(recs)
    assert inside >= 0.9, sorted(r["tokens"] for r in recs)
