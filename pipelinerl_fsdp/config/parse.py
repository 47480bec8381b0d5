"""Reading the configuration: TOML files layered in order, `--section.key=value` overrides typed through the
schema's annotations, the variants (task, loss, engine) selected before their keys apply, then every section's
checks and the cross-key rules; and writing the resolved configuration back as TOML.

Unknown sections or keys, wrong types and impossible values are errors that name the key and where it came from
(the file, or the command line); nothing is silently defaulted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pipelinerl_fsdp.config.errors import ConfigError, check_choice
from pipelinerl_fsdp.config.rules import check_rules, resolve_defaults
from pipelinerl_fsdp.config.schema import Config, sections

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "a table (dict)"
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
    elif origin is dict:
        ok = isinstance(value, dict)
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


def _is_table(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


# Keys that moved, with where to: an old config fails naming the new key instead of "unknown key".
MOVED_KEYS = {
    "rl.loss": "the loss is its own section now: loss.name (reinforce -> reinforce_tis, ppo, grpo, ...; "
    "pipelinerl_fsdp/rl/objectives/)",
    "rl.is_clip": "now loss.is_clip (with loss.name = 'reinforce_tis')",
    "rl.ppo_eps": "now loss.eps_low and loss.eps_high (with loss.name = 'ppo', 'grpo', 'dr_grpo' or 'dapo')",
    "inference.recompute_kv_on_update": "now inference.kv_max_age: -1 keeps the KV cache (false), 0 recomputes it "
    "at every update (true), k >= 1 once it is more than k versions old",
}


def _apply_table(obj: Any, values: Any, path: str, source: str) -> None:
    """Set the keys of `values` (a TOML table) on the dataclass `obj`; sub-dataclasses are nested tables."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{path}] in {source} must be a table of keys, got {values!r}")
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        if f"{path}.{key}" in MOVED_KEYS:
            raise ConfigError(f"{path}.{key} in {source}: {MOVED_KEYS[f'{path}.{key}']}")
        if key not in hints:
            raise ConfigError(f"unknown key {path}.{key} in {source}; known keys of [{path}]: {', '.join(hints)}")
        if _is_table(hints[key]):
            _apply_table(getattr(obj, key), value, f"{path}.{key}", source)
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{path}.{key}", source))


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    known = sections()
    for sec, values in data.items():
        if sec not in known:
            raise ConfigError(f"unknown section [{sec}] in {source}; known sections: {', '.join(known)}")
        _apply_table(getattr(cfg, sec), values, sec, source)


def _parse_override_value(raw: str, tp: Any) -> Any:
    if tp is str:
        return raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # the type check then reports it against the key


def parse_overrides(args: list[str]) -> list[tuple[list[str], str]]:
    """`--section.key=value` / `--section.sub.key value` -> [(path parts, raw value)]."""
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
        out.append((name.split("."), raw))
        i += 1
    return out


def _override_as_table(section: Any, parts: list[str], raw: str) -> dict[str, Any]:
    """One command-line override of a key of `section` (the object of `parts[0]`) as the nested table a TOML file
    would hold (typed through the annotation)."""
    obj: Any = section
    tp: Any = str
    for j, key in enumerate(parts[1:], 1):
        hints = typing.get_type_hints(type(obj))
        if key not in hints:
            break  # reported by _apply_table with the known keys
        tp = hints[key]
        if j < len(parts) - 1:
            obj = getattr(obj, key)
    value: Any = _parse_override_value(raw, tp)
    for key in reversed(parts):
        value = {key: value}
    return value


def resolve_config_path(name: str) -> Path:
    """A path to a TOML file, or a name (with or without .toml) under train_configs/."""
    candidates = [Path(name), REPO_CONFIG_DIR / name, REPO_CONFIG_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"--config {name}: no such file (looked at {', '.join(str(c) for c in candidates)})")


def _variant(key: str, name: Any, source: str, classes: Mapping[str, type]) -> Any:
    """The section that `key` ("task.name", "loss.name", "inference.engine") selects: the named entry's own config
    class with its defaults (the values are applied after)."""
    if not isinstance(name, str):
        raise ConfigError(f"{key}: expected str, got {name!r} ({source})")
    try:
        check_choice(key, name, classes)
    except ConfigError as e:
        raise ConfigError(f"{e} ({source})") from None
    return classes[name]()


def _take_config_arg(argv: list[str]) -> str | None:
    """Remove `--config NAME` / `--config=NAME` from argv; returns NAME."""
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("command line: --config has no value")
            name = argv[i + 1]
            del argv[i : i + 2]
            return name
        if a.startswith("--config="):
            del argv[i]
            return a.split("=", 1)[1]
    return None


def parse_config(argv: list[str], variants: Mapping[str, Mapping[str, type]]) -> Config:
    """`[--config PATH_OR_NAME ...] [--section.key=value ...]` -> Config, with every section's own checks and the
    cross-key rules (a `ConfigError` names the key and, appended here once, where the values came from). Files are
    applied in the order given, overrides after them. `variants`: for each selector key ("task.name", "loss.name",
    "inference.engine"), the config class of each registered entry, which replaces its section's class.
    The job loads its configuration with `configure.load_config`, which passes the registries."""
    argv = list(argv)
    cfg = Config()
    layers: list[tuple[dict[str, Any], str]] = []  # (table, source), applied in order
    # several --config files are layered in order (a later one wins): e.g. a job, then a loss preset over it
    while (name := _take_config_arg(argv)) is not None:
        path = resolve_config_path(name)
        try:
            with open(path, "rb") as f:
                layers.append((tomllib.load(f), str(path)))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    overrides = parse_overrides(argv)
    # A task's, a loss's and an engine's keys depend on which: select each (the last name given wins) before
    # applying any key.
    for key, classes in variants.items():
        section, selector = key.split(".")
        name, name_source = getattr(getattr(cfg, section), selector), "defaults"
        for data, source in layers:
            if isinstance(data.get(section), dict) and selector in data[section]:
                name, name_source = data[section][selector], source
        for parts, raw in overrides:
            if parts == [section, selector]:
                name, name_source = raw, "command line"
        setattr(cfg, section, _variant(key, name, name_source, classes))
    for data, source in layers:
        _apply(cfg, data, source)
    for parts, raw in overrides:
        if parts[0] not in sections():
            raise ConfigError(
                f"unknown section [{parts[0]}] in command line --{'.'.join(parts)}; known sections: "
                f"{', '.join(sections())}"
            )
        _apply(cfg, _override_as_table(getattr(cfg, parts[0]), parts, raw), "command line")
    sources = [src for _, src in layers] + (["command line"] if overrides else [])
    cfg.source = " + ".join(sources) or "defaults"
    resolve_defaults(cfg.rl, cfg.loss)
    given = [(".".join(parts), "command line") for parts, _ in overrides]
    given = [(key, source) for data, source in layers for key in _given_keys(data, "")] + given
    try:
        check_sections(cfg, given)
        check_rules(cfg)
    except ConfigError as e:
        raise ConfigError(f"{e} ({cfg.source})") from None
    return cfg


def _given_keys(table: dict[str, Any], prefix: str) -> list[str]:
    """Every key a TOML table sets, dotted ('lora.rank')."""
    keys = []
    for key, value in table.items():
        if isinstance(value, dict):
            keys += _given_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def check_switched_section(section: Any, path: str, given: list[tuple[str, str]]) -> None:
    """A section with an `enabled` switch ([lora]) that is off: a key of it set in a file or on the command line
    (`given`: dotted keys under `path`, with their source) would do nothing, silently. Refused, naming the switch
    (the same rule for every such section, nested ones included)."""
    for key, source in given:
        parts = key.split(".")
        obj: Any = section
        for depth in range(1, len(parts)):  # obj: the table of parts[:depth]
            if not dataclasses.is_dataclass(obj):
                break
            name = ".".join([path, *parts[1:depth]])
            if parts[depth] != "enabled" and getattr(obj, "enabled", None) is False:
                raise ConfigError(
                    f"{key} is set ({source}) but [{name}] is off ({name}.enabled = false), so it would do "
                    f"nothing: set {name}.enabled = true to use it, or remove {key}"
                )
            obj = getattr(obj, parts[depth], None)


def check_sections(cfg: Config, given: list[tuple[str, str]] | None = None) -> None:
    """Every section's (and nested section's) own `check()`: the first impossible value, named; then a key set
    (`given`: dotted keys with their source) in a section that is switched off (`check_switched_section`)."""
    for name in sections():
        _check_tree(getattr(cfg, name), name)
    for name in sections():
        mine = [(k, src) for k, src in given or [] if k.split(".")[0] == name]
        check_switched_section(getattr(cfg, name), name, mine)


def _check_tree(obj: Any, path: str) -> None:
    for key, what in obj.check() if hasattr(obj, "check") else []:
        raise ConfigError(f"{path}.{key} = {getattr(obj, key)!r} must be {what}")
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub):
            _check_tree(sub, f"{path}.{f.name}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_table(obj: Any, path: str, lines: list[str]) -> None:
    lines.append(f"\n[{path}]")
    subs = []
    off = getattr(obj, "enabled", None) is False  # a section switched off: its other keys as comments (a key of
    for f in dataclasses.fields(obj):  # it set while off is refused on loading, see check_switched_section)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            subs.append((f.name, value))
        else:
            lines.append(f"{'# ' if off and f.name != 'enabled' else ''}{f.name} = {_toml_value(value)}")
    for name, value in subs:
        _toml_table(value, f"{path}.{name}", lines)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (loads back to an equal Config)."""
    lines = [f"# resolved from: {cfg.source}"]
    for sec in sections():
        _toml_table(getattr(cfg, sec), sec, lines)
    return "\n".join(lines) + "\n"


def save_resolved(cfg: Config, folder: str | Path) -> Path:
    """Write `config.toml` (the resolved configuration) into the run's output folder."""
    path = Path(folder) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))
    return path
