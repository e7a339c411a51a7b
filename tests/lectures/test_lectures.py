"""Rules every lecture keeps (CONTRIBUTING.md, "Adding or changing a lecture"), read from the notebooks."""

import json
import re
from pathlib import Path

import pytest

LECTURES = sorted((Path(__file__).resolve().parents[2] / "lectures").glob("*.ipynb"))
# A string literal that says two things are the same: "same weights:", "formula equals the count:", ...
CLAIM = re.compile(r'"[^"\n]*\b(equals?|equal to|same|match(es)?|unchanged|agree|bit-equal|within)\b[^"\n]*"', re.I)


def test_there_are_lectures():
    assert len(LECTURES) >= 3


@pytest.mark.parametrize("lecture", LECTURES, ids=[p.stem for p in LECTURES])
def test_every_printed_equality_claim_is_asserted_in_its_cell(lecture):
    cells = json.loads(lecture.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    unasserted = [src[:80] for src in code if CLAIM.search(src) and "assert" not in src]
    assert not unasserted, (
        f"{lecture.name}: cells that print an equality claim without asserting it (the notebook must fail "
        f"if the claim stops being true): {unasserted}"
    )
