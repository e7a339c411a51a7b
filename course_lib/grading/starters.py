"""Labs have one source: ``solutions/``. The learner's starters in ``labs/`` are generated from it.

A solution region is marked in a ``.py`` file or in a notebook's code cell like this::

    def ring_all_reduce(tensor, group=None):
        # BEGIN SOLUTION Task 1: ring all-reduce from send/recv; returns nothing, sums into tensor
        ...the reference implementation...
        # END SOLUTION

The text after ``BEGIN SOLUTION`` starts with the task's number and says what the region must do
and return: the learner reads it. In the starter the region becomes a fenced "your code" region at
the region's indentation, holding ``raise NotImplementedError("Task 1: ...")`` so a test that reaches
it names the task::

        # ━━ Task 1 — your code: ring all-reduce from send/recv; returns nothing, sums into tensor ━━
        raise NotImplementedError('Task 1: ring all-reduce from send/recv; returns nothing, ...')
        # ━━ end of Task 1 ━━

and a ``.py`` starter opens (after its docstring) with an index of its regions and their lines.
Where raising is not what the starter should do, ``# STUB: <code>`` lines inside the region give the
starter's code instead. Every other file is copied as it is, except that a path into
``solutions/`` becomes the same path into ``labs/`` in every text file (a starter's config or
README must point at the learner's tree, never at the answers).

    python -m course_lib.grading.starters                # regenerate labs/ from solutions/
    python -m course_lib.grading.starters --lab lab09    # regenerate one lab's folder only
    python -m course_lib.grading.starters --check        # exit 1, listing files, when labs/ has drifted
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = re.compile(r"^(\s*)# BEGIN SOLUTION\s*(.*)$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
STUB = re.compile(r"^\s*# STUB: ?(.*)$")
SKIP = {"__pycache__", ".ipynb_checkpoints"}
NOT_A_LAB = {"lectures"}  # solutions/lectures/: the lectures' reference answers (grading/exercises.py)
TEXT = {".md", ".yaml", ".yml", ".json", ".txt", ".cfg", ".toml"}
TASK = re.compile(r"^Tasks? ([0-9]+(?:[-+][0-9]+)?)\b")
FENCE = "━━"
INDEX_HEAD = '# Your code goes in the fenced "Task N — your code" regions of this file:\n'


def _label(task: str) -> str:
    """'Task 1' for a region whose text starts with its task, else 'your code' alone."""
    m = TASK.match(task)
    return f"Task {m[1]}" if m else ""


def _fence(indent: str, task: str, stubs: list[str]) -> list[str]:
    """The starter's region: an opening fence with the task's text, the stub, a closing fence."""
    label = _label(task)
    text = task[len(label) :].lstrip(": ") if label else task
    head = f"{label} — your code" if label else "your code"
    return [
        f"{indent}# {FENCE} {head}: {text} {FENCE}\n",
        *(f"{indent}{s}\n" for s in stubs),
        f"{indent}# {FENCE} end of {label or 'your code'} {FENCE}\n",
    ]


def strip_source(text: str, where: str = "<source>") -> str:
    """Replace every marked solution region of a piece of Python source by its stub."""
    out: list[str] = []
    region: list[str] | None = None
    indent = task = ""
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        if region is None:
            m = BEGIN.match(line)
            if m:
                region, indent, task = [], m[1], m[2].strip() or "solution removed"
            else:
                if END.match(line):
                    raise ValueError(f"{where}:{n}: '# END SOLUTION' without a '# BEGIN SOLUTION' before it")
                out.append(line)
        elif END.match(line):
            stubs = [STUB.match(text)[1] for text in region if STUB.match(text)]
            if not stubs:
                stubs = [f"raise NotImplementedError({task!r})"]
            out.extend(_fence(indent, task, stubs))
            region = None
        else:
            if BEGIN.match(line):
                raise ValueError(f"{where}:{n}: solution regions cannot nest")
            region.append(line)
    if region is not None:
        raise ValueError(f"{where}: '# BEGIN SOLUTION' is never closed by '# END SOLUTION'")
    return "".join(out)


def with_index(source: str) -> str:
    """Put an index of the fenced regions (task, what it asks, line) after the module docstring."""
    lines = source.splitlines(keepends=True)
    opening = f"# {FENCE} "
    fences = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if text.startswith(opening) and "your code" in text and not text.startswith(opening + "end of"):
            fences.append((n, text.removeprefix(opening).removesuffix(f" {FENCE}").replace(" — your code", "")))
    if not fences:
        return source
    body = ast.parse(source).body
    docstring = body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str)
    at = body[0].end_lineno if docstring else 0
    before = ["\n"] if docstring else []
    after = [] if at < len(lines) and not lines[at].strip() else ["\n"]
    shift = len(before) + 1 + len(fences) + len(after)
    index = [INDEX_HEAD, *(f"#   line {n + shift}: {text}\n" for n, text in fences)]
    return "".join(lines[:at] + before + index + after + lines[at:])


def strip_notebook(text: str, where: str = "<notebook>") -> str:
    """Strip solution regions from every code cell; clear outputs so no answer leaks through them."""
    nb = json.loads(text)
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        stripped = strip_source(source, f"{where} cell {i}")
        if stripped != source:
            cell["source"] = stripped.splitlines(keepends=True)
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def generate(solutions: Path, labs: Path, only: str | None = None) -> None:
    """Write the starter tree for every lab under ``solutions`` into ``labs`` (or only the folder ``only``)."""
    target = labs / only if only else labs
    if target.exists():
        shutil.rmtree(target)
    for src in sorted((solutions / only if only else solutions).rglob("*")):
        if src.is_dir() or SKIP & set(src.parts) or src.relative_to(solutions).parts[0] in NOT_A_LAB:
            continue
        dst = labs / src.relative_to(solutions)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".py":
            dst.write_text(_to_labs(with_index(strip_source(src.read_text(), str(src)))))
        elif src.suffix == ".ipynb":
            dst.write_text(_to_labs(strip_notebook(src.read_text(), str(src))))
        elif src.suffix in TEXT:
            dst.write_text(_to_labs(src.read_text()))
        else:
            shutil.copy2(src, dst)


def _to_labs(text: str) -> str:
    return text.replace("solutions/", "labs/")


def drift(solutions: Path = ROOT / "solutions", labs: Path = ROOT / "labs") -> list[str]:
    """Files of ``labs`` that differ from what ``generate`` would write (empty when in sync)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "labs"
        generate(solutions, fresh)
        want = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
        have = {p.relative_to(labs) for p in labs.rglob("*") if p.is_file() and not SKIP & set(p.parts)}
        changed = [str(p) for p in sorted(want & have) if (fresh / p).read_bytes() != (labs / p).read_bytes()]
        return sorted(changed + [f"{p} (missing)" for p in want - have] + [f"{p} (extra)" for p in have - want])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report drift, write nothing")
    parser.add_argument("--lab", help="regenerate one lab's folder only (lab09 or lab09_kv_cache)")
    args = parser.parse_args(argv)
    if args.check:
        files = drift()
        if files:
            print(
                "labs/ has drifted from solutions/ — run `python -m course_lib.grading.starters`:\n  "
                + "\n  ".join(files)
            )
            return 1
        print("labs/ is in sync with solutions/")
        return 0
    if args.lab:
        folders = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir() and p.name not in NOT_A_LAB)
        found = [f for f in folders if f == args.lab or f.startswith(args.lab + "_")]
        if len(found) != 1:
            parser.error(f"--lab {args.lab!r} names no single folder of solutions/: choose one of {', '.join(folders)}")
        generate(ROOT / "solutions", ROOT / "labs", only=found[0])
        print(f"labs/{found[0]} regenerated from solutions/{found[0]}")
        return 0
    generate(ROOT / "solutions", ROOT / "labs")
    print("labs/ regenerated from solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
