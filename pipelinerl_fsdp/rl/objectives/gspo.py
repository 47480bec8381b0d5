"""GSPO: PPO-clip on a sequence-level, length-normalised ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pipelinerl_fsdp.config import Normalization
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, clipped_surrogate, register_objective
from pipelinerl_fsdp.rl.objectives.ppo import PPOConfig


@dataclass
class GSPOConfig(PPOConfig):
    advantage_std: ClassVar[bool] = True  # GSPO eq. 6: group-normalised advantages
    name: str = "gspo"
    # the paper's clipping range (section 5.1): the sequence ratio stays within 1 -/+ a few 1e-4
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    normalize: Normalization = "sequence_mean"


@register_objective("gspo", GSPOConfig)
def gspo(t: Tokens, cfg: GSPOConfig) -> PerToken:
    """L = (1/B) sum_i (1/|o_i|) sum_t -min(s_it A_i, clip(s_it, 1 - eps_low, 1 + eps_high) A_i), with
    s_i = exp((1/|o_i|) sum_t log rho_t) and s_it = sg(s_i) pi(a_t) / sg(pi(a_t)): equal to s_i in value, with
    gradient s_i grad log pi(a_t) (GSPO-token, Zheng et al., arXiv 2507.18071, eqs. 5 and 13). For one advantage per
    sequence this is GSPO's sequence objective, clipped per sequence."""
    log_s = t.per_token(t.seq_mean(t.log_ratio.detach()))
    s = torch.exp(t.logp - t.logp.detach() + log_s)
    return clipped_surrogate(s, t.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
