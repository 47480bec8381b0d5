"""Every registered loss on one packed micro-batch of two groups with known log-probs: the loss value and its
gradient against the closed form of the loss's formula (computed here in plain Python, token by token), for each
normalisation, the mismatch masks, sequence-level TIS and GSPO's sequence ratio; the per-sample weights and the
overlong punishment by hand; and the `[loss]` section of the config."""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl_fsdp.config import ConfigError, to_toml
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.rl.advantages import overlong_penalty, shaped_group_advantages
from pipelinerl_fsdp.rl.loss import LossInput, LossStats, policy_loss
from pipelinerl_fsdp.rl.normalization import assign_loss_weights, sample_weights
from pipelinerl_fsdp.rl.objectives import CONFIGS, OBJECTIVES
from pipelinerl_fsdp.samples import Sample

# Two groups of two samples: (group, advantage, log rho per completion token). A prompt position (mask 0) opens the
# row, so every field is also checked to ignore it. Ratios: 1.105, 0.741 | 1, 7.39, 0.951 | 1.162 | 0.202, 1.051.
SAMPLES = [
    (0, 1.0, [0.1, -0.3]),
    (0, -1.0, [0.0, 2.0, -0.05]),
    (1, 0.5, [0.15]),
    (1, -0.5, [-1.6, 0.05]),
]
B, L = 4, 4  # samples in the step; task.max_new_tokens
LOGP = [-0.7, -1.2, -0.4, -2.3, -0.9, -0.2, -1.1, -0.6]  # log pi of each completion token


def micro_batch() -> dict[str, torch.Tensor]:
    """One packed row: a prompt target, then the four samples' completion tokens."""
    log_ratio = [x for _, _, lr in SAMPLES for x in lr]
    adv = [a for _, a, lr in SAMPLES for _ in lr]
    seq = [0] + [i for i, (_, _, lr) in enumerate(SAMPLES) for _ in lr]
    return {
        "logp": torch.tensor([-3.0] + LOGP, dtype=torch.float64),
        "behaviour": torch.tensor([-3.0] + [p - r for p, r in zip(LOGP, log_ratio)], dtype=torch.float64),
        "adv": torch.tensor([0.0] + adv, dtype=torch.float64),
        "mask": torch.tensor([0.0] + [1.0] * len(LOGP), dtype=torch.float64),
        "seq": torch.tensor(seq),
    }


def hand_weights(mode: str) -> list[float]:
    """Each sample's normalisation weight, from rl/normalization.py's table."""
    n = [len(lr) for _, _, lr in SAMPLES]
    group_tokens = {0: n[0] + n[1], 1: n[2] + n[3]}
    return {
        "sequences": [1 / B] * 4,
        "tokens": [1 / sum(n)] * 4,
        "sequence_mean": [1 / (B * k) for k in n],
        "group_mean": [1 / (2 * group_tokens[g]) for g, _, _ in SAMPLES],
        "constant": [1 / (B * L)] * 4,
    }[mode]


# Each loss's published defaults, written here from its paper (never read from the code under test): the closed
# forms below use these, so a wrong default in a loss's config class fails the comparison.
PUBLISHED: dict[str, dict[str, object]] = {
    # PipelineRL (arXiv 2509.19128): token-level truncated IS, c = 5, the step's loss summed / B sequences
    "reinforce_tis": {"is_clip": 5.0, "is_level": "token", "normalize": "sequences"},
    # PPO (Schulman et al. 2017, eq. 7): eps = 0.2
    "ppo": {"eps_low": 0.2, "eps_high": 0.2, "normalize": "sequences"},
    # GRPO (DeepSeekMath, arXiv 2402.03300, eq. 3): eps = 0.2, each sequence's token mean, / B
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "normalize": "sequence_mean"},
    # Dr. GRPO (arXiv 2503.20783): no per-sequence length division: / (B x max completion length)
    "dr_grpo": {"eps_low": 0.2, "eps_high": 0.2, "normalize": "constant"},
    # DAPO (arXiv 2503.14476, eqs. 8 and 13): eps_low 0.2, eps_high 0.28 (clip-higher), token mean, overlong
    # buffer 4,096 of 20,480 tokens
    "dapo": {"eps_low": 0.2, "eps_high": 0.28, "normalize": "tokens", "overlong_buffer": 0.2},
    # GSPO (arXiv 2507.18071, section 5.1): sequence-level ratio clipped to [1 - 3e-4, 1 + 4e-4]
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "normalize": "sequence_mean"},
    # CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): no lower bound on the IS weight, token mean; upper bound 4, as
    # ScaleRL (arXiv 2510.13786) and SkyRL run it
    "cispo": {"eps_low": 1.0, "eps_high": 4.0, "normalize": "tokens"},
}
# the losses whose papers divide each advantage by its group's standard deviation
STD_NORMALIZED = {"grpo", "dapo", "gspo", "cispo"}


def closed_form(name: str, keep: list[float] | None = None, **settings: object) -> tuple[float, list[float]]:
    """The loss and d loss / d log pi per completion token, from the loss's formula with its published defaults
    (`PUBLISHED`, overridden by `settings`), token by token; `keep` (per completion token, 1 or 0: the masks'
    keep_t) multiplies each token's term."""
    p = {**PUBLISHED[name], **settings}
    weights = hand_weights(str(p["normalize"]))
    keep = keep if keep is not None else [1.0] * len(LOGP)
    loss, grad = 0.0, []
    for (_, a, lrs), w in zip(SAMPLES, weights):
        first = len(grad)
        logps = [LOGP[first + j] for j in range(len(lrs))]
        if name == "gspo":
            s = math.exp(sum(lrs) / len(lrs))
            lo, hi = 1 - p["eps_low"], 1 + p["eps_high"]
            active = s * a <= min(max(s, lo), hi) * a  # the unclipped term is the minimum: its gradient flows
            for k in keep[first : first + len(lrs)]:  # each token's term s_it, of value s_i, differs in its gradient
                loss += k * w * -min(s * a, min(max(s, lo), hi) * a)
                grad.append(k * w * (-s * a if active else 0.0))
            continue
        seq_ratio = math.exp(sum(lrs))
        for lr, lp, k in zip(lrs, logps, keep[first:]):
            r = math.exp(lr)
            if name == "reinforce_tis":
                c = min(r if p["is_level"] == "token" else seq_ratio, p["is_clip"])
                loss += k * w * -c * a * lp
                grad.append(k * w * -c * a)
            elif name == "cispo":
                c = min(max(r, 1 - p["eps_low"]), 1 + p["eps_high"])
                loss += k * w * -c * a * lp
                grad.append(k * w * -c * a)
            else:  # the PPO family
                clipped = min(max(r, 1 - p["eps_low"]), 1 + p["eps_high"])
                loss += k * w * -min(r * a, clipped * a)
                grad.append(k * w * (-r * a if r * a <= clipped * a else 0.0))
    return loss, grad


def run(cfg, lag: list[float] | None = None) -> tuple[float, list[float], LossStats]:
    """The loss, its gradient per completion token and its statistics on `micro_batch()`; `lag`: each completion
    token's lag (the prompt position gets 0)."""
    mb = micro_batch()
    logp = mb["logp"].clone().requires_grad_()
    # the normalisation weights as the job computes them (rl/normalization.py), not by hand: the closed form's
    # hand_weights are what they must equal
    lengths, groups = [len(lr) for _, _, lr in SAMPLES], [g for g, _, _ in SAMPLES]
    per_sample = sample_weights(lengths, groups, [True] * B, cfg.normalize, B, len(set(groups)), L)
    weight = torch.tensor([0.0] + [per_sample[i] for i in mb["seq"][1:].tolist()], dtype=torch.float64)
    lags = torch.tensor([0.0, *lag], dtype=torch.float64) if lag is not None else None
    batch = LossInput(mb["mask"], mb["behaviour"], mb["adv"], weight, mb["seq"], lag=lags)
    loss, stats = policy_loss(logp, batch, cfg)
    loss.backward()
    assert logp.grad[0] == 0  # the prompt position
    return loss.item(), logp.grad[1:].tolist(), stats


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_paper_loss_is_selected_by_name_with_its_published_defaults(name):
    """`loss.name` selects the loss's own config class; its keys default to the paper's values, and the advantage
    normalisation (rl.std_normalize) to the paper's unless set; the resolved value is in the saved config."""
    cfg = load_config([f"--loss.name={name}"])
    assert type(cfg.loss) is CONFIGS[name] and OBJECTIVES[name].__doc__
    assert {k: getattr(cfg.loss, k) for k in PUBLISHED[name]} == PUBLISHED[name]
    assert cfg.rl.std_normalize is (name in STD_NORMALIZED)
    assert f"std_normalize = {'true' if name in STD_NORMALIZED else 'false'}" in to_toml(cfg)
    flipped = name not in STD_NORMALIZED
    explicit = load_config([f"--loss.name={name}", f"--rl.std_normalize={str(flipped).lower()}"])
    assert explicit.rl.std_normalize is flipped  # an explicit value wins


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_loss_and_its_gradient_match_its_closed_form(name):
    cfg = CONFIGS[name]()
    loss, grad, _ = run(cfg)
    want_loss, want_grad = closed_form(name)
    assert loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-9, abs=1e-12)
    assert any(g != 0 for g in grad)  # something to compare


@pytest.mark.parametrize("mode", ["sequences", "tokens", "sequence_mean", "group_mean", "constant"])
@pytest.mark.parametrize("name", ["reinforce_tis", "ppo"])
def test_each_normalisation_weighs_tokens_as_its_table_says(name, mode):
    cfg = CONFIGS[name](normalize=mode)
    loss, grad, _ = run(cfg)
    want_loss, want_grad = closed_form(name, normalize=mode)
    assert loss == pytest.approx(want_loss, rel=1e-9) and grad == pytest.approx(want_grad, rel=1e-9, abs=1e-12)


def test_hand_computed_values_of_the_paper_loss_and_of_ppo():
    # reinforce_tis, c = 5, over B = 4: -(1/4) sum_t min(rho_t, 5) A log pi
    loss, grad, stats = run(CONFIGS["reinforce_tis"]())
    w = [math.exp(0.1), math.exp(-0.3), 1.0, 5.0, math.exp(-0.05), math.exp(0.15), math.exp(-1.6), math.exp(0.05)]
    a = [1, 1, -1, -1, -1, 0.5, -0.5, -0.5]
    assert loss == pytest.approx(-sum(x * y * p for x, y, p in zip(w, a, LOGP)) / 4, rel=1e-9)
    assert grad[3] == pytest.approx(5.0 / 4)  # -5 * (-1) / 4: the truncated weight
    assert stats.clipped == 1 and stats.tokens == 8 and stats.sequences == 4
    # ppo, eps 0.2: tokens 0.741 (A > 0) and 7.39 (A < 0) keep the unclipped term (pessimistic); 0.202 with A < 0 is
    # clipped at 0.8 and loses its gradient
    _, grad, stats = run(CONFIGS["ppo"]())
    assert grad[6] == 0 and grad[3] == pytest.approx(math.exp(2.0) / 4) and stats.clipped == 1


def test_dual_clip_bounds_a_stale_negative_advantage_token():
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 5), c = 3: the token with ratio e^2 = 7.39 and A = -1
    contributes -max(min(7.39 x -1, 1.2 x -1), 3 x -1) = 3, not 7.39, and no gradient; every other token is PPO's."""
    loss0, grad0, stats0 = run(CONFIGS["ppo"]())
    loss, grad, stats = run(CONFIGS["ppo"](dual_clip=3.0))
    assert grad0[3] == pytest.approx(math.exp(2.0) / 4) and grad[3] == 0.0
    assert loss == pytest.approx(loss0 - math.exp(2.0) / 4 + 3.0 / 4, rel=1e-9)
    assert [g for i, g in enumerate(grad) if i != 3] == pytest.approx([g for i, g in enumerate(grad0) if i != 3])
    assert stats.clipped == stats0.clipped + 1
    with pytest.raises(ConfigError, match=r"loss\.dual_clip = 0\.5 must be 0 \(off\) or > 1"):
        load_config(["--loss.name=ppo", "--loss.dual_clip=0.5"])


def test_sequence_level_tis_weights_every_token_of_a_sequence_by_its_truncated_product():
    cfg = CONFIGS["reinforce_tis"](is_level="sequence", is_clip=1.5)
    loss, grad, stats = run(cfg)
    want_loss, want_grad = closed_form("reinforce_tis", is_level="sequence", is_clip=1.5)
    assert loss == pytest.approx(want_loss, rel=1e-9) and grad == pytest.approx(want_grad, rel=1e-9)
    # sample 1: product e^1.95 = 7.03 -> 1.5 at each of its tokens; sample 3: e^-1.55 = 0.21, untruncated
    assert grad[2] == grad[3] == grad[4] == pytest.approx(1.5 / 4)
    assert grad[6] == pytest.approx(-math.exp(-1.55) * -0.5 / 4)
    assert stats.clipped == 3  # the three tokens of the truncated sequence


def test_gspo_clips_whole_sequences_on_their_geometric_mean_ratio():
    _, grad, stats = run(CONFIGS["gspo"]())
    # every sequence's geometric-mean ratio s_i is far outside 1 -/+ 4e-4; as in PPO, the clip takes a sequence's
    # gradient away only where its advantage pushes s further out (A > 0 and s > 1, or A < 0 and s < 1)
    s = [math.exp(sum(lr) / len(lr)) for _, _, lr in SAMPLES]
    assert s[0] < 1 and s[1] > 1 and s[2] > 1 and s[3] < 1
    assert grad[0] == grad[1] == pytest.approx(-s[0] * 1.0 / (4 * 2))  # s_i A_i grad log pi, over B n_i
    assert grad[2:5] == pytest.approx([s[1] / (4 * 3)] * 3)
    assert grad[5:] == [0.0, 0.0, 0.0]  # samples 2 and 3: clipped, whole sequences
    assert stats.clipped == 3


def test_token_and_sequence_masks_leave_out_what_lies_outside_the_bounds():
    for rule, out in (("token", [3, 6]), ("sequence", [6, 7])):
        cfg = CONFIGS["reinforce_tis"](mask=rule)
        _, grad, stats = run(cfg)
        _, full = closed_form("reinforce_tis")
        # 7.39 and 0.202 are the tokens outside [0.5, 2]; sample 3 (geometric mean e^-0.775 = 0.46) the sequence
        assert [i for i, g in enumerate(grad) if g == 0] == out
        assert [g for i, g in enumerate(grad) if i not in out] == pytest.approx(
            [g for i, g in enumerate(full) if i not in out]
        )
        assert stats.masked == 2 and stats.mis_tokens == 2 and stats.mis_seqs == 1
    _, _, stats = run(CONFIGS["reinforce_tis"]())  # no mask: the rules are measured all the same
    assert stats.masked == 0 and stats.mis_tokens == 2 and stats.mis_seqs == 1
    assert stats.max_log_ratio == pytest.approx(2.0)


# each completion token's lag (versions between the trained one and the one that sampled it); with
# loss.max_token_lag = 2 the tokens at 1, 3, 5 and 7 (lags 3, 4, 5, 4) leave the loss
LAGS = [0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 0.0, 4.0]
STALE = [1, 3, 5, 7]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_lag_mask_zeroes_stale_tokens_and_leaves_the_rest_unchanged_under_every_loss(name):
    """loss.max_token_lag = 2: against the closed form with keep_t = 0 at the stale tokens (by hand), the loss
    drops their terms, their gradient is exactly 0 and every other token's is the unmasked loss's; counted as
    masked, and out of the tokens the applied weights (ess_truncated) are over, never out of the raw ESS sums."""
    loss, grad, stats = run(CONFIGS[name](max_token_lag=2), LAGS)
    keep = [0.0 if i in STALE else 1.0 for i in range(len(LOGP))]
    want_loss, want_grad = closed_form(name, keep=keep)
    assert loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert grad == pytest.approx(want_grad, rel=1e-9, abs=1e-12)
    assert [grad[i] for i in STALE] == [0.0] * len(STALE)
    _, full_grad, full = run(CONFIGS[name](), LAGS)  # the rule off (the default): the lags change nothing
    assert [g for i, g in enumerate(grad) if i not in STALE] == [g for i, g in enumerate(full_grad) if i not in STALE]
    assert any(full_grad[i] != 0 for i in STALE)  # there was gradient to take away
    assert stats.masked == 4 and stats.kept == 4 and stats.tokens == 8 and full.masked == 0 and full.kept == 8
    assert (stats.sum_rho, stats.sum_rho2) == (full.sum_rho, full.sum_rho2)


def test_the_lag_mask_bounds_by_hand():
    """k = 0 keeps the lag-0 tokens only; k at the largest lag (5) or above, and -1, change nothing; the kept
    tokens' truncated weights (reinforce_tis, c = 5) are what ess_truncated is over."""
    cfg = CONFIGS["reinforce_tis"]
    _, grad, stats = run(cfg(max_token_lag=0), LAGS)
    assert [i for i, g in enumerate(grad) if g != 0] == [0, 6] and stats.kept == 2
    base = run(cfg())
    for k in (-1, 5, 9):
        loss, grad, stats = run(cfg(max_token_lag=k), LAGS)
        assert (loss, grad) == base[:2] and stats.masked == 0
    _, _, stats = run(cfg(max_token_lag=2), LAGS)
    w = [math.exp(0.1), 1.0, math.exp(-0.05), math.exp(-1.6)]  # tokens 0, 2, 4, 6: none above c
    assert stats.sum_w == pytest.approx(sum(w), rel=1e-12) and stats.sum_w2 == pytest.approx(sum(x * x for x in w))
    with pytest.raises(ValueError, match="max_token_lag needs each token's lag"):
        run(cfg(max_token_lag=2))  # a micro-batch built without the trained version


def test_the_lag_mask_and_the_mismatch_mask_combine_and_count_a_token_once():
    """Token rule (out: 3 and 6, ratios 7.39 and 0.202) with max_token_lag = 2 (out: 1, 3, 5, 7): five tokens out,
    token 3 counted once; the rule's own measure (mis_tokens) is unchanged."""
    _, grad, stats = run(CONFIGS["reinforce_tis"](mask="token", max_token_lag=2), LAGS)
    _, full = closed_form("reinforce_tis")
    out = [1, 3, 5, 6, 7]
    assert [i for i, g in enumerate(grad) if g == 0] == out
    assert [g for i, g in enumerate(grad) if i not in out] == pytest.approx(
        [g for i, g in enumerate(full) if i not in out]
    )
    assert stats.masked == 5 and stats.kept == 3 and stats.mis_tokens == 2


def test_sample_weights_by_hand():
    lengths, groups = [2, 3, 1, 2], [0, 0, 1, 1]
    everyone = [True] * 4
    assert sample_weights(lengths, groups, everyone, "sequences", 4, 2, 4) == [0.25] * 4
    assert sample_weights(lengths, groups, everyone, "tokens", 4, 2, 4) == [1 / 8] * 4
    assert sample_weights(lengths, groups, everyone, "sequence_mean", 4, 2, 4) == pytest.approx(
        [1 / 8, 1 / 12, 1 / 4, 1 / 8]
    )
    assert sample_weights(lengths, groups, everyone, "group_mean", 4, 2, 4) == pytest.approx([0.1, 0.1, 1 / 6, 1 / 6])
    assert sample_weights(lengths, groups, everyone, "constant", 4, 2, 4) == [1 / 16] * 4
    # a wave of one group of a 2-group step: group and sequence weights are those of the whole step
    assert sample_weights([2, 3], [0, 0], [True, True], "group_mean", 4, 2, 4) == pytest.approx([0.1, 0.1])
    # overlong-filtered sample 1: weight 0, and out of every total
    some = [True, False, True, True]
    assert sample_weights(lengths, groups, some, "tokens", 4, 2, 4) == [0.2, 0.0, 0.2, 0.2]
    assert sample_weights(lengths, groups, some, "group_mean", 4, 2, 4) == pytest.approx([0.25, 0.0, 1 / 6, 1 / 6])


def test_assign_loss_weights_filters_truncated_samples_only_when_asked():
    def sample(n: int, finished: bool) -> Sample:
        return Sample(0, [1], [2] * n, [0.0] * n, [0] * n, 1.0, 0.0, finished)

    batch = [sample(2, True), sample(6, False)]
    assign_loss_weights(batch, CONFIGS["dapo"](), 2, 2, 8)  # tokens: 1 / 8 each
    assert [s.loss_weight for s in batch] == [1 / 8, 1 / 8]
    assign_loss_weights(batch, CONFIGS["dapo"](overlong_filter=True), 2, 2, 8)
    assert [s.loss_weight for s in batch] == [0.5, 0.0]


def test_overlong_punishment_by_hand():
    # budget 100, buffer 0.2: no penalty up to 80 tokens, then linear to -penalty at 100
    assert overlong_penalty(80, 100, 0.2, 1.0) == 0.0 and overlong_penalty(50, 100, 0.2, 1.0) == 0.0
    assert overlong_penalty(90, 100, 0.2, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 0.2, 2.0) == pytest.approx(-2.0)
    assert overlong_penalty(100, 100, 0.0, 1.0) == 0.0  # off
    # equal rewards, different lengths: only the shaped advantages tell them apart
    assert shaped_group_advantages([1.0, 1.0], [50, 100], "mean", False, 100, 0.2, 1.0) == pytest.approx([0.5, -0.5])
    assert shaped_group_advantages([1.0, 1.0], [50, 100], "mean", False, 100, 0.0, 1.0) == [0.0, 0.0]


def test_the_loss_section_selects_a_loss_and_its_own_keys():
    cfg = load_config(["--loss.name=gspo"])
    assert (cfg.loss.name, cfg.loss.eps_low, cfg.loss.normalize) == ("gspo", 3e-4, "sequence_mean")
    cfg = load_config(["--loss.name=dapo", "--loss.eps_high=0.3", "--loss.overlong_filter=true"])
    assert (cfg.loss.eps_high, cfg.loss.normalize, cfg.loss.overlong_filter) == (0.3, "tokens", True)
    assert load_config([]).loss.name == "reinforce_tis" and load_config([]).loss.is_clip == 5.0
    with pytest.raises(ConfigError, match=r"unknown key loss\.is_clip"):  # a key of another loss
        load_config(["--loss.name=ppo", "--loss.is_clip=3"])
    with pytest.raises(ConfigError, match=r"loss\.name = 'grpoo' is not one of"):
        load_config(["--loss.name=grpoo"])
    with pytest.raises(ConfigError, match=r"loss\.normalize"):
        load_config(["--loss.normalize=per_token"])
    with pytest.raises(ConfigError, match=r"loss\.mask_low = 1\.5 must be in \(0, 1\]"):
        load_config(["--loss.mask_low=1.5"])
    with pytest.raises(ConfigError, match=r"rl\.loss in command line: the loss is its own section now: loss\.name"):
        load_config(["--rl.loss=ppo"])
    with pytest.raises(ConfigError, match=r"needs rl\.waves = 1"):
        load_config(["--loss.name=dapo", "--rl.waves=2"])


def test_the_reference_implementation_preset_layers_over_a_job():
    cfg = load_config(["--config", "arithmetic", "--config", "pipelinerl_reference"])
    assert (cfg.task.name, cfg.inference.engine) == ("addition", "vllm")  # the job's keys stay
    assert (cfg.loss.name, cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.normalize) == ("cispo", 1.0, 0.02, "sequences")
    assert (cfg.rl.baseline, cfg.rl.std_normalize, cfg.rl.kl_coef) == ("loo", False, 0.0)
    # its weight: min(rho, 1.02), no lower bound
    _, grad, _ = run(cfg.loss)
    assert grad[3] == pytest.approx(1.02 / 4) and grad[6] == pytest.approx(-math.exp(-1.6) * -0.5 / 4)
