"""Lecture 10's composed step (a demo, not graded): the course model trained over one DP × TP × PP mesh, on one machine or several.

    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 8 examples/composed_training/run.py
    # the same 8 ranks as two "nodes" of 4 on this machine, two launchers (start both):
    accelerate launch --config_file labs/accelerate/loopback_node0.yaml examples/composed_training/run.py
    accelerate launch --config_file labs/accelerate/loopback_node1.yaml examples/composed_training/run.py

Every rank builds the course model from one seed and keeps its part (course_lib.parallel.compose):
its pipeline stage, split over its tensor-parallel group, fed its data-parallel share of each global
batch of the course language. Rank 0 prints the layout, where the ranks run, the loss of every step
and a fingerprint of the final parameters: the same numbers whichever way the ranks were started.
"""

import hashlib
import socket

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import script
from course_lib.dist.runtime import local_world_size
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Composed, Layout


def run(args) -> None:
    world = dist.get_world_size()
    layout = Layout(dp=args.dp, tp=args.tp, pp=args.pp, m=args.m)
    if layout.world_size != world:
        raise SystemExit(f"layout {layout} needs dp·tp·pp = {layout.world_size} ranks; {world} were launched")
    torch.manual_seed(0)  # initialised on the host (the same weights on every machine), then on this rank's device
    dev = cdist.device()
    model = Transformer(configs.get("tiny", n_layers=4)).to(dev)
    composed = Composed(model, layout, args.global_batch)
    opt = torch.optim.SGD(composed.parameters(), lr=args.lr)
    data = make_dataset(MarkovLanguage(), 64 * args.seq_len + 1, args.seq_len, seed=11)
    hosts = [None] * world
    dist.all_gather_object(hosts, (socket.gethostname(), local_world_size()))
    say = script.print_on(0)
    say(f"{layout} on {world} ranks, backend {cdist.backend()}; {local_world_size()} ranks per launcher")
    for step, (x, y) in zip(range(args.steps), data.batches(args.global_batch, seed=5, epochs=None)):
        loss = composed.step(x.to(dev), y.to(dev))  # the course language is drawn on the host
        opt.step()
        opt.zero_grad()
        losses = [None] * world
        dist.all_gather_object(losses, None if loss is None else float(loss))  # python floats, not device tensors
        say(f"step {step + 1}  loss {next(v for v in losses if v is not None):.6f}")
    state = composed.dense_state()
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(state[name].detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    say(f"final parameters fingerprint: {digest.hexdigest()[:16]}")


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
    script.main(run, parser)


if __name__ == "__main__":
    main()
