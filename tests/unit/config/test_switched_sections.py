"""A section with an `enabled` switch that is off: setting one of its keys alone is refused, naming the switch, the
same way for every such section (before: `--lora.rank=16` without `lora.enabled = true` ran full fine-tuning and
said nothing)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipelinerl_fsdp.config import Config, ConfigError
from pipelinerl_fsdp.configure import load_config


def switched_sections(obj: object = None, path: str = "") -> list[tuple[str, object]]:
    """Every (nested) section of the default config that has a boolean `enabled` field, with its object."""
    obj = Config() if obj is None else obj
    found = []
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub):
            name = f"{path}{f.name}"
            if isinstance(getattr(sub, "enabled", None), bool):
                found.append((name, sub))
            found += switched_sections(sub, name + ".")
    return found


def as_override(value: object) -> str:
    return json.dumps(value) if isinstance(value, (list, bool)) else str(value)


CASES = [
    (section, f.name, getattr(sub, f.name))
    for section, sub in switched_sections()
    for f in dataclasses.fields(sub)
    if f.name != "enabled" and not dataclasses.is_dataclass(getattr(sub, f.name))
]


def test_there_is_a_switched_section_to_check():
    assert "lora" in {s for s, _ in switched_sections()} and len(CASES) >= 6


@pytest.mark.parametrize("section, key, default", CASES, ids=[f"{s}.{k}" for s, k, _ in CASES])
def test_a_key_of_a_section_left_off_is_refused_naming_the_switch(section, key, default):
    arg = f"--{section}.{key}={as_override(default)}"
    with pytest.raises(ConfigError) as e:
        load_config([arg])
    msg = str(e.value)
    assert f"{section}.{key} is set (command line) but [{section}] is off ({section}.enabled = false)" in msg, msg
    assert f"set {section}.enabled = true" in msg
    cfg = load_config([f"--{section}.enabled=true", arg])  # switched on: accepted
    assert getattr(cfg, section).enabled is True


def test_lora_rank_alone_is_refused_on_the_command_line_and_in_a_file(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"lora\.rank is set \(command line\) but \[lora\] is off"):
        load_config(["--lora.rank=16"])
    toml = tmp_path / "job.toml"
    toml.write_text("[lora]\nrank = 8\n")
    with pytest.raises(ConfigError, match=rf"lora\.rank is set \({toml}\) but \[lora\] is off"):
        load_config(["--config", str(toml)])
    assert load_config(["--config", str(toml), "--lora.enabled=true"]).lora.rank == 8
    assert load_config(["--lora.enabled=false"]).lora.enabled is False  # the switch alone: fine
