"""Lab 11, Task 2: capture and restore, graded on their own with the grader's own training loop.

No check here calls the learner's ``train`` nor its Task 1 code: on 2 ranks the grader builds the
lab's model, optimizer, schedule and guard (given code), trains 4 steps (drawing from torch's, Python's
and NumPy's generators, as a loop with a data loader would), calls the learner's ``capture`` and
writes it with the given ``write_shards`` and a manifest of its own; then it trains on (so every piece
moves), builds fresh objects, scrambles the generators and calls the learner's ``restore``
(``verify_checkpoint`` replaced by a recorder: a Task 1 bug cannot cost Task 2 points, and restore
must call it). Right after ``restore`` everything is compared with what was captured, bit for bit,
and the feedback names the first piece that differs — the step, parameters, AdamW's state and learning
rates, the schedule, the guard, torch's, Python's and NumPy's random states. The same checkpoint is
then restored on one rank, which must come back as rank 0's state (the 2 -> 1 resume).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from course_lib.checkpoint.commit import sha256
from course_lib.dist import device, launch
from course_lib.grading.adapter import Adapter
from course_lib.grading.labs._lab11_common import LAUNCH_S, MANIFEST, scramble

SAVED_AT = 4
# what differs, in the order the feedback names it, and where to look
PIECES = {
    "step": "restore must return the step that capture saved (the data position)",
    "parameters": "put the model's state back (set_state_dict, from what read_shards filled in)",
    "AdamW's state (moments and step)": "save the optimizer's state (get_state_dict) and put it back (set_state_dict)",
    "AdamW's learning rates (param_groups)": "set_state_dict puts back the optimizer's param_groups too",
    "the schedule": "save scheduler.state_dict() in capture and load_state_dict it in restore",
    "the guard": "save guard.state_dict() in capture and load_state_dict it in restore",
    "torch's random state": "save torch.get_rng_state() in capture, torch.set_rng_state it in restore",
    "Python's random state": "save random.getstate() in capture, random.setstate it in restore (the lab's loop "
    "never draws from it, a data loader would)",
    "NumPy's random state": "save np.random.get_state() in capture, np.random.set_state it in restore (the lab's "
    "loop never draws from it, an augmentation would)",
}


def _objects(module, seed: int):
    torch.manual_seed(seed)  # the initial weights: another seed, other weights for restore to overwrite
    model = module.make_model().to(device())
    optimizer = module.make_optimizer(model)
    return model, optimizer, module.make_scheduler(optimizer), module.SpikeGuard(**module.GUARD)


def _train(module, objects, start: int, stop: int) -> None:
    """The grader's loop: data-parallel steps that also draw from Python's and NumPy's generators."""
    model, optimizer, scheduler, guard = objects
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = module.batches_from(start, rank, world)
    for step in range(start, stop):
        x, y = next(batches)
        loss = module.compute_loss(model, module.augment(x).to(device()), y.to(device()))
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        guard.history.append(float(loss.detach()) + random.random() + float(np.random.rand()))  # a loader's draws
        guard.calls += 1
        if step == 2:
            guard.skipped.append(step)


def _cpu(value):
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _snapshot(objects, step) -> dict:
    model, optimizer, scheduler, guard = objects
    optim = optimizer.state_dict()
    return {
        "step": step,
        "parameters": {n: _cpu(p) for n, p in model.named_parameters()},
        "AdamW's state (moments and step)": {i: {k: _cpu(v) for k, v in s.items()} for i, s in optim["state"].items()},
        "AdamW's learning rates (param_groups)": [g["lr"] for g in optim["param_groups"]],
        "the schedule": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "the guard": guard.state_dict(),
        "torch's random state": torch.get_rng_state(),
        "Python's random state": random.getstate(),
        "NumPy's random state": np.random.get_state(),
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _restore_rank(impl: Adapter, path: str, save: bool) -> tuple:
    """(state at capture or None, state right after restore, paths verify_checkpoint was called with)."""
    module, rank = impl.module("restore"), dist.get_rank()
    verified = []

    def verify_checkpoint(where):  # the grader's stand-in for Task 1's: it records, and trusts its own save
        verified.append(Path(where).name)
        return json.loads((Path(where) / MANIFEST).read_text())

    module.verify_checkpoint = verify_checkpoint
    captured = None
    if save:
        objects = _objects(module, seed=0)
        _train(module, objects, 0, SAVED_AT)
        state = impl["capture"](*objects, step=SAVED_AT)
        captured = _snapshot(objects, SAVED_AT)
        if rank == 0:
            Path(path).mkdir(parents=True)
        dist.barrier()
        module.write_shards(state, Path(path))
        dist.barrier()
        if rank == 0:
            files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(Path(path).iterdir())}
            (Path(path) / MANIFEST).write_text(json.dumps({"step": SAVED_AT, "files": files}))
        dist.barrier()
        _train(module, objects, SAVED_AT, SAVED_AT + 2)  # the run goes on: every piece moves past the capture
    fresh = _objects(module, seed=7 + rank)
    scramble(31 + rank)
    step = impl["restore"](path, *fresh)
    return captured, _snapshot(fresh, step), verified


def _first_difference(want: dict, got: dict, where: str) -> None:
    for piece, hint in PIECES.items():
        if not _same(want[piece], got[piece]):
            detail = f" ({got[piece]!r}, not {want[piece]!r})" if piece == "step" else ""
            raise AssertionError(f"{where}, {piece} differs from the captured one{detail}: {hint}")


def _check_verified(verified: list, where: str) -> None:
    assert verified, f"{where}: restore never called verify_checkpoint(path): verify the checkpoint it loads first"
    assert set(verified) == {f"step_{SAVED_AT:08d}"}, (
        f"{where}: restore called verify_checkpoint on {verified}, not on the checkpoint it loads, step_{SAVED_AT:08d}"
    )


def _saved(impl: Adapter, tmp: str):
    path = str(Path(tmp) / "ckpt" / f"step_{SAVED_AT:08d}")
    return path, launch(_restore_rank, 2, impl, path, True, timeout=LAUNCH_S)


def check_restore(impl: Adapter) -> None:
    """Right after restore, on 2 ranks, everything capture saved is back bit for bit: the first piece
    that differs is named."""
    with tempfile.TemporaryDirectory() as tmp:
        _, results = _saved(impl, tmp)
        for rank, (captured, restored, verified) in enumerate(results):
            where = f"right after restore on rank {rank} (of 2)"
            _first_difference(captured, restored, where)
            _check_verified(verified, where)


def check_restore_on_one_rank(impl: Adapter) -> None:
    """A 2-rank checkpoint restored on 1 rank comes back as rank 0's state: DCP reshards the tensors,
    and the rank's own entry holds the step, the schedule, the guard and the random states."""
    with tempfile.TemporaryDirectory() as tmp:
        path, results = _saved(impl, tmp)
        ((_, restored, verified),) = launch(_restore_rank, 1, impl, path, False, timeout=LAUNCH_S)
        where = "a 2-rank checkpoint restored on 1 rank: right after restore"
        _first_difference(results[0][0], restored, where)
        _check_verified(verified, where)
