"""Start-up cost of running a function on N ranks: course_lib.dist.launch vs torch.multiprocessing.spawn.

    .venv/bin/python benchmarks/bench_launch.py --worlds 2 4 --repeats 3

Both run the same function (init the process group, one all_reduce, return); the two methods are
interleaved in one run so machine noise hits both alike. launch() forks ranks from a server that
has already imported torch; spawn() starts fresh interpreters that import torch each time.
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from course_lib.dist import device, init, launch


def work():
    t = torch.ones(1, device=device())  # gloo: cpu, NCCL: this rank's GPU (NCCL reduces device tensors only)
    dist.all_reduce(t)
    return t.item()


def _spawned(rank, world, port):
    # the launchers' environment, so that course_lib.dist.init picks the backend and device as launch() does
    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1")
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    init(timeout_s=60)
    work()
    dist.destroy_process_group()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wall_seconds(fn, *args, **kwargs) -> float:
    """Seconds of ``fn(*args, **kwargs)`` on the parent's clock: it starts ranks and waits for them to exit, and runs
    no device work of its own (the ranks' all-reduce has finished when they return)."""
    start = time.perf_counter()  # host: process start-up seen from the parent, which touches no device
    fn(*args, **kwargs)
    return time.perf_counter() - start  # host: the same host-side duration, read when every rank has exited


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
            ours.append(_wall_seconds(launch, work, world))
            theirs.append(_wall_seconds(mp.spawn, _spawned, args=(world, _port()), nprocs=world))
        a, b = sorted(ours)[len(ours) // 2], sorted(theirs)[len(theirs) // 2]
        print(f"{world:>5} {a:>11.2f} {b:>13.2f} {b / a:>5.0f}x")


if __name__ == "__main__":
    main()
