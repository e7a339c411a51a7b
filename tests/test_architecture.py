"""The layout of ../shared/ARCHITECTURE.md, enforced: imports point one way and never form a cycle.

A learner reads the library bottom up — ``dist``, then the model and the arithmetic, then one
parallel strategy at a time — and each layer may only use what is below it. This test walks every
``import`` in ``course_lib`` (with ``ast``, nothing is executed) and fails on:

* an import that breaks the direction rules below;
* an import of a course_lib module inside a function (it hides a cycle from the reader);
* a cycle among course_lib modules.

It also proves that it can fail: a copy of the library with one planted upward import must be
reported.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

LIB = Path(__file__).resolve().parent.parent / "course_lib"

# What each layer may import from course_lib, besides itself. Exceptions are written as module
# prefixes, each with its reason.
BASE = ("course_lib.dist",)
# parallel/ builds on everything below it
BELOW_PARALLEL = (
    *BASE,
    "course_lib.model",
    "course_lib.data",
    "course_lib.optim",
    "course_lib.precision",
    "course_lib.cost",
)
ALLOWED = {
    "dist": BASE,
    "model": BASE,
    "data": (*BASE, "course_lib.model.tokenizer", "course_lib.dirichlet"),  # token ids; its tables' Dirichlet draws
    "dirichlet": (),  # torch only: Dirichlet draws from a torch.Generator
    "optim": BASE,
    "precision": BASE,
    "cost": (*BASE, "course_lib.model.config"),  # formulas read a ModelConfig's sizes
    "parallel": BELOW_PARALLEL,
    "inference": (*BELOW_PARALLEL, "course_lib.parallel"),
    "checkpoint": (*BELOW_PARALLEL, "course_lib.parallel"),
    "measure": ("course_lib.",),  # anything but grading and experiments (checked below)
    "experiments": ("course_lib.",),  # anything but grading (checked below)
    "plots": (),  # numbers in, Axes out
    "grading": ("course_lib.",),
    "cli": ("course_lib.",),
}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "course_lib"


def imports_of(path: Path, root: Path) -> list[tuple[str, int, bool]]:
    """(imported course_lib module, line, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(
                    (a.name, child.lineno, in_function) for a in child.names if a.name.startswith("course_lib")
                )
            elif isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("course_lib"):
                for a in child.names:  # `from course_lib.x import y` may name a module y or a name in x
                    sub = f"{child.module}.{a.name}"
                    is_module = (root.parent / sub.replace(".", "/")).with_suffix(".py").exists() or (
                        root.parent / sub.replace(".", "/") / "__init__.py"
                    ).exists()
                    found.append((sub if is_module else child.module, child.lineno, in_function))
            visit(child, inside)

    visit(tree, False)
    return found


def violations(root: Path = LIB) -> list[str]:
    problems = []
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        layer = layer_of(me)
        graph.setdefault(me, set())
        for target, line, in_function in imports_of(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target == me:
                continue
            if in_function:
                problems.append(
                    f"{where}: imports {target} inside a function; import it at the top (a hidden import hides a cycle)"
                )
            graph[me].add(target)
            # Importing course_lib.x.y first runs the package course_lib.x's __init__: from outside that
            # package, the import depends on what the __init__ imports too.
            parts = target.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if (
                    not me.startswith(package + ".")
                    and (root.parent / package.replace(".", "/") / "__init__.py").exists()
                ):
                    graph[me].add(package)
            theirs = layer_of(target)
            if theirs == layer:
                if layer == "parallel":  # sibling strategies do not import each other; only compose.py combines
                    mine, other = me.split(".")[2], target.split(".")[2]
                    if mine != other and mine != "compose":
                        problems.append(
                            f"{where}: parallel/{mine} imports parallel/{other}: sibling strategies "
                            f"stay independent; combine them in parallel/compose.py"
                        )
                continue
            if theirs == "grading" and layer != "cli":
                problems.append(f"{where}: imports {target}: nothing in course_lib imports grading")
                continue
            if theirs in ("measure", "experiments") and layer not in ("measure", "experiments"):
                problems.append(
                    f"{where}: imports {target}: instruments and experiments are for lectures, tests and "
                    f"benchmarks; move what the algorithm needs below (beside dist's counter)"
                )
                continue
            if theirs == "experiments" and layer == "measure":
                problems.append(
                    f"{where}: imports {target}: an instrument does not depend on a lecture's run; "
                    f"move what both need into measure/"
                )
                continue
            allowed = ALLOWED.get(layer)
            if allowed is None:
                problems.append(f"{where}: module {me} is in no layer of ARCHITECTURE.md")
            elif not any(
                target == a or target.startswith(a + ".") or (a.endswith(".") and target.startswith(a)) for a in allowed
            ):
                problems.append(
                    f"{where}: {layer} may not import {target} (upward or sideways in ARCHITECTURE.md): "
                    f"{layer} may use only {', '.join(allowed) or 'matplotlib and plain data'}"
                )
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected part of the module graph (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            w = next((m for m in graph if m == w), w)
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part) + [sorted(part)[0]])

    for v in list(graph):
        if v not in index:
            strong(v)
    return found


def test_imports_follow_the_architecture():
    problems = violations()
    assert not problems, "course_lib breaks the import rules of ARCHITECTURE.md:\n" + "\n".join(problems)


def test_the_check_fails_on_a_planted_upward_import_and_a_cycle(tmp_path):
    copy = tmp_path / "course_lib"
    shutil.copytree(LIB, copy, ignore=shutil.ignore_patterns("__pycache__"))
    runtime = copy / "dist" / "runtime.py"
    runtime.write_text(runtime.read_text() + "\nfrom course_lib.parallel.data import ddp  # planted\n")
    problems = violations(copy)
    assert any("dist may not import course_lib.parallel.data.ddp" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "course_lib.dist.runtime" in p for p in problems), problems
    mesh = copy / "dist" / "mesh.py"
    mesh.write_text(mesh.read_text() + "\ndef f():\n    from course_lib.dist import trace\n")
    assert any("inside a function" in p for p in violations(copy))


def test_every_module_is_in_a_layer():
    stray = [
        module_name(p, LIB)
        for p in LIB.rglob("*.py")
        if layer_of(module_name(p, LIB)) not in ALLOWED and module_name(p, LIB) != "course_lib"
    ]
    assert not stray, f"modules outside the layers of ARCHITECTURE.md: {stray}"
