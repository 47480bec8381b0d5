"""The planner: the job simulator (`perf/simulate.py`) run over the layouts and modes a cluster allows, from a hardware
spec (or a measured profile) and the model's shape, to say which mode to run, how to split the GPUs between engines
and trainer, and what to expect: samples per second, step time, token lag, the pause share.

The modes compared, each at its best setting:
- pipeline, async (staleness bound K = weights pushed every K steps) and conventional (G) on split GPUs: E engine
  GPUs (E / tp engines) and N - E trainer GPUs, E searched over a grid (`splits`);
- colocated (time-shared): every GPU generates a round of G batches, then every GPU trains G steps on it (the paper's
  "conventional RL", verl's and TRL's hybrid engine); simulated as conventional with N GPUs on each side and no
  broadcast (the weights are already on the GPUs; the engines' copy is the load).
Speed-ups are in samples per second, i.e. in time to a target at equal samples: what a mode's staleness does to the
samples a target takes is outside this model (the learning runs here measure it: docs/results.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from pipelinerl_fsdp.perf.costs import PushCost
from pipelinerl_fsdp.perf.lengths import Empirical, Lengths
from pipelinerl_fsdp.perf.simulate import SimConfig, SimCosts, SimResult, simulate
from pipelinerl_fsdp.perf.spec import GpuSpec, ModelShape, decode_from_spec, push_from_spec, train_from_spec

# bytes per parameter of the trained state on the trainer GPUs: bf16 weights and gradients' fp32 reduction, fp32
# master, two AdamW moments (16), plus a margin for activations and buffers: a trainer needs
# ceil(params x 20 / usable memory) GPUs at least
TRAIN_BYTES_PER_PARAM = 20


@dataclass(frozen=True)
class Assumptions:
    """What a spec-based cost model assumes (each a named, stated number; the sensitivity table moves them)."""

    mfu: float = 0.35  # the trainer's model FLOPs utilisation (TorchTitan: 33-39% for an 8B model on 8 H100s)
    decode_overhead_s: float = 1.5e-3  # the engine's per-step host time beyond the roofline
    decode_flops_efficiency: float = 0.5
    tp: int = 1  # GPUs per engine (tensor parallel): each engine is `tp` GPUs whose HBM it reads in parallel


@dataclass(frozen=True)
class Workload:
    """The job's RL settings and its completion lengths."""

    shape: ModelShape
    lengths: Lengths
    batch_size: int
    attempts: int
    slots: int  # inference.max_num_seqs per engine
    prompt_tokens: int
    max_new_tokens: int
    max_lag: int = 8
    steps: int = 20
    micro_batch_tokens: int = 32768


@dataclass(frozen=True)
class Choice:
    """One mode at one setting and layout, and what the simulator predicts for it."""

    mode: str  # pipeline, async, conventional, colocated
    k: int  # async's bound / conventional's and colocated's G (1 for pipeline)
    engine_gpus: int
    trainer_gpus: int
    result: SimResult

    @property
    def name(self) -> str:
        g = {"async": f" K={self.k}", "conventional": f" G={self.k}", "colocated": f" G={self.k}"}.get(self.mode, "")
        return f"{self.mode}{g}"


def quantile_lengths(path: str | Path, budget: int = 0) -> Empirical:
    """An `Empirical` distribution from a lengths file (`perf/data/*.json`: "quantiles" p10..p99 and max, tokens):
    2,001 points of the inverse CDF, linear between the given quantiles (from 1 token at 0), cut at `budget`."""
    import json

    data = json.loads(Path(path).read_text())
    q = data["quantiles"]
    knots = [(0.0, 1.0)] + sorted((float(k[1:]) / 100, float(v)) for k, v in q.items() if k.startswith("p"))
    knots.append((1.0, float(q["max"])))
    values = []
    for i in range(2001):
        u = i / 2000
        j = next(j for j in range(1, len(knots)) if u <= knots[j][0])
        (u0, v0), (u1, v1) = knots[j - 1], knots[j]
        v = v0 + (v1 - v0) * (u - u0) / (u1 - u0) if u1 > u0 else v1
        values.append(max(1, int(round(min(v, budget) if budget else v))))
    return Empirical(tuple(values))


def spec_costs(
    w: Workload, gpu: GpuSpec, engine_gpus: int, trainer_gpus: int, a: Assumptions, colocated: bool = False
) -> SimCosts:
    """Costs from the spec: one engine per `a.tp` GPUs (its HBM bandwidth and FLOPs `tp` times one GPU's), the
    trainer on `trainer_gpus`, the push over the inter-node link (engines and trainer on different nodes) or, when
    `colocated`, no broadcast at all (the engines' copy of the weights is the load)."""
    wide = replace(gpu, bf16_flops=gpu.bf16_flops * a.tp, hbm_bytes_per_s=gpu.hbm_bytes_per_s * a.tp)
    decode = decode_from_spec(
        w.shape, wide, step_overhead_s=a.decode_overhead_s, flops_efficiency=a.decode_flops_efficiency
    )
    train = train_from_spec(w.shape, gpu, trainer_gpus, mfu=a.mfu, micro_batch_tokens=w.micro_batch_tokens)
    push = push_from_spec(w.shape, gpu, trainer_gpus)
    if colocated:
        push = PushCost(push.bytes, push.bucket_bytes, 1e18, load_base_s=push.load_base_s, load_per_byte_s=0.0)
    return SimCosts(decode, train, push)


def min_trainer_gpus(shape: ModelShape, gpu: GpuSpec) -> int:
    """The fewest trainer GPUs whose memory holds the trained state (`TRAIN_BYTES_PER_PARAM`, 90% of each GPU)."""
    return max(1, math.ceil(shape.params * TRAIN_BYTES_PER_PARAM / (0.9 * gpu.memory_gib * 2**30)))


def splits(total: int, tp: int, min_trainers: int, points: int = 5) -> list[int]:
    """Engine GPU counts to try: multiples of `tp`, from about 1/8 to 7/8 of `total`, leaving `min_trainers`."""
    top = total - min_trainers
    out = sorted({max(tp, min(top, round(total * f / 8 / tp) * tp)) for f in range(1, 8)} if top >= tp else set())
    if len(out) > points:
        step = len(out) / points
        out = [out[int(i * step)] for i in range(points)]
    return [e for e in out if tp <= e <= top]


def run(w: Workload, mode: str, k: int, engines: int, trainer_gpus: int, costs: SimCosts, seed: int = 0) -> SimResult:
    """One simulation of `mode` with `engines` engines and `trainer_gpus` trainer GPUs (the caller's
    costs say how fast each is)."""
    sim_mode = "conventional" if mode == "colocated" else mode
    steps = max(w.steps, 2 * k) // k * k  # whole rounds
    cfg = SimConfig(
        mode=sim_mode,
        engines=engines,
        slots=w.slots,
        batch_size=w.batch_size,
        attempts=w.attempts,
        steps=steps,
        sync_every=k,
        max_lag=max(w.max_lag, k),
        prompt_tokens=w.prompt_tokens,
        max_new_tokens=w.max_new_tokens,
        decode_while_blocked=True,
    )
    return simulate(cfg, costs, w.lengths, seed)


def best_of_mode(
    w: Workload, gpu: GpuSpec, total: int, mode: str, ks: tuple[int, ...], a: Assumptions, seed: int = 0
) -> Choice | None:
    """The mode's best setting and split by samples per second (None: no layout fits)."""
    best: Choice | None = None
    if mode == "colocated":
        engines = total // a.tp
        for k in ks:
            r = run(w, mode, k, engines, total, spec_costs(w, gpu, total, total, a, colocated=True), seed)
            c = Choice(mode, k, total, total, r)
            best = c if best is None or r.samples_per_s > best.result.samples_per_s else best
        return best
    # the split searched at the middle setting, then every setting at that split (a mode's best split moves little
    # with its setting; a search of both at once would take len(ks) times the simulations)
    mid = ks[len(ks) // 2]
    for e in splits(total, a.tp, min_trainer_gpus(w.shape, gpu)):
        r = run(w, mode, mid, e // a.tp, total - e, spec_costs(w, gpu, e, total - e, a), seed)
        if best is None or r.samples_per_s > best.result.samples_per_s:
            best = Choice(mode, mid, e, total - e, r)
    if best is None:
        return None
    e, t = best.engine_gpus, best.trainer_gpus
    costs = spec_costs(w, gpu, e, t, a)
    for k in ks:
        if k != mid:
            r = run(w, mode, k, e // a.tp, t, costs, seed)
            if r.samples_per_s > best.result.samples_per_s:
                best = Choice(mode, k, e, t, r)
    return best


DEFAULT_KS = {"pipeline": (1,), "async": (1, 2, 4), "conventional": (1, 2, 4, 8, 16), "colocated": (1, 2, 4, 8, 16)}


def compare(
    w: Workload, gpu: GpuSpec, total: int, a: Assumptions | None = None, ks: dict | None = None, seed: int = 0
) -> dict[str, Choice]:
    """Every mode at its best setting and split on `total` GPUs."""
    a = a or Assumptions()
    ks = ks or DEFAULT_KS
    out = {}
    for mode, kk in ks.items():
        c = best_of_mode(w, gpu, total, mode, kk, a, seed)
        if c is not None:
            out[mode] = c
    return out


def recommend(variants: list[dict[str, Choice]]) -> tuple[str, float, str]:
    """The mode that wins on the first set of choices (the central assumptions), its margin over the runner-up there
    (samples/s ratio), and how sure: "clear" when it wins under every variant of the assumptions by > 10%, "likely"
    when it wins under every variant, else "uncertain" (named: which variant another mode wins)."""
    central = variants[0]
    ranked = sorted(central.values(), key=lambda c: -c.result.samples_per_s)
    best, second = ranked[0], ranked[1] if len(ranked) > 1 else ranked[0]
    margin = best.result.samples_per_s / second.result.samples_per_s
    margins = []
    for v in variants:
        top = max(v.values(), key=lambda c: c.result.samples_per_s)
        others = [c.result.samples_per_s for m, c in v.items() if m != best.mode]
        margins.append((top.mode, v[best.mode].result.samples_per_s / max(others) if others else math.inf))
    if all(m == best.mode and r > 1.1 for m, r in margins):
        sure = "clear"
    elif all(m == best.mode for m, _ in margins):
        sure = "likely"
    else:
        losers = sorted({m for m, _ in margins if m != best.mode})
        sure = f"uncertain ({', '.join(losers)} wins under some assumptions)"
    return best.mode, margin, sure
