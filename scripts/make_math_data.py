"""Write the small math data sets the tests and CPU configs use (data/math/), in every supported layout.

    python scripts/make_math_data.py [--out data/math]

No math data set with answers ships on PyPI and nothing is fetched at run time, so the problems are generated
here from templates: GSM8K-style word problems (whole-number answers, a worked solution ending in "#### N") and
short algebra/fraction problems with MATH-style `\\boxed{}` solutions. Seeded: the same files every time. The
`datasets` folder needs the `datasets` package (the `test` extra).
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonah", "Kira", "Liam"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "shells", "cookies", "cards"]


def word_problem(rng: random.Random) -> dict[str, str]:
    """A GSM8K-style problem: question, worked answer ending in '#### N'."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    a, b, c = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 9)
    if kind == 0:
        q = f"{name} has {a} {item}. {friend} gives {name} {b} more. How many {item} does {name} have now?"
        steps, ans = [f"{name} has {a} + {b} = {a + b} {item}."], a + b
    elif kind == 1:
        a = a + b
        q = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} are left?"
        steps, ans = [f"{a} - {b} = {a - b} {item} are left."], a - b
    elif kind == 2:
        q = f"{name} buys {c} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        steps, ans = [f"{c} * {b} = {c * b} {item}."], c * b
    else:
        total = b * c
        q = (
            f"{name} shares {total} {item} equally among {c} friends and then finds {a} more. "
            f"How many {item} does each friend get if the ones found are kept by {name}?"
        )
        steps, ans = [f"Each friend gets {total} / {c} = {b} {item}."], b
    return {"question": q, "answer": "\n".join(steps) + f"\n#### {ans:,}"}


def algebra_problem(rng: random.Random) -> dict[str, str]:
    """A MATH-style problem whose solution ends in a boxed answer (integers, fractions, expressions)."""
    kind = rng.randrange(3)
    if kind == 0:
        a, x, b = rng.randint(2, 9), rng.randint(-9, 9), rng.randint(-20, 20)
        return {
            "problem": f"Solve for $x$: ${a}x + {b} = {a * x + b}$.",
            "solution": f"Subtract {b} and divide by {a}: $x = \\boxed{{{x}}}$.",
        }
    if kind == 1:
        p, q = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
        s = p + q
        ans = f"\\frac{{{s.numerator}}}{{{s.denominator}}}" if s.denominator != 1 else str(s.numerator)
        return {
            "problem": f"Compute $\\frac{{{p.numerator}}}{{{p.denominator}}} + "
            f"\\frac{{{q.numerator}}}{{{q.denominator}}}$ in lowest terms.",
            "solution": f"With a common denominator the sum is $\\boxed{{{ans}}}$.",
        }
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return {
        "problem": f"Expand $(x + {a})(x + {b})$.",
        "solution": f"$(x+{a})(x+{b}) = \\boxed{{x^2 + {a + b}x + {a * b}}}$.",
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "math")
    a = ap.parse_args()
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2026)
    gsm = [word_problem(rng) for _ in range(400)]
    write_jsonl(out / "gsm8k_train.jsonl", gsm[:320])
    write_jsonl(out / "gsm8k_test.jsonl", gsm[320:])
    alg = [algebra_problem(rng) for _ in range(120)]
    write_jsonl(out / "math_train.jsonl", alg[:80])
    write_jsonl(out / "math_test.jsonl", alg[80:])
    # ORZ / DeepScaleR layout: problem + bare answer, as parquet and as a `datasets` save_to_disk folder
    orz = [
        {"problem": r["question"], "answer": r["answer"].rsplit("####", 1)[1].strip().replace(",", "")}
        for r in gsm[:100]
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(orz), out / "orz.parquet")
    chat = [{"messages": [{"role": "user", "content": r["problem"]}], "answer": r["answer"]} for r in orz[:40]]
    write_jsonl(out / "messages.jsonl", chat)
    try:
        import datasets
    except ImportError:
        print("datasets is not installed: skipped orz_saved/ (pip install -e .[test])")
    else:
        datasets.Dataset.from_list(orz[:60]).save_to_disk(str(out / "orz_saved"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
