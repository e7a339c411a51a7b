"""Grader of lab 03: ZeRO-1/2/3 with AdamW.

Graded: parameters after 5 steps equal torch DDP + torch AdamW (foreach=False) bit for bit at 2
ranks, fp32, on the course model and on a small model whose parameter sizes 2 does not divide;
with two backward passes per optimizer step (gradient accumulation) ZeRO-2 still equals AdamW on
the summed gradients, bit for bit; at 3 ranks (an odd N, units whose sizes 3 does not divide, one
smaller than N) each stage equals one-process AdamW on the average of the 3 ranks' gradients
within a derived tolerance; the bytes each rank holds (a census of the tensors reachable from the
learner's ZeroAdamW and the model: parameters, gradients, Adam moments) within 5% of the ZeRO
formula for fp32 AdamW at 4 ranks; and the communication of each stage: ZeRO-1 and ZeRO-2 only
reduce-scatter and all-gather, 2(N-1)/N·Ψ elements per step, ZeRO-2 reduce-scatters during
backward and keeps no full gradient, ZeRO-3 holds one unit at a time and moves 3(N-1)/N·Ψ.
Bit-equality is fair: adamw_ (given) does torch's arithmetic, and a 2-term sum has one order.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``zero.py``, tests/grading/test_lab_checks.py passes course_lib's own
``Zero`` (course_lib.parallel.data.zero), whose constructor, ``units`` and ``_gather`` are the lab's.

What each rank runs is in _lab03_ranks.py; the checks here launch it and compare.
"""

from pathlib import Path

import torch

from course_lib.cost.collective_bytes import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab03_ranks import (
    ACC_STEPS,
    ACCUMULATE,
    FP32,
    SIZE_TOL,
    STEPS,
    THREE,
    THREE_TOL,
    _accumulation,
    _bytes,
    _counts,
    _parity,
    _three_ranks,
)

ROLES = ("ZeroAdamW", "padded_size", "shard_of", "adamw_")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's ZeroAdamW and helpers, from ``zero.py``."""
    return Adapter.of_file(Path(lab_dir) / "zero.py", ROLES)


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("ZeroAdamW")
    for name in ROLES:
        assert callable(getattr(module, name, None)), f"zero.py must define {name}"


def check_padding(impl: Adapter) -> None:
    padded_size, shard_of = impl["padded_size"], impl["shard_of"]
    for numel, n, want in ((10, 4, 12), (12, 4, 12), (1, 4, 4), (7, 1, 7)):
        got = padded_size(numel, n)
        assert got == want, (
            f"padded_size({numel}, {n}) = {got}: the smallest multiple of {n} that holds {numel} is {want}"
        )
    flat = torch.arange(12.0)  # host: the grader's own process, no rank and no collective
    piece = shard_of(flat, 2, 4)
    assert torch.equal(piece, torch.tensor([6.0, 7.0, 8.0])), (  # host: compared with piece, on the host
        f"shard_of(arange(12), 2, 4) = {piece.tolist()}, expected [6, 7, 8]"
    )
    assert piece.data_ptr() == flat.data_ptr() + 6 * 4, "shard_of must return a view of the flat buffer, not a copy"


def _check_parity(impl: Adapter, stage: int) -> None:
    for rank, differ in enumerate(launch(_parity, 2, impl, stage, timeout=60)):
        for kind, names in differ.items():
            assert not names, (
                f"ZeRO-{stage}: after {STEPS} steps rank {rank}'s parameters {names[:3]} differ from torch DDP + AdamW "
                f"(model {kind!r}{', parameter sizes 2 does not divide' if kind == 'odd' else ''}): check the 1/N "
                "average, which slice each rank updates, and the all-gather"
            )


def _check_bytes(impl: Adapter, stage: int) -> None:
    world = 4
    for rank, (held, psi) in enumerate(launch(_bytes, world, impl, stage, timeout=60)):
        want = zero_model_state_bytes(psi, world, stage, **FP32)
        assert abs(held - want) <= SIZE_TOL * want, (
            f"ZeRO-{stage} at 4 ranks: rank {rank} holds {held} bytes of parameters, gradients and Adam state; the "
            f"formula says {want:.0f} (fp32: 4Ψ params, 4Ψ grads, 8Ψ moments, sharded by stage): look for a full "
            "buffer that this stage should shard, or a .grad left behind"
        )


RING_OPS = {"reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single", "all_gather_into_tensor"}


def _check_comm(impl: Adapter, stage: int, counts: dict, psi: int) -> None:
    """Stages 1-2 move what DDP moves, 2(N-1)/N·Ψ elements per rank per step, by reduce-scatter and all-gather."""
    other = {key.split("@")[0] for key in counts} - RING_OPS
    assert not other, (
        f"ZeRO-{stage} called {sorted(other)} in one step: reduce-scatter the averaged gradient (rank r needs "
        "only the sum of its own slice) and all-gather the updated parameters, nothing else"
    )
    moved, want = ring_wire_bytes(counts, 2), zero_comm_bytes(psi, 2, stage, bytes_per_element=4)
    assert abs(moved - want) <= SIZE_TOL * want, (
        f"ZeRO-{stage} moved {moved:.0f} bytes per rank in one step at 2 ranks; a reduce-scatter of the gradient and "
        f"an all-gather of the parameters move 2(N-1)/N·Ψ·4 = {want:.0f}: look for a buffer sent twice or whole"
    )


def _check_three_ranks(impl: Adapter, stage: int) -> None:
    for rank, (worst, differ) in enumerate(launch(_three_ranks, THREE, impl, stage, timeout=60)):
        assert not differ, (
            f"ZeRO-{stage} at 3 ranks: after {STEPS} steps rank {rank}'s parameters {differ[:3]} differ from AdamW on "
            f"the mean of the 3 ranks' gradients by up to {worst:.1e} (allowed {THREE_TOL:g}); units of 20, 8 and 2 "
            "elements are padded to 21, 9 and 3: check the padding, the shard sizes and offsets (padded, not numel), "
            "and the 1/N average"
        )


def check_stage1_parity(impl: Adapter) -> None:
    _check_parity(impl, 1)


def check_stage1_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 1)


def check_stage1_comm(impl: Adapter) -> None:
    _, counts, _, _, _, psi = launch(_counts, 2, impl, 1, timeout=60)[0]
    _check_comm(impl, 1, counts, psi)


def check_stage1_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 1)


def check_stage2_parity(impl: Adapter) -> None:
    _check_parity(impl, 2)


def check_stage2_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 2)


def check_stage2_during_backward(impl: Adapter) -> None:
    before, counts, held, _, n_units, psi = launch(_counts, 2, impl, 2, timeout=60)[0]
    calls = sum(v["calls"] for k, v in before.items() if k.startswith("reduce_scatter"))
    assert calls == n_units, (
        f"ZeRO-2 should reduce-scatter each of the {n_units} units during backward, as soon as "
        f"its gradients are complete; counted {calls} reduce-scatters before step()"
    )
    assert not held, f"ZeRO-2 keeps only the gradient shard: set p.grad = None after copying; still held: {held[:3]}"
    _check_comm(impl, 2, counts, psi)


def check_stage2_accumulates(impl: Adapter) -> None:
    for rank, differ in enumerate(launch(_accumulation, 2, impl, 2, timeout=60)):
        assert not differ, (
            f"ZeRO-2 with {ACCUMULATE} backward passes per step (gradient accumulation): after {ACC_STEPS} steps rank "
            f"{rank}'s parameters {differ[:3]} differ from AdamW on the sum of both passes' averaged gradients: "
            "_grad_ready must add each pass's shard to u.grad_shard (zero_grad clears it), not overwrite or zero it"
        )


def check_stage2_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 2)


def check_stage3_parity(impl: Adapter) -> None:
    _check_parity(impl, 3)


def check_stage3_bytes(impl: Adapter) -> None:
    _check_bytes(impl, 3)


def check_stage3_comm(impl: Adapter) -> None:
    _, counts, _, seen, n_units, psi = launch(_counts, 2, impl, 3, timeout=60)[0]
    for unit, live in seen:
        assert live == [unit], (
            f"ZeRO-3: while unit {unit} runs its forward, only it should be gathered; gathered "
            f"were units {live}: free after forward"
        )
    gathers = sum(v["calls"] for k, v in counts.items() if k.startswith("all_gather"))
    assert gathers == 2 * n_units, (
        f"ZeRO-3 all-gathers each of the {n_units} units twice per step (forward, backward); counted {gathers}"
    )
    moved, want = ring_wire_bytes(counts, 2), zero_comm_bytes(psi, 2, 3, bytes_per_element=4)
    assert abs(moved - want) <= SIZE_TOL * want, (
        f"ZeRO-3 moved {moved:.0f} bytes per rank per step; 3(N-1)/N·Ψ·4 = {want:.0f}"
    )


def check_stage3_three_ranks(impl: Adapter) -> None:
    _check_three_ranks(impl, 3)


ZERO1 = (check_padding, check_stage1_parity)  # stages 2 and 3 pad like stage 1 and update with Task 2's step
ZERO2 = (*ZERO1, check_stage2_parity)  # stage 3 reduce-scatters with Task 3's hook
TASKS = [
    Task("zero.py imports and defines ZeroAdamW and helpers", 1, check_setup, setup=True),
    Task("Task 1: padded_size and shard_of", 2, check_padding),
    Task("Task 2: ZeRO-1 parameters equal DDP + AdamW", 3, check_stage1_parity, needs=(check_padding,)),
    Task("Task 2: ZeRO-1 bytes per rank = 4Ψ + 4Ψ + 8Ψ/N", 1, check_stage1_bytes, needs=(check_padding,)),
    Task("Task 2: ZeRO-1 reduce-scatters and all-gathers, 2Ψ moved", 1, check_stage1_comm, needs=ZERO1),
    Task("Task 2: ZeRO-1 at 3 ranks equals AdamW", 1, check_stage1_three_ranks, needs=ZERO1),
    Task("Task 3: ZeRO-2 parameters equal DDP + AdamW", 2, check_stage2_parity, needs=ZERO1),
    Task("Task 3: ZeRO-2 bytes per rank = 4Ψ + 12Ψ/N", 1, check_stage2_bytes, needs=(check_padding,)),
    Task(
        "Task 3: ZeRO-2 reduce-scatters during backward, 2Ψ moved",
        1,
        check_stage2_during_backward,
        needs=(*ZERO1, check_stage1_comm),
    ),
    Task("Task 3: ZeRO-2 accumulates two backwards per step", 1, check_stage2_accumulates, needs=ZERO1),
    Task(
        "Task 3: ZeRO-2 at 3 ranks equals AdamW", 1, check_stage2_three_ranks, needs=(*ZERO1, check_stage1_three_ranks)
    ),
    Task("Task 4: ZeRO-3 parameters equal DDP + AdamW", 2, check_stage3_parity, needs=ZERO2),
    Task("Task 4: ZeRO-3 bytes per rank = 16Ψ/N", 1, check_stage3_bytes, needs=(check_padding, check_stage2_bytes)),
    Task(
        "Task 4: ZeRO-3 one unit at a time, 3Ψ moved",
        2,
        check_stage3_comm,
        needs=(*ZERO2, check_stage2_during_backward),
    ),
    Task(
        "Task 4: ZeRO-3 at 3 ranks equals AdamW",
        1,
        check_stage3_three_ranks,
        needs=(*ZERO2, check_stage1_three_ranks, check_stage2_three_ranks),
    ),
]
