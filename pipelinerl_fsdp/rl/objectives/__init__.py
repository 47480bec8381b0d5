"""Policy-gradient losses, by name (`loss.name`): one module each in this package.

A loss module defines its per-token objective and registers it with `@register_objective("name", ConfigClass)`,
where ConfigClass extends `config.LossConfig` with the loss's own keys (its `[loss]` section) and its defaults for
the shared ones (normalisation, mismatch masking, overlong handling). `rl.loss.policy_loss` applies what every
loss shares: the masks, the normalisation weights, the KL penalty and the statistics behind ESS. Importing this
package imports every module in it.

Every objective sees the same ratio: rho_t = pi(a_t) / mu(a_t), mu the engine's sampling distribution when it
generated the token (PipelineRL: there is no separate "old policy" pass; the trainer takes one step per batch, so
rho covers both the policy's lag and any engine/trainer mismatch).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipelinerl_fsdp.config import LossConfig


@dataclass(frozen=True)
class Tokens:
    """The generated tokens of one packed micro-batch (flat, one entry per target position)."""

    logp: torch.Tensor  # log pi(a_t), differentiable
    log_ratio: torch.Tensor  # log rho_t = log pi - log mu (detached from nothing: differentiable through logp)
    advantages: torch.Tensor
    mask: torch.Tensor  # 1.0 on generated tokens, 0.0 on prompt positions
    seq: torch.Tensor  # long: which sequence of the micro-batch each position belongs to
    n_seq: int

    @property
    def rho(self) -> torch.Tensor:
        return torch.exp(self.log_ratio)

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per sequence: the sum of `x` over its generated tokens ([n_seq])."""
        return torch.zeros(self.n_seq, dtype=x.dtype, device=x.device).index_add(0, self.seq, x * self.mask)

    def seq_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per sequence: the mean of `x` over its generated tokens ([n_seq]; 0 for a sequence without any)."""
        return self.seq_sum(x) / self.seq_sum(torch.ones_like(x)).clamp(min=1.0)

    def per_token(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A per-sequence value at each of the sequence's positions."""
        return per_seq[self.seq]


@dataclass(frozen=True)
class PerToken:
    loss: torch.Tensor  # per token, before masking and normalisation
    clipped: torch.Tensor  # 1.0 where the objective clipped or truncated this token's update
    weights: torch.Tensor  # the importance weights the update applies (detached), for ESS of the update


Objective = Callable[[Tokens, LossConfig], PerToken]

OBJECTIVES: dict[str, Objective] = {}
CONFIGS: dict[str, type[LossConfig]] = {}


def register_objective(name: str, config_class: type[LossConfig]) -> Callable[[Objective], Objective]:
    """Register a loss under `name` (the value of `loss.name`), with its config class (its `[loss]` keys)."""

    def add(fn: Objective) -> Objective:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice")
        if config_class.name != name:  # a config built directly (tests, benchmarks) must name its own loss
            raise ValueError(
                f"objective {name!r}: its config class {config_class.__name__} has name {config_class.name!r}"
            )
        OBJECTIVES[name], CONFIGS[name] = fn, config_class
        return fn

    return add


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float = 0.0
) -> PerToken:
    """PPO's pessimistic clipped objective, per token: -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A),
    differentiable through `ratio`. Its clipping acts on the objective, so the weights it applies are the
    unclipped ratio. `dual_clip` c > 1 (dual-clip PPO, Ye et al. 2020, arXiv 1912.09729, eq. 5; verl's
    `clip_ratio_c`): where A < 0 the objective is also bounded below by c A, so a token whose ratio grew far past
    1 (stale under a long lag) pushes no harder than one at ratio c; 0: off."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    bound = clipped < unclipped
    if dual_clip:
        floor = dual_clip * advantages
        dual = (advantages < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        bound = bound | dual
    return PerToken(-objective, bound.float(), ratio.detach())


def weighted_log_likelihood(weights: torch.Tensor, advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sg(w) A log pi per token: REINFORCE with importance weights `w` held constant (gradient w A grad log pi)."""
    return -weights.detach() * advantages * logp


for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")
