"""Lab 02 entry point: train the tiny course model with your DDP and watch its communication.

    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab02_ddp/run.py
    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab02_ddp/run.py --accumulate 4

Each optimizer step consumes one global batch of ``--batch`` sequences, split evenly over the
ranks and, with ``--accumulate k``, over k micro-batches per rank; the first k-1 run inside
``no_sync()``. Printed per step: the loss averaged over ranks, and the all-reduces issued in the
step — one per bucket with synchronisation, none inside no_sync. At the end every rank's
parameters are compared with rank 0's: data parallelism keeps the replicas identical.
"""

import contextlib

import torch
import torch.distributed as dist

from course_lib import data
from course_lib import dist as cdist
from course_lib.dist import counter, script
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.data.ddp import split_batch

from ddp import DDP


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    say = script.print_on(0)
    torch.manual_seed(rank)  # deliberately different: DDP's broadcast must make them equal
    model = DDP(Transformer(configs.get("tiny")).to(dev), bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    say(
        f"{world} ranks, backend {cdist.backend()}; {len(model.buckets)} buckets of "
        f"{[sum(p.numel() * 4 for p in b.params) for b in model.buckets]} bytes, first {model.bucket_names()[0]}"
    )

    lang = data.MarkovLanguage()
    ds = data.make_dataset(lang, args.batch * 64 * args.steps + 1, 64, seed=1)
    for step, (x, y) in enumerate(ds.batches(args.batch, seed=0)):
        if step == args.steps:
            break
        x, y = split_batch(x, rank, world), split_batch(y, rank, world)  # this rank's rows
        micro = list(zip(split_batch_k(x, args.accumulate), split_batch_k(y, args.accumulate)))
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        with counter.count() as c:
            for i, (mx, my) in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = next_token_loss(model(mx.to(dev)), my.to(dev)) / len(micro)
                    loss.backward()
                total += loss.detach()
        opt.step()
        dist.all_reduce(total)  # outside the count: reporting only
        say(
            f"step {step + 1}: loss {total.item() / world:.4f}, all-reduces {c.calls('all_reduce')} "
            f"({c.bytes('all_reduce')} B) for {len(model.buckets)} buckets; {len(micro) - 1} of {len(micro)} "
            "micro-batches ran in no_sync"
        )

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor(float(torch.equal(flat, reference)), device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    say(f"replicas identical after {args.steps} steps: {bool(same.item())}; entropy floor {lang.loss_floor(64):.4f}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step and rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05)
    script.main(run, parser)


def split_batch_k(t: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Cut a rank's rows into k equal micro-batches (the same divisibility rule as split_batch)."""
    return [split_batch(t, i, k) for i in range(k)]


if __name__ == "__main__":
    main()
