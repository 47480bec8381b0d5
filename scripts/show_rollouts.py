"""Print the latest logged rollouts of a run readably: python scripts/show_rollouts.py OUTPUT_DIR [-n 4] [--step N]

Reads `OUTPUT_DIR/rl/rollouts/step-*.jsonl` (written every `metrics.rollouts_every` steps)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output_dir", type=Path)
    ap.add_argument("-n", type=int, default=4, help="rollouts to show")
    ap.add_argument("--step", type=int, default=None, help="that step's file (default: the newest)")
    ap.add_argument("--outcome", default=None, help="only rollouts with this outcome (correct, wrong, ...)")
    a = ap.parse_args()
    files = sorted((a.output_dir / "rl" / "rollouts").glob("step-*.jsonl"))
    if a.step is not None:
        files = [f for f in files if f.name == f"step-{a.step:07d}.jsonl"]
    if not files:
        sys.exit(f"no rollout files under {a.output_dir / 'rl' / 'rollouts'} (set metrics.rollouts_every)")
    recs = [json.loads(line) for line in files[-1].read_text().splitlines()]
    if a.outcome:
        recs = [r for r in recs if r["outcome"] == a.outcome]
    print(f"{files[-1]}: {len(recs)} rollouts")
    for r in recs[: a.n]:
        print("=" * 100)
        print(
            f"group {r['group']} | {r['outcome']} | reward {r['reward']} | gold {r['gold']!r} | "
            f"{r['tokens']} tokens | versions {r['versions']} | lag {r['lag_max']}"
        )
        print("-" * 40 + " prompt")
        print(r["prompt"])
        print("-" * 40 + " completion")
        print(r["completion"])


if __name__ == "__main__":
    main()
