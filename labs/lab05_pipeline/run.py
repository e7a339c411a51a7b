"""Lab 05 entry point: your pipeline schedule on paper, then the course model trained with it beside the unpipelined model.

    .venv/bin/accelerate launch --config_file labs/accelerate/pipeline_cpu.yaml labs/lab05_pipeline/run.py
    .venv/bin/accelerate launch --config_file labs/accelerate/pipeline_cpu.yaml labs/lab05_pipeline/run.py --v 2
    .venv/bin/accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab05_pipeline/run.py          # p = 4

The pipeline has as many ranks as were launched, p; ``--v 2`` runs your interleaved 1F1B (Task 3).

1. On paper: your lists for p ranks and m micro-batches, checked by course_lib's ``check`` and played
   by its simulator (a forward of one stage — one chunk when interleaved — takes 1 time unit, a
   backward 2), drawn as one line per rank, with the bubble and the activations in flight beside
   the formulas of Narayanan et al. 2021, §2.2.
2. For real: the course model ("tiny", p·v blocks) cut into p·v stages, trained for a few steps by
   course_lib's executor walking your lists, while every rank also trains the whole model on the same
   micro-batches with the same AdamW. A schedule changes when each piece of work runs, never what
   is computed: the losses and the weights stay equal bit for bit.
"""

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.cost.pipeline import bubble_fraction, in_flight_microbatches, p2p_bytes_per_step
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import counter, script
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.pipeline import executor, stages
from course_lib.parallel.pipeline.schedules import check
from course_lib.parallel.pipeline.simulate import Deadlock, simulate

from pipeline_parallel import build_schedule


def timeline(sim) -> list[str]:
    """One line per rank, one character per time unit: F forward, BB backward, '.' idle; lower case for
    odd chunks (interleaved: stage s is chunk s // p)."""
    p, lines = sim.schedule.p, []
    for r, spans in enumerate(sim.spans):
        row = ["."] * int(sim.makespan)
        for span in spans:
            mark = span.name if (span.meta["stage"] // p) % 2 == 0 else span.name.lower()
            for t in range(int(span.start), int(span.end)):
                row[t] = mark
        lines.append(f"rank {r} |{''.join(row)}|")
    return lines


def whole_name(stage, name: str) -> str:
    """The name in the whole model of a stage's parameter (a stage numbers its blocks from 0)."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = str(stage.blocks[int(parts[1])])
    return ".".join(parts)


def on_paper(schedule, say) -> None:
    p, m, v = schedule.p, schedule.m, schedule.v
    check(schedule)  # ValueError: a micro-batch missing or twice, backward before forward, a send unmatched
    sim = simulate(schedule, {"F": 1, "B": 2})  # Deadlock: some rank waits for a tensor nobody will send
    for r in range(p):
        say(
            f"rank {r} computes: {' '.join(repr(a) if v > 1 else f'{a.op}{a.microbatch}' for a in schedule.compute(r))}"
        )
    for line in timeline(sim):
        say(line)
    rule = "(p - 1)/(m + p - 1)" if v == 1 else "(p - 1)/(v·m + p - 1)"
    say(f"bubble: {sim.bubble_fraction():.4f} of the step; {rule} = {bubble_fraction(p, m, v):.4f}")
    formula = [in_flight_microbatches(schedule.name, p, r, m, v) for r in range(p)]
    what = "micro-batches" if v == 1 else "stage-micro-batches (each 1/v of a rank's layers)"
    say(f"activations held at most, per rank: {sim.peak_in_flight()} {what}; formula {formula}")
    assert abs(sim.bubble_fraction() - bubble_fraction(p, m, v)) < 1e-12, "the bubble differs from the formula"
    assert sim.peak_in_flight() == formula, "the activations in flight differ from the formula"


def run(args) -> str | None:
    """Everything after init, on every rank (main records it with ``--trace``). Returns why the script must
    stop early (your schedule is missing or cannot run), None when it ran to the end."""
    rank, p, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    m, v, b, t = args.microbatches, args.v, args.batch, args.seq_len
    if v > 1 and m % p:
        raise SystemExit(f"interleaved 1F1B takes micro-batches in groups of p: m={m} is no multiple of p={p}")
    try:
        schedule = build_schedule(p, m, v)
    except NotImplementedError as e:
        return f"not implemented yet: {e} (./course grade lab05 says what is missing)"
    say = script.print_on(schedule.placement[-1])  # the rank that sees the losses
    kind = "1F1B" if v == 1 else f"interleaved 1F1B, v={v}"
    say(f"{kind} over p={p} ranks, m={m} micro-batches of {b}x{t} tokens, backend {cdist.backend()}, device {dev}")

    # 1. On paper.
    try:
        on_paper(schedule, say)
    except (ValueError, Deadlock) as e:
        return f"your schedule cannot run: {e}"

    # 2. For real: the pipelined stages and the whole model, from one seed, side by side.
    cfg = configs.get("tiny", n_layers=schedule.n_stages, max_seq_len=max(64, t))
    torch.manual_seed(0)
    whole = Transformer(cfg).to(dev)
    parts = stages.split(whole, schedule.n_stages)
    mine = {s: parts[s] for s in schedule.stages_of(rank)}
    # AdamW is elementwise, so grouping the parameters differently changes nothing (foreach=False: torch's plain loop)
    opt_whole = torch.optim.AdamW(whole.parameters(), lr=3e-3, foreach=False)
    opt_mine = torch.optim.AdamW([q for st in mine.values() for q in st.parameters()], lr=3e-3, foreach=False)
    data = make_dataset(MarkovLanguage(), m * b * t * args.steps + 1, t, seed=0)

    say(f"{'step':>5} {'pipelined loss':>15} {'whole-model loss':>17}  equal")
    all_equal = True
    for step, (x, y) in enumerate(data.batches(m * b, seed=0)):
        xs, ys = x.reshape(m, b, t).to(dev), y.reshape(m, b, t).to(dev)
        with counter.count() as sent:
            result = executor.run_step(schedule, mine, xs, ys, next_token_loss, (b, t, cfg.d_model))
        opt_mine.step()
        opt_mine.zero_grad()
        losses = []
        for i in range(m):
            loss = whole.loss(xs[i], ys[i])
            losses.append(loss.item())
            (loss / m).backward()
        opt_whole.step()
        opt_whole.zero_grad()
        if result.losses:  # the rank of the last stage: the step's mean loss, both ways
            piped = sum(result.losses[i] for i in range(m)) / m
            same = [result.losses[i] for i in range(m)] == losses
            all_equal &= same
            say(f"{step:>5} {piped:>15.4f} {sum(losses) / m:>17.4f}  {'yes' if same else 'NO'}")

    # The weights after training, on every rank; the activations held and the bytes sent in the last step.
    whole_params = dict(whole.named_parameters())
    differ = sum(
        not torch.equal(q, whole_params[whole_name(stage, name)])
        for stage in mine.values()
        for name, q in stage.named_parameters()
    )
    numbers = torch.tensor([differ, result.peak_in_flight, sent.bytes("isend")], device=dev)
    every = [torch.empty_like(numbers) for _ in range(p)]
    dist.all_gather(every, numbers)
    differ_total = sum(int(e[0]) for e in every)
    peaks = [int(e[1]) for e in every]
    total_sent = sum(int(e[2]) for e in every)
    boundaries = sum(a != c for a, c in zip(schedule.placement, schedule.placement[1:]))  # between two ranks
    formula = [in_flight_microbatches(schedule.name, p, r, m, v) for r in range(p)]
    say(f"activations held while running, per rank: {peaks}; formula {formula}")
    say(
        f"bytes sent between stages in one step: {total_sent}; 2·m·(p·v - 1)·(b·s·d·4) = "
        f"{p2p_bytes_per_step(m, boundaries, b * t * cfg.d_model * 4)}"
    )
    say(f"tensors of the stages' weights that differ from the whole model's after {args.steps} steps: {differ_total}")
    assert all_equal and differ_total == 0, "pipelining must not change the numbers: ./course grade lab05 says where"
    say("the pipelined model follows the whole model bit for bit")
    return None


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--v", type=int, default=1, help="stages (chunks) per rank: 1 is 1F1B, 2 or more interleaved")
    parser.add_argument("--microbatches", type=int, default=8, help="m, micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    script.main(run, parser)


if __name__ == "__main__":
    main()
