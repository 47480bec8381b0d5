"""What every role of the RL stage shares, built once per rank before any engine starts: the tokenizer, the task
(an environment's chat template checked to frame its turns), the ids that end a completion, the sequence limits
(checked against the config and the model folder) and the layout of the weight sync. The trainer, the inference
loop and the engine factory take these instead of deciding them each on their own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from pipelinerl_fsdp.checkpoint_layout import resume_point
from pipelinerl_fsdp.config import Config
from pipelinerl_fsdp.episodes import check_env_template
from pipelinerl_fsdp.job.weight_sync import WeightSyncLayout, weight_sync_layout
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.models.hf_io import read_model_args
from pipelinerl_fsdp.preflight import (
    check_environment,
    check_limits,
    check_vocab,
    engine_max_len,
    sequence_limits,
    stop_token_ids,
    tokenizer_folder,
)
from pipelinerl_fsdp.tasks import Task, make_task
from pipelinerl_fsdp.tokenizer import load_tokenizer


@dataclass(frozen=True)
class JobInputs:
    model_path: str  # the policy the job starts from (HF folder)
    tokenizer_path: str
    tokenizer: PreTrainedTokenizerBase
    task: Task
    stop_ids: list[int]  # ids that end a completion, the same for every engine
    prompt_len: int  # longest prompt in tokens (task.max_prompt_tokens, when set, bounds it)
    engine_max_len: int  # the engines' max_model_len
    weight_sync: WeightSyncLayout


def build_job_inputs(cfg: Config, model_path: str | Path, world: World) -> JobInputs:
    """Load and check the job's inputs (a `ConfigError` names what does not fit), and the checkpoint to resume from
    (`checkpoint.resume = "required"` with nothing to resume, or a bad `resume_from`, is named here)."""
    resume_point(cfg.checkpoint, cfg.job.output_dir)
    folder = tokenizer_folder(cfg.tokenizer, model_path)
    tokenizer = load_tokenizer(folder)
    task = make_task(cfg.task)
    check_environment(cfg.task, task)
    if task.multi_turn:  # before any episode: the chat template must frame an environment turn
        check_env_template(tokenizer, cfg.tokenizer)
    prompt_len, total = sequence_limits(cfg.tokenizer, cfg.task, task, tokenizer)
    check_limits(cfg.trainer, cfg.inference, cfg.task, prompt_len, total)
    check_vocab(read_model_args(model_path).vocab_size, tokenizer, f"model folder {model_path}")
    return JobInputs(
        model_path=str(model_path),
        tokenizer_path=folder,
        tokenizer=tokenizer,
        task=task,
        stop_ids=stop_token_ids(model_path, tokenizer),
        prompt_len=prompt_len,
        engine_max_len=engine_max_len(cfg.inference, cfg.task, prompt_len),
        weight_sync=weight_sync_layout(cfg.job, cfg.inference, world, cfg.lora),
    )
