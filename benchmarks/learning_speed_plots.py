"""`benchmarks.learning_speed`'s figures: the learning curves and ESS per mode and seed (`learning_speed.png`), and
the token-lag histogram per mode (`learning_speed_lag.png`, from the runs' rollout dumps)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import pyplot, save_figure


def plot(results: dict[str, dict], target: float, path: Path) -> bool:
    """Held-out accuracy (when measured) and sampled reward against time and samples, one curve per seed; ESS
    (raw, and dashed of the truncated weights) against the step."""
    plt = pyplot()
    if plt is None:
        return False
    has_eval = "eval_curve" in next(iter(results.values()))["seeds"][0]
    panels = (["accuracy"] if has_eval else []) + ["reward_smooth"]
    fig, axes = plt.subplots(len(panels), 3, figsize=(17, 4.6 * len(panels)), squeeze=False)
    ylabel = {"accuracy": "held-out greedy accuracy", "reward_smooth": "sampled reward (moving average)"}
    for i, (name, v) in enumerate(results.items()):
        colour = f"C{i}"
        for k, run in enumerate(v["seeds"]):  # one curve per seed, one colour per mode
            label = name if k == 0 else None
            for row, key in enumerate(panels):
                c = run["eval_curve"] if key == "accuracy" else run["curve"]
                axes[row][0].plot(c["wall_time_s"], c[key], color=colour, lw=0.9, label=label)
                axes[row][1].plot(c["samples"], c[key], color=colour, lw=0.9, label=label)
            ess = run["curve"]["ess"]
            axes[0][2].plot(range(1, len(ess) + 1), ess, color=colour, lw=0.6, label=label)
            truncated = run["curve"].get("ess_truncated")
            if truncated and any(x == x for x in truncated):  # NaN != NaN: runs without the metric draw nothing
                axes[0][2].plot(range(1, len(truncated) + 1), truncated, color=colour, lw=0.6, ls="--")
    for row, key in enumerate(panels):
        for ax, xl in zip(axes[row][:2], ["trainer wall time (s)", "samples"]):
            if row == 0:
                ax.axhline(target, color="grey", ls="--", lw=0.8)
            ax.set_xlabel(xl)
            ax.set_ylabel(ylabel[key])
    axes[0][2].set_xlabel("optimizer step")
    axes[0][2].set_ylabel("ESS (dashed: truncated weights)")
    for row in range(1, len(panels)):
        axes[row][2].axis("off")
    save_figure(fig, path)
    return True


def plot_lag(results: dict[str, dict], path: Path) -> bool:
    """Each mode's token-lag histogram (its seeds' tokens together) as the share of tokens per integer lag, overlaid
    step histograms on a log y axis (the tail of old tokens is orders of magnitude below lag 0). False when no mode
    has one (no rollout dumps) or matplotlib is missing."""
    hists = {name: v["token_lag"] for name, v in results.items() if v.get("token_lag", {}).get("tokens")}
    plt = pyplot() if hists else None
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for i, (name, lag) in enumerate(hists.items()):
        lags = sorted(int(k) for k in lag["hist"])
        xs = list(range(0, lags[-1] + 2))
        share = [lag["hist"].get(str(x), 0) / lag["tokens"] for x in xs]
        label = f"{name} (p50 {lag['p50']}, p90 {lag['p90']}, max {lag['max']})"
        ax.step(xs, share, where="post", color=f"C{i}", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("token lag (versions between the trained weights and the token's)")
    ax.set_ylabel("share of the run's tokens")
    save_figure(fig, path)
    return True
