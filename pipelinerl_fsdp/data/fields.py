"""From a record to (question, gold answer, reference solution): field names and answer formats, with presets for
the common layouts.

  gsm8k     question / answer, the gold after "####" in the answer (GSM8K)
  math      problem / solution, the gold in the solution's last \\boxed{} (MATH, MATH-500)
  orz       problem / answer, the gold as is (Open-Reasoner-Zero, DeepScaleR, AIME sets)
  messages  chat `messages` (the last user turn is the question) / answer
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipelinerl_fsdp.data.files import Record
from pipelinerl_fsdp.rewards.math_answer import last_boxed

ANSWER_FORMATS = ("plain", "gsm8k", "boxed")


@dataclass(frozen=True)
class FieldSpec:
    question: str
    answer: str
    answer_format: str  # one of ANSWER_FORMATS
    solution: str = ""  # a worked solution for the supervised warm start ("": use the gold answer)


PRESETS: dict[str, FieldSpec] = {
    "gsm8k": FieldSpec("question", "answer", "gsm8k", solution="answer"),
    "math": FieldSpec("problem", "solution", "boxed", solution="solution"),
    "orz": FieldSpec("problem", "answer", "plain"),
    "messages": FieldSpec("messages", "answer", "plain"),
}


def field_spec(
    preset: str, question: str = "", answer: str = "", answer_format: str = "", solution: str = ""
) -> FieldSpec:
    """A preset with any of its fields overridden (empty strings keep the preset's)."""
    spec = PRESETS[preset]
    return replace(
        spec,
        question=question or spec.question,
        answer=answer or spec.answer,
        answer_format=answer_format or spec.answer_format,
        solution=solution or spec.solution,
    )


def gold_from(value: Any, fmt: str) -> str | None:
    """The gold answer inside a field's value, or None when it has none in that format."""
    if value is None:
        return None
    text = str(value).strip()
    if fmt == "gsm8k":
        if "####" not in text:
            return None
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    elif fmt == "boxed":
        boxed = last_boxed(text)
        if boxed is None:
            return None
        text = boxed.strip()
    return text or None


def question_from(value: Any, field: str) -> str | None:
    if field == "messages":
        if not isinstance(value, list):
            return None
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users and isinstance(users[-1], str) else None
    return value if isinstance(value, str) and value.strip() else None


def solution_text(fields: dict[str, Any], spec: FieldSpec, gold: str) -> str:
    """A supervised target: the worked solution (GSM8K's "####" line rewritten as a boxed answer), else the gold
    answer in a box."""
    sol = fields.get(spec.solution) if spec.solution else None
    if not isinstance(sol, str) or not sol.strip():
        return f"\\boxed{{{gold}}}"
    if spec.answer_format == "gsm8k" and "####" in sol:
        return sol.rsplit("####", 1)[0].rstrip() + f"\nThe answer is \\boxed{{{gold}}}."
    return sol


def problem_fields(record: Record, spec: FieldSpec) -> tuple[str, str, str] | str:
    """(question, gold, solution), or the reason the record is unusable."""
    f = record.fields
    if spec.question not in f:
        return f"missing field {spec.question!r}"
    if spec.answer not in f:
        return f"missing field {spec.answer!r}"
    question = question_from(f[spec.question], spec.question)
    if question is None:
        return f"field {spec.question!r} holds no question"
    gold = gold_from(f[spec.answer], spec.answer_format)
    if gold is None:
        return f"field {spec.answer!r} holds no {spec.answer_format} answer"
    return question, gold, solution_text(f, spec, gold)
