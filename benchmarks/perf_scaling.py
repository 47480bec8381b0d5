"""How PipelineRL scales, from the performance model (`pipelinerl_fsdp.perf`, spec-based costs: no GPU ran it): the
paper's own setting predicted with a sensitivity table, and the scale-down the paper names as its open question.

    python -m benchmarks.perf_scaling --out benchmarks/results/regime/scaling.json      # ~5 min on 2 cores
    python -m benchmarks.perf_scaling --only paper                                        # the paper's setting only

The paper's setting: Qwen2.5-7B's shape, 16 nodes of 8 H100 SXM, 48 GPUs generating (one engine each) and 80
training, 4,096 samples a step (256 prompts x 16 attempts), 256 sequences per engine, an 8,192-token budget, the
math-reasoning length distribution of `pipelinerl_fsdp/perf/data/math_reasoning_lengths.json` (its source and
why are in the file: a log-normal whose shape is an assumption). Its conventional baseline is the paper's: every GPU
generates a round of G batches, then every GPU trains G steps (`colocated` G here: time-shared, no broadcast).
Speed-up = pipeline's samples per second / the baseline's, which is time to a target at equal samples; the paper's
~2x is in time to the same reward, so staleness's effect on samples is the difference (not modelled).
Sensitivity: each assumption moved alone (MFU, the engine's per-step overhead, the length tail, the split, the
engines' slots). The scale-down: 8 to 128 H100s, 0.5B / 1.5B / 7B, the math lengths and a uniform twin of the same
mean; batch 32 x GPUs; every mode at its best split and setting (`perf/planner.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from benchmarks.harness import RESULTS, pyplot, report, save_figure
from pipelinerl_fsdp.perf.lengths import Empirical, Uniform
from pipelinerl_fsdp.perf.planner import Assumptions, Workload, compare, quantile_lengths, run, spec_costs
from pipelinerl_fsdp.perf.spec import H100_SXM, ModelShape

MATH = Path(__file__).resolve().parents[1] / "pipelinerl_fsdp" / "perf" / "data" / "math_reasoning_lengths.json"
STEPS = 16


def paper_workload(shape: str = "qwen2.5-7b", lengths=None, slots: int = 256, batch: int = 4096) -> Workload:
    return Workload(
        shape=ModelShape.flavour(shape),
        lengths=lengths or quantile_lengths(MATH, 8192),
        batch_size=batch,
        attempts=16,
        slots=slots,
        prompt_tokens=256,
        max_new_tokens=8192,
        max_lag=64,  # above the lag it reaches: nothing dropped (the paper reports no drops)
        steps=STEPS,
    )


def heavier(budget: int = 8192) -> Empirical:
    """A heavier tail than the central one: median 2,000, p99 at the budget (more of the batch near the cap, as a
    distilled reasoning model's; DeepScaleR's 8k stage averaged 3,500-5,500 tokens)."""
    import numpy as np

    z = np.array([-2.326, -1.282, -0.674, 0.0, 0.674, 1.282, 2.326])  # p1 p10 p25 p50 p75 p90 p99
    sigma = np.log(budget / 2000) / 2.326
    q = 2000 * np.exp(sigma * z)
    u = np.linspace(0.0005, 0.9995, 2000)
    vals = np.interp(u, [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99], q)
    return Empirical(tuple(int(min(budget, max(1, v))) for v in vals))


def paper(a: Assumptions, w: Workload, engines: int = 48, trainers: int = 80) -> dict:
    """Pipeline on the split, and the paper's conventional G = 8 and 16 (every GPU in turn), samples/s."""
    total = engines + trainers
    pipe = run(w, "pipeline", 1, engines // a.tp, trainers, spec_costs(w, H100_SXM, engines, trainers, a))
    out = {"pipeline": pipe}
    for g in (8, 16):
        costs = spec_costs(w, H100_SXM, total, total, a, colocated=True)
        out[f"conventional G={g}"] = run(w, "colocated", g, total // a.tp, total, costs)
    return out


def paper_rows(only_central: bool) -> tuple[list[list], list[dict]]:
    w, a = paper_workload(), Assumptions()
    uniform = Uniform(max(1, round(w.lengths.mean() * 0.9)), round(w.lengths.mean() * 1.1))
    cases = [("central (MFU 0.35, 1.5 ms step overhead, math lengths, 48 / 80, 256 slots)", a, w, 48, 80)]
    if not only_central:
        cases += [
            ("MFU 0.25", dataclasses.replace(a, mfu=0.25), w, 48, 80),
            ("MFU 0.5", dataclasses.replace(a, mfu=0.5), w, 48, 80),
            ("step overhead 0.75 ms", dataclasses.replace(a, decode_overhead_s=0.75e-3), w, 48, 80),
            ("step overhead 3 ms", dataclasses.replace(a, decode_overhead_s=3e-3), w, 48, 80),
            ("lengths uniform (same mean)", a, dataclasses.replace(w, lengths=uniform), 48, 80),
            ("lengths heavier (median 2,000, p99 8,192)", a, dataclasses.replace(w, lengths=heavier()), 48, 80),
            ("split 32 / 96", a, w, 32, 96),
            ("split 64 / 64", a, w, 64, 64),
            ("64 slots per engine", a, dataclasses.replace(w, slots=64), 48, 80),
        ]
    rows, data = [], []
    for label, aa, ww, e, t in cases:
        r = paper(aa, ww, e, t)
        p = r["pipeline"]
        s8, s16 = (p.samples_per_s / r[f"conventional G={g}"].samples_per_s for g in (8, 16))
        rows.append(
            [label, f"{p.samples_per_s:.0f}", f"{r['conventional G=8'].samples_per_s:.0f}",
             f"{r['conventional G=16'].samples_per_s:.0f}", f"{s8:.2f}x", f"{s16:.2f}x",
             f"{p.lag_p50:.0f} / {p.lag_p90:.0f} / {p.lag_max}", f"{p.engine_occupancy:.2f}",
             f"{p.trainer_busy_frac:.2f}", f"{p.engine_paused_frac:.3f}", f"{1 / p.steps_per_s:.1f}"]
        )  # fmt: skip
        data.append({"case": label, "speedup_g8": s8, "speedup_g16": s16, **{k: summary(v) for k, v in r.items()}})
    return rows, data


def summary(r) -> dict:
    return {
        "samples_per_s": r.samples_per_s,
        "step_s": 1 / r.steps_per_s,
        "lag_p50": r.lag_p50,
        "lag_p90": r.lag_p90,
        "lag_max": r.lag_max,
        "engine_occupancy": r.engine_occupancy,
        "trainer_busy": r.trainer_busy_frac,
        "pause_share": r.engine_paused_frac,
        "dropped_samples": r.dropped_samples,
    }


def scale_rows() -> tuple[list[list], list[dict]]:
    rows, data = [], []
    for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"):
        for lname in ("math tail", "uniform"):
            for n in (8, 16, 32, 64, 128):
                w = paper_workload(shape, batch=32 * n)
                if lname == "uniform":
                    m = w.lengths.mean()
                    w = dataclasses.replace(w, lengths=Uniform(max(1, round(m * 0.9)), round(m * 1.1)))
                t0 = time.time()
                c = compare(w, H100_SXM, n, Assumptions())
                p = c["pipeline"]
                ratio = {m: p.result.samples_per_s / v.result.samples_per_s for m, v in c.items() if m != "pipeline"}
                rows.append(
                    [shape.removeprefix("qwen2.5-"), lname, n, f"{p.engine_gpus} / {p.trainer_gpus}",
                     f"{p.result.samples_per_s:.1f}", f"{ratio['conventional']:.2f}x ({c['conventional'].name})",
                     f"{ratio['async']:.2f}x ({c['async'].name})", f"{ratio['colocated']:.2f}x ({c['colocated'].name})",
                     f"{p.result.lag_p50:.0f} / {p.result.lag_p90:.0f} / {p.result.lag_max}"]
                )  # fmt: skip
                data.append(
                    {"model": shape, "lengths": lname, "gpus": n, "pipeline_split": [p.engine_gpus, p.trainer_gpus],
                     "speedups": ratio, "best": {m: v.name for m, v in c.items()},
                     "pipeline": summary(p.result), "seconds": time.time() - t0}
                )  # fmt: skip
                print(f"{shape} {lname} {n} GPUs: {time.time() - t0:.1f} s", flush=True)
    return rows, data


def plot(data: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, base in zip(axes, ("conventional", "async", "colocated")):
        for i, shape in enumerate(("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")):
            for lname, ls in (("math tail", "-"), ("uniform", "--")):
                pts = [(d["gpus"], d["speedups"][base]) for d in data if d["model"] == shape and d["lengths"] == lname]
                ax.plot(*zip(*pts), ls, color=f"C{i}", marker="o", label=f"{shape} {lname}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("H100 GPUs")
        ax.set_title(f"pipeline / best {base}")
    axes[0].set_ylabel("samples/s ratio (predicted)")
    axes[0].legend(fontsize=7)
    save_figure(fig, path)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["paper", "scale"], default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "perf_scaling.json")
    ap.add_argument("--replot", action="store_true", help="only the plot again, from --out's *_all.json")
    a = ap.parse_args()
    if a.replot:
        saved = json.loads(a.out.with_name(a.out.stem + "_all.json").read_text())
        if plot(saved["scale"], a.out.with_suffix(".png")):
            print(f"plot: {a.out.with_suffix('.png')}")
        return
    out: dict = {}
    if a.only != "scale":
        rows, out["paper"] = paper_rows(False)
        cols = [
            "case",
            "pipeline samples/s",
            "conv. G=8 samples/s",
            "conv. G=16 samples/s",
            "speed-up vs G=8",
            "vs G=16",
            "pipeline lag p50/p90/max",
            "engine occupancy",
            "trainer busy",
            "pause share",
            "step s",
        ]
        report(a.out.with_name(a.out.stem + "_paper.json"), "The paper's setting, predicted", cols, rows, out)
    if a.only != "paper":
        rows, out["scale"] = scale_rows()
        cols = [
            "model",
            "lengths",
            "GPUs",
            "pipeline split (engine / trainer)",
            "pipeline samples/s",
            "vs best conventional (split)",
            "vs best async",
            "vs colocated (in turn)",
            "pipeline lag p50/p90/max",
        ]
        report(a.out, "How PipelineRL scales down (predicted, H100)", cols, rows, out)
        if plot(out["scale"], a.out.with_suffix(".png")):
            print(f"plot: {a.out.with_suffix('.png')}")
    a.out.with_name(a.out.stem + "_all.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
