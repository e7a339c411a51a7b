"""Solution regions are stripped into stubs that name their task, in .py files and notebooks."""

import json

import pytest

from course_lib.grading.starters import strip_notebook, strip_source, with_index

SOURCE = '''def f(x):
    """Doc."""
    # BEGIN SOLUTION Task 1: double it
    y = 2 * x
    return y
    # END SOLUTION


def g():
    # BEGIN SOLUTION
    # STUB: return None
    return 42
    # END SOLUTION
'''


def test_region_becomes_a_stub_naming_the_task():
    out = strip_source(SOURCE)
    assert "2 * x" not in out and "42" not in out, "no solution code may survive in a starter"
    assert "    raise NotImplementedError('Task 1: double it')\n" in out
    assert "    return None\n" in out, "STUB lines replace the region when given"
    namespace = {}
    exec(out, namespace)
    with pytest.raises(NotImplementedError, match="Task 1"):
        namespace["f"](1)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
        ("x = 1\n# END SOLUTION\n", "without a '# BEGIN SOLUTION'"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "cannot nest"),
    ],
)
def test_malformed_markers_are_reported(bad, why):
    with pytest.raises(ValueError, match=why):
        strip_source(bad, "lab.py")


def test_notebook_cells_are_stripped_and_their_outputs_cleared():
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "source": SOURCE.splitlines(keepends=True),
                "outputs": [{"text": "84"}],
                "execution_count": 3,
                "metadata": {},
            },
            {"cell_type": "markdown", "source": ["# BEGIN SOLUTION is only code"], "metadata": {}},
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    out = json.loads(strip_notebook(json.dumps(nb)))
    code = "".join(out["cells"][0]["source"])
    assert "42" not in code and out["cells"][0]["outputs"] == [], "outputs could leak the answer"
    assert out["cells"][1]["source"] == ["# BEGIN SOLUTION is only code"]


def test_starters_never_point_into_solutions(tmp_path):
    from course_lib.grading.starters import generate

    (tmp_path / "solutions" / "accelerate").mkdir(parents=True)
    (tmp_path / "solutions" / "accelerate" / "ds.yaml").write_text(
        "deepspeed_config_file: solutions/deepspeed/zero3.json\n"
    )
    generate(tmp_path / "solutions", tmp_path / "labs")
    assert (
        tmp_path / "labs" / "accelerate" / "ds.yaml"
    ).read_text() == "deepspeed_config_file: labs/deepspeed/zero3.json\n"


def test_the_learner_sees_a_fenced_region_per_task_and_an_index_with_its_lines():
    source = '"""A lab."""\n\nimport math\n\n\n' + SOURCE
    out = with_index(strip_source(source))
    lines = out.splitlines()
    assert lines[2] == '# Your code goes in the fenced "Task N — your code" regions of this file:', out
    rows = [line for line in lines if line.startswith("#   line ")]
    assert len(rows) == 2, f"one index row per region: {rows}"
    for row in rows:
        at = int(row.split()[2].rstrip(":"))
        assert "your code" in lines[at - 1] and lines[at - 1].lstrip().startswith("# ━━"), (
            f"the index must point at its region's opening fence: {row!r} -> line {at}: {lines[at - 1]!r}"
        )
    assert "Task 1: double it" in rows[0] and "your code" in rows[1]
    assert "    # ━━ Task 1 — your code: double it ━━" in lines and "    # ━━ end of Task 1 ━━" in lines
    compile(out, "starter.py", "exec")  # still Python


def test_one_lab_regenerates_without_touching_the_others(tmp_path):
    from course_lib.grading.starters import generate

    for lab in ("lab01_a", "lab02_b"):
        (tmp_path / "solutions" / lab).mkdir(parents=True)
        (tmp_path / "solutions" / lab / "x.py").write_text(SOURCE)
    generate(tmp_path / "solutions", tmp_path / "labs")
    (tmp_path / "labs" / "lab02_b" / "x.py").write_text("# the learner's work\n")
    (tmp_path / "solutions" / "lab01_a" / "x.py").write_text("x = 1\n")
    generate(tmp_path / "solutions", tmp_path / "labs", only="lab01_a")
    assert (tmp_path / "labs" / "lab01_a" / "x.py").read_text() == "x = 1\n"
    assert (tmp_path / "labs" / "lab02_b" / "x.py").read_text() == "# the learner's work\n", (
        "only= must stay in its lab"
    )
