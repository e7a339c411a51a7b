"""Grader of lab 10, the capstone: a DP × TP × PP training step, and a planner's pick against measurement.

Graded:

* **coordinates** — rank -> (d, s, t) equal to :class:`course_lib.dist.Mesh`'s grid (tp innermost,
  dp outermost) on every rank of several layouts; ``check_layout`` raises ValueError for layouts that
  each break exactly one rule (K/V heads, vocabulary, d_ff, blocks, batch, tied embeddings across
  stages: a missing rule shows), each message naming its constraint, and accepts those that break none;
* **build** — on 8 ranks, every rank's stage, its TP shards gathered, equals the dense model's
  blocks bit for bit (slicing is exact), and each rank holds 1/tp of every matrix;
* **step** — 3 SGD steps on 8 ranks at three layouts give the losses and the parameters of one
  process training on the whole batch (tolerances below);
* **traffic** — what the learner predicts each rank hands to torch.distributed in one step, per
  operation and group, equals what :mod:`course_lib.dist.counter` measures of the learner's own
  step, exactly (calls and bytes are integers), and ``rank_parameters`` equals the stage's size;
* **pick** — "the planner's pick against measurement", made deterministic: the grader measures the
  traffic and the parameters of every candidate layout's step on 8 ranks and applies the README's
  cost model (α per call, β per byte, 6·P·T FLOPs at a time-shared rate, the pipeline's bubble) to
  the *measurements*; the learner's ``step_seconds`` applies it to *predictions*. They must agree
  for every candidate on two machines (this 2-core CPU; two 4-GPU nodes on 1 Gb/s: their picks differ), and
  ``pick`` must choose the layout the measurements make fastest, skipping candidates that cannot run.
  No clock is read: wall-clock times on a shared 2-core machine would make the grade a lottery
  (``run.py --measure`` shows them beside the predictions, ungraded).

The checks take an :class:`~course_lib.grading.adapter.Adapter` with the roles of :data:`ROLES`: the
grader passes the learner's ``capstone.py``; tests/grading/test_lab_checks.py passes course_lib's Mesh,
``check_layout`` and ``Composed`` (course_lib's planner has another model and interface, so traffic and
pick run on the reference solution in tests/labs/test_labs.py and on planted bugs in
tests/labs/test_lab10_capstone.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.dist import counter, device, launch
from course_lib.dist.mesh import AXES
from course_lib.grading.adapter import Adapter
from course_lib.grading.expect import raises
from course_lib.grading.grade import Task
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Layout, dense_names, sgd_one_process
from course_lib.parallel.pipeline.stages import split

ROLES = ("coordinates", "check_layout", "build", "step", "rank_parameters", "traffic", "step_seconds", "pick")


def adapter(lab_dir: Path) -> Adapter:
    """The learner's functions, from ``capstone.py``."""
    return Adapter.of_file(Path(lab_dir) / "capstone.py", ROLES)


G, S, LR, STEPS = 8, 16, 0.1, 3
# The composed step computes one process's sums in other orders (TP adds partial products, the
# pipeline the micro-batches' gradients one by one, DP the replicas'). Reordering a float32 sum of n
# terms moves it by at most about n·u·Σ|terms| (Higham, "Accuracy and Stability of Numerical
# Algorithms", §4.2; u = 2^-24 ≈ 6e-8): the loss, a mean of G·S = 128 token losses of about 4.2,
# by 128·u ≈ 7.6e-6 relative -> 1e-5; parameters move by lr·g with |g| ≲ 1, three steps of
# gradients off by 128·u·Σ|g| give well under 1e-6 (measured: under 1e-7). A wrong split (rows,
# a missing 1/dp or 1/m) moves the loss by 1e-2 and the parameters by 1e-3 or more.
# (Derived in tests/parallel/test_compose.py, which checks course_lib's composition with the same numbers.)
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6
# step_seconds against the grader's: the same formula on the same integers, summed in another order
# over at most a few dozen float64 terms: 1e-9 relative is 10^7 ulps of room, a wrong term is >1%.
SECONDS_RTOL = 1e-9
TRAIN_LAYOUTS = (Layout(dp=2, tp=2, pp=2, m=2), Layout(dp=1, tp=2, pp=4, m=4), Layout(dp=4, tp=1, pp=2, m=2))
BUILD_LAYOUTS = (Layout(dp=2, tp=2, pp=2, m=2), Layout(dp=1, tp=2, pp=4, m=4))
TRAFFIC_LAYOUTS = (Layout(dp=2, tp=2, pp=2, m=2), Layout(dp=1, tp=2, pp=4, m=4), Layout(dp=8, tp=1, pp=1, m=1))
CANDIDATES = (  # every layout of 8 ranks the tiny model takes (tp <= 2: it has 2 K/V heads), m in {1, 2, 4}
    Layout(dp=8, tp=1, pp=1, m=1),
    Layout(dp=4, tp=2, pp=1, m=1),
    Layout(dp=4, tp=1, pp=2, m=2),
    Layout(dp=2, tp=2, pp=2, m=2),
    Layout(dp=2, tp=1, pp=4, m=4),
    Layout(dp=1, tp=2, pp=4, m=4),
)
# What pick must skip: tp=4 for 2 K/V heads; dp=16 for 8 rows (which the model, not knowing, would
# predict fastest on the CPU: the same work per rank, its dp group beyond the one node free)
REFUSED = (Layout(dp=2, tp=4, pp=1, m=1), Layout(dp=16, tp=1, pp=1, m=1))
# The README's machines (the cost model's constants); built with the learner's Machine class.
MACHINES = (
    dict(name="2-core CPU, gloo", alpha=2e-3, beta=2e-9, flops_per_core=2.5e9, cores=2),
    dict(
        name="2 nodes × 4 GPUs, 1 Gb/s",
        alpha=10e-6,
        beta=1 / 150e9,
        flops_per_core=100e12,
        cores=8,
        node=4,
        alpha_out=50e-6,
        beta_out=8e-9,
    ),
)
LAUNCH_S = 150  # one 8-rank launch: ~6 s to start and build the groups on 2 cores, ~1 s per layout


def _cfg():
    return configs.get("tiny", n_layers=4)  # 4 blocks, so that 4 equal stages are possible


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(_cfg())


def _batches():
    """STEPS global batches (x, y) on the host: every machine draws the same tokens, for the one-process
    reference here and for the ranks, which move them to their device."""
    g = torch.Generator().manual_seed(3)  # host: the same tokens on every machine
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, 64, (G, S + 1), generator=g)  # host: drawn with g
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _reference():
    return sgd_one_process(_model(), _batches(), LR)


def _gathered_stage(part) -> dict[str, torch.Tensor]:
    """This rank's stage with its TP shards joined, under the whole model's parameter names."""
    stage, tp = part.stage, part.groups["tp"]
    t = dist.get_world_size(tp)
    names, out = dense_names(stage), {}
    for name, p in stage.named_parameters():
        dim = getattr(p, "partition_dim", None)
        full = p.detach().clone()
        if dim is not None and t > 1:
            parts = [torch.empty_like(p) for _ in range(t)]
            dist.all_gather(parts, p.detach().contiguous(), group=tp)
            full = torch.cat(parts, dim=dim)
        out[names[name]] = full
    return out


def _rank(impl: Adapter, layouts, steps: int, gather: bool) -> list[dict]:
    """On each rank, for each layout: build, train ``steps`` SGD steps (counting the first), report."""
    rank, out = dist.get_rank(), []
    for layout in layouts:
        part = impl["build"](_model().to(device()), layout, G)  # initialised on the host: the same weights
        got = {
            "coords": tuple(impl["coordinates"](rank, layout)),
            "numel": sum(p.numel() for p in part.stage.parameters()),
            "built": _gathered_stage(part) if gather and steps == 0 else None,
            "losses": [],
            "traffic": None,
        }
        opt = torch.optim.SGD(part.stage.parameters(), lr=LR)
        for i, (x, y) in enumerate((x.to(device()), y.to(device())) for x, y in _batches()[:steps]):
            with counter.count() as c:
                got["losses"].append(impl["step"](part, x, y))
            if i == 0:
                got["traffic"] = c.as_dict()
            opt.step()
            opt.zero_grad()
        if gather and steps:
            got["trained"] = _gathered_stage(part)
        out.append(got)
    return out


def _run(impl: Adapter, layouts, steps: int, gather: bool = False) -> list[list[dict]]:
    """[layout][rank] -> what _rank reported; one launch of 8 ranks for all the layouts."""
    results = launch(_rank, 8, impl, layouts, steps, gather, timeout=LAUNCH_S)
    return [[results[r][i] for r in range(8)] for i in range(len(layouts))]


# -------------------------------------------------------------------------------------- checks


def check_setup(impl: Adapter) -> None:
    module = impl.module("coordinates")
    for fn in (*ROLES, "make_groups"):
        assert callable(getattr(module, fn, None)), f"capstone.py must define {fn}()"


def check_coordinates(impl: Adapter) -> None:
    for dp, tp, pp in ((2, 2, 2), (1, 2, 4), (4, 2, 1), (2, 1, 4), (8, 1, 1), (3, 2, 2), (2, 4, 3)):
        layout = Layout(dp=dp, tp=tp, pp=pp)
        # course_lib.dist.Mesh's grid (its axes dp, pp, cp, tp; cp = 1 here), built without process groups
        grid = torch.arange(layout.world_size).view(dp, pp, 1, tp)  # host: rank arithmetic in the grader's process
        assert AXES == ("dp", "pp", "cp", "tp")
        for rank in range(layout.world_size):
            d, s, _, t = ((grid == rank).nonzero()[0]).tolist()
            got = tuple(impl["coordinates"](rank, layout))
            assert got == (d, s, t), (
                f"coordinates({rank}, {layout}) returned {got}, expected (d, s, t) = {(d, s, t)}: tp innermost, "
                "then pp, dp outermost (rank = (d·pp + s)·tp + t)"
            )


def _refusals():
    """(layout, config, words, what): each breaks exactly ONE of check_layout's rules, so that a missing
    rule shows (a case breaking several is refused by any one of them); the message must say one of
    ``words``. tests/labs/test_lab10_capstone.py proves, with the rules written there, that each breaks one only."""
    cfg = _cfg()  # 4 heads, 2 K/V heads, vocabulary 64, d_ff 192, 4 blocks
    return (
        (Layout(tp=4), cfg, ("heads",), "tp=4 with 2 key/value heads (it divides the 4 attention heads)"),
        (Layout(tp=2), _cfg_with(vocab_size=65), ("heads", "vocab"), "tp=2 with a vocabulary of 65"),
        (Layout(tp=2), _cfg_with(d_ff=193), ("heads", "d_ff"), "tp=2 with d_ff = 193"),
        (Layout(pp=8), cfg, ("blocks",), "pp=8 stages for 4 transformer blocks"),
        (Layout(pp=3), cfg, ("blocks",), "pp=3 stages for 4 transformer blocks (3 does not divide 4)"),
        (Layout(dp=4, m=4), cfg, ("batch",), f"dp=4 × m=4 for a global batch of {G} (each alone divides it)"),
        (Layout(dp=3), cfg, ("batch",), f"dp=3 for a global batch of {G}"),
        (Layout(pp=2), _cfg_with(tie_embeddings=True), ("tied",), "pp=2 with tied embeddings"),
    )


def _cfg_with(**overrides):
    return configs.get("tiny", n_layers=4, **overrides)


# Layouts every rule accepts, some at a rule's edge: all the candidates, tied embeddings on one stage
ACCEPTED = (*((layout, False) for layout in CANDIDATES), (Layout(dp=8), True), (Layout(dp=2, tp=2, m=4), True))


def check_refusals(impl: Adapter) -> None:
    """check_layout raises ValueError for each layout that breaks one rule (heads, blocks, batch, tied;
    each case breaks that rule alone), naming the rule; and accepts every layout that breaks none."""
    for layout, c, words, what in _refusals():
        e = raises(ValueError, impl["check_layout"], layout, c, G, what=f"check_layout for {what}")
        assert any(w in str(e) for w in words), (
            f"check_layout refused {what}, but its message does not say {' or '.join(map(repr, words))}: {e}"
        )
    for layout, tied in ACCEPTED:
        try:
            impl["check_layout"](layout, _cfg_with(tie_embeddings=tied), G)
        except ValueError as e:
            raise AssertionError(
                f"check_layout refused {layout}{' with tied embeddings' if tied else ''}, which the model and a "
                f"batch of {G} can take: {e}"
            ) from None


def check_build(impl: Adapter) -> None:
    dense = {n: p.detach() for n, p in _model().named_parameters()}
    for layout, ranks in zip(BUILD_LAYOUTS, _run(impl, BUILD_LAYOUTS, 0, gather=True)):
        covered = set()
        for rank, got in enumerate(ranks):
            s = got["coords"][1]
            stage = split(_model(), layout.pp, uniform=True)[s]
            want = sum(p.numel() // layout.tp if p.dim() == 2 else p.numel() for p in stage.parameters())
            assert got["numel"] == want, (
                f"{layout}: rank {rank} (stage {s}) holds {got['numel']} parameters, expected {want}: 1/tp of every "
                "matrix (TPBlock, VocabParallelEmbedding, ColumnParallelLinear), the norms whole"
            )
            for name, tensor in got["built"].items():
                assert name in dense and torch.equal(tensor, dense[name]), (
                    f"{layout}: rank {rank}'s {name}, its TP shards joined, is not the dense model's: build stage "
                    f"s = {s} from the same model and split it with from_dense"
                )
                covered.add(name)
        missing = sorted(set(dense) - covered)
        assert not missing, f"{layout}: no rank holds {missing[:3]}: each stage keeps its blocks, ends included"


def check_training(impl: Adapter) -> None:
    ref_losses, ref_params = _reference()
    for layout, ranks in zip(TRAIN_LAYOUTS, _run(impl, TRAIN_LAYOUTS, STEPS, gather=True)):
        reporting = [got["losses"] for got in ranks if got["losses"] and got["losses"][0] is not None]
        assert len(reporting) == layout.dp * layout.tp, (
            f"{layout}: {len(reporting)} ranks returned a loss; the {layout.dp * layout.tp} ranks of the last stage must"
        )
        for losses in reporting:
            for i, (got, want) in enumerate(zip(losses, ref_losses)):
                assert abs(got - want) <= LOSS_RTOL * abs(want), (
                    f"{layout}: the loss of step {i} is {got:.6f}, one process has {want:.6f}: look at the replica's "
                    "rows, the mean over the m micro-batches and over dp"
                )
        for rank, got in enumerate(ranks):
            for name, tensor in got["trained"].items():
                gap = (tensor - ref_params[name]).abs().max().item()
                assert gap <= PARAM_ATOL, (
                    f"{layout}: after {STEPS} SGD steps rank {rank}'s {name} is off by {gap:.1e} from one process "
                    f"(allowed {PARAM_ATOL:g}): the gradients must be the whole batch's mean (rows, the dp average)"
                )


def check_traffic(impl: Adapter) -> None:
    cfg = _cfg()
    for layout, ranks in zip(TRAFFIC_LAYOUTS, _run(impl, TRAFFIC_LAYOUTS, 1)):
        for rank, got in enumerate(ranks):
            coords = got["coords"]
            n = impl["rank_parameters"](cfg, layout, coords)
            assert n == got["numel"], (
                f"{layout}: rank_parameters(coords={coords}) = {n}, the built stage holds {got['numel']}"
            )
            want = impl["traffic"](cfg, layout, G, S, coords)
            measured = got["traffic"]
            wrong = sorted(k for k in set(want) | set(measured) if want.get(k) != measured.get(k))
            assert not wrong, (
                f"{layout}, rank {rank} {coords}: traffic() predicts "
                + "; ".join(f"{k} {want.get(k)}" for k in wrong)
                + " — the counter measured "
                + "; ".join(f"{k} {measured.get(k)}" for k in wrong)
            )


def _measured_seconds(layout: Layout, ranks: list[dict], machine) -> float:
    """The README's cost model applied to what the ranks measured: the slowest rank's time."""
    sizes = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    spans = {"tp": layout.tp, "pp": layout.pp * layout.tp, "dp": layout.world_size}
    tokens = G * S // layout.dp
    worst = 0.0
    for got in ranks:
        compute = (layout.m + layout.pp - 1) / layout.m * 6 * got["numel"] * tokens
        seconds = compute / machine.flops_per_rank(layout.world_size)
        for key, c in got["traffic"].items():
            axis = key.split("@")[1]
            if sizes.get(axis, 1) > 1:
                alpha, beta = machine.link(spans[axis])
                seconds += c["calls"] * alpha + c["bytes"] * beta
        worst = max(worst, seconds)
    return worst


def check_pick(impl: Adapter) -> None:
    cfg = _cfg()
    machine_class = impl.module("pick").Machine
    measured = _run(impl, CANDIDATES, 1)
    picks = []
    for spec in MACHINES:
        machine = machine_class(**spec)
        reference = {ly: _measured_seconds(ly, ranks, machine) for ly, ranks in zip(CANDIDATES, measured)}
        for layout, want in reference.items():
            got = impl["step_seconds"](cfg, layout, G, S, machine)
            assert abs(got - want) <= SECONDS_RTOL * want, (
                f"{machine.name}: step_seconds({layout}) = {got:.6e} s; the cost model on the measured traffic and "
                f"parameters gives {want:.6e} s: check the bubble, the FLOPs, the time-shared rate and which groups pay"
            )
        best = min(CANDIDATES, key=reference.get)
        picks.append(best)
        candidates = [REFUSED[0], *CANDIDATES[::-1], REFUSED[1]]  # not in the fastest-first order
        got = impl["pick"](candidates, cfg, G, S, machine)
        assert got == best, (
            f"{machine.name}: pick chose {got}; the measured traffic makes {best} fastest "
            f"({reference[best]:.3e} s): skip what check_layout refuses, take the least step_seconds"
        )
    assert len(set(picks)) == len(picks), f"the grader's machines should pick different layouts: {picks}"


TASKS = [
    Task("capstone.py imports and defines the functions", 1, check_setup, setup=True),
    Task("Task 1: rank -> (d, s, t), tp innermost, dp outermost", 2, check_coordinates),
    Task("Task 1: layouts the model cannot take refused, naming why", 1, check_refusals),
    # build uses Task 1's coordinates (through make_groups) and check_layout
    Task(
        "Task 2: each rank's stage, TP-split, is the dense model's",
        2,
        check_build,
        timeout=180,
        needs=(check_coordinates, check_refusals),
    ),
    Task(
        "Task 3: 3 SGD steps on 8 ranks equal one process (3 layouts)",
        5,
        check_training,
        timeout=180,
        needs=(check_coordinates, check_refusals, check_build),  # trains Task 2's stage
    ),
    Task(
        "Task 4: predicted traffic equals the counter's, per rank and group",
        3,
        check_traffic,
        timeout=180,
        needs=(check_coordinates, check_build),  # measures Task 2's stage
    ),
    Task(
        "Task 4: step_seconds and pick agree with the measured traffic",
        3,
        check_pick,
        timeout=180,
        needs=(check_coordinates, check_refusals, check_build),  # pick skips what check_layout refuses
    ),
]
