"""The long-tail / uniform ratio next to the paper's claim: PipelineRL's gain over the other modes on the heavy-tailed
long-generation preset and on its uniform twin (same task, same mean length), from two `learning_speed` runs.

    python -m benchmarks.learning_speed --task long_tail --out benchmarks/results/long_tail
    python -m benchmarks.learning_speed --task long_uniform --out benchmarks/results/long_uniform
    python -m benchmarks.long_regime --tail benchmarks/results/long_tail --uniform benchmarks/results/long_uniform

The paper's claim (issue 46): pipeline's gains "diminish when sequence lengths are uniform". With uniform lengths
every sequence of a conventional round ends at about the same time, so the engines idle less waiting for the
longest one and there is less for in-flight updates to win back. Per mode M run on both presets, the speed-up of
pipeline over M is M's median time to the held-out target / pipeline's (`learning_speed`'s medians over seeds), on
each preset; the ratio tail / uniform above 1 is what the claim predicts. `best conventional` is the fastest
conventional G of those run on each preset (it may differ between them). Beside the times, the same ratio of
optimizer steps per second (defined where a mode missed the target), the bound B of each preset (from conventional
G=1's busy fractions) and pipeline's token lag p50 / p90 / max over the whole run (its rollout dumps).
Writes long_regime.json and long_regime.md under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness import RESULTS, report

CLAIM = 'the paper: gains "diminish when sequence lengths are uniform" (tail / uniform > 1)'


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tail", type=Path, required=True, help="learning_speed --task long_tail's --out folder")
    p.add_argument("--uniform", type=Path, required=True, help="learning_speed --task long_uniform's --out folder")
    p.add_argument("--out", type=Path, default=RESULTS / "long_regime")
    return p.parse_args()


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None where either is missing (a target never reached) or den is 0."""
    return num / den if num is not None and den else None


def pipeline_speedups(modes: dict[str, dict]) -> dict[str, dict]:
    """Pipeline's speed-up over every other mode of one preset's run, as time to target (M's / pipeline's median)
    and as optimizer steps per second (pipeline's / M's); `best conventional` is the fastest conventional G there."""
    pipe = modes["pipeline"]
    out = {
        name: {
            "time": ratio(v["time_to_target_s"], pipe["time_to_target_s"]),
            "steps_per_s": ratio(pipe["steps_per_s"], v["steps_per_s"]),
        }
        for name, v in modes.items()
        if name != "pipeline"
    }
    conv = {k: v["time_to_target_s"] for k, v in modes.items() if k.startswith("conventional")}
    conv = {k: t for k, t in conv.items() if t}  # modes that reached the target
    if conv:
        best = min(conv, key=conv.get)
        out["best conventional"] = {**out[best], "which": best}
    return out


def compare(tail: dict, uniform: dict) -> list[dict]:
    """One row per mode run on both presets (and the best conventional G): pipeline's speed-ups on each preset and
    their ratio tail / uniform, of time to target and of steps per second."""
    t, u = pipeline_speedups(tail["modes"]), pipeline_speedups(uniform["modes"])
    rows = []
    for name in [n for n in t if n in u]:
        r = {"vs": name, "tail": t[name]["time"], "uniform": u[name]["time"]}
        r["ratio"] = ratio(r["tail"], r["uniform"])
        r["claim_holds"] = None if r["ratio"] is None else r["ratio"] > 1
        r["steps_per_s_tail"], r["steps_per_s_uniform"] = t[name]["steps_per_s"], u[name]["steps_per_s"]
        r["steps_per_s_ratio"] = ratio(r["steps_per_s_tail"], r["steps_per_s_uniform"])
        if "which" in t[name]:
            r["which"] = f"{t[name]['which']} / {u[name]['which']}"
        rows.append(r)
    return rows


def pipeline_lag(saved: dict) -> dict:
    """Pipeline's token lag over the whole run (every seed's tokens) and the preset's bound B."""
    lag = saved["modes"]["pipeline"].get("token_lag", {})
    return {"p50": lag.get("p50"), "p90": lag.get("p90"), "max": lag.get("max"), "bound": saved.get("bound")}


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    a = parse_args()
    tail = json.loads((a.tail / "learning_speed.json").read_text())
    uniform = json.loads((a.uniform / "learning_speed.json").read_text())
    rows = compare(tail, uniform)
    lags = {"long_tail": pipeline_lag(tail), "long_uniform": pipeline_lag(uniform)}
    columns = ["pipeline vs", "speed-up, tail", "speed-up, uniform", "tail / uniform", "claim holds",
               "steps/s ratio, tail", "steps/s ratio, uniform", "tail / uniform (steps/s)"]  # fmt: skip
    table = [
        [
            r["vs"] + (f" ({r['which']})" if "which" in r else ""),
            fmt(r["tail"]),
            fmt(r["uniform"]),
            fmt(r["ratio"]),
            "n/a" if r["claim_holds"] is None else ("yes" if r["claim_holds"] else "no"),
            fmt(r["steps_per_s_tail"]),
            fmt(r["steps_per_s_uniform"]),
            fmt(r["steps_per_s_ratio"]),
        ]
        for r in rows
    ]
    lag_note = "; ".join(
        f"{name}: pipeline token lag p50 / p90 / max {v['p50']} / {v['p90']} / {v['max']}, B = {fmt(v['bound'])}"
        for name, v in lags.items()
    )
    title = f"Long-tail vs uniform lengths, {CLAIM}. {lag_note}"
    data = {"claim": CLAIM, "tail": str(a.tail), "uniform": str(a.uniform), "rows": rows, "pipeline_lag": lags}
    print(title, flush=True)
    report(a.out / "long_regime.json", title, columns, table, data)


if __name__ == "__main__":
    main()
