"""Adapters: one check grades a learner's module and tests course_lib's own implementation.

A check never imports the code it checks. It is handed an :class:`Adapter`, a map from a *role*
("merge_partials", "ring_attention", ...) to a callable, and calls ``impl["ring_attention"](q, k, v)``.
The lab's grader builds the adapter from the learner's file (:meth:`Adapter.of_file`); the test
suite builds it from course_lib (:meth:`Adapter.of_library`). So every check of a lab also proves
the library, and no check is written twice (CS336's adapters do the same for its tests).

Checks launch ranks, so an adapter crosses process boundaries: it holds *where* each callable lives
(a dotted module name or the path of a ``.py`` file, and an attribute), never the callable itself,
and resolves it in the process that calls it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


def load(path: Path | str) -> ModuleType:
    """Import the ``.py`` file at ``path`` under a name of its own (labs/ and solutions/ both have one)."""
    path = Path(path)
    if not path.exists():
        raise AssertionError(f"{path} is missing: the lab expects your code in {path.name}")
    name = f"_submission_{abs(hash(str(path.resolve())))}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


@dataclass(frozen=True)
class Adapter:
    """Role name -> callable, resolved where it is called. ``sources`` holds (role, module, attribute)."""

    sources: tuple[tuple[str, str, str], ...]

    @classmethod
    def of_file(cls, path: Path | str, roles: Iterable[str]) -> Adapter:
        """Each role is the attribute of the same name in the file at ``path`` (a learner's module)."""
        return cls(tuple((role, str(Path(path).resolve()), role) for role in roles))

    @classmethod
    def of_library(cls, **roles: str) -> Adapter:
        """``role="course_lib.some.module:attribute"`` for each role (course_lib's own implementation)."""
        pairs = []
        for role, where in roles.items():
            module, _, attribute = where.partition(":")
            pairs.append((role, module, attribute or role))
        return cls(tuple(pairs))

    def _source(self, role: str) -> tuple[str, str]:
        for r, module, attribute in self.sources:
            if r == role:
                return module, attribute
        raise KeyError(f"the adapter has no role {role!r} (it has {', '.join(r for r, _, _ in self.sources)})")

    def module(self, role: str) -> ModuleType:
        """The module that implements ``role``: a check may patch what the implementation calls."""
        module, _ = self._source(role)
        return load(module) if module.endswith(".py") else importlib.import_module(module)

    def __getitem__(self, role: str) -> Callable:
        module, attribute = self._source(role)
        found = getattr(self.module(role), attribute, None)
        if found is None:
            raise AssertionError(f"{Path(module).name} must define {attribute}")
        return found

    def roles(self) -> list[str]:
        return [r for r, _, _ in self.sources]
