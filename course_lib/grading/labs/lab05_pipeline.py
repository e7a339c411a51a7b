"""Grader of lab 05: the 1F1B pipeline schedule, its send/receive pairing, and (extra credit)
interleaved 1F1B (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM*, §2.2).

Graded, for p = 1 ... 8 ranks and several m micro-batches per step:

* the action lists pass course_lib's ``check`` (every micro-batch once per stage, forward before
  backward, every send received) and its simulator plays them to the end (no deadlock);
* the simulated bubble equals ``cost.pipeline.bubble_fraction``, (p - 1)/(v·m + p - 1), and the
  activations each rank holds at once equal ``cost.pipeline.in_flight_microbatches``;
* each message sits right next to the compute action that produces or consumes its tensor;
* one training step of the course model on 2 and 3 ranks (1F1B) and on 2 ranks (interleaved), run
  by course_lib's runtime from the learner's lists (_lab05_step.py), gives the non-pipelined
  model's losses and gradients bit for bit, and sends ``cost.pipeline.p2p_bytes_per_step``.

Each task isolates one function: the compute orders (Tasks 1 and 3) are checked with course_lib's
message pairing (``schedules.with_messages``, what ``build`` uses), the pairing (Task 2) on
course_lib's compute orders (``build(name, p, m, v).compute(rank)``). The runtime checks run both
of the learner's together and declare the other task's rows in ``needs`` (the 1F1B step needs
Task 1's, the interleaved step Task 2's), so that a mistake there is blamed on its own task; before
any rank starts, they play the learner's order (paired by course_lib), then check the learner's
messages, on paper, so a list the runtime could not walk fails with what is wrong in it. The
simulator's costs are whole numbers (F = 1, B = 2 time units per stage or chunk — the bubble
fraction does not depend on the unit), so its times are exact.

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``pipeline_parallel.py``, tests/grading/test_lab_checks.py passes course_lib's
own compute orders and pairing (course_lib.parallel.pipeline.schedules).
"""

from collections.abc import Callable
from pathlib import Path

from course_lib.cost.pipeline import bubble_fraction, in_flight_microbatches
from course_lib.dist import launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.grade import Task
from course_lib.grading.labs._lab05_step import _assert_step, _step, _what
from course_lib.parallel.pipeline.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    build,
    check,
    with_messages,
)
from course_lib.parallel.pipeline.simulate import Deadlock, simulate

ROLES = ("one_f_one_b", "with_messages", "interleaved")
NAMES = (*ROLES, "build_schedule")  # what check_setup wants in the file


def adapter(lab_dir: Path) -> Adapter:
    """The learner's compute orders and message pairing, from ``pipeline_parallel.py``."""
    return Adapter.of_file(Path(lab_dir) / "pipeline_parallel.py", ROLES)


COST = {F: 1, B: 2}  # time units of one stage's (one chunk's) forward and backward: whole numbers, exact sums
# Python floats are IEEE doubles on every CPU: busy / (p·makespan) and the formula are each a division of exact
# integers, correct to 1.1e-16 relative; 1e-12 admits that, while one idle time unit more moves the bubble by
# (busy per rank)/(makespan·(makespan + 1)) > 3e-3 here (makespans ≤ 240 units).
BUBBLE_TOL = 1e-12
PS = (2, 3, 4, 8, 1)  # p = 1, the edge case, last: its feedback would teach least
ONE_F_ONE_B_CASES = [(p, m, 1) for p in PS for m in sorted({1, 3, p, 2 * p + 1, 8})]  # (p, m, v): m < p, = p, > p
INTERLEAVED_CASES = [(p, m, v) for v in (2, 3) for p in PS for m in sorted({p, 2 * p, 3 * p})]  # m: multiples of p
# Task 2 on course_lib's compute orders: all forwards then all backwards (GPipe), 1F1B, interleaved
MESSAGE_CASES = [
    *(("gpipe", p, m, v) for p, m, v in ONE_F_ONE_B_CASES),
    *(("1f1b", p, m, v) for p, m, v in ONE_F_ONE_B_CASES),
    *(("interleaved", p, m, 2) for p in PS for m in (p, 2 * p)),
]
# (p ranks, m micro-batches) of the runtime checks, by chunks per rank v. 1F1B at p = 3 too: a rank in the middle,
# with a neighbour on each side, warm-ups of 0, 1 and 2 forwards, and m < p (one launch of 3 ranks, ~2 s on 2 cores).
# Interleaved: m a multiple of p.
STEP_CASES = {1: ((2, 3), (2, 4), (3, 2), (3, 4)), 2: ((2, 2), (2, 4))}


# --------------------------------------------------------------- lists from the learner's functions


def _placement(p: int, v: int) -> tuple[int, ...]:
    return tuple(s % p for s in range(p * v))


def _compute_order(impl: Adapter, p: int, m: int, v: int, rank: int) -> list[Action]:
    """The learner's compute order of ``rank``: 1F1B for v = 1, interleaved for v > 1, its shape checked."""
    if v == 1:
        got, call = impl["one_f_one_b"](p, m, rank), f"one_f_one_b(p={p}, m={m}, rank={rank})"
    else:
        got, call = impl["interleaved"](p, m, v, rank), f"interleaved(p={p}, m={m}, v={v}, rank={rank})"
    assert isinstance(got, (list, tuple)), f"{call} returned {type(got).__name__}: return a list of Action"
    for a in got:
        assert isinstance(a, Action), (
            f"{call} returned {a!r}: every item must be an Action(op, microbatch, stage) from "
            "course_lib.parallel.pipeline.schedules"
        )
        assert a.op in (F, B), f"{call} returned {a!r}: a compute order holds F and B only (messages are Task 2)"
        assert 0 <= a.microbatch < m, f"{call} returned {a!r}: the micro-batches are 0 ... m - 1 = {m - 1}"
        assert 0 <= a.stage < p * v, f"{call} returned {a!r}: the stages are 0 ... p·v - 1 = {p * v - 1}"
    return list(got)


def _with_learners_messages(impl: Adapter, compute: list[Action], placement: tuple[int, ...]) -> tuple[Action, ...]:
    got = impl["with_messages"](list(compute), placement)
    assert isinstance(got, (list, tuple)), f"with_messages returned {type(got).__name__}: return a tuple of Action"
    last = len(placement) - 1
    for a in got:
        assert isinstance(a, Action), (
            f"with_messages returned {a!r} in its list: every item must be an Action from "
            "course_lib.parallel.pipeline.schedules"
        )
        assert a.op in (F, B, SEND_F, RECV_F, SEND_B, RECV_B), f"with_messages returned {a!r}: an op it does not know"
        assert 0 <= a.stage <= last, f"with_messages returned {a!r}: the stages are 0 ... {last}"
        assert not (a.op in (RECV_F, SEND_B) and a.stage == 0), (
            f"with_messages returned {a!r}: stage 0 has no previous stage to receive from or send to"
        )
        assert not (a.op in (SEND_F, RECV_B) and a.stage == last), (
            f"with_messages returned {a!r}: stage {last} is the last, with no next stage to send to or receive from"
        )
    return tuple(got)


def _schedule(orders: list[list[Action]], p: int, m: int, v: int, pair: Callable) -> Schedule:
    """A Schedule from one compute order per rank, with messages inserted by ``pair(compute, placement)``."""
    placement = _placement(p, v)
    actions = tuple(tuple(pair(order, placement)) for order in orders)
    return Schedule("1f1b" if v == 1 else "interleaved", p, m, v, placement, actions)


def _play(schedule: Schedule, what: str, hint: str):
    """course_lib's check, then its simulator; their verdicts as feedback."""
    try:
        check(schedule)
    except ValueError as e:
        raise AssertionError(f"{what}: {e}") from None
    try:
        return simulate(schedule, COST)
    except Deadlock as e:
        raise AssertionError(f"{what}: {e}; {hint}") from None


# ------------------------------------------------------------------------------- the rule of Task 2


def _around(a: Action, placement: tuple[int, ...], rank: int) -> tuple[list[Action], list[Action]]:
    """(receives right before ``a``, sends right after it), by the rule of Task 2."""
    n, s, i = len(placement), a.stage, a.microbatch
    prev_remote = s > 0 and placement[s - 1] != rank
    next_remote = s < n - 1 and placement[s + 1] != rank
    if a.op == F:
        return [Action(RECV_F, i, s)] * prev_remote, [Action(SEND_F, i, s)] * next_remote
    return [Action(RECV_B, i, s)] * next_remote, [Action(SEND_B, i, s)] * prev_remote


def _assert_kept(what: str, compute: list[Action], got: tuple[Action, ...], rank: int) -> None:
    kept = [a for a in got if a.op in (F, B)]
    if kept != compute:
        k = next((k for k, (a, b) in enumerate(zip(kept, compute)) if a != b), min(len(kept), len(compute)))
        raise AssertionError(
            f"{what}, rank {rank}: with_messages must keep the compute actions, in their order, and add messages "
            f"only; from compute action {k} on it returned {kept[k : k + 3]}, the input has {compute[k : k + 3]}"
        )


def _assert_adjacent(what: str, compute: list[Action], got: tuple[Action, ...], placement: tuple[int, ...], rank: int):
    """Between two compute actions a and b, exactly a's sends, then b's receives (the rule of Task 2)."""
    _assert_kept(what, compute, got, rank)
    at = [j for j, a in enumerate(got) if a.op in (F, B)]
    for j, a in enumerate(compute):
        want = (_around(compute[j - 1], placement, rank)[1] if j else []) + _around(a, placement, rank)[0]
        seen = list(got[(at[j - 1] + 1 if j else 0) : at[j]])
        assert seen == want, (
            f"{what}, rank {rank}: right before {a!r} you have {seen}, expected {want}: a send goes right after "
            "the compute that produces its tensor, then the receive right before the compute that needs one; "
            "nothing between two stages of one rank"
        )
    tail, want = list(got[at[-1] + 1 :]), _around(compute[-1], placement, rank)[1]
    assert tail == want, f"{what}, rank {rank}: after the last compute you have {tail}, expected {want}"


def _learners_pairing(impl: Adapter, name: str, p: int, m: int, v: int) -> list[tuple[list[Action], tuple]]:
    """(course_lib's compute order, the learner's full list) for each rank of ``name``."""
    reference = build(name, p, m, v)
    pairs = []
    for r in range(p):
        compute = reference.compute(r)
        got = _with_learners_messages(impl, compute, reference.placement)
        _assert_kept(f"{name} at p={p}, m={m}", compute, got, r)
        pairs.append((compute, got))
    return pairs


# --------------------------------------------------------------------------- Tasks 1 and 3 on paper


def _paired_by_course_lib(impl: Adapter, p: int, m: int, v: int) -> Schedule:
    """The learner's compute orders (Task 1 or 3), paired by course_lib: independent of Task 2."""
    orders = [_compute_order(impl, p, m, v, r) for r in range(p)]
    return _schedule(orders, p, m, v, with_messages)


def _hint(v: int) -> str:
    if v == 1:
        return "look at the warm-up: rank r runs p - r - 1 forwards (at most m) before its first backward"
    return "look at the warm-up, 2(p - r - 1) + (v - 1)·p forwards, and the chunk of the k-th forward and backward"


def _check_orders(impl: Adapter, cases) -> None:
    for p, m, v in cases:
        _play(_paired_by_course_lib(impl, p, m, v), _what(p, m, v), _hint(v))


def _check_bubble(impl: Adapter, cases) -> None:
    for p, m, v in cases:
        sim = _play(_paired_by_course_lib(impl, p, m, v), _what(p, m, v), _hint(v))
        got, want = sim.bubble_fraction(), bubble_fraction(p, m, v)
        assert abs(got - want) <= BUBBLE_TOL, (
            f"{_what(p, m, v)}: the simulated bubble is {got:.4f} of the step (F = 1, B = 2 time units), the formula "
            f"(p - 1)/({'' if v == 1 else 'v·'}m + p - 1) says {want:.4f}: some rank idles while it could compute — look "
            "at when each rank starts its backwards (right after its warm-up) and their order (micro-batch order)"
        )


def _check_in_flight(impl: Adapter, cases, rule: str) -> None:
    for p, m, v in cases:
        schedule = _paired_by_course_lib(impl, p, m, v)
        got = _play(schedule, _what(p, m, v), _hint(v)).peak_in_flight()
        want = [in_flight_microbatches(schedule.name, p, r, m, v) for r in range(p)]
        assert got == want, (
            f"{_what(p, m, v)}: ranks 0..{p - 1} hold {got} micro-batches' activations at most; {rule} = {want}"
        )


# ------------------------------------------- one step on 2 and 3 ranks, by course_lib's runtime (_lab05_step.py)


def _step_schedule(impl: Adapter, p: int, m: int, v: int) -> Schedule:
    """The learner's order with the learner's messages, checked on paper first: a list the runtime
    cannot walk fails here with what is wrong in it, not as hanging ranks."""
    what = _what(p, m, v)
    _play(_paired_by_course_lib(impl, p, m, v), what, _hint(v))  # the order alone (Task 1 or 3)
    orders = [_compute_order(impl, p, m, v, r) for r in range(p)]
    schedule = _schedule(orders, p, m, v, lambda c, pl: _with_learners_messages(impl, c, pl))
    for r in range(p):  # the messages alone (Task 2's rule)
        _assert_adjacent(what, orders[r], schedule.actions[r], schedule.placement, r)
    # both pass on their own, so together they are valid: nothing left to blame on paper
    _play(schedule, what, "your messages around your order")
    return schedule


def _check_step(impl: Adapter, v: int) -> None:
    for p in sorted({p for p, _ in STEP_CASES[v]}):
        schedules = [_step_schedule(impl, p, m, v) for q, m in STEP_CASES[v] if q == p]
        per_rank = launch(_step, p, schedules, timeout=90)
        for j, schedule in enumerate(schedules):
            _assert_step(schedule, [r[j] for r in per_rank])


# ------------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("one_f_one_b")
    missing = [n for n in NAMES if not callable(getattr(module, n, None))]
    assert not missing, f"pipeline_parallel.py must define {', '.join(missing)}"


def check_1f1b_valid(impl: Adapter) -> None:
    _check_orders(impl, ONE_F_ONE_B_CASES)


def check_1f1b_bubble(impl: Adapter) -> None:
    _check_bubble(impl, ONE_F_ONE_B_CASES)


def check_1f1b_in_flight(impl: Adapter) -> None:
    _check_in_flight(impl, ONE_F_ONE_B_CASES, "1F1B holds min(p - rank, m)")


def check_messages_pair_up(impl: Adapter) -> None:
    for name, p, m, v in MESSAGE_CASES:
        pairs = _learners_pairing(impl, name, p, m, v)
        schedule = Schedule(name, p, m, v, _placement(p, v), tuple(got for _, got in pairs))
        _play(
            schedule,
            f"your messages around course_lib's {name} order at p={p}, m={m}",
            "a rank blocked on a receive before it sends what its neighbour waits for stalls both: "
            "receive right before the compute that needs the tensor, send right after the one that makes it",
        )


def check_messages_adjacent(impl: Adapter) -> None:
    for name, p, m, v in MESSAGE_CASES:
        for r, (compute, got) in enumerate(_learners_pairing(impl, name, p, m, v)):
            _assert_adjacent(f"{name} at p={p}, m={m}", compute, got, _placement(p, v), r)


def check_1f1b_step(impl: Adapter) -> None:
    _check_step(impl, v=1)


def check_interleaved_lists(impl: Adapter) -> None:
    _check_orders(impl, INTERLEAVED_CASES)
    _check_bubble(impl, INTERLEAVED_CASES)
    _check_in_flight(impl, INTERLEAVED_CASES, "interleaved 1F1B holds min(2(p - rank - 1) + (v - 1)·p + 1, v·m)")


def check_interleaved_step(impl: Adapter) -> None:
    _check_step(impl, v=2)


TASKS = [
    Task("pipeline_parallel.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: 1F1B lists are valid and never deadlock (p ≤ 8)", 2, check_1f1b_valid),
    Task("Task 1: 1F1B bubble = (p - 1)/(m + p - 1)", 1, check_1f1b_bubble),
    Task("Task 1: 1F1B holds min(p - rank, m) micro-batches", 2, check_1f1b_in_flight),
    Task("Task 2: every send meets its receive, no deadlock", 2, check_messages_pair_up),
    Task("Task 2: each message right next to its compute", 1, check_messages_adjacent),
    Task(
        "Task 2: a 1F1B step on 2 and 3 ranks equals the unpipelined model",
        3,
        check_1f1b_step,
        timeout=150,
        needs=(check_1f1b_valid, check_1f1b_bubble, check_1f1b_in_flight),  # your 1F1B order runs it (Task 1)
    ),
    Task("Task 3 (extra credit): interleaved lists: valid, bubble, in flight", 2, check_interleaved_lists),
    Task(
        "Task 3 (extra credit): an interleaved step equals the unpipelined model",
        2,
        check_interleaved_step,
        timeout=150,
        needs=(check_messages_pair_up, check_messages_adjacent),  # your messages carry it (Task 2)
    ),
]
