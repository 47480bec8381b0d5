"""Start-up checks: one stop set for every engine, the sequence budget, the tokenizer folder."""

from __future__ import annotations

import json

import pytest

from pipelinerl_fsdp.config import ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.preflight import (
    check_sequence_budget,
    engine_max_len,
    sequence_limits,
    stop_token_ids,
    tokenizer_folder,
)
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer


def test_stop_ids_are_the_union_of_tokenizer_config_and_generation_config(tmp_path):
    tok = build_char_tokenizer(ALPHABET)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert stop_token_ids(tmp_path, tok) == [1, 7]
    (tmp_path / "generation_config.json").unlink()
    assert stop_token_ids(tmp_path, tok) == [1]


def test_longest_sequence_must_fit_the_micro_batch():
    tok = build_char_tokenizer(ALPHABET)
    cfg = load_config(
        [
            "--task.name=chain_sum",
            "--task.digits=2",
            "--task.max_terms=8",
            "--task.max_new_tokens=96",
            "--trainer.micro_batch_tokens=100",
        ]
    )
    task = make_task(cfg.task)
    prompt, total = sequence_limits(cfg.tokenizer, cfg.task, task, tok)
    assert prompt == len("99+" * 7 + "99=") == 24 and total == 120
    with pytest.raises(
        ConfigError,
        match=r"trainer\.micro_batch_tokens = 100 is smaller than the longest "
        r"sequence: a prompt of up to 24 tokens .* task\.max_new_tokens = 96",
    ):
        check_sequence_budget(cfg.trainer, cfg.inference, cfg.tokenizer, cfg.task, task, tok)
    cfg.trainer.micro_batch_tokens = 120
    check_sequence_budget(cfg.trainer, cfg.inference, cfg.tokenizer, cfg.task, task, tok)  # exactly fits


def test_every_generated_prompt_is_within_the_longest_prompt():
    for args in (["--task.digits=3"], ["--task.name=chain_sum", "--task.digits=2", "--task.max_terms=6"]):
        task = make_task(load_config(args).task)
        bound = len(task.longest_prompt())
        assert max(len(task.train_problem(0, i).prompt) for i in range(2000)) == bound


def test_tokenizer_folder_missing_is_a_named_error(tmp_path):
    cfg = load_config([])
    with pytest.raises(ConfigError, match=r"model\.path \(its tokenizer; or set tokenizer\.path\): .* holds no"):
        tokenizer_folder(cfg.tokenizer, tmp_path)
    build_char_tokenizer(ALPHABET).save_pretrained(str(tmp_path / "tok"))
    cfg = load_config([f"--tokenizer.path={tmp_path / 'tok'}"])
    assert tokenizer_folder(cfg.tokenizer, tmp_path) == str(
        tmp_path / "tok"
    )  # tokenizer.path wins over the model folder


def test_engine_max_len_from_the_data_or_the_config():
    cfg = load_config(["--config", "arithmetic"])
    assert engine_max_len(cfg.inference, cfg.task, 12) == 12 + cfg.task.max_new_tokens
    cfg = load_config(["--config", "arithmetic", "--inference.max_model_len=64"])
    assert engine_max_len(cfg.inference, cfg.task, 12) == 64
    cfg = load_config(["--config", "arithmetic", "--inference.max_model_len=10"])
    with pytest.raises(ConfigError, match="inference.max_model_len = 10 is shorter"):
        check_sequence_budget(
            cfg.trainer, cfg.inference, cfg.tokenizer, cfg.task, make_task(cfg.task), build_char_tokenizer(ALPHABET)
        )


def test_cuda_graphs_only_on_gpu():
    from pipelinerl_fsdp.inference.vllm_options import enforce_eager

    assert enforce_eager(True, on_gpu=True) is False
    assert enforce_eager(False, on_gpu=True) is True
    assert enforce_eager(True, on_gpu=False) is True
