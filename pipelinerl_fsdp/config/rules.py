"""The cross-key rules: values that are fine alone but not together (a batch of whole groups, waves that divide
it, a mode and its evaluations, ...). Each raises a `ConfigError` naming the keys; the loader appends the source."""

from __future__ import annotations

from pathlib import Path

from pipelinerl_fsdp.config.errors import ConfigError
from pipelinerl_fsdp.config.schema import Config
from pipelinerl_fsdp.config.training import LossConfig, RLConfig


def resolve_defaults(rl: RLConfig, loss: LossConfig) -> None:
    """Keys whose default depends on another section, decided once the values are in: `rl.std_normalize` unset
    takes the selected loss's (`LossConfig.advantage_std`)."""
    if rl.std_normalize is None:
        rl.std_normalize = type(loss).advantage_std


def check_rules(cfg: Config) -> None:
    """Rules across keys and sections that do not depend on the world size (configure.validate_world does)."""
    rl = cfg.rl
    if not cfg.eval.pass_k or any(not 1 <= k <= cfg.eval.samples for k in cfg.eval.pass_k):
        raise ConfigError(
            f"eval.pass_k = {cfg.eval.pass_k} must list k values in [1, eval.samples = {cfg.eval.samples}]"
        )
    if cfg.inference.max_num_seqs < rl.attempts:
        raise ConfigError(
            f"inference.max_num_seqs = {cfg.inference.max_num_seqs} must be >= rl.attempts = "
            f"{rl.attempts}: a group is generated on one engine"
        )
    if rl.batch_size % rl.attempts:
        raise ConfigError(
            f"rl.batch_size = {rl.batch_size} must be a multiple of rl.attempts = {rl.attempts}: "
            f"a step trains on whole groups (their advantages share a baseline)"
        )
    if (rl.batch_size // rl.attempts) % rl.waves:
        raise ConfigError(
            f"rl.waves = {rl.waves} must divide the {rl.batch_size // rl.attempts} groups of a step "
            f"(rl.batch_size = {rl.batch_size} / rl.attempts = {rl.attempts}): each part is whole groups"
        )
    if cfg.loss.normalize == "tokens" and rl.waves > 1:
        raise ConfigError(
            f"loss.normalize = 'tokens' divides by the step's completion tokens, which are known only once the whole "
            f"batch is in: it needs rl.waves = 1 (got {rl.waves})"
        )
    if cfg.job.stage == "rl" and cfg.inference.top_p < 1:
        # Both samplers return log-probs of the renormalised nucleus, the trainer those of the full softmax: the
        # importance ratio would be wrong even at zero lag.
        raise ConfigError(
            f"inference.top_p = {cfg.inference.top_p} < 1 is not supported for training rollouts: "
            "the engine's log-probs would be those of the truncated nucleus while the trainer scores "
            f"the full distribution, so importance weights are off even on-policy"
        )
    if rl.mode == "conventional" and rl.filter_zero_advantage:
        raise ConfigError(
            "rl.mode = 'conventional' generates exactly the samples of its sync_every steps, so "
            "rl.filter_zero_advantage = true would leave the trainer short of data"
        )
    if (
        rl.mode == "conventional"
        and cfg.eval.every
        and (cfg.eval.every % rl.sync_every or rl.max_steps % rl.sync_every)
    ):
        # engines load only the versions synced after each round (multiples of sync_every): any other version due
        # for evaluation, the final one included, would never be loaded, and its evaluation never happen
        raise ConfigError(
            f"rl.mode = 'conventional' loads only every rl.sync_every = {rl.sync_every}-th version: eval.every = "
            f"{cfg.eval.every} and rl.max_steps = {rl.max_steps} must be multiples of it, or the evaluations due "
            f"at other versions would never run"
        )
    if rl.mode == "conventional" and cfg.checkpoint.interval % rl.sync_every:
        raise ConfigError(
            f"rl.mode = 'conventional': checkpoint.interval = {cfg.checkpoint.interval} must be a "
            f"multiple of rl.sync_every = {rl.sync_every} (checkpoints between rounds)"
        )
    if cfg.lora.enabled and cfg.job.stage == "warmstart":
        raise ConfigError(
            "lora.enabled = true trains adapters in the RL stage; the warm start (job.stage = 'warmstart') trains "
            "the full model: turn [lora] off for it"
        )
    if cfg.lora.enabled and cfg.lora.dropout > 0:
        # the engines serve the merged weights without dropout and the KL reference runs with the adapters off
        raise ConfigError(
            f"lora.dropout = {cfg.lora.dropout}: dropout in the trainer's forward would put its noise into the "
            "importance ratio pi_theta / mu (the engines sample without it) and into the mismatch metrics; RL with "
            "LoRA here needs lora.dropout = 0"
        )
    if cfg.lora.enabled and rl.mode == "colocated":
        raise ConfigError(
            "lora.enabled = true is not supported with rl.mode = 'colocated' (its single process copies the full "
            "weights into its engine each step); use rl.mode = 'pipeline', 'async' or 'conventional'"
        )
    if cfg.lora.enabled and getattr(cfg.inference, "vllm_weight_load", None) == "reload":
        # a reload reads every weight from the pushed tensors, and a push carries only adapters
        raise ConfigError(
            "lora.enabled = true needs inference.vllm_weight_load = 'auto', 'inplace' or 'unpacked': the engines "
            "merge pushed adapters into their weights in place ('reload' rebuilds the model from a full push)"
        )
    for key in ("model.path", "tokenizer.path") if cfg.job.stage != "plan" else ():  # a plan reads no weights
        sec, name = key.split(".")
        path = getattr(getattr(cfg, sec), name)
        if path and not Path(path).is_dir():
            raise ConfigError(f"{key} = {path!r}: no such folder")
