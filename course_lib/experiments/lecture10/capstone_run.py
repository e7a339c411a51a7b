"""The capstone run (lecture 10): the course model trained end to end over one DP × TP × PP mesh
(:class:`course_lib.parallel.compose.Composed`) beside one process training it on the same batches,
with one step of every rank traced for the timeline.

Both runs start from one seed and see the same global batches of the course language
(:class:`course_lib.data.MarkovLanguage`), in the same order: the composed run's loss of every step
and its final parameters (gathered from every stage and tensor-parallel shard) are compared with
the single process's. tests/parallel/test_compose.py derives the tolerances for three steps; the lecture
states its own for the length of this run.

Tested in tests/experiments/test_capstone_measure.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import device, launch, trace
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Composed, Layout, sgd_one_process

AXES = ("dp", "pp", "tp")
CAPSTONE = Layout(
    dp=2, tp=2, pp=2, m=2
)  # the lecture's layout: every axis at 2, 8 ranks  # the mesh's order, outermost first (course_lib.dist.mesh)


MOE = dict(n_routed_experts=4, n_activated_experts=2, moe_d_ff=32)  # the tiny model's mixture-of-experts variant


def _model(n_layers: int, seed: int, overrides: dict | None = None) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(configs.get("tiny", n_layers=n_layers, **(overrides or {})))


def _batches(steps: int, global_batch: int, seq_len: int, data_seed: int):
    """The first ``steps`` global batches [G, s] of the course language (one dataset, cycled)."""
    return small_run.batches(steps, global_batch, seq_len, data_seed, stream_batches=64)


def one_process(
    steps: int,
    lr: float,
    global_batch: int,
    seq_len: int,
    n_layers: int = 4,
    seed: int = 0,
    data_seed=11,
    overrides=None,
):
    """:func:`~course_lib.parallel.compose.sgd_one_process` on the capstone's model and batches."""
    return sgd_one_process(_model(n_layers, seed, overrides), _batches(steps, global_batch, seq_len, data_seed), lr)


def _composed_rank(layout: Layout, steps, lr, global_batch, seq_len, n_layers, seed, data_seed, overrides, traced_step):
    # Composed computes where the model is: on the rank's device
    composed = Composed(_model(n_layers, seed, overrides).to(device()), layout, global_batch)
    opt = torch.optim.SGD(composed.parameters(), lr=lr)
    losses, spans = [], []
    for step, (x, y) in enumerate(_batches(steps, global_batch, seq_len, data_seed)):
        if step == traced_step:
            dist.barrier()  # every rank starts the traced step together: the timeline shows the step, not the skew
            with trace.record() as tl:
                losses.append(composed.step(x, y))
            spans = tl.spans
        else:
            losses.append(composed.step(x, y))
        opt.step()
        opt.zero_grad()
    state = composed.dense_state()
    coords = {axis: composed.mesh.rank(axis) for axis in AXES}
    return {"losses": losses, "spans": spans, "coords": coords, "state": state if dist.get_rank() == 0 else None}


def composed_vs_one_process(
    layout: Layout = CAPSTONE,
    steps: int = 40,
    lr: float = 0.1,
    global_batch: int = 8,
    seq_len: int = 32,
    n_layers: int = 4,
    seed: int = 0,
    data_seed: int = 11,
    traced_step: int = 1,
    overrides: dict | None = None,
) -> dict:
    """Train ``steps`` SGD steps over ``layout`` (one launch of layout.world_size ranks) and on one process.

    ``overrides``: changes to the tiny model's config (:data:`MOE` for its mixture-of-experts variant,
    which a layout with ep > 1 needs). Returns {"losses": the composed run's loss per step (from a last-stage rank), "reference": one
    process's, "loss_rel_gap": max over steps of |Δloss| / loss, "param_gap": max |Δ| over every
    parameter, "n_params": tensors compared, "reporting": how many ranks reported a loss (the last
    stage's dp·tp), "spans": per rank, the traced step's spans, "coords": per rank {"dp","pp","tp"}}.
    """
    args = (steps, lr, global_batch, seq_len, n_layers, seed, data_seed, overrides)
    reference, ref_params = one_process(*args)
    out = launch(_composed_rank, layout.world_size, layout, *args, traced_step, timeout=300)
    reporting = [r["losses"] for r in out if r["losses"][0] is not None]
    losses = reporting[0]
    if any(r != losses for r in reporting):
        raise AssertionError("the last stage's ranks disagree on the loss: look at the dp all-reduce of the loss")
    state = out[0]["state"]
    if sorted(state) != sorted(ref_params):
        raise AssertionError(f"gathered {len(state)} parameter tensors, the model has {len(ref_params)}")
    return {
        "losses": losses,
        "reference": reference,
        "loss_rel_gap": max(abs(a - b) / abs(b) for a, b in zip(losses, reference)),
        "param_gap": max((state[n] - p).abs().max().item() for n, p in ref_params.items()),
        "n_params": len(ref_params),
        "reporting": len(reporting),
        "spans": [r["spans"] for r in out],
        "coords": [r["coords"] for r in out],
    }
