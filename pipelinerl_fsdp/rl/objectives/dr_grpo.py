"""Dr. GRPO: GRPO without its length and std normalisations."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config import Normalization
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective
from pipelinerl_fsdp.rl.objectives.ppo import PPOConfig


@dataclass
class DrGRPOConfig(PPOConfig):
    name: str = "dr_grpo"
    normalize: Normalization = "constant"


@register_objective("dr_grpo", DrGRPOConfig)
def dr_grpo(t: Tokens, cfg: DrGRPOConfig) -> PerToken:
    """L = (1/(B L_max)) sum_i sum_t -min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps) A_i), L_max =
    task.max_new_tokens (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783, eq. 3): a constant
    instead of each sequence's length, so long wrong answers are not penalised less per token. Advantages
    r - mean, without std (rl.std_normalize defaults to false under it)."""
    return clipped_surrogate(t.rho, t.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
