"""Cut the course Transformer into consecutive pipeline stages, balanced by cost.

Stage 0 holds the token embedding, the last stage the final norm and the output layer, and the
transformer blocks are shared out in contiguous runs so that the costliest stage is as cheap as
it can be (the linear-partition problem, solved exactly by dynamic programming). The cost of a
block is its parameter count by default — proportional to its FLOPs per token for a dense model —
or whatever the caller measured (seconds per block on this machine, say).

Every rank builds the whole model from the same seed and keeps only its stages, so a stage starts
from exactly the weights of the non-pipelined model. With tied embeddings the first and the last
stage each hold a copy of the shared matrix; :func:`sum_tied_gradients` gives both the sum of their
gradients after the backward pass (Megatron-LM's "embedding group"), which keeps the two copies equal.

Tested in tests/parallel/pipeline/test_pipeline.py (balance, split, tied embeddings kept in sync).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.model.transformer import Transformer
from course_lib.parallel.pipeline.schedules import Schedule


def balance(block_costs: Sequence[float], n_stages: int, first: float = 0.0, last: float = 0.0) -> list[range]:
    """Contiguous runs of blocks, one per stage, minimising the most expensive stage; ``first`` and
    ``last`` are the costs the first and the last stage carry besides their blocks."""
    n = len(block_costs)
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    if n_stages > n:
        raise ValueError(
            f"{n_stages} pipeline stages need at least {n_stages} transformer blocks, one per stage; "
            f"the model has {n}: use fewer stages (p·v <= n_layers) or a deeper model"
        )
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, i: int, j: int) -> float:  # blocks i..j-1 on this stage
        return prefix[j] - prefix[i] + (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)

    # best[s][j]: the least possible maximum over stages 0..s-1 holding blocks 0..j-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                worst = max(best[s - 1][i], cost(s - 1, i, j))
                if worst < best[s][j]:
                    best[s][j], cut[s][j] = worst, i
    runs, j = [], n
    for s in range(n_stages, 0, -1):
        runs.append(range(cut[s][j], j))
        j = cut[s][j]
    return runs[::-1]


class Stage(nn.Module):
    """Blocks ``layers`` of ``model``, plus the embedding on stage 0 and the norm and output layer on the last."""

    def __init__(self, model: Transformer, index: int, n_stages: int, layers: range):
        super().__init__()
        memo: dict = {}  # one memo: a matrix tied inside this stage stays tied in the copy
        self.index, self.first, self.last = index, index == 0, index == n_stages - 1
        self.blocks = list(layers)  # which of the model's blocks this stage holds
        self.tied = model.cfg.tie_embeddings and n_stages > 1  # a copy of the shared matrix on each end
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings, memo) if self.first else None
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i], memo) for i in layers)
        self.norm = copy.deepcopy(model.norm, memo) if self.last else None
        self.output = copy.deepcopy(model.output, memo) if self.last else None
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [batch, seq] on stage 0, hidden states [batch, seq, d_model] elsewhere; logits on the last."""
        h = self.tok_embeddings(x) if self.first else x
        t = h.shape[1]
        for layer in self.layers:
            h = layer(h, self.rope_cos[:t], self.rope_sin[:t])
        return self.output(self.norm(h)) if self.last else h


def split(
    model: Transformer, n_stages: int, block_costs: Sequence[float] | None = None, uniform: bool = False
) -> list[Stage]:
    """``model`` cut into ``n_stages`` stages, balanced by parameter count or by ``block_costs``; with
    ``uniform``, the same number of blocks on every stage, as Megatron-LM lays out its (virtual)
    pipeline stages, which requires n_layers to be a multiple of n_stages (= p·v)."""
    count = lambda module: sum(t.numel() for t in module.parameters())
    n_layers = len(model.layers)
    if uniform:
        if n_layers % n_stages:
            raise ValueError(
                f"uniform stages: {n_layers} transformer blocks do not split into {n_stages} equal stages "
                f"(p·v = {n_stages}); choose p·v dividing n_layers, or balance by cost (uniform=False)"
            )
        per = n_layers // n_stages
        return [Stage(model, s, n_stages, range(s * per, (s + 1) * per)) for s in range(n_stages)]
    if block_costs is None:
        block_costs = [count(b) for b in model.layers]
        first, last = count(model.tok_embeddings), count(model.norm) + model.output.weight.numel()
    else:
        if len(block_costs) != len(model.layers):
            raise ValueError(f"block_costs has {len(block_costs)} entries; the model has {len(model.layers)} blocks")
        first = last = 0.0
    runs = balance(block_costs, n_stages, first, last)
    return [Stage(model, s, n_stages, run) for s, run in enumerate(runs)]


def tied_group(schedule: Schedule):
    """The process group of the first and the last stage's ranks, for tied embeddings (collective:
    every rank calls it, in the same order); None when one rank holds both."""
    ranks = sorted({schedule.placement[0], schedule.placement[-1]})
    return dist.new_group(ranks) if len(ranks) == 2 else None


def sum_tied_gradients(schedule: Schedule, stages: dict[int, nn.Module], group) -> None:
    """With tied embeddings the first stage's embedding and the last stage's output layer are two
    copies of one matrix: give both the sum of their gradients (call after the step's backward)."""
    last = schedule.n_stages - 1
    ends = [stages[s] for s in (0, last) if s in stages]
    if not ends or not ends[0].tied:
        return
    weights = [stages[0].tok_embeddings.weight] if 0 in stages else []
    weights += [stages[last].output.weight] if last in stages else []
    for w in weights:
        if w.grad is None:
            w.grad = torch.zeros_like(w)
    if len(weights) == 2:  # one rank holds both ends
        total = weights[0].grad + weights[1].grad
        for w in weights:
            w.grad.copy_(total)
    else:
        dist.all_reduce(weights[0].grad, group=group)
