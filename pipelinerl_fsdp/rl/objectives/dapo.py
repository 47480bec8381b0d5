"""DAPO: clip-higher PPO, token-level normalisation, soft overlong punishment (dynamic sampling is
rl.filter_zero_advantage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipelinerl_fsdp.config import Normalization
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective
from pipelinerl_fsdp.rl.objectives.ppo import PPOConfig


@dataclass
class DAPOConfig(PPOConfig):
    advantage_std: ClassVar[bool] = True  # DAPO eq. 9: group-normalised advantages
    name: str = "dapo"
    eps_high: float = 0.28
    normalize: Normalization = "tokens"
    overlong_buffer: float = 0.2  # the paper: 4,096 of 20,480 tokens


@register_objective("dapo", DAPOConfig)
def dapo(t: Tokens, cfg: DAPOConfig) -> PerToken:
    """L = (1/sum_i |o_i|) sum_i sum_t -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i), eps_low 0.2,
    eps_high 0.28 (Yu et al., arXiv 2503.14476, eq. 8); rewards of completions in the last overlong_buffer of the
    budget lowered linearly, down to -overlong_penalty at the budget (eq. 13; loss.overlong_buffer). Dynamic
    sampling (dropping groups whose attempts all scored the same) is rl.filter_zero_advantage = true."""
    return clipped_surrogate(t.rho, t.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
