"""The frame of a script started by ``accelerate launch`` or ``torchrun``: every lab's ``run.py``.

Each entry script does the same around what its lab is about: parse its options and ``--trace PATH``,
join the process group the launcher describes (:func:`course_lib.dist.init` reads RANK, WORLD_SIZE and
MASTER_ADDR/PORT from the environment), run its body on every rank — recorded into one Chrome trace of
all ranks when ``--trace`` is given (:func:`course_lib.dist.chrome_trace.to_file`) — and leave the group. Here
that frame is written once; a script keeps its options and its body::

    def run(args) -> None:  # on every rank, after init
        say = script.print_on(0)  # print on rank 0 only
        ...

    def main() -> None:
        parser = script.parser(__doc__)
        parser.add_argument("--steps", type=int, default=8)
        script.main(run, parser)

A script imports the modules beside it by name (``from ddp import DDP``, the learner's file): Python
puts the folder of the script it runs first on ``sys.path``, under ``python run.py``, ``accelerate
launch`` and ``torchrun`` alike, so no path needs to be set by hand.

Tested in tests/dist/test_dist_script.py, and through the labs' scripts in tests/labs/test_labs.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch.distributed as dist

from course_lib.dist import chrome_trace, runtime

TRACE_HELP = "write every rank's timeline to PATH as one Chrome trace (open it in ui.perfetto.dev)"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The script's option parser, described by the first line of its docstring, with ``--trace PATH``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--trace", metavar="PATH", help=TRACE_HELP)
    return p


def main(body: Callable[[argparse.Namespace], str | None], options: argparse.ArgumentParser, argv=None) -> None:
    """Parse ``argv`` (the command line when None), join the launcher's process group, run ``body(args)``
    on every rank — traced into ``args.trace`` when given — and leave the group. A body that returns a
    message (why the script stopped early) makes the script exit with it, after the group is left."""
    args = options.parse_args(argv)
    runtime.init()
    with chrome_trace.to_file(args.trace):  # None: records nothing
        stop = body(args)
    runtime.shutdown()
    if stop is not None:
        raise SystemExit(stop)


def print_on(rank: int = 0) -> Callable[..., None]:
    """``print`` on the rank ``rank``, a no-op on every other: what one rank says for all."""
    return print if dist.get_rank() == rank else (lambda *a, **k: None)
