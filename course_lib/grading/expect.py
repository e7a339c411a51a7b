"""A lab's contract on errors, checked so that the feedback says which exception was expected.

Where a lab asks the learner to refuse something (release a block twice, resume a checkpoint that
fails its checksum), the grader does not accept just any exception: the README and the docstring
name the type, because the code that calls the learner's function catches that type and no other.
``raises`` makes the verdict say both sides::

    raises(RuntimeError, pool.release, 3, what="releasing a block that is already free")
    # AssertionError: releasing a block that is already free must raise RuntimeError, got ValueError: 3 is free
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def raises(expected: type[BaseException], fn: Callable, *args: Any, what: str, **kwargs: Any) -> BaseException:
    """Call ``fn(*args, **kwargs)``; return the exception it raised, which must be an ``expected``.

    Fails with an AssertionError naming ``what`` was done, the type the lab's contract expects, and
    what happened instead (another type and its message, or a normal return).
    """
    try:
        fn(*args, **kwargs)
    except NotImplementedError:
        # the starter's stub (a RuntimeError too): the grader reports "not implemented yet", never a pass
        raise
    except expected as e:
        return e
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        got = type(e).__name__ + (f": {message}" if message else "")
        raise AssertionError(f"{what} must raise {expected.__name__}, got {got}") from e
    raise AssertionError(f"{what} must raise {expected.__name__}; it returned normally")
