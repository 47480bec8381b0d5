"""Loss, advantages and ESS against hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch

from pipelinerl_fsdp.config import LossConfig, RLConfig
from pipelinerl_fsdp.rewards.outcomes import OUTCOME_CODE
from pipelinerl_fsdp.rl.advantages import group_advantages, is_zero_advantage_group
from pipelinerl_fsdp.rl.ess import ess_from_sums
from pipelinerl_fsdp.rl.groups import group_samples
from pipelinerl_fsdp.rl.loss import LossInput, policy_loss
from pipelinerl_fsdp.rl.objectives.ppo import PPOConfig
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig


def loss_of(logp, mu, adv, mask, b, cfg=None, ref=None, current=None, kl_coef=0.0):
    """`policy_loss` normalised over `b` sequences (loss.normalize = "sequences"), one sequence's tokens."""
    batch = LossInput(mask, mu, adv, torch.ones_like(mask) / b, current=current, ref_logp=ref)
    return policy_loss(logp, batch, cfg or ReinforceTISConfig(), kl_coef)


def test_group_mean_and_loo_and_std():
    r = [1.0, 0.0, 0.0, 1.0]
    assert group_advantages(r) == [0.5, -0.5, -0.5, 0.5]
    # leave-one-out: 1 - (1/3), 0 - (2/3)
    assert group_advantages(r, "loo") == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # TRL's GRPOTrainer (scale_rewards="group") and ServiceNow/PipelineRL: (r - mean) / (sample std + 1e-4); the
    # sample std of (1, 0, 0, 1) is sqrt(4 x 0.25 / 3) = 0.57735 (the population std, 0.5, would give +-1)
    a = 0.5 / (0.57735027 + 1e-4)
    assert group_advantages(r, std_normalize=True) == pytest.approx([a, -a, -a, a], rel=1e-6)
    # G = 2: the factor sqrt(G / (G - 1)) = 1.41 between the two definitions
    b = 0.5 / (0.70710678 + 1e-4)
    assert group_advantages([1.0, 0.0], std_normalize=True) == pytest.approx([b, -b], rel=1e-6)
    assert group_advantages([1.0, 1.0], std_normalize=True) == [0.0, 0.0]
    assert group_advantages([0.7], std_normalize=True) == [0.0]  # a group of one: no spread, no signal
    same = group_advantages([0.3, 0.3, 0.3])  # rounding of the mean aside, zero
    assert is_zero_advantage_group(same) and not is_zero_advantage_group(group_advantages(r))
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(r, "median")


def test_reinforce_loss_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    mu = torch.tensor([-1.0, -2.5, -0.5 - math.log(10.0)])  # rho = 1, e^0.5, 10 (truncated to 5)
    adv = torch.tensor([1.0, 1.0, -2.0])
    mask = torch.tensor([1.0, 1.0, 1.0])
    loss, s = loss_of(logp, mu, adv, mask, 2, ReinforceTISConfig(is_clip=5.0))
    rho_bar = [1.0, math.exp(0.5), 5.0]
    expected = -(rho_bar[0] * 1 * -1.0 + rho_bar[1] * 1 * -2.0 + rho_bar[2] * -2 * -0.5) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()  # the weight is stop-gradient: d/dlogp = -rho_bar * A / B
    assert logp.grad.tolist() == pytest.approx([-r * a / 2 for r, a in zip(rho_bar, [1, 1, -2])], rel=1e-6)
    assert s.sum_w == pytest.approx(sum(rho_bar), rel=1e-6)
    assert s.sum_w2 == pytest.approx(sum(x * x for x in rho_bar), rel=1e-6)
    assert s.tokens == 3 and s.clipped == 1


def test_mask_excludes_tokens():
    logp = torch.tensor([-1.0, -3.0])
    loss, s = loss_of(logp, logp, torch.tensor([2.0, 100.0]), torch.tensor([1.0, 0.0]), 1)
    assert float(loss) == pytest.approx(2.0)
    assert s.tokens == 1


def test_ppo_clip_hand_computed():
    logp = torch.tensor([math.log(1.5), math.log(0.5)])
    mu = torch.zeros(2)
    adv = torch.tensor([1.0, 1.0])
    loss, s = loss_of(logp, mu, adv, torch.ones(2), 1, PPOConfig())
    # token 1: min(1.5, 1.2) = 1.2; token 2: min(0.5, 0.8) = 0.5
    assert float(loss) == pytest.approx(-(1.2 + 0.5), rel=1e-6)
    assert s.clipped == 1


def test_kl_k3_penalty():
    logp = torch.tensor([-1.0])
    ref = torch.tensor([-1.5])
    loss, s = loss_of(logp, logp, torch.zeros(1), torch.ones(1), 1, ref=ref, kl_coef=0.1)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert s.kl == pytest.approx(k3, rel=1e-6)
    assert float(loss) == pytest.approx(0.1 * k3, rel=1e-6)


def test_ess_is_one_on_policy_and_below_one_off_policy():
    logp = torch.randn(50)
    _, s = loss_of(logp, logp.clone(), torch.ones(50), torch.ones(50), 1)
    assert ess_from_sums(s.sum_w, s.sum_w2, s.tokens) == pytest.approx(1.0)
    _, s = loss_of(logp, logp + 0.5 * torch.randn(50), torch.ones(50), torch.ones(50), 1)
    assert 0 < ess_from_sums(s.sum_w, s.sum_w2, s.tokens) < 0.99
    assert math.isnan(ess_from_sums(0, 0, 0))


def test_ppo_changes_the_update():
    # off-policy tokens (rho = 1.5 and 0.5): PPO's clipped objective zeroes the gradient where the ratio left the
    # trust region in the advantage's direction; REINFORCE weights every token by rho_bar.
    mu = torch.zeros(2)
    adv = torch.tensor([1.0, -1.0])
    grads = {}
    for kind, cfg in (("reinforce", ReinforceTISConfig()), ("ppo", PPOConfig())):
        logp = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
        loss, _ = loss_of(logp, mu, adv, torch.ones(2), 1, cfg)
        loss.backward()
        grads[kind] = logp.grad.tolist()
    assert grads["reinforce"] == pytest.approx([-1.5, 0.5])
    assert grads["ppo"] == pytest.approx(
        [0.0, 0.0]
    )  # both tokens are clipped: 1.5 > 1.2 with A > 0, 0.5 < 0.8 with A < 0


def test_ppo_ess_uses_the_unclipped_ratios():
    logp = torch.tensor([math.log(8.0), 0.0])
    mu = torch.zeros(2)
    _, s = loss_of(logp, mu, torch.ones(2), torch.ones(2), 1, PPOConfig())
    assert s.sum_w == pytest.approx(9.0) and s.sum_w2 == pytest.approx(65.0)  # 8 is not truncated to 5
    _, s = loss_of(logp, mu, torch.ones(2), torch.ones(2), 1, ReinforceTISConfig(is_clip=5.0))
    assert s.sum_w == pytest.approx(6.0)  # REINFORCE: the truncated weights it applies


def test_kl_log_ratio_is_clamped():
    logp = torch.tensor([-30.0], requires_grad=True)  # the reference gives this token probability ~1
    loss, s = loss_of(logp, logp.detach(), torch.zeros(1), torch.ones(1), 1, ref=torch.tensor([0.0]), kl_coef=1.0)
    assert s.kl == pytest.approx(math.exp(10) - 10 - 1, rel=1e-5)  # not exp(30)
    loss.backward()
    # the clamp is where the gradient stops: outside [-10, 10] the penalty is constant in log pi (without the clamp
    # the gradient would be -(e^30 - 1), finite but enormous)
    assert logp.grad.item() == 0.0


def test_the_micro_batch_loss_reads_the_packed_fields_and_sums_entropy_over_counted_tokens():
    from pipelinerl_fsdp.rl.loss import micro_batch_loss, stats_from_sums

    logp = torch.tensor([[-1.0, -0.5, -2.0, -0.1]], requires_grad=True)
    mb = LossInput(
        mask=torch.tensor([0.0, 1.0, 1.0, 0.0]),  # a prompt target, two completion tokens, a second prompt
        behaviour_logp=torch.tensor([0.0, -0.5, -2.0, 0.0]),
        advantage=torch.tensor([0.0, 1.0, 1.0, 0.0]),
        weight=torch.tensor([0.0, 0.5, 0.5, 0.0]),  # the sample's loss weight: 1 / B, B = 2
        seq=torch.tensor([0, 1, 1, 2]),
    )
    ent = torch.tensor([[9.0, 0.5, 0.25, 9.0]])
    loss, sums = micro_batch_loss(logp, ent, mb, ReinforceTISConfig(), 0.0)
    stats = stats_from_sums(sums)
    assert stats.entropy == 0.75 and stats.tokens == 2.0
    assert loss.item() == pytest.approx(-(-0.5 - 2.0) / 2)  # on-policy: weights 1, A = 1, over B = 2
    mb.ref_logp = logp.detach()[0] - 1.0
    kl_loss, kl_sums = micro_batch_loss(logp, ent, mb, ReinforceTISConfig(), 0.5)
    assert stats_from_sums(kl_sums).kl > 0 and kl_loss.item() > loss.item()  # the reference model's log-probs are used


def test_ess_of_raw_and_of_truncated_weights_part_ways_on_stale_data():
    # log-ratios ~ N(0, 1): the raw weights' ESS is exp(-sigma^2) = 0.368; truncating at c = 5 cuts the tail the
    # raw ESS sees, so the loss's weights look more on-policy than the data are: 0.552 (from the normal CDF:
    # E[min(rho, 5)] = e^0.5 Phi(ln5 - 1) + 5 (1 - Phi(ln5)), E[min(rho, 5)^2] = e^2 Phi(ln5 - 2) + 25 (1 - Phi(ln5)))
    g = torch.Generator().manual_seed(0)
    log_ratio = torch.randn(200_000, generator=g)
    mu = torch.zeros_like(log_ratio)
    ones = torch.ones_like(log_ratio)
    _, s = loss_of(log_ratio, mu, ones, ones, 1)
    raw = ess_from_sums(s.sum_rho, s.sum_rho2, s.tokens)
    truncated = ess_from_sums(s.sum_w, s.sum_w2, s.tokens)
    assert raw == pytest.approx(math.exp(-1), abs=0.03)
    assert truncated == pytest.approx(0.552, abs=0.03)
    # on-policy they coincide
    _, s = loss_of(mu, mu, ones, ones, 1)
    assert ess_from_sums(s.sum_rho, s.sum_rho2, s.tokens) == pytest.approx(1.0)
    assert ess_from_sums(s.sum_w, s.sum_w2, s.tokens) == pytest.approx(1.0)


def test_lag0_mismatch_sums_count_only_the_current_versions_tokens():
    behaviour = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    logp = behaviour + torch.tensor([0.1, -0.2, 0.5, 0.3])  # log rho per token
    mask, current = torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    _, st = loss_of(logp, behaviour, torch.ones(4), mask, 1.0, current=current)
    # tokens 0 and 1 only: token 2 is stale, token 3 is not a completion token
    assert st.lag0_tokens == 2.0
    k3 = (math.exp(0.1) - 1 - 0.1) + (math.exp(-0.2) - 1 + 0.2)
    assert st.lag0_k3 == pytest.approx(k3, rel=1e-5) and st.lag0_abs_log_ratio == pytest.approx(0.3, rel=1e-5)
    _, none = loss_of(logp, behaviour, torch.ones(4), mask, 1.0)
    assert none.lag0_tokens == 0.0  # without versions nothing is taken for lag 0


def test_a_group_is_assembled_with_each_attempts_score_and_its_advantage_against_the_group():
    attempts = [
        SimpleNamespace(tokens=[5, 6], logprobs=[-0.25, -0.5], versions=[3, 3], finished=True),
        SimpleNamespace(tokens=[7], logprobs=[-1.0], versions=[4], finished=False),
    ]
    scores = [(1.0, "correct"), (0.0, "truncated")]
    samples = group_samples(7, [1, 2], attempts, scores, RLConfig(), LossConfig(), 16)
    assert [(s.group_id, s.prompt_ids, s.completion_ids, s.versions) for s in samples] == [
        (7, [1, 2], [5, 6], [3, 3]),
        (7, [1, 2], [7], [4]),
    ]
    assert [(s.reward, s.advantage, s.finished) for s in samples] == [(1.0, 0.5, True), (0.0, -0.5, False)]
    assert [s.outcome for s in samples] == [OUTCOME_CODE["correct"], OUTCOME_CODE["truncated"]]
    assert samples[0].logprobs is attempts[0].logprobs  # no fault: the engine's log-probs as they are
    shifted = group_samples(7, [1, 2], attempts, scores, RLConfig(baseline="loo"), LossConfig(), 16, 0.25)
    assert shifted[0].logprobs == [0.0, -0.25] and [s.advantage for s in shifted] == [1.0, -1.0]
