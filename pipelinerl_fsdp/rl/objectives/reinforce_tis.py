"""Truncated importance-weighted REINFORCE: the PipelineRL paper's objective (docs/objective.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.rl.objectives import PerToken, Tokens, register_objective, weighted_log_likelihood

# |log rho| of a whole sequence is clamped here before exp() (a product of many ratios overflows quickly)
SEQUENCE_LOG_RATIO_CLAMP = 20.0


@dataclass
class ReinforceTISConfig(LossConfig):
    name: str = "reinforce_tis"
    # c: the importance weights are truncated at c (the paper: 5)
    is_clip: float = 5.0
    # "token": w_t = min(rho_t, c) (TIS per token); "sequence": every token of a sequence gets
    # min(prod_t rho_t, c) (sequence-level TIS)
    is_level: Literal["token", "sequence"] = "token"

    def check(self) -> list[tuple[str, str]]:
        return super().check() + ([("is_clip", "> 0")] if self.is_clip <= 0 else [])


@register_objective("reinforce_tis", ReinforceTISConfig)
def reinforce_tis(t: Tokens, cfg: ReinforceTISConfig) -> PerToken:
    """L_t = -sg(w_t) A log pi(a_t), w_t = min(rho_t, c) (is_level token) or min(prod_s rho_s, c) over the
    token's sequence (is_level sequence). The weight is a constant: the gradient flows through log pi only.
    Follows the PipelineRL paper (arXiv 2509.19128, eq. 2; c = 5)."""
    if cfg.is_level == "token":
        raw = t.rho.detach()
    else:
        log_seq = t.seq_sum(t.log_ratio.detach()).clamp(-SEQUENCE_LOG_RATIO_CLAMP, SEQUENCE_LOG_RATIO_CLAMP)
        raw = t.per_token(torch.exp(log_seq))
    w = raw.clamp(max=cfg.is_clip)
    return PerToken(weighted_log_likelihood(w, t.advantages, t.logp), (raw > cfg.is_clip).float(), w)
