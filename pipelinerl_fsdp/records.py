"""Records of counters and sums whose fields each say how values from several sources combine (`SUM` or `MAX`):
an engine's counters (`samples.EngineStats`) summed over the engines, a micro-batch's loss statistics
(`rl.loss.LossStats`) over micro-batches and trainer ranks. A field is a float or a tuple of floats (combined
element by element); a record travels as the flat list of its values (`values`, `from_values`), so that adding a
field is all it takes to count, send and reduce one more number."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

SUM, MAX = "sum", "max"
_COMBINE: dict[str, Callable[[float, float], float]] = {SUM: lambda a, b: a + b, MAX: max}

R = TypeVar("R")


def stat(reduce: str = SUM, size: int = 0, default: float | None = None) -> Any:
    """A dataclass field of a record, combined with `reduce` (`SUM` or `MAX`); its default is `default`, else the
    reduction's identity (0, or -inf for a maximum). `size` > 0: a tuple of that many floats, combined element by
    element."""
    if reduce not in _COMBINE:
        raise ValueError(f"unknown reduction {reduce!r}: one of {sorted(_COMBINE)}")
    start = default if default is not None else 0.0 if reduce == SUM else -math.inf
    meta = {"reduce": reduce, "size": size}
    if size:
        return dataclasses.field(default=(start,) * size, metadata=meta)
    return dataclasses.field(default=start, metadata=meta)


def reduction(f: dataclasses.Field) -> str:
    """How a record's field combines (`SUM` or `MAX`)."""
    return f.metadata["reduce"]


def values(record: Any, reduce: str | None = None) -> list[float]:
    """The record's values in field order, tuples spread out; only the fields combined with `reduce` if given."""
    out: list[float] = []
    for f in dataclasses.fields(record):
        if reduce is None or reduction(f) == reduce:
            v = getattr(record, f.name)
            if f.metadata["size"]:
                out.extend(float(x) for x in v)
            else:
                out.append(float(v))
    return out


def from_values(record: R, flat: list[float], reduce: str | None = None) -> R:
    """A copy of `record` whose fields (those combined with `reduce` if given) take their values from `flat`, in the
    order `values` gives them."""
    want = len(values(record, reduce))
    if len(flat) != want:
        raise ValueError(f"{len(flat)} values for the {want} of a {type(record).__name__}")
    it = iter(flat)
    new: dict[str, Any] = {}
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        if reduce is None or reduction(f) == reduce:
            n = f.metadata["size"]
            new[f.name] = tuple(next(it) for _ in range(n)) if n else next(it)
    return dataclasses.replace(record, **new)  # type: ignore[type-var]


def combine(a: R, b: R) -> R:
    """Two records of one type combined field by field, each with its reduction."""
    new: dict[str, Any] = {}
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        op, x, y = _COMBINE[reduction(f)], getattr(a, f.name), getattr(b, f.name)
        new[f.name] = tuple(op(p, q) for p, q in zip(x, y)) if f.metadata["size"] else op(x, y)
    return dataclasses.replace(a, **new)  # type: ignore[type-var]


def total(records: Iterable[R], empty: R) -> R:
    """`records` combined, in order, onto `empty` (the record of no source: every field its identity)."""
    out = empty
    for r in records:
        out = combine(out, r)
    return out


def reductions(record_type: type) -> list[str]:
    """The reductions a record type's fields use, in the order of their first field."""
    return list(dict.fromkeys(reduction(f) for f in dataclasses.fields(record_type)))


def positions(record_type: type, reduce: str) -> list[int]:
    """Indices, in a record's `values`, of the values its fields combined with `reduce` give."""
    out: list[int] = []
    i = 0
    for f in dataclasses.fields(record_type):
        n = f.metadata["size"] or 1
        if reduction(f) == reduce:
            out.extend(range(i, i + n))
        i += n
    return out
