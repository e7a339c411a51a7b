"""course_lib.dist — the distributed runtime every later chapter uses.

* :mod:`~course_lib.dist.runtime` — the one place that picks device and backend; ``init()``.
* :mod:`~course_lib.dist.launch`  — ``launch(fn, world_size)``: run a function on N ranks.
* :mod:`~course_lib.dist.forkserver_freeze` — imported by launch's fork server only: ``gc.freeze()``.
* :mod:`~course_lib.dist.timing`  — the clock that waits for the device.
* :mod:`~course_lib.dist.p2p`     — sends and receives posted together (safe under NCCL).
* :mod:`~course_lib.dist.mesh`    — ``Mesh(dp=, tp=, pp=, cp=, ep=)``: process groups per parallelism.
* :mod:`~course_lib.dist.intercept` — reports each ``torch.distributed`` call to its observers:
* :mod:`~course_lib.dist.counter` — calls and bytes per collective and process group;
* :mod:`~course_lib.dist.trace`   — per-rank timeline of compute and communication spans.
* :mod:`~course_lib.dist.chrome_trace` — all ranks' timelines as one Chrome trace-event file (Perfetto).
* :mod:`~course_lib.dist.census`  — bytes of the storages a rank holds (parameters, gradients, state).
* :mod:`~course_lib.dist.ordered` — an all-reduce that adds the ranks' tensors in rank order (deterministic).
* :mod:`~course_lib.dist.script`  — the frame of a script under ``accelerate launch`` (the labs' run.py).
"""

import torch
import torch.distributed

# The course calls torch 2.13's names for the flat collectives (all_gather_single, reduce_scatter_single;
# older releases call them all_gather_into_tensor, reduce_scatter_tensor). An older torch fails here, saying
# so, rather than deep inside a rank with an AttributeError.
if not hasattr(torch.distributed, "reduce_scatter_single"):
    raise ImportError(
        f"course_lib needs torch 2.13 (pyproject.toml pins it); this is torch {torch.__version__}, whose "
        "torch.distributed has no reduce_scatter_single. Run ./course, which installs the pinned versions in .venv/, "
        "or pip install -e . in a fresh environment"
    )

from course_lib.dist import counter, trace
from course_lib.dist.launch import LaunchTimeout, RankError, launch
from course_lib.dist.mesh import Mesh
from course_lib.dist.runtime import backend, device, init, rank, shutdown, synchronize, world_size

__all__ = [
    "LaunchTimeout",
    "Mesh",
    "RankError",
    "backend",
    "counter",
    "device",
    "init",
    "launch",
    "rank",
    "shutdown",
    "synchronize",
    "trace",
    "world_size",
]
