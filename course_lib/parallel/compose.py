"""One mesh, three parallelisms: data × tensor × pipeline parallel training of the course model.

Each piece is one course_lib already has; composing them is a matter of giving each its own
process group from one :class:`~course_lib.dist.Mesh` (``dp`` outermost, then ``pp``, ``tp``
innermost, so that TP's ranks are neighbours — one NVLink domain on a real machine):

* **pipeline** — the dense model is cut into ``pp`` stages (:func:`course_lib.parallel.pipeline.stages.split`),
  and rank (d, s, t) keeps stage s. A step runs a schedule's action list
  (:mod:`course_lib.parallel.pipeline.schedules`, 1F1B by default) over the ``pp`` group;
* **tensor** — inside its stage, each block becomes a :class:`~course_lib.parallel.tensor.model.TPBlock`
  over the ``tp`` group; stage 0's embedding is vocabulary-parallel, the last stage's output layer is
  column-parallel and its loss the vocabulary-parallel cross-entropy. The TP ranks of one stage run
  the same actions in the same order, so their all-reduces pair up;
* **data** — each ``dp`` replica gets its 1/dp of the global batch and cuts it into ``m``
  micro-batches; after the pipeline's backward, every gradient is averaged over the ``dp`` group;
* **expert** (a mixture-of-experts model, ``ep`` > 1, tp = 1) — ``ep`` consecutive replicas share the
  routed experts of each MoE layer, E/ep each (:mod:`course_lib.parallel.expert`): tokens travel to
  their experts' rank by all-to-all inside the stage. A routed expert's gradient arrives already
  summed over its ``ep`` group (the dispatch's backward brings every replica's share to the owner), so
  it is summed over the dp/ep copies of the same expert (the "expert data parallel" group) and
  divided by dp, where the replicated parameters are all-reduced over the whole ``dp`` group.

Numerically the composed step computes what one process computes on the whole batch: the same
sums, in other orders (TP adds partial products over its ranks, the pipeline adds the micro-batches'
gradients one after another, DP adds the replicas'). Narayanan et al. 2021 (*Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM*, §2.3, §3) compose the three this way and
study which sizes to choose; :mod:`course_lib.cost.planner` predicts it from the course's models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import device
from course_lib.dist.mesh import Mesh
from course_lib.dist.runtime import require_on_device
from course_lib.model.transformer import Transformer
from course_lib.parallel.expert.layer import ExpertParallelMoE, expert_parallel, expert_params
from course_lib.parallel.pipeline import executor, schedules
from course_lib.parallel.pipeline.stages import Stage, split
from course_lib.parallel.tensor.model import TPBlock
from course_lib.parallel.tensor.sharded_layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def tensor_parallel_stage(stage: Stage, group) -> Stage:
    """``stage`` (a :class:`~course_lib.parallel.pipeline.stages.Stage`) with its layers split over a TP
    group, in place: blocks become :class:`~course_lib.parallel.tensor.model.TPBlock`, the first stage's
    embedding vocabulary-parallel, the last stage's output layer column-parallel (logits [b, s, V/t]).
    ``Stage.forward`` runs it unchanged: hidden states between stages stay replicated over the group."""
    if stage.first:
        stage.tok_embeddings = VocabParallelEmbedding.from_dense(stage.tok_embeddings, group)
    stage.layers = nn.ModuleList(TPBlock.from_dense(b, group) for b in stage.layers)
    if stage.last:
        stage.output = ColumnParallelLinear.from_dense(stage.output, group)
    return stage


def dense_names(stage: Stage) -> dict[str, str]:
    """The stage's parameter names -> the whole model's (block i of the stage is block ``stage.blocks[i]``)."""
    # an expert-parallel MoE holds experts first, first+1, ... under the local names experts.0, experts.1, ...
    firsts = {f"{n}.experts.": m.first for n, m in stage.named_modules() if isinstance(m, ExpertParallelMoE)}
    out = {}
    for name, _ in stage.named_parameters():
        full = name
        for prefix, first in firsts.items():
            if name.startswith(prefix):
                j, rest = name[len(prefix) :].split(".", 1)
                full = f"{prefix}{first + int(j)}.{rest}"
        if full.startswith("layers."):
            _, i, rest = full.split(".", 2)
            full = f"layers.{stage.blocks[int(i)]}.{rest}"
        out[name] = full
    return out


@dataclass(frozen=True)
class Layout:
    """Sizes of the mesh and of the pipeline's step: dp · tp · pp ranks, m micro-batches per replica."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    m: int = 1
    schedule: str = "1f1b"
    ep: int = 1  # expert-parallel ranks, carved out of dp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} m={self.m}" + (f" ep={self.ep}" if self.ep > 1 else "")


def check_layout(layout: Layout, cfg, global_batch: int) -> None:
    """Refuse a layout the model or the batch cannot be split by, saying which constraint and the fix."""
    problems = []
    if cfg.n_heads % layout.tp or cfg.n_kv_heads % layout.tp:
        problems.append(
            f"tensor parallel size {layout.tp} does not divide {cfg.n_heads} attention heads and "
            f"{cfg.n_kv_heads} key/value heads: choose tp among the common divisors"
        )
    if cfg.vocab_size % layout.tp or cfg.d_ff % layout.tp:
        problems.append(f"tp={layout.tp} does not divide the vocabulary ({cfg.vocab_size}) and d_ff ({cfg.d_ff})")
    if layout.pp > cfg.n_layers:
        problems.append(f"{layout.pp} pipeline stages need at least {layout.pp} blocks; the model has {cfg.n_layers}")
    if global_batch % (layout.dp * layout.m):
        problems.append(
            f"the global batch {global_batch} does not split into dp={layout.dp} replicas × m={layout.m} "
            f"micro-batches: choose dp·m dividing {global_batch}"
        )
    if layout.ep > 1 and (not cfg.is_moe or cfg.n_routed_experts % layout.ep or layout.dp % layout.ep):
        problems.append(
            f"expert parallel size {layout.ep} needs a mixture of experts whose {cfg.n_routed_experts} routed experts "
            f"it divides, and ep dividing dp={layout.dp} (its ranks are carved out of the replicas)"
        )
    if layout.ep > 1 and layout.tp > 1:
        problems.append("expert parallelism is composed here with tp=1 (experts are not split over TP ranks): use tp=1")
    if cfg.tie_embeddings and layout.pp > 1:
        problems.append("tied embeddings across pipeline stages are not composed here: untie them or use pp=1")
    if problems:
        raise ValueError(f"layout {layout} cannot run this model: " + "; ".join(problems))


class Composed:
    """This rank's part of a DP × TP × PP model, built from a dense model of the same seed.

    Call on every rank of a world of ``layout.world_size``; every rank passes the same dense
    ``model`` (it keeps only its stage, split over its TP group), already on the rank's device
    (``model.to(course_lib.dist.device())``): the stage computes where the model is, and the
    collectives need it there. The batches given to :meth:`step` may stay on the host: each
    micro-batch is moved to the stage's device when it enters the pipeline.
    """

    def __init__(self, model: Transformer, layout: Layout, global_batch: int):
        check_layout(layout, model.cfg, global_batch)
        require_on_device(model, "Composed")  # its stage and its collectives on the rank's device
        self.layout, self.cfg, self.global_batch = layout, model.cfg, global_batch
        self.mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep)
        self.schedule = schedules.build(layout.schedule, layout.pp, layout.m)
        stage = split(model, layout.pp)[self.mesh.rank("pp")]
        # tp = 1 keeps the dense blocks (an MoE block has no TP form here; a dense one computes the same)
        self.stage = tensor_parallel_stage(stage, self.mesh.group("tp")) if layout.tp > 1 else stage
        self.expert_dp = None  # the copies of this rank's experts: one per group of ep replicas
        if layout.ep > 1:
            expert_parallel(self.stage, self.mesh.group("ep"))
            for j in range(layout.ep):  # new_group is collective: every rank makes every group, in order
                for line in self.mesh.lines("dp"):
                    group = dist.new_group(line[j :: layout.ep])
                    if dist.get_rank() in line[j :: layout.ep]:
                        self.expert_dp = group

    def parameters(self):
        return self.stage.parameters()

    def _my_rows(self, batch: torch.Tensor) -> torch.Tensor:
        per = self.global_batch // self.layout.dp
        d = self.mesh.rank("dp")
        return batch[d * per : (d + 1) * per]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
        """Forward and backward of one global batch [G, s]; gradients averaged over dp in ``.grad``.

        Returns the mean loss of the whole batch on the ranks of the last stage (equal on its TP
        ranks; averaged over dp), None elsewhere.
        """
        if tokens.shape[0] != self.global_batch:
            raise ValueError(f"step expects the global batch of {self.global_batch} rows, got {tokens.shape[0]}")
        x, y = self._my_rows(tokens), self._my_rows(targets)
        m = self.layout.m
        xs, ys = list(x.chunk(m)), list(y.chunk(m))
        tp_group = self.mesh.group("tp")
        result = executor.run_step(
            self.schedule,
            {self.mesh.rank("pp"): self.stage},
            xs,
            ys,
            lambda logits, t: vocab_parallel_cross_entropy(logits, t, tp_group),
            (x.shape[0] // m, x.shape[1], self.cfg.d_model),
            group=self.mesh.group("pp"),
        )
        self._average_over_dp()
        if not self.stage.last:
            return None
        # on the stage's device: NCCL reduces device tensors only (the numbers are the same on CPU)
        loss = torch.tensor(sum(result.losses.values()) / m, device=device())
        dist.all_reduce(loss, group=self.mesh.group("dp"))
        return loss.item() / self.layout.dp

    def _average_over_dp(self) -> None:
        if self.layout.dp == 1:
            return
        experts = {id(p) for p in expert_params(self.stage)}
        replicated = [p for p in self.stage.parameters() if id(p) not in experts]
        self._average(replicated, self.mesh.group("dp"))
        if experts:  # already summed over the ep group by the dispatch's backward: add the copies, divide by dp
            self._average([p for p in self.stage.parameters() if id(p) in experts], self.expert_dp)

    def _average(self, params, group) -> None:
        for p in params:
            # An expert that none of this replica's tokens reached has no gradient here, while its copy in
            # another replica may have one: every rank of the group must add a buffer of the same size
            # (gloo fails on the mismatch, NCCL would hang). Its zero adds nothing, as in one process.
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce per step: a single bucket
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        flat /= self.layout.dp
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters, gathered on every rank (TP shards joined, stages collected).

        Collective over the world. For checks against single-process training. The result is on the
        host (CPU copies): it is gathered as Python objects, and a pickled CUDA tensor would be
        unpickled onto the *sender's* GPU on every rank.
        """
        tp_group = self.mesh.group("tp")
        mine = {}
        names = dense_names(self.stage)
        for name, p in self.stage.named_parameters():
            dim = getattr(p, "partition_dim", None)
            if dim is None or self.layout.tp == 1:
                full = p.detach().clone()
            else:
                parts = [torch.empty_like(p) for _ in range(self.layout.tp)]
                dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
                full = torch.cat(parts, dim=dim)
            mine[names[name]] = full.cpu()  # host: pickled for all_gather_object (see the docstring)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out = {}
        for part in gathered:
            out.update(part)
        return out


def sgd_one_process(model, batches, lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference every composed run is checked against: plain SGD on one process over whole global
    batches. Returns (loss of every step, final parameters by name); ``model`` itself is left untouched.
    The batches may stay on the host: each is moved to the model's device."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    at = next(model.parameters()).device
    losses = []
    for x, y in batches:
        loss = model.loss(x.to(at), y.to(at))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
