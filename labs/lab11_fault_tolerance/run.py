"""Lab 11 entry point: train with your checkpoints, kill a rank, resume, and compare the final state.

    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 2 labs/lab11_fault_tolerance/run.py
    ... run.py --root build/lab11/b --kill-at 7      # rank 1 SIGKILLs itself after 7 steps: the job dies
    ... run.py --root build/lab11/b --resume         # the restart: continues from the last checkpoint

Each run trains your ``train`` to ``--steps`` steps on every launched rank, saving every
``--save-every`` steps under ``--root`` (default build/lab11/run), and prints the losses, the
steps your guard skipped, where it resumed from, and a fingerprint of the final state: the sha256
of the parameters, AdamW's moments, the next batch and the next random numbers of every rank.
A resumed run whose fingerprint equals the uninterrupted run's is bit-identical to it.
"""

import hashlib
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.dist import script

import resilient as lab

ROOT = Path(__file__).resolve().parents[2]


def fingerprint(summary: dict) -> str:
    """sha256 over this rank's final state, in a fixed order."""
    h = hashlib.sha256()
    tensors = [*summary["params"].values(), summary["next_batch"][0], summary["rng"][0]]
    tensors += [v for i in sorted(summary["optimizer"]) for _, v in sorted(summary["optimizer"][i].items())]
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr((summary["rng"][1], summary["lr"], summary["step"])).encode())
    return h.hexdigest()


def kill_after(steps: int, victim: int) -> None:
    """Make rank ``victim`` SIGKILL itself when ``steps`` steps are done (as the grader does)."""
    original, calls = lab.compute_loss, [0]

    def compute_loss(model, x, y):
        if calls[0] == steps and dist.get_rank() == victim:
            print(f"rank {victim}: SIGKILL after {steps} steps", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1
        return original(model, x, y)

    lab.compute_loss = compute_loss


def run(args) -> None:
    world = dist.get_world_size()
    say = script.print_on(0)
    if args.kill_at is not None:
        kill_after(args.kill_at, args.victim)
    say(
        f"{world} ranks, backend {cdist.backend()}; {args.steps} steps, a checkpoint every {args.save_every} in {args.root}"
    )
    out = lab.train(args.root, args.steps, save_every=args.save_every, keep=args.keep, resume=args.resume)
    say(f"resumed from: {out['resumed_from'] or 'nothing (a fresh start)'}")
    for step, loss in out["losses"].items():
        say(f"step {step:3d}  loss {loss:.4f}")
    say(f"skipped by the guard: {out['skipped'] or 'none'}")
    prints = [None] * world
    dist.all_gather_object(prints, fingerprint(out))
    say(f"final state fingerprint: {hashlib.sha256(''.join(prints).encode()).hexdigest()[:16]}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--root", type=Path, default=ROOT / "build" / "lab11" / "run", help="checkpoint folder")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    parser.add_argument("--kill-at", type=int, metavar="STEP", help="a rank SIGKILLs itself after STEP steps")
    parser.add_argument("--victim", type=int, default=1, help="the rank --kill-at kills")
    script.main(run, parser)


if __name__ == "__main__":
    main()
