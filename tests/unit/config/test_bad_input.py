"""Bad input where a user types or points: every checked config key's impossible value, and every file the job
reads (model folder, tokenizer, checkpoint) missing, empty or corrupt, is an error that names the key or the file."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipelinerl_fsdp.checkpoint_layout import damage, newest_intact
from pipelinerl_fsdp.config import ConfigError, sections
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.engine_kinds import engine_configs
from pipelinerl_fsdp.models.hf_io import read_model_args, read_state_dict
from pipelinerl_fsdp.rl.objectives import CONFIGS as LOSS_CONFIGS
from pipelinerl_fsdp.tasks import TASKS
from pipelinerl_fsdp.tokenizer import load_tokenizer


def _ck(cfg):
    """`resume_point`'s arguments: the checkpoint section and the job's output folder."""
    return cfg.checkpoint, cfg.job.output_dir


# numeric keys where every value of the type is meaningful
ANY_VALUE = {("job", "seed")}
CANDIDATES = (-1, 0, -0.5, 1.5, 2, 0.5, -2, -3, 5, 1e9)
# each section's classes: the schema's, and every variant a registry puts in its place (an engine's, a task's, a
# loss's own config class)
VARIANTS = {"inference": [*engine_configs().values()], "task": [t.config_class for t in TASKS.values()]}
VARIANTS["loss"] = [*LOSS_CONFIGS.values()]
# the command line that selects a variant
SELECT = {**{c: [f"--inference.engine={n}"] for n, c in engine_configs().items()}}


def section_classes() -> list[tuple[str, type]]:
    return [(s, c) for s, tp in sections().items() for c in VARIANTS.get(s, [tp])]


def numeric_keys() -> list[tuple[str, type, str]]:
    """(section, its class, key) of every int or float key of every section class, variants included."""
    out = []
    for section, cls in section_classes():
        hints = typing.get_type_hints(cls)
        out += [(section, cls, f.name) for f in dataclasses.fields(cls) if hints[f.name] in (int, float)]
    return out


def rejected_value(cls: type, key: str) -> object | None:
    """A value of `key` that the section's own `check()` names as impossible (None: every candidate is fine)."""
    default = getattr(cls(), key)
    for v in CANDIDATES:
        if isinstance(v, type(default)) and key in {k for k, _ in cls(**{key: v}).check()}:
            return v
    return None


# loss keys whose -1 means "off": -2 is their first impossible negative value
LOSS_OFF_AT_MINUS_ONE = {"max_token_lag"}


def test_every_numeric_key_has_a_range_check():
    """A numeric key added without a check would accept nonsense (a negative batch size) silently: each section's
    `check()`, and each engine's, task's and loss's own config class's, names every numeric key (seeds aside) set to
    some impossible value; a task's or a loss's, -1 itself (-2 where -1 means off)."""
    unchecked = []
    for s, c, k in numeric_keys():
        if (s, k) in ANY_VALUE or k.endswith("seed"):
            continue
        if s in ("task", "loss"):
            bad = -2 if k in LOSS_OFF_AT_MINUS_ONE else -1
            if k not in {key for key, _ in c(**{k: bad}).check()}:
                unchecked.append(f"{s}.{k} = {bad} ({c.__name__})")
        elif rejected_value(c, k) is None:
            unchecked.append(f"{s}.{k} ({c.__name__})")
    assert unchecked == [], f"add a check to the section's check() (or to ANY_VALUE here): {unchecked}"


@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_loss_max_token_lag_takes_off_or_a_lag_and_names_itself_otherwise(name):
    """-1 (off) and every lag >= 0 load under every loss; -2 is a ConfigError naming loss.max_token_lag."""
    for ok in (-1, 0, 7):
        assert load_config([f"--loss.name={name}", f"--loss.max_token_lag={ok}"]).loss.max_token_lag == ok
    with pytest.raises(ConfigError) as e:
        load_config([f"--loss.name={name}", "--loss.max_token_lag=-2"])
    assert "loss.max_token_lag = -2 must be >= 0, or -1 (off)" in str(e.value) and "command line" in str(e.value)


CHECKED = [
    (s, c, k)
    for s, c, k in numeric_keys()
    if s not in ("task", "loss") and not k.endswith("seed") and rejected_value(c, k) is not None
] + [
    (s, c, f.name) for s, c in section_classes() if s == "warmstart" for f in dataclasses.fields(c) if f.name == "path"
]


# the whole error a user sees for a few keys, written out by hand (not read back from the sections' checks)
EXPECTED = {
    ("rl", "batch_size"): "rl.batch_size = -1 must be >= 1 (command line)",
    ("world", "timeout_s"): "world.timeout_s = -1 must be >= 10 seconds (command line)",
    ("lora", "dropout"): "lora.dropout = -0.5 must be in [0, 1) (command line)",
    ("warmstart", "path"): "warmstart.path = '' must be a non-empty folder path (command line)",
    ("inference", "temperature"): (
        "inference.temperature = -0.5 must be > 0 (log-probs of a greedy policy are undefined) (command line)"
    ),
    ("inference", "kv_max_age"): (
        "inference.kv_max_age = -2 must be >= -1 (-1: keep the KV cache; k >= 0: recompute it when older) "
        "(command line)"
    ),
}


def test_the_hand_written_messages_are_of_checked_keys():
    assert set(EXPECTED) <= {(s, k) for s, _, k in CHECKED}


@pytest.mark.parametrize("section, cls, key", CHECKED, ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_an_impossible_value_names_its_key_and_what_it_must_be(section, cls, key):
    bad = "" if isinstance(getattr(cls(), key), str) else rejected_value(cls, key)
    must = dict(cls(**{key: bad}).check())[key]
    assert must.strip(), f"{section}.{key}: the check says nothing of what the value must be"
    with pytest.raises(ConfigError) as e:
        load_config([*SELECT.get(cls, []), f"--{section}.{key}={bad}"])
    if (section, key) in EXPECTED:
        assert str(e.value) == EXPECTED[section, key]
    assert f"{section}.{key} = " in str(e.value) and f" must be {must} (command line)" in str(e.value)


def typed_keys() -> list[tuple[str, str]]:
    """Per section, its first numeric or boolean key."""
    out = []
    for section, tp in sections().items():
        hints = typing.get_type_hints(tp)
        out += [(section, f.name) for f in dataclasses.fields(tp) if hints[f.name] in (int, float, bool)][:1]
    return out


@pytest.mark.parametrize("section, key", typed_keys())
def test_a_value_of_the_wrong_type_names_its_key(section, key):
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: expected .*got 'many'"):
        load_config([f"--{section}.{key}=many"])


# -- files ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def model_folder(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 32,
                "max_position_embeddings": 64,
            }
        )
    )
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8)}, str(d / "model.safetensors"))
    return d


def test_model_folder_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json; is .* an HF model folder"):
        read_model_args(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/config\.json: no config\.json"):
        read_model_args(tmp_path / "empty")


def test_model_config_corrupt_or_incomplete(model_folder):
    (model_folder / "config.json").write_text('{"hidden_size": 8,\n  oops}')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(line 2, column 3"):
        read_model_args(model_folder)
    (model_folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"config\.json: no 'vocab_size'"):
        read_model_args(model_folder)


def test_weights_missing_truncated_or_not_safetensors(model_folder):
    assert set(read_state_dict(model_folder)) == {"model.embed_tokens.weight"}
    weights = model_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        read_state_dict(model_folder)
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        read_state_dict(model_folder)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        read_state_dict(model_folder)


def test_a_shard_listed_in_the_index_but_missing(model_folder):
    (model_folder / "model.safetensors").rename(model_folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors: listed in .*index\.json"):
        read_state_dict(model_folder)
    (model_folder / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"index\.json: no 'weight_map'"):
        read_state_dict(model_folder)


def test_tokenizer_missing_empty_or_corrupt(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a tokenizer folder"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("garbage")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=rf"{tmp_path}: the tokenizer does not load"):
        load_tokenizer(tmp_path)


def test_checkpoint_folders_empty_partial_or_corrupt(tmp_path):
    assert newest_intact(tmp_path / "nowhere") == (None, [])
    partial = tmp_path / "step-0000004"
    partial.mkdir()
    assert "no meta.json" in (damage(partial) or "")
    (partial / "meta.json").write_text("{not json")
    assert "meta.json unreadable" in (damage(partial) or "")
    path, skipped = newest_intact(tmp_path)
    assert path is None and len(skipped) == 1 and "step-0000004" in skipped[0]


def test_resume_from_a_missing_or_partial_checkpoint_is_a_config_error(tmp_path):
    from pipelinerl_fsdp.checkpoint_layout import resume_point

    with pytest.raises(ConfigError, match=r"checkpoint\.resume_from = .*: no such folder"):
        resume_point(*_ck(load_config([f"--checkpoint.resume_from={tmp_path}/nowhere"])))
    (tmp_path / "step-0000002").mkdir()
    with pytest.raises(ConfigError, match=r"checkpoint\.resume_from = .*: incomplete"):
        resume_point(*_ck(load_config([f"--checkpoint.resume_from={tmp_path}/step-0000002"])))
    with pytest.raises(ConfigError, match=r"checkpoint\.resume = 'required' but .* holds no intact checkpoint"):
        resume_point(*_ck(load_config(["--checkpoint.resume=required", f"--checkpoint.folder={tmp_path}"])))


@pytest.mark.parametrize(
    "content, named",
    [
        (None, "no such file"),
        ('{"question": \n', "invalid JSON"),
        ('{"question": "2+2?"}\n', "missing field 'answer'"),
        ("", "no records"),
    ],
)
def test_a_bad_data_file_is_named_before_any_rank_starts(tmp_path, capsys, monkeypatch, content, named):
    """The launcher's config check reads the math task's files (`Task.check_files`) before torchrun starts, and
    every rank checks them before the world forms: a missing, malformed or field-less file is a config error
    naming it before any rank starts (it was named after ~34 s, by the warm start's rank, the other rank waiting
    on it)."""
    from pipelinerl_fsdp import launch, train

    path = tmp_path / "train.jsonl"
    if content is not None:
        path.write_text(content)
    args = ["--config", "math_tiny_cpu", f"--task.train_files=['{path}']", f"--job.output_dir={tmp_path / 'out'}"]
    assert launch.main(["max-restarts", *args]) == 2
    err = capsys.readouterr().err
    assert f"{path}" in err and named in err and "command line" in err

    def no_world(cfg):
        raise AssertionError("the world formed before the data files were checked")

    monkeypatch.setattr(train, "init_world", no_world)
    with pytest.raises(ConfigError, match=named):
        train.run(load_config(args))
