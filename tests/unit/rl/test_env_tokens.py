"""Multi-turn rollouts: tokens the environment wrote (version ENV_VERSION) are context only. They contribute nothing
to the loss or its gradient, nor to the importance weights, the ESS, the normalisation, the lags or the
mismatch metrics; they travel between the roles unchanged."""

from __future__ import annotations

import pytest
import torch

from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.rl.batching import completion_fields, rl_micro_batches
from pipelinerl_fsdp.rl.loss import LossStats, micro_batch_loss, stats_from_sums
from pipelinerl_fsdp.rl.normalization import assign_loss_weights
from pipelinerl_fsdp.rl.objectives import CONFIGS
from pipelinerl_fsdp.rl.step_metrics import StepTimes, step_metrics, token_lags
from pipelinerl_fsdp.samples import ENV_VERSION, EngineStats, Sample
from pipelinerl_fsdp.training.collector import group_lag
from pipelinerl_fsdp.transport.rollouts import decode_samples, encode_samples

E = ENV_VERSION
# prompt 3 tokens; model turn (versions 4, 4), environment answer (2 tokens), model turn after an update (5, 5, 5)
VERSIONS = [4, 4, E, E, 5, 5, 5]
ENV = [i for i, v in enumerate(VERSIONS) if v == E]


def after_update_marks(versions: list[int]) -> list[float]:
    """`completion_fields`' after-update marks of one completion."""
    v = torch.tensor(versions, dtype=torch.long)
    return completion_fields(v, torch.zeros_like(v), 1, version=0)["after_update"].tolist()


def host_loss(*args: object) -> tuple[torch.Tensor, LossStats]:
    """`micro_batch_loss` with its statistics read on the host."""
    loss, sums = micro_batch_loss(*args)  # type: ignore[arg-type]
    return loss, stats_from_sums(sums)


def sample(logprobs: list[float], reward: float = 1.0, advantage: float = 0.5) -> Sample:
    return Sample(0, [1, 2, 3], [4, 5, 6, 7, 8, 9, 10], logprobs, list(VERSIONS), reward, advantage)


def loss_and_grad(s: Sample, logp_values: list[float], loss_name: str) -> tuple[float, torch.Tensor]:
    cfg = LossConfig(name=loss_name)
    objective_cfg = CONFIGS[loss_name]()
    assign_loss_weights([s], cfg, batch_size=1, attempts=1, max_new_tokens=16)
    (mb,) = rl_micro_batches([s], budget=64, device=torch.device("cpu"), version=5)
    n_prompt_targets = len(s.prompt_ids) - 1
    logp = torch.zeros(1, mb.loss_input.mask.shape[0])
    logp[0, n_prompt_targets : n_prompt_targets + len(logp_values)] = torch.tensor(logp_values)
    logp.requires_grad_(True)
    loss, stats = host_loss(logp, torch.zeros_like(logp), mb.loss_input, objective_cfg, 0.0)
    loss.backward()
    assert stats.tokens == 5 and stats.lag0_tokens == 3 and stats.lag0_after_update_tokens == 3
    return loss.item(), logp.grad[0, n_prompt_targets : n_prompt_targets + len(logp_values)]


@pytest.mark.parametrize("loss_name", ["reinforce_tis", "ppo", "gspo", "cispo"])
def test_environment_tokens_contribute_nothing_to_the_loss_or_its_gradient(loss_name):
    behaviour = [-1.0, -0.5, -7.0, -9.0, -0.8, -1.2, -0.3]
    # the model's tokens near their behaviour log-probs (inside every objective's clip range: GSPO's is 3e-4 wide)
    logp = [b + 2e-5 * (i + 1) if v != E else -2.0 for i, (b, v) in enumerate(zip(behaviour, VERSIONS))]
    loss, grad = loss_and_grad(sample(behaviour), logp, loss_name)
    assert grad[ENV].abs().max() == 0.0
    assert grad[[i for i in range(7) if i not in ENV]].abs().min() > 0.0  # the model's tokens do get gradient
    # whatever the environment tokens' log-probs (trainer's or engine's), the loss is the same
    other_logp = list(logp)
    other_behaviour = list(behaviour)
    for i in ENV:
        other_logp[i], other_behaviour[i] = 5.0, 0.0
    loss2, grad2 = loss_and_grad(sample(other_behaviour), other_logp, loss_name)
    assert loss2 == pytest.approx(loss, rel=1e-6) and torch.allclose(grad, grad2)


def test_normalisation_and_lags_count_only_sampled_tokens():
    s = sample([-1.0] * 7)
    assert s.model_tokens == 5
    assign_loss_weights([s], LossConfig(name="reinforce_tis", normalize="sequence_mean"), 1, 1, 16)
    assert s.loss_weight == pytest.approx(1 / 5)
    assert token_lags([s], 6) == [2, 2, 1, 1, 1]
    assert group_lag([s], 6) == 2  # not 7: the environment's "version" -1 is no version
    # the episode is one sequence: an update between two turns marks the later turn (its cache may be kept)
    assert after_update_marks(VERSIONS) == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert after_update_marks([4, 5, E, 4, 6, 6]) == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert after_update_marks([E, E, 3, 4]) == [0.0, 0.0, 0.0, 1.0]  # the first sampled token sets the start
    (mb,) = rl_micro_batches([s], 64, torch.device("cpu"), version=5)
    assert mb.loss_input.mask[2:].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert mb.loss_input.current[2:].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_environment_tokens_travel_unchanged():
    s = sample([-1.0, -0.5, 0.0, 0.0, -0.8, -1.2, -0.3])
    (back,) = decode_samples(1, *encode_samples([s]))
    assert (
        back.versions == VERSIONS
        and back.completion_ids == s.completion_ids
        and back.logprobs == pytest.approx(s.logprobs)
    )


def test_ess_per_turn_index_counts_each_model_turns_tokens_only():
    """ESS of turn 1 and of turn 2 from their own raw ratios; the environment's tokens between them count in
    neither, and the step's metric is `ess_turn/<i>` for a multi-turn task."""
    s = sample([0.0] * 7)
    (mb,) = rl_micro_batches([s], 64, torch.device("cpu"), version=5)
    assert mb.loss_input.turn[2:].tolist() == [1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    log_ratio = torch.tensor([0.1, -0.3, 9.0, 9.0, 0.2, 0.0, -0.5])  # huge values on the environment's tokens
    logp = torch.zeros(1, mb.loss_input.mask.shape[0])
    logp[0, 2:] = log_ratio
    _, stats = host_loss(logp, torch.zeros_like(logp), mb.loss_input, CONFIGS["reinforce_tis"](), 0.0)

    def ess(x: torch.Tensor) -> float:
        w = torch.exp(x)
        return float(w.sum() ** 2 / (w * w).sum() / len(w))

    assert stats.turn_tokens[:3] == (2, 3, 0)  # turns 1, 2, 3
    times = StepTimes(0.0, 0.0, 1.0, 0.0)
    m = step_metrics([s], 5, stats, EngineStats(), EngineStats(), times, multi_turn=True)
    assert m["ess_turn/1"] == pytest.approx(ess(log_ratio[:2]), rel=1e-5)
    assert m["ess_turn/2"] == pytest.approx(ess(log_ratio[4:]), rel=1e-5)
    assert "ess_turn/3" not in m and m["turns_per_episode"] == 2 and m["env_tokens_per_episode"] == 2
    assert m["lag_turn/1"] == 1 and m["lag_turn/2"] == 0


def test_environment_tokens_have_no_tenth_no_lag_and_count_in_no_position_metric():
    """The 5 model tokens are j = 0..4 of n = 5 (tenths 1, 3, 5, 7, 9); the 2 environment tokens between them have
    tenth 0 and lag 0 in the loss input, and huge log ratios there reach no `ess_pos` / `abs_log_ratio_pos` /
    `lag_pos`; the lag mask never needs them (their mask is 0 already)."""
    s = sample([0.0] * 7)
    (mb,) = rl_micro_batches([s], 64, torch.device("cpu"), version=6)
    assert mb.loss_input.tenth[2:].tolist() == [1.0, 3.0, 0.0, 0.0, 5.0, 7.0, 9.0]
    assert mb.loss_input.lag[2:].tolist() == [2.0, 2.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    log_ratio = [0.1, -0.3, 9.0, 9.0, 0.2, 0.0, -0.5]
    logp = torch.zeros(1, mb.loss_input.mask.shape[0])
    logp[0, 2:] = torch.tensor(log_ratio)
    _, stats = host_loss(logp, torch.zeros_like(logp), mb.loss_input, CONFIGS["reinforce_tis"](), 0.0)
    assert stats.tenth_tokens == (1, 0, 1, 0, 1, 0, 1, 0, 1, 0)
    m = step_metrics([s], 6, stats, EngineStats(), EngineStats(), StepTimes(0.0, 0.0, 1.0, 0.0), multi_turn=True)
    for i, lr, lag in ((1, 0.1, 2), (3, 0.3, 2), (5, 0.2, 1), (7, 0.0, 1), (9, 0.5, 1)):
        assert m[f"abs_log_ratio_pos/{i}"] == pytest.approx(lr, abs=1e-6) and m[f"ess_pos/{i}"] == pytest.approx(1.0)
        assert m[f"lag_pos/{i}"] == lag
    assert all(m[f"lag_pos/{i}"] != m[f"lag_pos/{i}"] for i in (2, 4, 6, 8, 10))  # NaN: no token there
    assert m["lag_frac/1"] == pytest.approx(3 / 5) and m["lag_frac/2"] == pytest.approx(2 / 5)
    stale = host_loss(logp, torch.zeros_like(logp), mb.loss_input, CONFIGS["reinforce_tis"](max_token_lag=1), 0)
    assert stale[1].masked == 2 and stale[1].kept == 3  # the first turn's two tokens, lag 2; not the environment's
