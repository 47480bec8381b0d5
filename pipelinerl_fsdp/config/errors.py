"""The configuration's one error type, and the checks every section uses to report impossible values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration problem. The message names the key; the loader appends where the values came from (the
    files, the command line) once, at the boundary, so the code that finds a problem needs only the section."""


def failed(checks: Iterable[tuple[str, bool, str]]) -> list[tuple[str, str]]:
    """(key, what it must be) for each (key, ok, what) whose value is impossible: what a section's `check()`
    returns."""
    return [(key, what) for key, ok, what in checks if not ok]


def check_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    """A registry-backed key: `value` must name an entry of its registry (`choices`)."""
    choices = sorted(choices)
    if value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}")
