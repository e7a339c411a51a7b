"""Lab 05's runtime rows: one training step of the course model from a schedule, by course_lib's runtime.

lab05_pipeline.py checks the learner's lists on paper and builds the schedules; here each rank runs
one step of each schedule with :func:`course_lib.parallel.pipeline.executor.run_step` and the
non-pipelined model's step on the same micro-batches (:func:`_step`, launched on p ranks), and
:func:`_assert_step` compares: every loss and gradient bit for bit, the activations in flight and
the bytes sent with the formulas of course_lib.cost.pipeline. Bit-equality is fair: each
micro-batch runs the same ops on the same tensors, and each stage adds its m gradients in
micro-batch order, as the reference's m backward passes do.
"""

import torch
import torch.distributed as dist

from course_lib.cost.pipeline import in_flight_microbatches, p2p_bytes_per_step
from course_lib.dist import counter, device
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.pipeline import executor, stages
from course_lib.parallel.pipeline.schedules import Schedule

BATCH, SEQ = 2, 16  # one micro-batch: 2 sequences of 16 tokens


def _what(p: int, m: int, v: int) -> str:
    return f"1F1B at p={p}, m={m}" if v == 1 else f"interleaved at p={p}, m={m}, v={v}"


def _param_name(stage, local: str) -> str:
    """The name in the whole model of a stage's parameter (its blocks are numbered from 0)."""
    parts = local.split(".")
    if parts[0] == "layers":
        parts[1] = str(stage.blocks[int(parts[1])])
    return ".".join(parts)


def _step(schedules: list[Schedule], seed: int = 0) -> list[dict]:
    """On each rank: one step of each schedule by course_lib's runtime, and the non-pipelined model's."""
    results = []
    for schedule in schedules:
        cfg = configs.get("tiny", n_layers=schedule.n_stages)  # one transformer block per stage
        torch.manual_seed(seed)
        reference = Transformer(cfg).to(device())  # initialised on the host: the same weights everywhere
        parts = stages.split(reference, schedule.n_stages)  # every rank builds all; keeps its own
        mine = {s: parts[s] for s in schedule.stages_of(dist.get_rank())}
        g = torch.Generator().manual_seed(seed + 1)  # host: the same tokens on every machine
        tokens = torch.randint(0, cfg.vocab_size, (schedule.m, BATCH, SEQ + 1), generator=g)  # host: drawn with g
        tokens = tokens.to(device())
        xs, ys = tokens[:, :, :-1], tokens[:, :, 1:]
        with counter.count() as c:
            result = executor.run_step(schedule, mine, xs, ys, next_token_loss, (BATCH, SEQ, cfg.d_model))
        ref_losses = {}
        for i in range(schedule.m):  # the whole model on the same micro-batches: the mean loss of the step
            loss = reference.loss(xs[i], ys[i])
            ref_losses[i] = loss.item()
            (loss / schedule.m).backward()
        ref = dict(reference.named_parameters())
        differ = []
        for s, stage in mine.items():
            for local, param in stage.named_parameters():
                want = ref[_param_name(stage, local)].grad
                if param.grad is None:
                    differ.append((f"stage {s}'s {local}", "has no gradient"))
                elif not torch.equal(param.grad, want):
                    gap = (param.grad - want).abs().max().item()
                    differ.append((f"stage {s}'s {local}", f"differs from the non-pipelined model's by {gap:.3g}"))
        results.append(
            {
                "losses": result.losses,
                "ref_losses": ref_losses,
                "differ": differ,
                "peak": result.peak_in_flight,
                "sent": c.bytes("isend"),
                "hidden_bytes": BATCH * SEQ * cfg.d_model * 4,  # one micro-batch's fp32 hidden state
            }
        )
    return results


def _assert_step(schedule: Schedule, results: list[dict]) -> None:
    """One step's results on each rank against the non-pipelined model and the formulas."""
    p, m, v = schedule.p, schedule.m, schedule.v
    what = _what(p, m, v)
    last = schedule.placement[-1]
    assert sorted(results[last]["losses"]) == list(range(m)), (
        f"{what}: rank {last} (the last stage) computed the loss of micro-batches {sorted(results[last]['losses'])}"
    )
    for rank, r in enumerate(results):
        for i, loss in r["losses"].items():
            assert loss == r["ref_losses"][i], (
                f"{what}: rank {rank}'s loss of micro-batch {i} is {loss}, the non-pipelined model's "
                f"{r['ref_losses'][i]}: each stage's forward must read its own micro-batch's input"
            )
        if r["differ"]:
            name, how = r["differ"][0]
            raise AssertionError(
                f"{what}: rank {rank}: the gradient of {name} {how} ({len(r['differ'])} tensors differ): every "
                "micro-batch's backward must run once per stage, after its forward, in micro-batch order"
            )
        want = in_flight_microbatches(schedule.name, p, rank, m, v)
        assert r["peak"] == want, (
            f"{what}: rank {rank} held {r['peak']} micro-batches' activations at once while running, "
            f"the formula says {want}"
        )
    between_ranks = sum(a != b for a, b in zip(schedule.placement, schedule.placement[1:]))
    sent = sum(r["sent"] for r in results)
    want = p2p_bytes_per_step(m, between_ranks, results[0]["hidden_bytes"])
    assert sent == want, (
        f"{what}: the ranks sent {sent} bytes in one step; each micro-batch crosses each of the "
        f"{between_ranks} stage boundaries between ranks twice (activation forward, gradient back): {want} bytes"
    )
