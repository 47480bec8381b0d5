"""Cost models from a measured profile: a JSON file the micro-benchmarks write, and the least-squares fits that
turn measured points into `DecodeCost` / `TrainCost`.

The file (every section optional; times in seconds, sizes in tokens or bytes):

    {
      "hardware": "1x H100 SXM 80GB, vLLM 0.x, CUDA graphs on",   # free text: what was measured
      "command": "python -m benchmarks.engine_cost ...",           # how to measure it again
      "decode": {"base_s": ..., "per_seq_s": ..., "per_kv_s": ..., "prefill_per_token_s": ...,
                 "points": [[live_seqs, kv_sum, seconds], ...]},
      "train": {"step_base_s": ..., "per_token_s": ..., "per_micro_batch_s": ..., "per_token_ctx_s": ...,
                "ranks": 1, "micro_batch_tokens": 4096,
                "points": [[tokens, micro_batches, seconds], ...]},
      "push": {"bytes": ..., "bucket_bytes": ..., "link_bytes_per_s": ..., "gather_bytes_per_s": ...,
               "per_bucket_s": ..., "load_base_s": ..., "load_per_byte_s": ...}
    }

A "decode" or "train" section with its coefficients uses them (its points, if any, are only checked against
them: `Profile.fits`); one with points and no coefficients is fitted from them (`fit_decode`, `fit_train`;
coefficients the points cannot tell apart stay at the values given, e.g. prefill_per_token_s). A decode point may
carry a fourth number, the prompt tokens prefilled in that step ([live, kv_sum, prefill_tokens, seconds]); a
train point the summed squared sequence lengths ([tokens, micro_batches, sq_sum, seconds]).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipelinerl_fsdp.perf.costs import DecodeCost, PushCost, TrainCost

DECODE_KEYS = ("base_s", "per_seq_s", "per_kv_s", "prefill_per_token_s")
TRAIN_KEYS = ("step_base_s", "per_token_s", "per_micro_batch_s", "per_token_ctx_s")


@dataclass(frozen=True)
class Fit:
    """A least-squares fit: its coefficients, and each point's residual (model - measured, seconds) and relative
    residual (over the measured time)."""

    coefficients: dict[str, float]
    residuals: tuple[float, ...]
    relative: tuple[float, ...]

    @property
    def rms_rel(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.relative)))) if self.relative else float("nan")

    @property
    def max_rel(self) -> float:
        return float(np.max(np.abs(self.relative))) if self.relative else float("nan")


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, exactly, by trying every subset of free columns (a few columns only: a cost
    model has 3-4 coefficients, so 8-16 ordinary least squares)."""
    m, n = a.shape
    if n > 6:
        raise ValueError(f"nonnegative_lstsq: {n} columns; this exhaustive solver is for a few")
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err - 1e-18 * max(best_err, 1.0):
                full = np.zeros(n)
                full[list(cols)] = x
                best, best_err = full, err
    return best


def _fit(columns: list[str], x: np.ndarray, y: np.ndarray, relative: bool) -> tuple[dict[str, float], np.ndarray]:
    if len(y) < len(columns):
        raise ValueError(f"a fit of {len(columns)} coefficients needs at least as many points, got {len(y)}")
    if np.any(y <= 0):
        raise ValueError("measured times must be > 0")
    w = 1 / y if relative else np.ones_like(y)  # relative: each point's error as a fraction of its time
    coef = nonnegative_lstsq(x * w[:, None], y * w)
    return dict(zip(columns, map(float, coef))), x @ coef - y


def _points(points: Any, what: str) -> np.ndarray:
    arr = np.asarray(points, dtype=float)
    if arr.ndim != 2 or arr.shape[1] not in (3, 4) or not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} points must be rows of 3 or 4 finite numbers, got shape {arr.shape}")
    return arr


def fit_decode(points: Any, relative: bool = True, prefill_per_token_s: float = 0.0) -> tuple[DecodeCost, Fit]:
    """DecodeCost from measured steps [(live_seqs, kv_sum, seconds)] (or with prefill tokens third): non-negative
    least squares of seconds on [1, live, kv_sum (, prefill)]; `relative`: minimise relative errors (steps of
    1 ms and 100 ms count alike)."""
    p = _points(points, "decode")
    cols = ["base_s", "per_seq_s", "per_kv_s"] + (["prefill_per_token_s"] if p.shape[1] == 4 else [])
    x = np.column_stack([np.ones(len(p)), p[:, :-1]])
    coef, res = _fit(cols, x, p[:, -1], relative)
    coef.setdefault("prefill_per_token_s", prefill_per_token_s)
    if coef["base_s"] + coef["per_seq_s"] <= 0:
        raise ValueError("fit_decode: the points give a step that takes no time (base_s = per_seq_s = 0)")
    return DecodeCost(**coef), Fit(coef, tuple(map(float, res)), tuple(map(float, res / p[:, -1])))


def fit_train(
    points: Any, ranks: int = 1, micro_batch_tokens: int = 4096, relative: bool = True
) -> tuple[TrainCost, Fit]:
    """TrainCost from measured steps [(tokens, micro_batches, seconds)] (or with sum(len^2) third): non-negative
    least squares of seconds on [1, tokens, micro_batches (, sq_sum / 2)]."""
    p = _points(points, "train")
    cols = ["step_base_s", "per_token_s", "per_micro_batch_s"] + (["per_token_ctx_s"] if p.shape[1] == 4 else [])
    x = np.column_stack([np.ones(len(p)), p[:, :-1]])
    if p.shape[1] == 4:
        x[:, 3] /= 2  # the model's term is per_token_ctx_s * sq_sum / 2
    coef, res = _fit(cols, x, p[:, -1], relative)
    cost = TrainCost(**coef, ranks=ranks, micro_batch_tokens=micro_batch_tokens)
    return cost, Fit(coef, tuple(map(float, res)), tuple(map(float, res / p[:, -1])))


def _residuals(predict: Any, p: np.ndarray, coef: dict[str, float]) -> Fit:
    model = np.array([predict(*row[:-1]) for row in p])
    res = model - p[:, -1]
    return Fit(coef, tuple(map(float, res)), tuple(map(float, res / p[:, -1])))


@dataclass(frozen=True)
class Profile:
    """A measured profile: the costs it gives (None: the section is absent) and, per section with points, how
    the costs fit them."""

    decode: DecodeCost | None = None
    train: TrainCost | None = None
    push: PushCost | None = None
    hardware: str = ""
    command: str = ""
    fits: dict[str, Fit] = field(default_factory=dict)


def read_profile(data: dict[str, Any], source: str = "profile") -> Profile:
    """A `Profile` from the parsed JSON (see the module docstring); errors name `source` and the section."""
    unknown = set(data) - {"hardware", "command", "decode", "train", "push"}
    if unknown:
        raise ValueError(f"{source}: unknown sections {sorted(unknown)}")
    fits: dict[str, Fit] = {}
    decode = train = push = None
    try:
        if "decode" in data:
            d = dict(data["decode"])
            points = d.pop("points", None)
            if any(k in d for k in DECODE_KEYS[:3]):
                decode = DecodeCost(**d)
                if points:
                    p = _points(points, "decode")
                    fits["decode"] = _residuals(decode.step_s, p, {k: d.get(k, 0.0) for k in DECODE_KEYS})
            elif points:
                decode, fits["decode"] = fit_decode(points, prefill_per_token_s=d.get("prefill_per_token_s", 0.0))
            else:
                raise ValueError("neither coefficients nor points")
        if "train" in data:
            t = dict(data["train"])
            points = t.pop("points", None)
            shape = {k: t.pop(k) for k in ("ranks", "micro_batch_tokens") if k in t}
            if any(k in t for k in TRAIN_KEYS[:2]):
                train = TrainCost(**t, **shape)
                if points:
                    p = _points(points, "train")
                    fits["train"] = _residuals(train.step_s, p, {k: t.get(k, 0.0) for k in TRAIN_KEYS})
            elif points:
                train, fits["train"] = fit_train(points, **shape)
            else:
                raise ValueError("neither coefficients nor points")
        if "push" in data:
            push = PushCost(**data["push"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None
    return Profile(decode, train, push, str(data.get("hardware", "")), str(data.get("command", "")), fits)


def load_profile(path: str | Path) -> Profile:
    """Read a profile file (JSON, the module docstring's format)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"profile {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {path}: the top level must be an object")
    return read_profile(data, str(path))


def profile_dict(profile: Profile, points: dict[str, list[list[float]]] | None = None) -> dict[str, Any]:
    """The JSON form of `profile` (with the measured `points` per section, if given): what `load_profile` reads."""
    out: dict[str, Any] = {"hardware": profile.hardware, "command": profile.command}
    for name in ("decode", "train", "push"):
        cost = getattr(profile, name)
        if cost is not None:
            out[name] = asdict(cost) | ({"points": points[name]} if points and name in points else {})
    return out


def save_profile(path: str | Path, profile: Profile, points: dict[str, list[list[float]]] | None = None) -> None:
    """Write `profile` (and its points) as JSON."""
    Path(path).write_text(json.dumps(profile_dict(profile, points), indent=1) + "\n")
