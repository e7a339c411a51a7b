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

# Your code goes in the fenced "Task N — your code" regions of this file:
#   line 77: Task 1: return (d, s, t), inverting rank = (d·pp + s)·tp + t
#   line 98: Task 1: raise ValueError naming every rule the layout breaks (heads, blocks, batch, tied); return None if it breaks none
#   line 162: Task 2: return the Part: coords, make_groups, stage s of the split made tensor-parallel over the tp group, the schedule
#   line 186: Task 3: leave the dp-averaged gradients in .grad; return the global batch's mean loss on the last stage, None elsewhere
#   line 201: Task 4: return the rank's parameter count: 1/tp of every matrix of its stage, the norms whole
#   line 227: Task 4: return {"op@group": {"calls": n, "bytes": b}} for every call one step makes on this rank
#   line 286: Task 4: return the seconds of the slowest rank: bubble-stretched compute plus alpha-beta communication
#   line 294: Task 4: return the candidate check_layout accepts with the least step_seconds (the first of equals)

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
    # ━━ Task 1 — your code: return (d, s, t), inverting rank = (d·pp + s)·tp + t ━━
    raise NotImplementedError('Task 1: return (d, s, t), inverting rank = (d·pp + s)·tp + t')
    # ━━ end of Task 1 ━━


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
    # ━━ Task 1 — your code: raise ValueError naming every rule the layout breaks (heads, blocks, batch, tied); return None if it breaks none ━━
    raise NotImplementedError('Task 1: raise ValueError naming every rule the layout breaks (heads, blocks, batch, tied); return None if it breaks none')
    # ━━ end of Task 1 ━━


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
    # ━━ Task 2 — your code: return the Part: coords, make_groups, stage s of the split made tensor-parallel over the tp group, the schedule ━━
    raise NotImplementedError('Task 2: return the Part: coords, make_groups, stage s of the split made tensor-parallel over the tp group, the schedule')
    # ━━ end of Task 2 ━━


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
    # ━━ Task 3 — your code: leave the dp-averaged gradients in .grad; return the global batch's mean loss on the last stage, None elsewhere ━━
    raise NotImplementedError("Task 3: leave the dp-averaged gradients in .grad; return the global batch's mean loss on the last stage, None elsewhere")
    # ━━ end of Task 3 ━━


# ------------------------------------------------------------------------------ Task 4


def rank_parameters(cfg: ModelConfig, layout: Layout, coords: tuple[int, int, int]) -> int:
    """How many parameters rank ``coords`` holds (its stage, tensor-parallel): what ``build`` gives it.

    Stage s holds blocks [s·L/pp, (s+1)·L/pp), plus the embedding (V × d) on stage 0 and the final
    norm (d) and output layer (V × d) on the last. A TP rank holds 1/tp of every matrix (wq, wk, wv,
    wo, w1, w2, w3, the embedding, the output layer) and the whole of every norm weight (d each).
    """
    # ━━ Task 4 — your code: return the rank's parameter count: 1/tp of every matrix of its stage, the norms whole ━━
    raise NotImplementedError("Task 4: return the rank's parameter count: 1/tp of every matrix of its stage, the norms whole")
    # ━━ end of Task 4 ━━


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
    # ━━ Task 4 — your code: return {"op@group": {"calls": n, "bytes": b}} for every call one step makes on this rank ━━
    raise NotImplementedError('Task 4: return {"op@group": {"calls": n, "bytes": b}} for every call one step makes on this rank')
    # ━━ end of Task 4 ━━


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
    # ━━ Task 4 — your code: return the seconds of the slowest rank: bubble-stretched compute plus alpha-beta communication ━━
    raise NotImplementedError('Task 4: return the seconds of the slowest rank: bubble-stretched compute plus alpha-beta communication')
    # ━━ end of Task 4 ━━


def pick(candidates: list[Layout], cfg: ModelConfig, global_batch: int, seq_len: int, machine: Machine) -> Layout:
    """The candidate with the least ``step_seconds`` on ``machine``, skipping those ``check_layout`` refuses
    (the first of equals)."""
    # ━━ Task 4 — your code: return the candidate check_layout accepts with the least step_seconds (the first of equals) ━━
    raise NotImplementedError('Task 4: return the candidate check_layout accepts with the least step_seconds (the first of equals)')
    # ━━ end of Task 4 ━━
