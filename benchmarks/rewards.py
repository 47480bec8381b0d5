"""Reward throughput: math-verify answers per second per worker in the reward pool, and the share of timeouts on a
hostile set (expressions that make math-verify grind), next to a plain in-process loop.

    python -m benchmarks.rewards [--workers 1,2] [--answers 400] [--timeout 2] [--out benchmarks/results/rewards.json]

Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.harness import RESULTS, report
from pipelinerl_fsdp.rewards.math_answer import score_math_answer, warm_up
from pipelinerl_fsdp.rewards.pool import RewardPool

FN = "pipelinerl_fsdp.rewards.math_answer:score_math_answer"


def realistic(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Answers as a policy writes them: mostly boxed numbers and fractions, some wrong, some without a box."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 9)
        kind = rng.randrange(5)
        if kind == 0:
            out.append((f"The total is {a} + {b} = \\boxed{{{a + b}}}.", str(a + b)))
        elif kind == 1:
            out.append((f"So $x = \\boxed{{\\frac{{{a}}}{{{b}}}}}$", f"{a}/{b}"))
        elif kind == 2:
            out.append((f"I think it is \\boxed{{{a + 1}}}", str(a)))
        elif kind == 3:
            out.append((f"The answer is {a}.", str(a)))
        else:
            out.append((f"\\boxed{{x^2 + {a}x + {b}}}", f"x^2+{a}x+{b}"))
    return out


def hostile(n: int) -> list[tuple[str, str]]:
    """Power towers and huge expansions: math-verify needs seconds on each."""
    forms = [
        "\\boxed{{2^{{2^{{2^{{2^{{2^{{{k}}}}}}}}}}}}}",
        "\\boxed{{(x+1)^{{{k}0000}}}}",
        "\\boxed{{9^{{9^{{9^{{{k}}}}}}}}}",
    ]
    return [(forms[i % len(forms)].format(k=2 + i % 5), "1") for i in range(n)]


def run_pool(answers: list[tuple[str, str]], workers: int, timeout: float) -> dict:
    pool = RewardPool(FN, workers, timeout)
    try:
        pool.wait_ready(timeout_s=120)  # start-up (spawn + warm-up) is not timed
        t0 = time.perf_counter()
        for i, (c, g) in enumerate(answers):
            pool.submit(i, c, g)
        got = pool.wait_all(timeout_s=3600)
        secs = time.perf_counter() - t0
    finally:
        pool.close()
    outcomes: dict[str, int] = {}
    for _, _, o in got:
        outcomes[o] = outcomes.get(o, 0) + 1
    return {
        "answers": len(got),
        "seconds": round(secs, 2),
        "answers_per_s": round(len(got) / secs, 1),
        "answers_per_s_per_worker": round(len(got) / secs / workers, 1),
        "outcomes": outcomes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--answers", type=int, default=400)
    ap.add_argument("--hostile", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--out", default=str(RESULTS / "rewards.json"))
    a = ap.parse_args()
    answers = realistic(a.answers)
    warm_up()
    t0 = time.perf_counter()
    for c, g in answers:
        score_math_answer(c, g)
    inline = len(answers) / (time.perf_counter() - t0)
    rows = [
        {
            "set": "realistic",
            "workers": 0,
            "answers": len(answers),
            "answers_per_s": round(inline, 1),
            "answers_per_s_per_worker": round(inline, 1),
            "outcomes": {},
            "seconds": 0.0,
        }
    ]
    for w in [int(x) for x in a.workers.split(",")]:
        rows.append({"set": "realistic", "workers": w, **run_pool(answers, w, a.timeout)})
        rows.append({"set": "hostile", "workers": w, **run_pool(hostile(a.hostile), w, a.timeout)})
    cols = ["set", "workers", "answers", "answers_per_s", "answers_per_s_per_worker", "outcomes"]
    report(
        Path(a.out),
        "Reward throughput: math-verify in-process and in the reward pool (workers 0: in-process loop)",
        cols,
        [[r[c] for c in cols] for r in rows],
        {"timeout_s": a.timeout, "rows": rows},
    )


if __name__ == "__main__":
    main()
