"""The RL step's loss around the chosen objective (`loss.name`, rl/objectives/): the engine/trainer mismatch mask
and the lag mask (`loss.max_token_lag`), the per-sample normalisation weights (rl/normalization.py), an optional KL
penalty to a frozen reference (k3 estimator), and the sums behind the step's ESS, clipping and mismatch metrics
(docs/objective.md).

All inputs are per output token of one packed micro-batch, flattened; `mask` is 1 on the tokens that count
(generated tokens), 0 elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pipelinerl_fsdp import records
from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.records import MAX, SUM, stat
from pipelinerl_fsdp.rl.objectives import OBJECTIVES, Tokens
from pipelinerl_fsdp.rl.positions import TENTHS

# |log pi_ref - log pi| is clamped here before exp() in the k3 estimator: one token the policy has moved far from
# the reference would otherwise give an unbounded penalty and gradient (PipelineRL clamps it the same way).
KL_LOG_RATIO_CLAMP = 10.0
# Completion-token positions at which the lag-0 mismatch is also summed per range ([0, 32), [32, 64), [64, 128),
# [128, ...)): a KV cache kept from older weights (or numerics that drift with context length) shows as a mismatch
# that grows with the position in the completion.
POSITION_BINS = (0, 32, 64, 128)


# Model turns of a multi-turn episode whose importance weights are also summed per turn index (the last counts every
# later turn): the ESS of each turn (`ess_turn/<i>`).
TURN_BINS = 8


def position_bin_names() -> list[str]:
    """Names of the ranges of POSITION_BINS: "0-31", "32-63", "64-127", "128+"."""
    ends = [f"-{b - 1}" for b in POSITION_BINS[1:]] + ["+"]
    return [f"{lo}{end}" for lo, end in zip(POSITION_BINS, ends)]


@dataclass
class LossInput:
    """What the loss reads of one packed micro-batch, per target token, flattened ([T] each): `mask` 1 on the
    tokens that count (those a policy sampled), the engine's log-probs, the advantages and the per-sample
    normalisation weights (rl/normalization.py); `seq` the sequence index of each token (None: one sequence). The
    optional fields turn on statistics (`policy_loss`) or the KL penalty (`ref_logp`)."""

    mask: torch.Tensor
    behaviour_logp: torch.Tensor
    advantage: torch.Tensor
    weight: torch.Tensor
    seq: torch.Tensor | None = None
    current: torch.Tensor | None = None  # 1 on the tokens the trained version sampled (lag 0)
    after_update: torch.Tensor | None = None  # 1 on tokens sampled after an in-flight update within their sequence
    position: torch.Tensor | None = None  # each token's index in its completion
    tenth: torch.Tensor | None = None  # each token's tenth of its completion (rl/positions.py: 1..10; 0 elsewhere)
    turn: torch.Tensor | None = None  # each token's model-turn index, from 1 (0 elsewhere)
    ref_logp: torch.Tensor | None = None  # log-probs under the frozen reference model (rl.kl_coef > 0)
    lag: torch.Tensor | None = None  # trained version - the token's version (loss.max_token_lag; 0 off the mask)
    n_seq: int | None = None  # sequences in the micro-batch (None: read from `seq`, a wait for the device on GPU)


@dataclass
class LossStats:
    """The statistics of the loss, summed over tokens and sequences (micro-batches, then trainer ranks, combine them
    as each field says: records.py), behind the step's ESS, clipping and mismatch metrics (rl/step_metrics.py)."""

    sum_rho: float = stat(SUM)  # raw importance weights rho = pi / mu: the paper's ESS
    sum_rho2: float = stat(SUM)
    sum_w: float = stat(SUM)  # the weights the update applies (truncated, or PPO-type objectives' unclipped ratio)
    sum_w2: float = stat(SUM)
    tokens: float = stat(SUM)
    kept: float = stat(SUM)  # tokens both masks keep: those the update's weights (sum_w) are over
    entropy: float = stat(SUM)  # of the counted tokens (`micro_batch_loss`)
    clipped: float = stat(SUM)
    kl: float = stat(SUM)  # k3 to the reference model, when rl.kl_coef > 0
    # lag-0 tokens (sampled by the weights being trained): the engine/trainer mismatch (k3, |log rho|)
    lag0_tokens: float = stat(SUM)
    lag0_k3: float = stat(SUM)
    lag0_abs_log_ratio: float = stat(SUM)
    # ...those of them sampled after an in-flight update within their sequence
    lag0_after_update_tokens: float = stat(SUM)
    lag0_after_update_k3: float = stat(SUM)
    masked: float = stat(SUM)  # tokens the mismatch mask or the lag mask (loss.max_token_lag) left out
    mis_tokens: float = stat(SUM)  # tokens the token rule would leave out with [mask_low, mask_high]
    mis_seqs: float = stat(SUM)  # sequences the sequence rule would
    sequences: float = stat(SUM)
    max_log_ratio: float = stat(MAX)
    # the lag-0 tokens and their k3 per range of POSITION_BINS
    lag0_tokens_pos: tuple[float, ...] = stat(SUM, size=len(POSITION_BINS))
    lag0_k3_pos: tuple[float, ...] = stat(SUM, size=len(POSITION_BINS))
    # tokens, sum rho and sum rho^2 per model-turn index (the last counting every later turn)
    turn_tokens: tuple[float, ...] = stat(SUM, size=TURN_BINS)
    turn_rho: tuple[float, ...] = stat(SUM, size=TURN_BINS)
    turn_rho2: tuple[float, ...] = stat(SUM, size=TURN_BINS)
    # tokens, sum rho, sum rho^2 and sum |log rho| per tenth of their completion (rl/positions.py), all lags
    tenth_tokens: tuple[float, ...] = stat(SUM, size=TENTHS)
    tenth_rho: tuple[float, ...] = stat(SUM, size=TENTHS)
    tenth_rho2: tuple[float, ...] = stat(SUM, size=TENTHS)
    tenth_abs_log_ratio: tuple[float, ...] = stat(SUM, size=TENTHS)


def mismatch_masks(t: Tokens, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens a masking rule (MIS / IcePop) would keep, per token: (token rule: rho_t within [low, high];
    sequence rule: the geometric mean of the sequence's rho within [low, high], at each of its tokens)."""
    lr = t.log_ratio.detach()
    lo, hi = torch.log(torch.tensor(low, dtype=lr.dtype)), torch.log(torch.tensor(high, dtype=lr.dtype))
    token = ((lr >= lo) & (lr <= hi)).to(lr.dtype)
    geo = t.seq_mean(lr)
    sequence = t.per_token(((geo >= lo) & (geo <= hi)).to(lr.dtype))
    return token, sequence


def policy_loss(
    logp: torch.Tensor, batch: LossInput, cfg: LossConfig, kl_coef: float = 0.0
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch, `logp` the trainer's log-probs of its tokens: sum_t weight_t * keep_t * L_t
    (+ kl_coef * sum_t weight_t * k3_t with `batch.ref_logp`), L_t the objective's per-token loss (`cfg.name`),
    weight_t its sample's normalisation weight (`loss.normalize`), keep_t the mismatch mask (`loss.mask`: 1
    everywhere with "none") times the lag mask (`loss.max_token_lag` k >= 0: 0 where `batch.lag` > k).

    Returns the loss and its statistics (`LossStats`): the raw importance weights rho = pi / mu (the paper's ESS)
    and the weights the update applies (the truncated ones for REINFORCE-type objectives, the unclipped ratio for
    PPO-type ones, whose clipping acts on the objective); the tokens and sequences the masking rules would leave
    out with [mask_low, mask_high], whichever rule is on. On the lag-0 tokens (`batch.current`) rho differs from 1
    only by the engine/trainer mismatch (kernels, dtype, a wrong tokenizer or template): the k3 estimate of
    KL(engine || trainer), rho - 1 - log rho on the engine's samples, and |log rho| are summed there; also over
    those `batch.after_update` marks (sampled over a KV cache older weights computed, unless the engine recomputed
    it), and per range of POSITION_BINS (`batch.position`). With `batch.turn`: tokens, sum rho and sum rho^2 per
    turn index (up to TURN_BINS, the last counting every later turn). With `batch.tenth`: tokens, sum rho, sum rho^2
    and sum |log rho| per tenth of the completion, over every counted token whatever its lag.

    The statistics come to the host here (one copy); the training step keeps them on the device instead
    (`micro_batch_loss`, `add_sums`)."""
    loss, parts = loss_parts(logp, batch, cfg, kl_coef)
    return loss, stats_from_sums(stat_sums(parts, logp.device))


def loss_parts(
    logp: torch.Tensor, batch: LossInput, cfg: LossConfig, kl_coef: float = 0.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss`'s loss and its statistics as device tensors by `LossStats` field name (0-d, or [size] for the
    tuple fields; a field left out keeps its default), read nowhere: nothing here waits for the device, given
    `batch.n_seq`."""
    objective = OBJECTIVES.get(cfg.name)
    if objective is None:
        raise ValueError(f"unknown loss {cfg.name!r}; registered: {sorted(OBJECTIVES)}")
    b, mask = batch, batch.mask
    log_ratio = (logp - b.behaviour_logp).clamp(max=30.0)  # exp() stays finite for wildly stale tokens
    seq = b.seq if b.seq is not None else torch.zeros_like(mask, dtype=torch.long)
    n_seq = b.n_seq if b.n_seq is not None else int(seq.max()) + 1 if seq.numel() else 0
    t = Tokens(logp, log_ratio, b.advantage, mask, seq, n_seq)
    token_keep, seq_keep = mismatch_masks(t, cfg.mask_low, cfg.mask_high)
    keep = {"none": torch.ones_like(mask), "token": token_keep, "sequence": seq_keep}[cfg.mask]
    if cfg.max_token_lag >= 0:
        if b.lag is None:
            raise ValueError("loss.max_token_lag needs each token's lag: rl_micro_batches(..., version=)")
        keep = keep * (b.lag <= cfg.max_token_lag).to(keep.dtype)
    out = objective(t, cfg)
    counted = mask * keep
    loss = (out.loss * counted * b.weight).sum()
    parts: dict[str, torch.Tensor] = {}
    if b.ref_logp is not None and kl_coef > 0:
        d = (b.ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * (kl * mask * b.weight).sum()
        parts["kl"] = (kl.detach() * mask).sum()
    lr = log_ratio.detach()
    rho = torch.exp(lr)
    lag0 = mask * b.current if b.current is not None else torch.zeros_like(mask)
    w, raw = out.weights * counted, rho * mask
    has_tokens = t.seq_sum(torch.ones_like(mask)) > 0
    late = lag0 * b.after_update if b.after_update is not None else 0 * mask
    parts.update(
        sum_rho=raw.sum(),
        sum_rho2=(raw * rho).sum(),
        sum_w=w.sum(),
        sum_w2=(w * out.weights).sum(),
        tokens=mask.sum(),
        kept=counted.sum(),
        clipped=(out.clipped * mask).sum(),
        masked=(mask * (1 - keep)).sum(),
        mis_tokens=(mask * (1 - token_keep)).sum(),
        mis_seqs=((t.seq_sum(1 - seq_keep) > 0) & has_tokens).sum(),
        sequences=has_tokens.sum(),
    )
    if mask.numel():  # -inf where no token counts, as the field's default
        parts["max_log_ratio"] = lr.masked_fill(mask == 0, float("-inf")).max()
    parts["lag0_tokens"], parts["lag0_k3"], parts["lag0_abs_log_ratio"] = lag0_mismatch_sums(lr, lag0)
    parts["lag0_after_update_tokens"], parts["lag0_after_update_k3"], _ = lag0_mismatch_sums(lr, late)
    if b.position is not None:
        edges = [*POSITION_BINS[1:], float("inf")]
        ranges = [
            lag0_mismatch_sums(lr, lag0 * ((b.position >= lo) & (b.position < hi)).to(lag0.dtype))
            for lo, hi in zip(POSITION_BINS, edges)
        ]
        parts["lag0_tokens_pos"] = torch.stack([r[0] for r in ranges])
        parts["lag0_k3_pos"] = torch.stack([r[1] for r in ranges])
    if b.turn is not None:
        turns = [
            mask * ((b.turn == i) if i < TURN_BINS else (b.turn >= i)).to(mask.dtype) for i in range(1, TURN_BINS + 1)
        ]
        parts["turn_tokens"] = torch.stack([m.sum() for m in turns])
        parts["turn_rho"] = torch.stack([(rho * m).sum() for m in turns])
        parts["turn_rho2"] = torch.stack([(rho * rho * m).sum() for m in turns])
    if b.tenth is not None:
        tenths = tenth_sums(b.tenth, mask, lr)
        for i, name in enumerate(("tenth_tokens", "tenth_rho", "tenth_rho2", "tenth_abs_log_ratio")):
            parts[name] = tenths[i]
    return loss, parts


def tenth_sums(tenth: torch.Tensor, mask: torch.Tensor, log_ratio: torch.Tensor) -> torch.Tensor:
    """Per tenth 1..TENTHS of the completion (`tenth`, 0: none), over the tokens where `mask` is 1: their count, sum
    rho, sum rho^2 and sum |log rho|, rho = exp(log_ratio): the rows of a [4, TENTHS] tensor, from one
    index_add."""
    rho = torch.exp(log_ratio)
    rows = torch.stack([torch.ones_like(rho), rho, rho * rho, log_ratio.abs()])
    rows = torch.where(mask > 0, rows, torch.zeros_like(rows))  # a prompt position's log ratio is not a token's
    sums = torch.zeros(4, TENTHS + 1, dtype=rows.dtype, device=rows.device).index_add(1, tenth.long(), rows)
    return sums[:, 1:]


def lag0_mismatch_sums(log_ratio: torch.Tensor, lag0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over the tokens where `lag0` is 1: their count, and the sums of the k3 term rho - 1 - log rho (>= 0; its mean
    estimates KL(engine || trainer) from the engine's samples) and of |log rho|, rho = pi_trainer / pi_engine
    (0-d tensors)."""
    k3 = torch.expm1(log_ratio) - log_ratio
    return lag0.sum(), (k3 * lag0).sum(), (log_ratio.abs() * lag0).sum()


def stat_sums(parts: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """`LossStats` as one flat float64 tensor on `device`, in `records.values` order: each field from `parts` (by
    name; float32 values widen exactly, as `float()` of them would), else its default. Built on the device: no
    copy from the host (a blocking copy on GPU)."""
    pieces = []
    for f in dataclasses.fields(LossStats):
        size = f.metadata["size"] or 1
        if f.name in parts:
            v = parts[f.name].reshape(-1).to(torch.float64)
            if v.numel() != size:
                raise ValueError(f"LossStats.{f.name}: {v.numel()} values, expected {size}")
        else:
            default = f.default[0] if f.metadata["size"] else f.default
            v = torch.full((size,), default, dtype=torch.float64, device=device)
        pieces.append(v.to(device))
    return torch.cat(pieces)


def empty_sums(device: torch.device) -> torch.Tensor:
    """The sums of no micro-batch (every field its reduction's identity), on `device`."""
    return stat_sums({}, device)


def add_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two micro-batches' `stat_sums` combined on the device, each value with its field's reduction (`records`):
    the same float64 operations, in the same order, as `records.combine` of their `LossStats` on the host."""
    out = a + b
    for i in records.positions(LossStats, MAX):
        out[i] = torch.maximum(a[i], b[i])
    return out


def total_sums(sums: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`add_sums` over `sums` in order, onto `empty_sums` (as `records.total` onto `LossStats()`)."""
    out = empty_sums(device)
    for s in sums:
        out = add_sums(out, s)
    return out


def stats_from_sums(sums: torch.Tensor) -> LossStats:
    """`stat_sums` read on the host: one copy (the one the step waits for)."""
    return records.from_values(LossStats(), sums.tolist())


def micro_batch_loss(
    logp: torch.Tensor, entropy: torch.Tensor, batch: LossInput, cfg: LossConfig, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`policy_loss` on one packed micro-batch, `logp` and `entropy` the model's [1, T] outputs, with the summed
    entropy of its counted tokens added to the statistics, which stay on the device (`stat_sums`: the step adds
    them up with `add_sums` and reads them once, `stats_from_sums`)."""
    loss, parts = loss_parts(logp[0], batch, cfg, kl_coef)
    parts["entropy"] = (entropy[0] * batch.mask).sum()
    return loss, stat_sums(parts, logp.device)
