"""Lab 03 entry point: train with your ZeRO stages 0-3, compare with DDP, weigh memory and traffic.

    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab03_zero/run.py
    accelerate launch --config_file labs/accelerate/gpu.yaml labs/lab03_zero/run.py

For each stage: are the parameters after a few AdamW steps equal to torch DDP + AdamW? How many
bytes of parameters, gradients and Adam state does each rank hold, against the ZeRO formula
(fp32: 4Ψ + 4Ψ + 8Ψ, sharded by stage)? How many bytes does a rank move per step, against
2(N-1)/N·Ψ (stages 0-2) and 3(N-1)/N·Ψ (stage 3) elements of 4 bytes?
At 2 ranks the parameters must be equal bit for bit; at 4, gloo adds the four gradients of an
element in an order that depends on where it sits in the buffer, and torch DDP's buckets are laid
out differently from your units, so expect differences around 1e-6 there.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import dist as cdist
from course_lib.cost.collective_bytes import ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import counter, script
from course_lib.dist.census import held_bytes
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss

from zero import ZeroAdamW

LR, WD = 3e-3, 0.1


def model(name):
    torch.manual_seed(0)
    return Transformer(configs.get(name)).to(cdist.device())


def data(steps, vocab):
    """This rank's token batches on its device, drawn on the host: the same tokens on every machine."""
    g = torch.Generator().manual_seed(1 + dist.get_rank())  # host: the same tokens on every machine
    # host: drawn with g, then moved to the device
    return [torch.randint(0, vocab, (4, 33), generator=g).to(cdist.device()) for _ in range(steps)]


def reference(name, steps):
    net = model(name)
    ddp = DDP(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for x in data(steps, net.cfg.vocab_size):
        next_token_loss(ddp(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    n = dist.get_world_size()
    say = script.print_on(0)
    ref = reference(args.model, args.steps)
    psi = sum(p.numel() for p in ref)
    say(f"{n} ranks, backend {cdist.backend()}, model {args.model!r} with Ψ = {psi} parameters, fp32 AdamW")
    say(
        f"{'stage':>5} {'max |Δθ| vs DDP':>16} {'held B/rank':>12} {'formula':>10} {'moved B/step':>13} {'formula':>10}"
    )
    for stage in (0, 1, 2, 3):
        net = model(args.model)
        zero = ZeroAdamW(net, stage, lr=LR, weight_decay=WD)
        batches = data(args.steps, net.cfg.vocab_size)
        for x in batches:
            with counter.count() as c:  # the last step's traffic
                next_token_loss(net(x[:, :-1]), x[:, 1:]).backward()
                zero.step()
            zero.zero_grad()
        held = torch.tensor(float(held_bytes(zero, net)), device=cdist.device())
        dist.all_reduce(held, op=dist.ReduceOp.MAX)  # the largest rank's share
        for u in zero.units if stage == 3 else []:
            zero._gather(u)  # to read the parameters
        gap = max((p - q).abs().max().item() for p, q in zip(net.parameters(), ref))
        moved = ring_wire_bytes(c.as_dict(), n)
        say(
            f"{stage:>5} {gap:>16.2e} {int(held):>12} {zero_model_state_bytes(psi, n, stage, 8, 4, 4):>10.0f} "
            f"{moved:>13.0f} {zero_comm_bytes(psi, n, stage, 4):>10.0f}"
        )


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=5)
    script.main(run, parser)


if __name__ == "__main__":
    main()
