"""Math answers checked with math-verify: the last `\\boxed{...}` of a completion against the gold answer.

`score_math_answer` is a reward function for the reward pool: it runs in a worker process's main thread, where
math-verify's own signal-based timeouts work; the pool adds a hard deadline around it (a hung or crashed worker
is replaced and the answer counts as `timeout` / `error`).
"""

from __future__ import annotations

import logging

# math-verify warns on every call when its timeouts are off; in a worker they are on, but keep it quiet anyway
logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the box was cut off


def parse_gold(gold: str, timeout_s: int = 5) -> list:
    """math-verify's parse of a gold answer (plain or LaTeX); empty if it cannot be parsed into an expression
    (no fallback to the raw string: a gold answer that math-verify cannot read could never be matched reliably)."""
    from math_verify import parse

    text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    return parse(text, fallback_mode="no_fallback", parsing_timeout=timeout_s)


def warm_up() -> None:
    """The first math-verify call builds its parsers (~1 s): done by each pool worker before it takes answers."""
    score_math_answer("\\boxed{\\frac{1}{2}}", "0.5")


def score_math_answer(completion: str, gold: str, timeout_s: int = 5) -> tuple[float, str]:
    """(reward, outcome): 1.0 "correct" when the last boxed answer equals the gold answer; otherwise 0.0 with
    "no_answer" (no box), "unparsable" (box or gold math-verify cannot read) or "wrong"."""
    from math_verify import parse, verify

    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0, "no_answer"
    gold_parsed = parse_gold(gold, timeout_s)
    answer = parse(f"\\boxed{{{boxed}}}", fallback_mode="no_fallback", parsing_timeout=timeout_s)
    if not gold_parsed or not answer:
        return 0.0, "unparsable"
    ok = verify(gold_parsed, answer, timeout_seconds=timeout_s)
    return (1.0, "correct") if ok else (0.0, "wrong")


def score_boxed_exact(completion: str, gold: str) -> tuple[float, str]:
    """(reward, outcome) by string equality of the last boxed answer and the gold answer, whitespace removed: the
    cheap baseline reward (no parsing, so `1/2` and `\\frac{1}{2}` differ); outcomes as `score_math_answer`."""
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0, "no_answer"
    same = "".join(boxed.split()) == "".join(gold.split())
    return (1.0, "correct") if same else (0.0, "wrong")
