"""Per-token policy-gradient objectives, by name (`rl.loss`): one module each in this package.

An objective turns the importance weights, advantages and log-probs of the generated tokens into the per-token
loss; `rl.loss.policy_loss` adds what every objective shares (masking, normalisation, the KL penalty, the
statistics behind ESS). A module registers its objective with `@register_objective("name")`; importing this
package imports every module in it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSettings:
    kind: str = "reinforce"  # a name in OBJECTIVES (`rl.loss`)
    is_clip: float = 5.0  # c: importance weights are truncated at c
    ppo_eps: float = 0.2
    kl_coef: float = 0.0


@dataclass(frozen=True)
class PerToken:
    loss: torch.Tensor  # per token, before masking and normalisation
    clipped: torch.Tensor  # 1.0 where the objective clipped this token's update
    weights: torch.Tensor  # the importance weights the update applies (detached), for ESS of the update


Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossSettings], PerToken]
"""(rho, advantages, logp, settings) -> PerToken; rho = pi(a_t) / mu(a_t), differentiable through logp."""

OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str) -> Callable[[Objective], Objective]:
    def add(fn: Objective) -> Objective:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice")
        OBJECTIVES[name] = fn
        return fn

    return add


for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")
