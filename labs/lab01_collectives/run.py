"""Lab 01 entry point: check your ring collectives, count their bytes, time them against a model.

    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab01_collectives/run.py
    accelerate launch --config_file labs/accelerate/gpu.yaml labs/lab01_collectives/run.py

The alpha-beta (latency-bandwidth, Hockney) model: sending m bytes costs α + m/β. The ring
all-reduce makes 2(N-1) steps of S/N bytes each, so T ≈ 2(N-1)·α + 2(N-1)/N · S/β.
α and β are fitted here from a ping-pong between ranks 0 and 1.
"""

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.dist import counter, script
from course_lib.dist.timing import clock

from collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, ranks started together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = clock()  # waits for the device, so the barrier's work is not counted
        fn()
        times.append(clock() - start)
    return sorted(times)[len(times) // 2]


def ping_pong(nbytes: int, repeats: int) -> float:
    """One-way time of an nbytes message between ranks 0 and 1 (half a round trip)."""
    buf = torch.zeros(max(1, nbytes // 4), device=cdist.device())

    def round_trip():
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return timed(round_trip, repeats) / 2


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    say = script.print_on(0)
    say(f"{n} ranks, backend {cdist.backend()}, device {dev}")

    # 1. Correct? Integer-valued data: any summation order gives the same floats.
    g = torch.Generator().manual_seed(rank)  # host: the same draw on every machine, moved to dev below
    x = torch.randint(-9, 9, (1000 + n - 1,), generator=g).float().to(dev)  # host: drawn with g
    reference = x.clone()
    dist.all_reduce(reference)
    assert torch.equal(ring_all_reduce(x.clone()), reference), "ring_all_reduce differs from dist.all_reduce"
    assert torch.equal(ring_reduce_scatter(x), reference.tensor_split(n)[rank]), "ring_reduce_scatter differs"
    shard = x[:10].contiguous()
    gathered = torch.empty(10 * n, device=dev)
    dist.all_gather_single(gathered, shard)
    assert torch.equal(ring_all_gather(shard), gathered), "ring_all_gather differs"
    say("correct: all three equal torch.distributed")

    # 2. Bytes each rank sends, against the ring's formula.
    s = 1 << 20
    y = torch.ones(s // 4, device=dev)
    with counter.count() as c:
        ring_all_reduce(y)
    sent = c.bytes("isend") + c.bytes("send")
    say(f"all-reduce of S = {s} B: rank 0 sent {sent} B; 2(N-1)/N·S = {2 * (n - 1) * s // n} B")

    # 3. Time against the alpha-beta model.
    alpha = ping_pong(4, 20)
    big = 4 << 20
    beta = big / max(ping_pong(big, 5) - alpha, 1e-9)
    say(f"alpha-beta fit from ping-pong: α = {alpha * 1e6:.1f} µs, β = {beta / 1e9:.2f} GB/s")
    say(f"{'size':>10} {'ring (ms)':>10} {'model (ms)':>11} {'torch (ms)':>11}")
    for kib in args.sizes_kib:
        t = torch.ones(kib * 256, device=dev)
        ring = timed(lambda t=t: ring_all_reduce(t), args.repeats)
        torch_t = timed(lambda t=t: dist.all_reduce(t), args.repeats)
        model = 2 * (n - 1) * alpha + 2 * (n - 1) / n * t.numel() * 4 / beta
        say(f"{kib:>7} KiB {ring * 1e3:>10.2f} {model * 1e3:>11.2f} {torch_t * 1e3:>11.2f}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 64, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    script.main(run, parser)


if __name__ == "__main__":
    main()
