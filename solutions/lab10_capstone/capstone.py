"""Lab 10 — the capstone: one training step over a DP × TP × PP mesh, and a planner that picks the layout.

Eight ranks train the course model. Each rank has coordinates (d, s, t) on a mesh of sizes
(dp, pp, tp): it holds pipeline stage s of the model, split over the tp ranks that share (d, s),
and it is fed replica d's share of every global batch. Every piece is one you built in an earlier
lab, and course_lib has them all (given here, read their docstrings):

    course_lib.parallel.pipeline.stages.split(model, pp, uniform=True)   the model cut into stages
    course_lib.parallel.pipeline.schedules.build("1f1b", pp, m)         a schedule's action lists
    course_lib.parallel.pipeline.executor.run_step(schedule, ...)       one pipelined forward+backward
    course_lib.parallel.tensor.model.TPBlock.from_dense(block, group)    a block split over a TP group
    course_lib.parallel.tensor.sharded_layers: VocabParallelEmbedding, ColumnParallelLinear (``from_dense``),
                                       vocab_parallel_cross_entropy(logits, targets, group)

What is new is the composition (Narayanan et al. 2021, *Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM*, §2.3 and §3), and the question every large run starts with:
which (dp, tp, pp, m) to choose. You write

    Task 1  ``coordinates`` (rank -> (d, s, t), tp innermost, dp outermost) and ``check_layout``
            (refuse what the model or the batch cannot be split by, saying which constraint);
    Task 2  ``build``: this rank's stage, tensor-parallel over its TP group;
    Task 3  ``step``: replica d's rows, m micro-batches through the pipeline, the dp average —
            losses and parameters equal to one process training on the whole batch;
    Task 4  ``traffic`` (what each rank sends per step, on which group: graded exactly against what
            course_lib.dist.counter measures of *your* step), ``step_seconds`` (the cost model of the
            README on that traffic) and ``pick`` (the candidate layout it predicts fastest).

``make_groups`` (given) builds the process groups from your ``coordinates``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import intercept
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Layout
from course_lib.parallel.pipeline import executor, schedules
from course_lib.parallel.pipeline.stages import Stage, split
from course_lib.parallel.tensor.model import TPBlock
from course_lib.parallel.tensor.sharded_layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

AXES = ("dp", "pp", "tp")  # the order of a rank's coordinates (d, s, t), outermost first

# ------------------------------------------------------------------------------ Task 1


def coordinates(rank: int, layout: Layout) -> tuple[int, int, int]:
    """(d, s, t) of global ``rank`` on a mesh of ``layout.dp`` × ``layout.pp`` × ``layout.tp`` ranks.

    tp is innermost — ranks t and t+1 of one TP group are neighbours (on a real machine, GPUs of
    one NVLink domain, since TP talks most) — then pp, and dp outermost:

        rank = (d · pp + s) · tp + t

    so at dp = pp = tp = 2, rank 5 is (1, 0, 1). This is course_lib.dist.Mesh's layout (Megatron-LM's).
    """
    # BEGIN SOLUTION Task 1: return (d, s, t), inverting rank = (d·pp + s)·tp + t
    t = rank % layout.tp
    s = rank // layout.tp % layout.pp
    d = rank // (layout.tp * layout.pp)
    return d, s, t
    # END SOLUTION


def check_layout(layout: Layout, cfg: ModelConfig, global_batch: int) -> None:
    """Raise ``ValueError`` if the model or the batch cannot be split as ``layout`` says; else nothing.

    Each message names its constraint, with the numbers, so that the learner running it can fix it:

      * tp must divide the attention heads *and* the key/value heads (each rank computes whole
        heads), the vocabulary and d_ff — say "heads" in the message ("vocab" or "d_ff" will do
        where that is what tp does not divide);
      * pp stages need at least pp transformer blocks, and ``split(..., uniform=True)`` gives every
        stage the same number, so pp must divide n_layers — say "blocks";
      * the global batch must split into dp replicas of m micro-batches: dp·m divides it (each of
        dp and m dividing it alone is not enough) — say "batch";
      * tied embeddings are not composed across stages (pp > 1; on one stage they are fine) — say "tied".

    The grader tries layouts that break one rule each, so every rule must be there on its own.
    """
    # BEGIN SOLUTION Task 1: raise ValueError naming every rule the layout breaks (heads, blocks, batch, tied); return None if it breaks none
    problems = []
    if cfg.n_heads % layout.tp or cfg.n_kv_heads % layout.tp or cfg.vocab_size % layout.tp or cfg.d_ff % layout.tp:
        problems.append(
            f"tensor parallel size {layout.tp} does not divide {cfg.n_heads} attention heads, {cfg.n_kv_heads} "
            f"key/value heads, the vocabulary ({cfg.vocab_size}) and d_ff ({cfg.d_ff}): choose a common divisor"
        )
    if cfg.n_layers % layout.pp:
        problems.append(
            f"{layout.pp} pipeline stages of equal size need a multiple of {layout.pp} transformer blocks; "
            f"the model has {cfg.n_layers}"
        )
    if global_batch % (layout.dp * layout.m):
        problems.append(
            f"the global batch {global_batch} does not split into dp={layout.dp} replicas × m={layout.m} "
            f"micro-batches: choose dp·m dividing {global_batch}"
        )
    if cfg.tie_embeddings and layout.pp > 1:
        problems.append("tied embeddings across pipeline stages are not composed here: untie them or use pp=1")
    if problems:
        raise ValueError(f"layout {layout} cannot run this model: " + "; ".join(problems))
    # END SOLUTION


def make_groups(layout: Layout) -> dict[str, object]:
    """This rank's process group along each axis ("dp", "pp", "tp"), from your ``coordinates`` (given).

    The group along an axis is the set of ranks that share the two other coordinates, ordered by
    the coordinate along it. ``dist.new_group`` is collective, so every rank creates every group in
    the same order. Each group is named for course_lib.dist.counter ("all_reduce@tp", ...).
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if layout.world_size != world:
        raise ValueError(f"layout {layout} needs dp·tp·pp = {layout.world_size} ranks; the world has {world}")
    coords = [tuple(coordinates(r, layout)) for r in range(world)]
    sizes = (layout.dp, layout.pp, layout.tp)
    inside = all(0 <= c < n for xyz in coords for c, n in zip(xyz, sizes))
    if len(set(coords)) != world or not inside:
        raise ValueError(
            f"coordinates() must give each of the {world} ranks its own (d, s, t) with d < {layout.dp}, "
            f"s < {layout.pp}, t < {layout.tp}; it gave {coords}"
        )
    groups = {}
    for i, axis in enumerate(AXES):
        lines: dict[tuple, list[int]] = {}
        for r, xyz in enumerate(coords):
            lines.setdefault(xyz[:i] + xyz[i + 1 :], []).append(r)
        for key in sorted(lines):
            ranks = sorted(lines[key], key=lambda r: coords[r][i])
            if ranks != sorted(ranks):  # torch numbers a group's ranks in increasing global rank
                raise ValueError(f"along {axis}, coordinates() must increase with the global rank: {ranks}")
            group = dist.new_group(ranks)
            if me in ranks:
                groups[axis] = group
                intercept.name_group(group, axis)
    return groups


@dataclass
class Part:
    """What one rank holds: its coordinates, its groups, its stage (tensor-parallel) and the schedule."""

    cfg: ModelConfig
    layout: Layout
    global_batch: int
    coords: tuple[int, int, int]  # (d, s, t)
    groups: dict  # "dp" | "pp" | "tp" -> process group
    stage: Stage
    schedule: schedules.Schedule


# ------------------------------------------------------------------------------ Task 2


def build(model: Transformer, layout: Layout, global_batch: int) -> Part:
    """This rank's :class:`Part` of ``model``; call on every rank, each with the same dense ``model``.

    Check the layout, find this rank's coordinates and groups (``make_groups``), cut the model into
    ``layout.pp`` equal stages (``split(model, pp, uniform=True)``), keep stage s and split it over
    the TP group: blocks become TPBlocks, stage 0's embedding vocabulary-parallel, the last stage's
    output layer column-parallel (its logits are [b, s, V/tp]). The norms stay whole on every TP
    rank. Build the schedule ``layout.schedule`` (1F1B) for pp ranks and m micro-batches.
    """
    # BEGIN SOLUTION Task 2: return the Part: coords, make_groups, stage s of the split made tensor-parallel over the tp group, the schedule
    check_layout(layout, model.cfg, global_batch)
    coords = tuple(coordinates(dist.get_rank(), layout))
    groups = make_groups(layout)
    stage = split(model, layout.pp, uniform=True)[coords[1]]
    tp = groups["tp"]
    if stage.first:
        stage.tok_embeddings = VocabParallelEmbedding.from_dense(stage.tok_embeddings, tp)
    stage.layers = nn.ModuleList(TPBlock.from_dense(block, tp) for block in stage.layers)
    if stage.last:
        stage.output = ColumnParallelLinear.from_dense(stage.output, tp)
    schedule = schedules.build(layout.schedule, layout.pp, layout.m)
    return Part(model.cfg, layout, global_batch, coords, groups, stage, schedule)
    # END SOLUTION


# ------------------------------------------------------------------------------ Task 3


def step(part: Part, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
    """Forward and backward of one global batch ``tokens``, ``targets`` [G, S] (the same on every rank).

    1. Replica d takes rows [d·G/dp, (d+1)·G/dp) and cuts them into m micro-batches (``chunk``).
    2. ``executor.run_step`` runs the schedule over the pp group with this rank's stage; the loss is
       the vocabulary-parallel cross-entropy over the tp group; the hidden state between stages is
       [G/(dp·m), S, d_model]. run_step divides each micro-batch's loss by m before its backward, so
       the gradients are those of the replica's mean loss.
    3. When dp > 1: average every gradient over the dp group, all in ONE all-reduce (flatten the
       ``.grad`` of the stage's parameters into one tensor, reduce, divide by dp, copy back).
    4. Return the mean loss of the whole global batch on the ranks of the last stage — the mean of
       ``result.losses`` over the m micro-batches, averaged over dp with one all-reduce of a float32
       scalar when dp > 1 — and None on the other ranks.

    The caller then steps the optimizer: the parameters must follow one process training on [G, S].
    """
    # BEGIN SOLUTION Task 3: leave the dp-averaged gradients in .grad; return the global batch's mean loss on the last stage, None elsewhere
    ly, (d, _, _) = part.layout, part.coords
    rows = part.global_batch // ly.dp
    x, y = tokens[d * rows : (d + 1) * rows], targets[d * rows : (d + 1) * rows]
    tp, dp = part.groups["tp"], part.groups["dp"]
    result = executor.run_step(
        part.schedule,
        {part.coords[1]: part.stage},
        list(x.chunk(ly.m)),
        list(y.chunk(ly.m)),
        lambda logits, t: vocab_parallel_cross_entropy(logits, t, tp),
        (rows // ly.m, x.shape[1], part.cfg.d_model),
        group=part.groups["pp"],
    )
    if ly.dp > 1:
        grads = [p.grad for p in part.stage.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp)
        flat /= ly.dp
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
    if not part.stage.last:
        return None
    device = next(part.stage.parameters()).device  # the dp all-reduce needs it where the collectives run
    loss = torch.tensor(sum(result.losses.values()) / ly.m, device=device)
    if ly.dp > 1:
        dist.all_reduce(loss, group=dp)
        loss /= ly.dp
    return loss.item()
    # END SOLUTION


# ------------------------------------------------------------------------------ Task 4


def rank_parameters(cfg: ModelConfig, layout: Layout, coords: tuple[int, int, int]) -> int:
    """How many parameters rank ``coords`` holds (its stage, tensor-parallel): what ``build`` gives it.

    Stage s holds blocks [s·L/pp, (s+1)·L/pp), plus the embedding (V × d) on stage 0 and the final
    norm (d) and output layer (V × d) on the last. A TP rank holds 1/tp of every matrix (wq, wk, wv,
    wo, w1, w2, w3, the embedding, the output layer) and the whole of every norm weight (d each).
    """
    # BEGIN SOLUTION Task 4: return the rank's parameter count: 1/tp of every matrix of its stage, the norms whole
    d, v, hd = cfg.d_model, cfg.vocab_size, cfg.head_dim
    matrices = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * cfg.d_ff
    per_block = matrices // layout.tp + 2 * d
    s = coords[1]
    n = cfg.n_layers // layout.pp * per_block
    if s == 0:
        n += v * d // layout.tp
    if s == layout.pp - 1:
        n += d + v * d // layout.tp
    return n
    # END SOLUTION


def traffic(
    cfg: ModelConfig, layout: Layout, global_batch: int, seq_len: int, coords: tuple[int, int, int]
) -> dict[str, dict[str, int]]:
    """What rank ``coords`` hands to torch.distributed in one call of your ``step``, per operation and group.

    In the counter's format, ``{"all_reduce@tp": {"calls": 18, "bytes": 147456}, "isend@pp": ...}``,
    with the operations your step calls ("all_reduce", "isend", "irecv") and the groups' names ("dp",
    "pp", "tp"); leave out what has no call. Bytes are payloads in float32 (4 bytes a value): the
    whole tensor of an all-reduce, a send or a receive. With b = G/(dp·m) rows per micro-batch, one
    hidden state is b·S·d_model values. Per micro-batch:

      * tp: each block 2 all-reduces forward (the g after attention and after the MLP) and 2 backward
        (the f before them) of one hidden state; stage 0's embedding one forward; the last stage's
        output layer one backward, and the vocab-parallel cross-entropy 3 of b·S values. The layers
        call them whatever tp is, even on a group of one rank: count them at tp = 1 too;
      * pp: a stage that has a next stage sends its output (isend) and receives its gradient (irecv);
        one that has a previous stage receives its input and sends its input's gradient (run_step
        posts every receive as an irecv, batched with a send: crossing sends cannot deadlock under NCCL);
    and per step, when dp > 1, the one all-reduce of the gradients (every parameter of the rank,
    ``rank_parameters``) and, on the last stage, the one of the loss.
    """
    # BEGIN SOLUTION Task 4: return {"op@group": {"calls": n, "bytes": b}} for every call one step makes on this rank
    ly = layout
    _, s, _ = coords
    b = global_batch // (ly.dp * ly.m)
    hidden = 4 * b * seq_len * cfg.d_model
    first, last = s == 0, s == ly.pp - 1
    blocks = cfg.n_layers // ly.pp
    tp_calls = 4 * blocks + first + last
    out = {
        "all_reduce@tp": {
            "calls": ly.m * (tp_calls + 3 * last),
            "bytes": ly.m * (tp_calls * hidden + 3 * last * 4 * b * seq_len),
        }
    }
    p2p = ly.m * ((not last) + (not first))  # each neighbour: one message each way per micro-batch
    if p2p:
        out["isend@pp"] = out["irecv@pp"] = {"calls": p2p, "bytes": p2p * hidden}
    if ly.dp > 1:
        grads = 4 * rank_parameters(cfg, ly, coords)
        out["all_reduce@dp"] = {"calls": 1 + last, "bytes": grads + 4 * last}
    return out
    # END SOLUTION


@dataclass(frozen=True)
class Machine:
    """The cost model's constants (the README's table). Every call on a group of more than one rank
    costs α seconds plus β seconds per byte of its payload, on the link its group uses: inside a node
    (``node`` consecutive ranks) or across the network. ``cores`` cores (devices) share their
    ``flops_per_core`` among the ranks."""

    name: str
    alpha: float  # seconds per call inside a node (latency: a collective's start, a message's round trip)
    beta: float  # seconds per payload byte inside a node (1 / bandwidth)
    flops_per_core: float  # FLOP/s one core (or one device) sustains on the course model's matmuls
    cores: int  # cores (devices) the ranks share
    node: int = 8  # ranks per node
    alpha_out: float = 0.0  # across nodes
    beta_out: float = 0.0

    def flops_per_rank(self, world: int) -> float:
        """A rank's compute rate: one core each while there are enough, time-shared beyond."""
        return self.flops_per_core * min(1.0, self.cores / world)

    def link(self, span: int) -> tuple[float, float]:
        """(α, β) for a group whose ranks lie within ``span`` consecutive ranks: inside a node or not."""
        return (self.alpha, self.beta) if span <= self.node else (self.alpha_out, self.beta_out)


# This machine: 8 gloo ranks time-shared on 2 cores, talking over loopback (calibrated in the README).
CPU = Machine("2-core CPU, gloo", alpha=2e-3, beta=2e-9, flops_per_core=2.5e9, cores=2)
# Two nodes of 4 GPUs on 1 Gb/s Ethernet, running the same tiny model: compute is nearly free, and
# which group crosses the network decides.
NODES = Machine(
    "2 nodes × 4 GPUs, 1 Gb/s",
    alpha=10e-6,
    beta=1 / 150e9,
    flops_per_core=100e12,
    cores=8,
    node=4,
    alpha_out=50e-6,
    beta_out=8e-9,
)


def step_seconds(cfg: ModelConfig, layout: Layout, global_batch: int, seq_len: int, machine: Machine) -> float:
    """The predicted time of one ``step`` of ``layout``: the slowest rank's compute plus communication.

    For each rank (d, s, t), with P = ``rank_parameters`` and T = G·S/dp tokens in its replica:

        compute = (m + pp - 1)/m · 6·P·T / machine.flops_per_rank(world)    (the pipeline's bubble:
                  m micro-batches take m + pp - 1 slots; 6 FLOPs per parameter per token, fwd + bwd)
        comm    = Σ over its ``traffic`` entries on groups of more than one rank: calls·α + bytes·β,
                  (α, β) = machine.link(span): a tp group lies within tp consecutive ranks, a pp
                  group within pp·tp, a dp group within dp·pp·tp (tp innermost)

    and the step takes the largest compute + comm over the ranks.
    """
    # BEGIN SOLUTION Task 4: return the seconds of the slowest rank: bubble-stretched compute plus alpha-beta communication
    ly, world = layout, layout.world_size
    sizes = {"dp": ly.dp, "pp": ly.pp, "tp": ly.tp}
    spans = {"tp": ly.tp, "pp": ly.pp * ly.tp, "dp": world}
    tokens = global_batch * seq_len // ly.dp
    worst = 0.0
    for rank in range(world):
        xyz = coordinates(rank, ly)
        flops = 6 * rank_parameters(cfg, ly, xyz) * tokens
        seconds = (ly.m + ly.pp - 1) / ly.m * flops / machine.flops_per_rank(world)
        for key, c in traffic(cfg, ly, global_batch, seq_len, xyz).items():
            axis = key.split("@")[1]
            if sizes[axis] > 1:
                alpha, beta = machine.link(spans[axis])
                seconds += c["calls"] * alpha + c["bytes"] * beta
        worst = max(worst, seconds)
    return worst
    # END SOLUTION


def pick(candidates: list[Layout], cfg: ModelConfig, global_batch: int, seq_len: int, machine: Machine) -> Layout:
    """The candidate with the least ``step_seconds`` on ``machine``, skipping those ``check_layout`` refuses
    (the first of equals)."""
    # BEGIN SOLUTION Task 4: return the candidate check_layout accepts with the least step_seconds (the first of equals)
    best, best_seconds = None, float("inf")
    for layout in candidates:
        try:
            check_layout(layout, cfg, global_batch)
        except ValueError:
            continue
        seconds = step_seconds(cfg, layout, global_batch, seq_len, machine)
        if seconds < best_seconds:
            best, best_seconds = layout, seconds
    if best is None:
        raise ValueError("no candidate layout can run this model and batch")
    return best
    # END SOLUTION
