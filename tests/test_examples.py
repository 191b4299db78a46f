"""The recipes' data generators write what their READMEs promise."""

from __future__ import annotations

from pathlib import Path

from turnrl.loading import load_module

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_every_generated_gsm8k_problem_has_a_non_negative_integer_answer():
    gsm8k = load_module(str(EXAMPLES / "gsm8k_tools" / "prepare_data.py"), what="gsm8k data")
    rows = [row for seed in range(5) for row in gsm8k.generated_rows(400, seed)]
    answers = [row["answer"] for row in rows]
    assert all(a.isdigit() for a in answers), [a for a in answers if not a.isdigit()][:5]
    assert all(row["tools_kwargs"]["check_answer"]["create_kwargs"]["ground_truth"] == row["answer"] for row in rows)
