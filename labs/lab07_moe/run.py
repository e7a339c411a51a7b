"""Lab 07 entry point: your router, balancing loss, dispatch and combine in an expert-parallel MoE layer.

    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 2 labs/lab07_moe/run.py
    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab07_moe/run.py          # 4 ranks

Each of the N ranks holds E/N of the experts and its own tokens. Every rank builds the whole layer
from the same seed, so it can also compute its tokens' output with all the experts at hand: the
layer on one rank. The script checks that your expert-parallel output equals it, prints what your
router kept and what your all-to-alls carried, then trains the layer for a few steps towards a
teacher network, without and with your balancing loss, and prints the busiest expert's load
against the mean load of all experts.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.dist import counter, script
from course_lib.model.moe import Expert, routed_experts

import mixture_of_experts as lab

# torch.distributed.nn.functional.all_to_all_single is marked deprecated in favour of a private module;
# it is the public all-to-all whose backward is the reverse all-to-all, which is what the lab needs.
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated.*", category=FutureWarning)


def build(args, n: int, rank: int):
    """The router and the experts of this rank, the same on every rank (seeded), plus all the experts."""
    torch.manual_seed(0)  # initialised on the host (the same weights on every machine), then moved to the device
    dev = cdist.device()
    router = lab.Router(args.d_model, args.experts, args.top_k, capacity_factor=args.capacity_factor).to(dev)
    experts = nn.ModuleList(Expert(args.d_model, args.d_ff) for _ in range(args.experts)).to(dev)
    per = args.experts // n
    return router, experts, nn.ModuleList(experts[rank * per : (rank + 1) * per])


def data(args, n: int, rank: int):
    """This rank's tokens and a teacher network's outputs for them. All tokens share one offset: the
    untrained router then sends most of them to the same few experts."""
    g = torch.Generator().manual_seed(1)  # host: the same tokens on every machine, moved to the device below
    x = torch.randn(n * args.tokens, args.d_model, generator=g)  # host: drawn with g, first (the order matters)
    x = (x + torch.randn(args.d_model, generator=g)).to(cdist.device())  # host: drawn with g, then moved
    torch.manual_seed(2)
    with torch.no_grad():
        y = Expert(args.d_model, args.d_ff).to(x.device)(x)
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)
    return x[mine], y[mine]


def load_ratio(routing, n_experts: int) -> float:
    """max/mean of the kept assignments per expert, over all ranks' tokens."""
    load = routing.load(n_experts)
    dist.all_reduce(load)
    return (load.max() / load.float().mean()).item()


def train(args, coef: float, n: int, rank: int) -> list[tuple[float, float]]:
    """Steps of Adam on the layer (router replicated, experts sharded); (loss, load ratio) per step."""
    router, _, mine = build(args, n, rank)
    x, target = data(args, n, rank)
    opt = torch.optim.Adam([*router.parameters(), *mine.parameters()], lr=1e-2)
    history = []
    for _ in range(args.steps):
        y, routing = lab.moe_forward(x, router, mine, args.experts)
        task = (y - target).square().mean()
        loss = (task + coef * lab.switch_aux_loss(routing, args.experts)) if coef else task
        (loss / n).backward()  # the mean over ranks: each expert's gradient gathers every rank's share
        for p in router.parameters():  # the router is replicated: add up the ranks' gradients
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        mean_task = task.detach().clone()
        dist.all_reduce(mean_task)
        history.append((mean_task.item() / n, load_ratio(routing, args.experts)))
    return history


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    say = script.print_on(0)
    e, k, t, d = args.experts, args.top_k, args.tokens, args.d_model
    say(
        f"{n} ranks, backend {cdist.backend()}; E={e} experts ({e // n} per rank), top-{k}, "
        f"capacity factor {args.capacity_factor}, T={t} tokens per rank, d={d}"
    )

    # 1. Your expert-parallel layer against the same layer on one rank.
    try:
        router, experts, mine = build(args, n, rank)
        x, _ = data(args, n, rank)
        routing = router(x)
        with counter.count() as c:
            sent = lab.dispatch(x, routing, e)
            y = lab.combine(lab.local_experts(sent, mine), sent, routing, t)
        reference = routed_experts(x, routing, experts)  # this rank's tokens, all experts here
    except NotImplementedError as err:
        say(f"expert parallel layer: not implemented yet ({err})")
        return
    diff = ((y - reference).abs().max() / reference.abs().max()).item()
    verdict = torch.tensor([float(diff <= 1e-5)], device=cdist.device())
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    say(
        f"expert parallel output equals the layer on one rank (max |Δ| ≤ 1e-5 of the largest entry): {verdict.item() == 1}"
    )
    kept, cap = int(routing.kept.sum()), lab.capacity(t, k, e, args.capacity_factor)
    received = len(sent.tokens)
    formula = kept * d * 4 + received * d * 4 + kept * 8 + n * 8
    say(f"rank 0 kept {kept} of its T·k = {t * k} assignments (capacity {cap} per expert) and received {received} rows")
    say(
        f"rank 0 handed {c.bytes('all_to_all_single')} B to {c.calls('all_to_all_single')} all-to-alls; "
        f"rows out {kept}·{d}·4 + results back {received}·{d}·4 + int64 expert ids {kept}·8 + counts {n}·8 = {formula} B"
    )

    # 2. Training without and with your balancing loss.
    try:
        runs = {coef: train(args, coef, n, rank) for coef in (0.0, args.aux_coef)}
    except NotImplementedError as err:
        say(f"training: not implemented yet ({err})")
        return
    say("step   task loss  max/mean load   |  with aux loss: task loss  max/mean load")
    for step in sorted({0, 1, 2, 5, 10, 20, args.steps - 1} & set(range(args.steps))):
        (l0, r0), (l1, r1) = runs[0.0][step], runs[args.aux_coef][step]
        say(f"{step:4d}   {l0:9.4f}  {r0:13.2f}   |                {l1:9.4f}  {r1:13.2f}")
    tail = min(5, args.steps)
    last = {coef: sum(r for _, r in h[-tail:]) / tail for coef, h in runs.items()}
    say(
        f"busiest expert over the last {tail} steps: {last[0.0]:.2f}x the mean load without the loss, "
        f"{last[args.aux_coef]:.2f}x with {args.aux_coef}·switch_aux_loss"
    )
    say(f"your balancing loss evened out the load: {last[args.aux_coef] < last[0.0]}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--d-ff", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--aux-coef", type=float, default=0.1)
    script.main(run, parser)


if __name__ == "__main__":
    main()
