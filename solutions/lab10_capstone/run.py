"""Lab 10 entry point: your DP × TP × PP step on 8 ranks against one process, and your planner's pick.

    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 8 labs/lab10_capstone/run.py
    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 8 labs/lab10_capstone/run.py --dp 1 --tp 2 --pp 4 --m 4
    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 8 labs/lab10_capstone/run.py --measure

Every rank builds the course model (4 blocks) from one seed and keeps its part (your ``build``), trains
it with your ``step`` on global batches of the course language, and also trains the whole model in
one process on the same batches: rank 0 prints each step's loss beside one process's, whether the
final parameters agree, whether every rank's traffic equals your ``traffic``, and the layout your
``pick`` chooses on the README's two machines. ``--measure`` also times each candidate layout's
step on this machine and prints it beside your predictions (not graded: timings on a shared
machine vary from run to run).
"""

import copy
import statistics

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import counter, script
from course_lib.dist.timing import clock
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import dense_names

import capstone as cap

LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6  # float32 sums in another order: see the README (and tests/parallel/test_compose.py)
CANDIDATES = [
    cap.Layout(dp=8, tp=1, pp=1, m=1),
    cap.Layout(dp=4, tp=2, pp=1, m=1),
    cap.Layout(dp=4, tp=1, pp=2, m=2),
    cap.Layout(dp=2, tp=2, pp=2, m=2),
    cap.Layout(dp=2, tp=1, pp=4, m=4),
    cap.Layout(dp=1, tp=2, pp=4, m=4),
]


def model() -> Transformer:
    """The course model, initialised on the host from one seed (the same on every rank), on the rank's device."""
    torch.manual_seed(0)
    return Transformer(configs.get("tiny", n_layers=4)).to(cdist.device())


def gathered(part) -> dict[str, torch.Tensor]:
    """This rank's stage, TP shards joined, under the whole model's names."""
    tp, names, out = part.groups["tp"], dense_names(part.stage), {}
    for name, p in part.stage.named_parameters():
        full, dim = p.detach().clone(), getattr(p, "partition_dim", None)
        if dim is not None and part.layout.tp > 1:
            shards = [torch.empty_like(p) for _ in range(part.layout.tp)]
            dist.all_gather(shards, p.detach().contiguous(), group=tp)
            full = torch.cat(shards, dim=dim)
        out[names[name]] = full
    return out


def all_true(flag: bool) -> bool:
    t = torch.tensor([0 if flag else 1], device=cdist.device())
    dist.all_reduce(t)
    return t.item() == 0


def train(args, layout, batches, say) -> None:
    """Your composed step against one process, on the same batches."""
    part = cap.build(model(), layout, args.global_batch)
    opt = torch.optim.SGD(part.stage.parameters(), lr=args.lr)
    whole = copy.deepcopy(model())
    whole_opt = torch.optim.SGD(whole.parameters(), lr=args.lr)
    traffic_ok = True
    for i, (x, y) in enumerate(batches):
        with counter.count() as c:
            loss = cap.step(part, x, y)
        opt.step()
        opt.zero_grad()
        want = whole.loss(x, y)
        want.backward()
        whole_opt.step()
        whole_opt.zero_grad()
        if i == 0:
            say(f"rank 0 {part.coords}, one step: measured {c.as_dict()}")
            try:
                predicted = cap.traffic(whole.cfg, layout, args.global_batch, args.seq_len, part.coords)
                traffic_ok = predicted == c.as_dict()
            except NotImplementedError as e:  # every rank alike: the collectives below still pair up
                traffic_ok = None
                say(f"traffic: not implemented yet ({e})")
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss)
        got = next(v for v in losses if v is not None)
        ok = abs(got - want.item()) <= LOSS_RTOL * abs(want.item())
        say(f"step {i + 1}  loss {got:.6f}  one process {want.item():.6f}  equal within {LOSS_RTOL:g}: {ok}")
    ref = dict(whole.named_parameters())
    gap = max((t - ref[n].detach()).abs().max().item() for n, t in gathered(part).items())
    say(f"final parameters equal one process's within {PARAM_ATOL:g} on every rank: {all_true(gap <= PARAM_ATOL)}")
    if traffic_ok is not None:
        say(f"every rank's traffic equals traffic(): {all_true(traffic_ok)}")


def measure(args, batches, say) -> dict:
    """Median seconds of a step of each candidate layout on this machine (after one warm-up step)."""
    out = {}
    for layout in CANDIDATES:
        part = cap.build(model(), layout, args.global_batch)
        opt = torch.optim.SGD(part.stage.parameters(), lr=args.lr)
        times = []
        for x, y in batches:  # 6: one warm-up step, then the median of 5
            dist.barrier()
            start = clock()  # clock() waits for the device: the step's kernels, not their queueing
            cap.step(part, x, y)
            dist.barrier()
            times.append(clock() - start)
            opt.step()
            opt.zero_grad()
        out[layout] = statistics.median(times[1:] or times)
    return out


def run(args) -> None:
    world = dist.get_world_size()
    say = script.print_on(0)
    layout = cap.Layout(dp=args.dp, tp=args.tp, pp=args.pp, m=args.m)
    if layout.world_size != world:
        raise SystemExit(f"layout {layout} needs dp·tp·pp = {layout.world_size} ranks; {world} were launched")
    cfg = configs.get("tiny", n_layers=4)
    data = make_dataset(MarkovLanguage(), 64 * args.seq_len + 1, args.seq_len, seed=11)
    steps = max(args.steps, 6 if args.measure else 0)
    dev = cdist.device()  # the course language is drawn on the host: the same tokens on every machine
    stream = data.batches(args.global_batch, seed=5, epochs=None)
    batches = [(x.to(dev), y.to(dev)) for _, (x, y) in zip(range(steps), stream)]
    say(f"{layout} on {world} ranks, backend {cdist.backend()}; G={args.global_batch}, S={args.seq_len}")
    try:
        train(args, layout, batches[: args.steps], say)
    except NotImplementedError as e:  # raised alike on every rank
        say(f"not implemented yet: {e}")
        return
    if world != 8:
        return
    try:
        for machine in (cap.CPU, cap.NODES):
            best = cap.pick(CANDIDATES, cfg, args.global_batch, args.seq_len, machine)
            say(f"pick on {machine.name}: {best}")
    except NotImplementedError as e:
        say(f"pick: not implemented yet ({e})")
        return
    if args.measure:
        measured = measure(args, batches, say)
        predicted = {ly: cap.step_seconds(cfg, ly, args.global_batch, args.seq_len, cap.CPU) for ly in CANDIDATES}
        say(f"{'layout':<22}{'predicted (CPU)':>18}{'measured':>12}")
        for ly in sorted(CANDIDATES, key=predicted.get):
            say(f"{ly!s:<22}{predicted[ly] * 1e3:>15.1f} ms{measured[ly] * 1e3:>9.1f} ms")
        say(f"fastest measured: {min(measured, key=measured.get)}; predicted: {min(predicted, key=predicted.get)}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--m", type=int, default=2, help="micro-batches per data-parallel replica")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--measure", action="store_true", help="time every candidate layout's step (not graded)")
    script.main(run, parser)


if __name__ == "__main__":
    main()
