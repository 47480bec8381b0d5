"""GRPO: PPO-clip with each sequence's loss averaged over its tokens (and group-normalised advantages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelinerl_fsdp.config import Normalization
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective
from pipelinerl_fsdp.rl.objectives.ppo import PPOConfig


@dataclass
class GRPOConfig(PPOConfig):
    advantage_std: ClassVar[bool] = True  # DeepSeekMath eq. 3: (r - mean) / std of the group
    name: str = "grpo"
    normalize: Normalization = "sequence_mean"


@register_objective("grpo", GRPOConfig)
def grpo(t: Tokens, cfg: GRPOConfig) -> PerToken:
    """L = (1/B) sum_i (1/|o_i|) sum_t -min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i) (DeepSeekMath, arXiv
    2402.03300, eq. 3). Its advantages are (r - mean) / std of the group (rl.std_normalize defaults to true under
    it); its KL penalty is rl.kl_coef (k3, as the paper's)."""
    return clipped_surrogate(t.rho, t.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
