"""Grader of lab 01: ring reduce-scatter, all-gather and all-reduce from send/recv.

Graded: equality with torch.distributed (exact on integer-valued data, where any summation order
gives the same floats; 1e-5 on random data, where the ring adds in a different order than gloo),
that only point-to-point calls were used, and the bytes each rank sends against the ring's
formulas: (N-1)/N·S for reduce-scatter and all-gather, 2(N-1)/N·S for all-reduce.
Timings are not graded (too noisy on shared machines); run.py sets them against an alpha-beta model.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``collectives.py``. course_lib has no ring collectives of its own (its
code calls torch.distributed's), so no test runs these checks against the library.
"""

import math
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist import counter, device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task

ROLES = ("ring_reduce_scatter", "ring_all_gather", "ring_all_reduce")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's functions, from ``collectives.py``."""
    return Adapter.of_file(Path(lab_dir) / "collectives.py", ROLES)


WORLDS = (2, 4)
P2P = {"send", "isend", "recv", "irecv"}
# Random data (the 64 × 33 all-reduce): the ring adds an element's N values in another order than
# gloo. Each order is within (N-1)·eps·Σ|x| of the exact sum (Higham, "Accuracy and Stability of
# Numerical Algorithms", §4.2), so two orders differ by at most 2(N-1)·eps·Σ|x|; at N = 4 the largest
# Σ|x| of that data is 7.9: 2 × 3 × 1.19e-7 × 7.9 ≈ 5.6e-6 < 1e-5 on any CPU (at N = 2, a + b = b + a
# exactly), while a chunk sent or added at the wrong step errs by O(1).
TOL = dict(atol=1e-5, rtol=1e-5)


def _sent(c) -> int:
    return c.bytes("send") + c.bytes("isend")


def _collectives_used(c) -> set[str]:
    return {key.split("@")[0] for key in c.as_dict()} - P2P


def _data(numel: int, integer: bool, seed: int = 0) -> torch.Tensor:
    """This rank's test data on its device, drawn on the host so every machine grades the same numbers."""
    g = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())  # host: the same draw on every machine
    if integer:
        x = torch.randint(-100, 100, (numel,), generator=g).float()  # host: drawn with g, moved below
    else:
        x = torch.randn(numel, generator=g)  # host: drawn with g, moved below
    return x.to(device())


def _reduce_scatter(impl: Adapter, numel: int, integer: bool):
    x = _data(numel, integer)
    with counter.count() as c:
        mine = impl["ring_reduce_scatter"](x.clone())
    full = x.clone()
    dist.all_reduce(full)
    expected = full.tensor_split(dist.get_world_size())[dist.get_rank()]
    return mine, expected, _sent(c), _collectives_used(c), x.numel() * x.element_size()


def _all_gather(impl: Adapter, numel: int, integer: bool):
    shard = _data(numel, integer)
    with counter.count() as c:
        mine = impl["ring_all_gather"](shard.clone())
    expected = torch.empty(numel * dist.get_world_size(), device=device())
    dist.all_gather_single(expected, shard)
    return mine, expected, _sent(c), _collectives_used(c), expected.numel() * expected.element_size()


def _all_reduce(impl: Adapter, shape, integer: bool, transpose: bool = False):
    x = _data(math.prod(shape), integer).view(shape)
    if transpose:
        x = x.t()  # not contiguous: the result must still land in the caller's tensor
    mine = x.clone() if not transpose else x.clone().t().contiguous().t()
    with counter.count() as c:
        returned = impl["ring_all_reduce"](mine)
    expected = x.clone()
    dist.all_reduce(expected)
    return mine, returned is mine, expected, _sent(c), _collectives_used(c), x.numel() * x.element_size()


def _check_equal(results, name: str, exact: bool) -> None:
    for rank, (mine, expected, *_rest) in enumerate(results):
        assert mine is not None, f"{name} returned None on rank {rank}: return the result tensor"
        assert mine.shape == expected.shape, (
            f"{name}: rank {rank} returned shape {tuple(mine.shape)}, expected {tuple(expected.shape)}"
        )
        if exact:  # bit-equal: integers below 2^24 (here |sum| ≤ 400) add exactly in fp32, in any order
            assert torch.equal(mine, expected), (
                f"{name} differs from torch.distributed on rank {rank} with integer-valued data (exact in any "
                "summation order): check which chunk you send and receive at each step"
            )
        else:
            assert torch.allclose(mine, expected, **TOL), (
                f"{name} differs from torch.distributed on rank {rank} beyond 1e-5"
            )


def _check_p2p_only(results, name: str) -> None:
    for rank, r in enumerate(results):
        used = r[-2]
        assert not used, (
            f"{name} on rank {rank} called {sorted(used)}: build it from point-to-point calls only (the given _exchange)"
        )


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("ring_all_reduce")
    for fn in ROLES:
        assert callable(getattr(module, fn, None)), f"collectives.py must define {fn}()"


def check_reduce_scatter(impl: Adapter) -> None:
    for world in WORLDS:
        for numel in (8 * world, 8 * world + 3):  # divisible, and not
            results = launch(_reduce_scatter, world, impl, numel, True, timeout=30)
            _check_equal(
                [(r[0], r[1]) for r in results], f"ring_reduce_scatter (N={world}, {numel} elements)", exact=True
            )
            _check_p2p_only(results, "ring_reduce_scatter")


def check_reduce_scatter_bytes(impl: Adapter) -> None:
    for world in WORLDS:
        results = launch(_reduce_scatter, world, impl, 1024 * world, False, timeout=30)
        for rank, (_, _, sent, _, s) in enumerate(results):
            want = (world - 1) * s // world
            assert sent == want, (
                f"ring_reduce_scatter at N={world}: rank {rank} sent {sent} bytes, the ring sends (N-1)/N·S = {want}"
            )


def check_all_gather(impl: Adapter) -> None:
    for world in WORLDS:
        for integer in (True, False):
            results = launch(_all_gather, world, impl, 10, integer, timeout=30)
            # bit-equal on random data too: an all-gather only copies, it adds nothing
            _check_equal([(r[0], r[1]) for r in results], f"ring_all_gather (N={world})", exact=True)
            _check_p2p_only(results, "ring_all_gather")


def check_all_gather_bytes(impl: Adapter) -> None:
    for world in WORLDS:
        results = launch(_all_gather, world, impl, 1024, False, timeout=30)
        for rank, (_, _, sent, _, s) in enumerate(results):
            want = (world - 1) * s // world
            assert sent == want, (
                f"ring_all_gather at N={world}: rank {rank} sent {sent} bytes, the ring sends (N-1)/N·S = {want}"
            )


def check_all_reduce(impl: Adapter) -> None:
    for world in WORLDS:
        for shape, integer, transpose in (((6, 7), True, False), ((5, 3), True, True), ((64, 33), False, False)):
            results = launch(_all_reduce, world, impl, shape, integer, transpose, timeout=30)
            for rank, r in enumerate(results):
                assert r[1], f"ring_all_reduce must work in place and return the tensor it was given (rank {rank})"
            what = f"ring_all_reduce (N={world}, shape {shape}{', non-contiguous' if transpose else ''})"
            _check_equal([(r[0], r[2]) for r in results], what, exact=integer)
            _check_p2p_only(results, "ring_all_reduce")


def check_all_reduce_bytes(impl: Adapter) -> None:
    for world in WORLDS:
        results = launch(_all_reduce, world, impl, (256, world * 4), False, timeout=30)
        for rank, r in enumerate(results):
            sent, s = r[3], r[5]
            want = 2 * (world - 1) * s // world
            assert sent == want, (
                f"ring_all_reduce at N={world}: rank {rank} sent {sent} bytes, the ring sends 2(N-1)/N·S = {want}"
            )


TASKS = [
    Task("collectives.py imports and defines the three functions", 1, check_setup, setup=True),
    Task("Task 1: reduce-scatter equals torch.distributed", 2, check_reduce_scatter),
    Task("Task 1: reduce-scatter sends (N-1)/N·S bytes", 1, check_reduce_scatter_bytes),
    Task("Task 2: all-gather equals torch.distributed", 2, check_all_gather),
    Task("Task 2: all-gather sends (N-1)/N·S bytes", 1, check_all_gather_bytes),
    # Task 3's all-reduce is Task 1's reduce-scatter then Task 2's all-gather: they fail it too
    Task(
        "Task 3: all-reduce equals torch.distributed",
        3,
        check_all_reduce,
        needs=(check_reduce_scatter, check_all_gather),
    ),
    Task(
        "Task 3: all-reduce sends 2(N-1)/N·S bytes",
        2,
        check_all_reduce_bytes,
        needs=(check_reduce_scatter_bytes, check_all_gather_bytes),
    ),
]
