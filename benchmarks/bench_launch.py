"""Start-up cost of running a function on N ranks: course_lib.dist.launch vs torch.multiprocessing.spawn.

    .venv/bin/python benchmarks/bench_launch.py --worlds 2 4 --repeats 3

Both run the same function (init the process group, one all_reduce, return); the two methods are
interleaved in one run so machine noise hits both alike. launch() forks ranks from a server that
has already imported torch; spawn() starts fresh interpreters that import torch each time.
"""

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_lib.dist import launch


def work():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawned(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    work()
    dist.destroy_process_group()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    launch(work, 1)  # the fork server starts once per caller process: not part of the per-launch cost
    print(f"{'ranks':>5} {'launch (s)':>11} {'mp.spawn (s)':>13} {'ratio':>6}")
    for world in args.worlds:
        ours, theirs = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            launch(work, world)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            mp.spawn(_spawned, args=(world, _port()), nprocs=world)
            theirs.append(time.perf_counter() - t)
        a, b = sorted(ours)[len(ours) // 2], sorted(theirs)[len(theirs) // 2]
        print(f"{world:>5} {a:>11.2f} {b:>13.2f} {b / a:>5.0f}x")


if __name__ == "__main__":
    main()
