"""The composed model at real world sizes, without running it: one simulated rank at a time.

torch's fake process group (backend ``"fake"`` with a ``FakeStore``, from
``torch.testing._internal.distributed.fake_pg``) accepts any rank of any world size in one process:
every collective returns at once and moves nothing. The model is built on the meta device, where
tensors have shapes and no storage, so a 72B model costs no memory. For each simulated rank,
:func:`simulate_rank` builds what the composed step (:mod:`course_lib.parallel.compose`) builds for it:
- the mesh's process groups;
- its pipeline stage (``pipeline.stages.split``);
- the Megatron split of that stage over the rank's TP group (``compose.tensor_parallel_stage``).

It then runs one micro-batch forward and backward through the stage, under the course's communication
counter (:mod:`course_lib.dist.counter`). It reports the parameters the rank holds and every collective
it issued. tests/measure/test_simulated_ranks.py sets them against the planner's terms
(:func:`course_lib.cost.planner.rank_params`, :func:`course_lib.cost.step_time.tp_layer_collectives`).

What does not run this way, and why:
- ``Composed.step`` itself. It moves micro-batches to ``course_lib.dist.device()``, reads each loss
  with ``.item()``, and a meta tensor has no value for either.
- So the pipeline's sends and the data-parallel gradient average, which come from ``step``, are not
  counted here. The stage's forward and backward, with all their TP collectives, are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import counter
from course_lib.dist.mesh import Mesh
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Layout, tensor_parallel_stage
from course_lib.parallel.pipeline.stages import Stage, split


def meta_model(cfg: ModelConfig) -> Transformer:
    """``cfg``'s model on the meta device: every parameter's shape, no storage (a 72B model in ~2 s)."""
    with torch.device("meta"):  # meta: shapes without storage, so a real-size model fits in this process
        return Transformer(cfg)


def simulate_rank(
    model: Transformer,
    layout: Layout,
    rank: int,
    micro_batch: int,
    seq_len: int,
    step: bool = True,
    splits: list[list[int]] | None = None,
) -> dict:
    """What rank ``rank`` of ``layout`` holds and, with ``step``, sends for one micro-batch, forward and
    backward (the step is most of the cost: ~0.5 s a rank on 2 cores, against ~0.05 s to build it).

    Returns {"coords": {"dp", "pp", "tp"}, "blocks": the stage's block indices, "first", "last",
    "params": parameters held, "comm": the counter's {"op@group": {"calls", "bytes"}}, or None without
    ``step``}. ``splits``: each stage's blocks as ``pipeline.stages.split`` balances them, if known
    (split builds every stage; :func:`simulate_ranks` asks it once for all ranks).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "simulate_rank initialises a fake process group for each simulated rank: call it in a process "
            "with no process group (not inside launch())"
        )
    world = layout.dp * layout.tp * layout.pp
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's own, for tests like this one

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
        s = mesh.rank("pp")
        blocks = (splits or [stage.blocks for stage in split(model, layout.pp)])[s]
        stage = Stage(model, s, layout.pp, range(blocks[0], blocks[-1] + 1))  # what split() builds for stage s
        if layout.tp > 1:
            stage = tensor_parallel_stage(stage, mesh.group("tp"))
        cfg = model.cfg
        # meta, as the model: the shapes of one micro-batch, no values
        if stage.first:
            x = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
        else:
            x = torch.empty(micro_batch, seq_len, cfg.d_model, device="meta", requires_grad=True)
        comm = None
        if step:
            with counter.count() as c:
                y = stage(x)
                y.backward(torch.ones_like(y))
            comm = c.as_dict()
        return {
            "coords": {axis: mesh.rank(axis) for axis in ("dp", "pp", "tp")},
            "blocks": list(stage.blocks),
            "first": stage.first,
            "last": stage.last,
            "params": sum(p.numel() for p in stage.parameters()),
            "comm": comm,
        }
    finally:
        dist.destroy_process_group()


def simulate_ranks(
    cfg: ModelConfig, layout: Layout, ranks, micro_batch: int = 1, seq_len: int = 4096, stepped=None
) -> list[dict]:
    """:func:`simulate_rank` for each of ``ranks``, one after another, on one meta model of ``cfg``; the
    ranks in ``stepped`` (default: all) also run the micro-batch's forward and backward."""
    model = meta_model(cfg)
    splits = [stage.blocks for stage in split(model, layout.pp)]
    stepped = set(ranks if stepped is None else stepped)
    return [{"rank": r, **simulate_rank(model, layout, r, micro_batch, seq_len, r in stepped, splits)} for r in ranks]
