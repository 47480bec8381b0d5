"""Start-up checks and decisions that need the task, the tokenizer or the model folder, made once before any
engine starts or any step runs: which tokenizer every stage uses, which token ids end a completion, and whether
the longest sequence fits the trainer's micro-batch budget. A failure is a `ConfigError` that names the key."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.config import ConfigError, InferenceConfig, TaskConfig, TokenizerConfig, TrainerConfig
from pipelinerl_fsdp.models.hf_io import read_json
from pipelinerl_fsdp.tasks import Task
from pipelinerl_fsdp.tokenizer import encode_prompt


def tokenizer_folder(tok: TokenizerConfig, model_path: str | Path) -> str:
    """The one tokenizer of every stage (warm start, trainer, engines): tokenizer.path, else the model folder's."""
    path = tok.path or str(model_path)
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        key = "tokenizer.path" if tok.path else "model.path (its tokenizer; or set tokenizer.path)"
        raise ConfigError(f"{key}: {path} holds no tokenizer.json / tokenizer_config.json")
    return path


def check_environment(task_cfg: TaskConfig, task: Task) -> None:
    """A task whose environment this machine cannot run (a tool task without the sandbox's boundary) stops here,
    naming what is missing: it never runs with a weaker sandbox."""
    missing = task.environment_missing()
    if missing:
        raise ConfigError(
            f"task.name = {task_cfg.name}: this machine cannot run the task's environment (docs/extending.md): "
            + "; ".join(missing)
        )


def _eos_ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def stop_token_ids(model_path: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a completion, the same for every engine: the tokenizer's EOS plus the eos ids of the model
    folder's generation_config.json and config.json (vLLM stops on those too; we pass the union to both)."""
    ids = set(_eos_ids(tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if path.is_file():
            ids.update(_eos_ids(read_json(path).get("eos_token_id")))
    return sorted(ids)


def sequence_limits(
    tok: TokenizerConfig, task_cfg: TaskConfig, task: Task, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, int]:
    """(longest prompt in tokens, longest prompt + completion) for this task, tokenizer and chat template. With
    `task.max_prompt_tokens` set, longer prompts are skipped, so that is the bound."""
    prompt = max(len(encode_prompt(tokenizer, text, tok)) for text in task.prompts_to_check())
    cap = getattr(task_cfg, "max_prompt_tokens", 0)
    if cap:
        prompt = min(prompt, cap)
    return prompt, prompt + task_cfg.max_new_tokens


def engine_max_len(inf: InferenceConfig, task_cfg: TaskConfig, prompt_len: int) -> int:
    """The engines' `max_model_len`: `inference.max_model_len`, or the longest prompt + `task.max_new_tokens`."""
    need = prompt_len + task_cfg.max_new_tokens
    set_len = inf.max_model_len
    if set_len and set_len < need:
        raise ConfigError(
            f"inference.max_model_len = {set_len} is shorter than the longest prompt ({prompt_len} tokens) + "
            f"task.max_new_tokens = {task_cfg.max_new_tokens}; raise it, or cap prompts with "
            "task.max_prompt_tokens"
        )
    return set_len or need


def check_sequence_budget(
    trainer: TrainerConfig,
    inf: InferenceConfig,
    tok: TokenizerConfig,
    task_cfg: TaskConfig,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The longest sequence must fit one packed micro-batch (it is never split) and the engines."""
    check_limits(trainer, inf, task_cfg, *sequence_limits(tok, task_cfg, task, tokenizer))


def check_limits(trainer: TrainerConfig, inf: InferenceConfig, task_cfg: TaskConfig, prompt: int, total: int) -> None:
    """`check_sequence_budget` on limits already measured (`sequence_limits`)."""
    engine_max_len(inf, task_cfg, prompt)  # a too-short inference.max_model_len is named here, before any engine
    if total > trainer.micro_batch_tokens:
        raise ConfigError(
            f"trainer.micro_batch_tokens = {trainer.micro_batch_tokens} is smaller than the "
            f"longest sequence: a prompt of up to {prompt} tokens (task {task_cfg.name!r}) + "
            f"task.max_new_tokens = {task_cfg.max_new_tokens}; raise the budget or lower max_new_tokens"
        )


def check_vocab(vocab_size: int, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """The model's vocabulary must hold every id the tokenizer can produce."""
    if vocab_size < len(tokenizer):
        raise ConfigError(
            f"{where}: the model's vocab_size {vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens (tokenizer.path / model.path)"
        )
