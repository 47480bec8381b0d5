"""Config loading: file + overrides, and every error case names the key and its source."""

from pathlib import Path

import pytest

from pipelinerl_fsdp.config import Config, ConfigError, save_resolved
from pipelinerl_fsdp.configure import load_config, validate_world


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_defaults_and_named_config():
    cfg = load_config(["--config", "arithmetic"])
    assert cfg.task.name == "addition"
    assert cfg.source.endswith("arithmetic.toml")


def test_overrides_win_over_file(tmp_path):
    path = write(
        tmp_path,
        "[warmstart]\nsteps = 10\n[warmstart.optimizer]\nlr = 0.1\n[task]\nname = 'chain_sum'\nmax_new_tokens = 99\n",
    )
    cfg = load_config(
        [
            "--config",
            path,
            "--warmstart.steps=20",
            "--warmstart.optimizer.lr",
            "0.5",
            "--job.output_dir=/tmp/x y",
            "--trainer.optimizer.betas=[0.8, 0.9]",
        ]
    )
    assert cfg.warmstart.steps == 20 and cfg.warmstart.optimizer.lr == 0.5
    assert cfg.task.name == "chain_sum" and cfg.task.max_new_tokens == 99
    assert cfg.job.output_dir == "/tmp/x y"
    assert cfg.trainer.optimizer.betas == [0.8, 0.9]
    assert cfg.warmstart.optimizer.betas == [0.9, 0.95]  # two optimizers of one shape, set independently


def test_int_accepted_for_float(tmp_path):
    cfg = load_config(["--config", write(tmp_path, "[warmstart.optimizer]\nlr = 1\n")])
    assert cfg.warmstart.optimizer.lr == 1.0 and isinstance(cfg.warmstart.optimizer.lr, float)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("[bogus]\nx = 1\n", r"unknown section \[bogus\] in .*c\.toml"),
        ("[task]\nnmae = 'addition'\n", r"unknown key task\.nmae in .*c\.toml"),
        ("[warmstart]\nsteps = 'many'\n", r"warmstart\.steps: expected int, got 'many' \(.*c\.toml\)"),
        (
            "[task]\nname = 'poetry'\n",
            r"task\.name = 'poetry' is not one of 'addition', 'chain_sum', 'countdown', 'guess_number', 'math', "
            r"'tool_arithmetic', 'word_problems' \(.*c\.toml\)",
        ),
        ("[trainer.optimizer]\nlr = -1.0\n", r"trainer\.optimizer\.lr = -1\.0 must be > 0 \(.*c\.toml\)"),
        (
            "[warmstart.optimizer]\nmin_lr_ratio = 2.0\n",
            r"warmstart\.optimizer\.min_lr_ratio = 2\.0 must be in \[0, 1\]",
        ),
        ("[trainer]\nlr = 1e-4\n", r"unknown key trainer\.lr in .*known keys of \[trainer\]: optimizer"),
        (
            "[task]\nname = 'addition'\nmax_terms = 4\n",
            r"unknown key task\.max_terms .*known keys of \[task\]: name, "
            r"eval_size, eval_seed, max_new_tokens, digits",
        ),
        (
            "[task]\nname = 'chain_sum'\nmin_terms = 5\nmax_terms = 3\n",
            r"task\.max_terms = 3 must be >= task\.min_terms = 5",
        ),
        ("[task]\ndigits = 0\n", r"task\.digits = 0 must be between 1 and 18"),
        ("[model]\nflavour = 'giant'\n", r"model\.flavour = 'giant' is not one of"),
        ("[job]\nverbose = true\n", r"unknown key job\.verbose"),
        ("[rl]\nbatch_size = 60\n", r"rl\.batch_size = 60 must be a multiple of rl\.attempts = 8"),
        (
            "[job]\nstage = 'rl'\n[inference]\ntop_p = 0.9\n",
            r"inference\.top_p = 0\.9 < 1 is not supported for training",
        ),
        ("[task\nname = 1", r"c\.toml: invalid TOML: .*line 1"),
        ("[trainer.optimizer]\nbetas = [0.9]\n", r"trainer\.optimizer\.betas = \[0\.9\] must be two numbers"),
        ("[trainer]\noptimizer = 3\n", r"\[trainer\.optimizer\] in .*c\.toml must be a table"),
        ("[inference]\nmax_num_seqs = 4\n[rl]\nattempts = 8\n", r"inference\.max_num_seqs = 4 must be >= rl\.attempts"),
        ("[inference]\ntemperature = 0.0\n", r"inference\.temperature = 0\.0 must be > 0"),
        ("[metrics]\ntensorboard = 1\n", r"metrics\.tensorboard: expected bool"),
    ],
)
def test_file_errors_name_the_key(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(["--config", write(tmp_path, text)])


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--warmstart.steps=abc"], r"warmstart\.steps: expected int, got 'abc' \(command line\)"),
        (["--nosuch.key=1"], r"unknown section \[nosuch\] in command line"),
        (["--task.bogus=1"], r"unknown key task\.bogus in command line"),
        (["--config", "does_not_exist"], r"--config does_not_exist: no such file"),
        (["steps=3"], r"expected --section\.key=value"),
        (["--warmstart.steps"], r"has no value"),
        (["--rl.mode=sync"], r"rl\.mode"),
        (["--rl.mode=conventional", "--rl.filter_zero_advantage=true"], r"filter_zero_advantage = true would leave"),
        (["--trainer.optimizer.bogus=1"], r"unknown key trainer\.optimizer\.bogus in command line"),
        (["--task.name=chain_sum", "--task.max_terms=1"], r"task\.max_terms = 1 must be >= task\.min_terms = 2"),
        (["--task.name=nope"], r"task\.name = 'nope' is not one of .*'word_problems' \(command line\)"),
        (["--tokenizer.path=/nonexistent/tok"], r"tokenizer\.path = '/nonexistent/tok': no such folder"),
        (["--model.path=/nonexistent/model"], r"model\.path = '/nonexistent/model': no such folder"),
        (
            ["--rl.mode=conventional", "--rl.sync_every=4", "--checkpoint.interval=6"],
            r"checkpoint\.interval = 6 must be a multiple of rl\.sync_every = 4",
        ),
        (
            ["--rl.mode=conventional", "--rl.sync_every=4", "--eval.every=6", "--rl.max_steps=8"],
            r"eval\.every = 6 and rl\.max_steps = 8 must be multiples of it",
        ),
        (
            ["--rl.mode=conventional", "--rl.sync_every=4", "--eval.every=4", "--rl.max_steps=10"],
            r"loads only every rl\.sync_every = 4-th version",
        ),
        (["--inference.engine=sglang"], r"inference\.engine"),
        (["--checkpoint.export_every=-2"], r"checkpoint\.export_every = -2 must be >= 0"),
        (["--inference.gpu_memory_utilization=1.5"], r"inference\.gpu_memory_utilization = 1\.5 must be in \(0, 1\]"),
        (["--rl.waves=0"], r"rl\.waves = 0 must be >= 1"),
        (
            ["--rl.waves=3"],
            r"rl\.waves = 3 must divide the 8 groups of a step \(rl\.batch_size = 64 / rl\.attempts = 8\)",
        ),
    ],
)
def test_command_line_errors_name_the_key(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(args)


def test_world_checks():
    cfg = load_config(["--job.stage=warmstart", "--warmstart.batch_size=6"])
    validate_world(cfg, 3)
    with pytest.raises(ConfigError, match=r"world\.inference_ranks = 2 leaves no trainer rank: .* 2 rank"):
        validate_world(load_config(["--job.stage=warmstart", "--world.inference_ranks=2"]), 2)
    with pytest.raises(ConfigError, match=r"job\.stage = 'rl' needs world\.inference_ranks >= 1"):
        validate_world(load_config(["--job.stage=rl"]), 2)
    with pytest.raises(ConfigError, match=r"warmstart\.batch_size = 6 must be a multiple .* \(4\)"):
        validate_world(cfg, 4)


def test_resolved_config_roundtrips(tmp_path):
    cfg = load_config(["--config", "arithmetic", "--task.name=chain_sum", '--job.output_dir=a "quoted" dir'])
    path = save_resolved(cfg, tmp_path)
    again = load_config(["--config", str(path)])
    assert type(again.task).__name__ == "ChainSumConfig"
    for sec in ("job", "model", "tokenizer", "task", "trainer", "warmstart", "inference", "rl", "world", "metrics"):
        assert getattr(again, sec) == getattr(cfg, sec), sec
    assert isinstance(again, Config)


def test_task_keys_follow_the_selected_task(tmp_path):
    # the file selects chain_sum; its own keys are accepted, and the command line may switch the task back
    path = write(tmp_path, "[task]\nname = 'chain_sum'\nmax_terms = 5\n")
    assert load_config(["--config", path]).task.max_terms == 5
    with pytest.raises(ConfigError, match=r"unknown key task\.max_terms"):
        load_config(["--config", path, "--task.name=addition"])


@pytest.mark.parametrize("name", ["math", "math_1node_gpu", "math_smollm2_cpu"])
def test_math_configs_load_once_paths_are_set(tmp_path, name):
    with pytest.raises(ConfigError, match=r"model\.path = .*missing.*: no such folder"):
        load_config(["--config", name, f"--model.path={tmp_path / 'missing'}"])
    cfg = load_config(["--config", name, f"--model.path={tmp_path}", "--task.train_files=['data/math/orz.parquet']"])
    assert cfg.task.name == "math" and cfg.rl.batch_size % cfg.rl.attempts == 0
    if name == "math":  # the paper's split and batch
        assert (cfg.world.inference_ranks, cfg.rl.batch_size, cfg.loss.is_clip, cfg.rl.kl_coef) == (48, 4096, 5.0, 0.0)


@pytest.mark.parametrize(
    "args, pattern",
    [
        (['--lora.target_modules=["q_proj","qkv_proj"]'], r"lora.target_modules = .*unknown: \['qkv_proj'\]"),
        (["--lora.target_modules=[]"], r"lora.target_modules = \[\] must be a non-empty list"),
        (['--lora.target_modules=["q_proj","q_proj"]'], r"lora.target_modules .* without repeats"),
        (["--lora.rank=0"], r"lora.rank = 0 must be >= 1"),
        (["--lora.dropout=0.05"], r"lora.dropout = 0.05: dropout in the trainer's forward .* importance ratio"),
        (["--lora.engine_base=gpu"], r"lora.engine_base = 'gpu' must be one of \['auto', 'device', 'host'\]"),
        (["--job.stage=warmstart"], r"lora.enabled = true trains adapters in the RL stage"),
        (["--rl.mode=colocated"], r"lora.enabled = true is not supported with rl.mode = 'colocated'"),
        (
            ["--inference.engine=vllm", "--inference.vllm_weight_load=reload"],
            r"lora.enabled = true needs inference.vllm_weight_load",
        ),
    ],
)
def test_lora_values_and_rules_name_their_keys(args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(["--lora.enabled=true", *args])


def test_lora_defaults_target_every_linear_and_scale_alpha_over_rank():
    cfg = load_config(["--lora.enabled=true", "--lora.rank=8"])
    assert cfg.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert cfg.lora.scaling == 32.0 / 8
    assert not load_config([]).lora.enabled
