"""Labs have one source: ``solutions/``. The learner's starters in ``labs/`` are generated from it.

A solution region is marked in a ``.py`` file or in a notebook's code cell like this::

    def ring_all_reduce(tensor, group=None):
        # BEGIN SOLUTION Task 1: ring all-reduce from send/recv
        ...the reference implementation...
        # END SOLUTION

In the starter the region becomes ``raise NotImplementedError("Task 1: ring all-reduce from
send/recv")`` at the region's indentation, so a test that reaches it names the task. Where
raising is not what the starter should do, ``# STUB: <code>`` lines inside the region give the
starter's code instead. Every other file is copied as it is, except that a path into
``solutions/`` becomes the same path into ``labs/`` in every text file (a starter's config or
README must point at the learner's tree, never at the answers).

    python -m course_lib.grading.starters           # regenerate labs/ from solutions/
    python -m course_lib.grading.starters --check   # exit 1, listing files, when labs/ has drifted
"""

from __future__ import annotations

import argparse
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
            out.extend(f"{indent}{s}\n" for s in stubs)
            region = None
        else:
            if BEGIN.match(line):
                raise ValueError(f"{where}:{n}: solution regions cannot nest")
            region.append(line)
    if region is not None:
        raise ValueError(f"{where}: '# BEGIN SOLUTION' is never closed by '# END SOLUTION'")
    return "".join(out)


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


def generate(solutions: Path, labs: Path) -> None:
    """Write the starter tree for every lab under ``solutions`` into ``labs``."""
    if labs.exists():
        shutil.rmtree(labs)
    for src in sorted(solutions.rglob("*")):
        if src.is_dir() or SKIP & set(src.parts) or src.relative_to(solutions).parts[0] in NOT_A_LAB:
            continue
        dst = labs / src.relative_to(solutions)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".py":
            dst.write_text(_to_labs(strip_source(src.read_text(), str(src))))
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
    generate(ROOT / "solutions", ROOT / "labs")
    print("labs/ regenerated from solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
