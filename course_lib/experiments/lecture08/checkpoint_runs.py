"""Fault tolerance live (lecture 08b): train with checkpoints, kill a rank, resume, reshard, corrupt, measure.

:func:`train` is the per-rank training loop every experiment here runs: a narrower ``tiny`` (:data:`MODEL`) under
the course's ZeRO (:mod:`course_lib.parallel.data.zero`), the Markov language of
:mod:`course_lib.data`, and a "token dropout" that replaces 10% of the input tokens with random ones
drawn from each rank's global torch RNG, so that the RNG state matters to the result as much as
the weights and the data position do. Around it:

* :func:`kill_and_resume` — an uninterrupted run; the same run with one rank SIGKILLed at a random
  step; a run resumed from the last checkpoint. Returns all three for an exact comparison.
* :func:`reshard` — 4 ranks save, 2 ranks load and go on (and 2 -> 4 back), losses beside the
  uninterrupted 4-rank run's.
* :func:`crash_during_save` — a rank killed after DCP wrote its shards but before the manifest:
  what is on disk, and which checkpoint :func:`~course_lib.checkpoint.latest` picks.
* :func:`corrupt_copies` — copies of a checkpoint with one shard truncated and one altered.
* :func:`checkpoint_sizes` — full, incremental (full training and fine-tuning with frozen layers)
  and quantized checkpoints: bytes on disk beside :mod:`course_lib.cost.checkpoint`.

The loop is its own, not :func:`course_lib.experiments.small_run.train`: a run resumes mid-stream (its
batches come from the saved data position, :class:`course_lib.checkpoint.resume.TrainState`), a rank
kills itself at a given step, and checkpoints are written between steps; its windows are
:func:`~course_lib.experiments.small_run.windows`. Tested in tests/checkpoint/test_checkpoint.py and
tests/checkpoint/test_checkpoint_resume.py.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint import commit as commit_module
from course_lib.checkpoint import incremental, quantized, resume, sharded
from course_lib.checkpoint.commit import latest, read_manifest
from course_lib.checkpoint.resume import TrainState
from course_lib.checkpoint.zero_state import full_state, load_zero_state, zero_state_dict
from course_lib.cost.checkpoint import (
    dcp_file_bytes,
    full_checkpoint_bytes,
    incremental_checkpoint_bytes,
    quantized_checkpoint_bytes,
)
from course_lib.data import MarkovLanguage
from course_lib.dist import RankError, device, launch
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.zero import Zero

# configs.get("tiny", **MODEL): tiny at half its width, 22,688 parameters to tiny's 106,816 (lecture 08b counts them)
MODEL = dict(d_model=32, d_ff=64, n_heads=4, n_kv_heads=2, max_seq_len=16)
SEQ_LEN, N_SEQ, GLOBAL_BATCH = 16, 48, 8  # 6 steps per epoch: a 12-step run crosses an epoch boundary
LR, WEIGHT_DECAY, DATA_SEED = 3e-3, 0.1, 7
TIMEOUT_S = 120


def dataset():
    """48 windows of 16 tokens of the course language (the same on every rank and every run)."""
    return small_run.windows(MarkovLanguage(), N_SEQ, SEQ_LEN, DATA_SEED)


def _token_dropout(x: torch.Tensor, p: float = 0.1) -> torch.Tensor:
    """Replace a fraction p of the tokens of a host batch by random symbols, from this rank's global
    CPU RNG: the generator whose state :mod:`course_lib.checkpoint.resume` saves and restores, so the
    draws (and a resumed run) are the same on every machine. Move the result to the device after."""
    assert x.device.type == "cpu", (
        f"token dropout works on the host batch, before it moves to the device; got {x.device}"
    )
    mask = torch.rand(x.shape) < p  # host: the checkpointed CPU generator, identical draws on every machine
    # host: the same checkpointed CPU generator, so a resumed run draws what the uninterrupted one drew
    return torch.where(mask, torch.randint(0, 16, x.shape), x)


def _crash_before_manifest() -> None:
    """Make this rank die the moment the commit would write the manifest (after DCP wrote the shards)."""
    commit_module.write_manifest = lambda *_a, **_k: os.kill(os.getpid(), signal.SIGKILL)


def _resolve(load: str) -> Path:
    """A checkpoint directory, or the newest valid one under a root; rank 0 decides for everyone."""
    box = [None]
    if dist.get_rank() == 0:
        p = Path(load)
        box[0] = str(p if (p / commit_module.MANIFEST).exists() else latest(p))
    dist.broadcast_object_list(box, src=0)
    if box[0] == "None":
        raise FileNotFoundError(f"no valid checkpoint under {load}")
    return Path(box[0])


def train(
    root: str | None,
    steps: int,
    *,
    stage: int = 2,
    precision: str = "fp32",
    save_every: int = 0,
    keep: int | None = None,
    load: str | None = None,
    kill_at: int | None = None,
    victim: int = 0,
    crash_in_save_at: int | None = None,
    snapshots: bool = False,
    dropout: float = 0.1,
    seed: int = 0,
) -> dict:
    """One rank's training run (call through ``launch``) up to ``steps`` optimizer steps.

    ``save_every``: a checkpoint under ``root`` every that many steps (``keep``: prune to the
    newest k). ``load``: resume first from that checkpoint, or from the newest valid one under that
    root. ``kill_at``: rank ``victim`` SIGKILLs itself when ``kill_at`` steps are done.
    ``crash_in_save_at``: rank 0 dies inside the save of that step, before the manifest.
    ``snapshots``: also return the gathered state right after loading and at each save.
    ``dropout``: the fraction of input tokens replaced from the rank's RNG (0: none, and no draw).
    Returns {"losses": {step: mean loss over ranks}, "state", "step", "next_batch", "rng", ...}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same initial weights everywhere (Zero broadcasts rank 0's anyway)
    model = Transformer(configs.get("tiny", **MODEL)).to(device())  # Zero keeps its shards on device()
    zero = Zero(model, stage, lr=LR, weight_decay=WEIGHT_DECAY, precision=precision)
    train_state = TrainState(step=0, seed=DATA_SEED, global_batch=GLOBAL_BATCH)
    torch.manual_seed(1000 + rank)  # each rank its own random stream (token dropout)
    random.seed(1000 + rank)
    out = {"losses": {}, "saved": {}, "loaded": None, "loaded_from": None}
    if load is not None:
        path = _resolve(load)
        same_world = read_manifest(path)["world_size"] == world
        state = {**zero_state_dict(zero), **resume.state_dict(train_state, rng=same_world)}
        sharded.load(path, state)
        load_zero_state(zero, state)
        train_state = resume.restore(state)
        out["loaded_from"] = path.name
        if snapshots:
            out["loaded"] = full_state(zero)
    batches = train_state.batches(dataset(), rank, world)
    while train_state.step < steps:
        if kill_at is not None and train_state.step == kill_at and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: as a node failure
        x, y = next(batches)
        x = _token_dropout(x, dropout) if dropout else x
        loss = model.loss(x.to(device()), y.to(device()))
        loss.backward()
        zero.step()
        zero.zero_grad()
        train_state.step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["losses"][train_state.step] = (mean / world).item()
        if save_every and train_state.step % save_every == 0:
            if train_state.step == crash_in_save_at and rank == 0:
                _crash_before_manifest()
            state = {**zero_state_dict(zero), **resume.state_dict(train_state)}
            sharded.save(root, train_state.step, state, keep=keep)
            if snapshots:
                out["saved"][train_state.step] = full_state(zero)
    out.update(
        state=full_state(zero), step=train_state.step, next_batch=next(batches), rng=torch.rand(4)
    )  # host: the CPU RNG's state
    return out


def _run_until_killed(planned: str, world_size: int, *args, **kw) -> str:
    """Run :func:`train` that is set to lose a rank; the first line of the RankError it must end with."""
    try:
        launch(train, world_size, *args, timeout=TIMEOUT_S, **kw)
    except RankError as e:
        return str(e).splitlines()[0]
    raise AssertionError(f"{planned}, yet the run finished")


def kill_and_resume(root: str, world_size: int = 2, steps: int = 12, save_every: int = 3, seed: int = 0, **kw) -> dict:
    """Uninterrupted run, run killed at a random step, run resumed from its last checkpoint.

    The kill step (after the first checkpoint, before the end) and the victim rank are drawn from
    ``random.Random(seed)``. Returns {"reference", "resumed": per-rank results, "kill_at",
    "victim", "error": the killed run's RankError message, "resumed_from"}.
    """
    draw = random.Random(seed)
    kill_at, victim = draw.randrange(save_every + 1, steps), draw.randrange(world_size)
    reference = launch(train, world_size, None, steps, timeout=TIMEOUT_S, **kw)
    error = _run_until_killed(
        f"rank {victim} was to kill itself at step {kill_at}",
        world_size,
        root,
        steps,
        save_every=save_every,
        kill_at=kill_at,
        victim=victim,
        **kw,
    )
    resumed = launch(train, world_size, root, steps, save_every=save_every, load=root, timeout=TIMEOUT_S, **kw)
    return dict(
        reference=reference,
        resumed=resumed,
        kill_at=kill_at,
        victim=victim,
        error=error,
        resumed_from=resumed[0]["loaded_from"],
    )


def reshard(
    root: str, steps: int = 9, save_every: int = 3, big: int = 4, small: int = 2, stage: int = 1, back: bool = True
) -> dict:
    """``big`` ranks train and save every ``save_every`` steps (the uninterrupted run); ``small`` ranks
    resume from its first checkpoint and save; ``big`` ranks resume from the small run's next one.

    Token dropout is off: N ranks' random streams cannot be carried over to M ranks (see
    :mod:`course_lib.checkpoint.resume`), and here the only difference between the runs is to be
    the order in which the gradient sums are reduced. ``back=False`` skips the third run. Returns
    {"big", "small", "back": rank 0's results of the three runs, with the states right after
    loading and at each save (``snapshots``); "first", "second": the two checkpoints loaded}.
    """
    a, b = Path(root) / f"world{big}", Path(root) / f"world{small}"
    kw = dict(stage=stage, dropout=0.0, snapshots=True, timeout=TIMEOUT_S)
    big_run = launch(train, big, str(a), steps, save_every=save_every, **kw)
    first = commit_module.step_dir(a, save_every)
    small_run = launch(train, small, str(b), steps, save_every=save_every, load=str(first), **kw)
    second = commit_module.step_dir(b, 2 * save_every)
    back_run = launch(train, big, None, steps, load=str(second), **kw)[0] if back else None
    return {"big": big_run[0], "small": small_run[0], "back": back_run, "first": first, "second": second}


def crash_during_save(root: str, world_size: int = 2, save_every: int = 2, crash_at: int = 6, **kw) -> dict:
    """Rank 0 dies inside the save of step ``crash_at``, after every rank's shards are on disk.

    Returns {"error", "entries": names under root, "latest": the name latest() picks, "tmp_files":
    what the dead save left in its temp folder}.
    """
    error = _run_until_killed(
        f"rank 0 was to die in the save of step {crash_at}",
        world_size,
        root,
        crash_at + 2,
        save_every=save_every,
        crash_in_save_at=crash_at,
        **kw,
    )
    entries = sorted(p.name for p in Path(root).iterdir())
    tmp = [p for p in Path(root).iterdir() if p.name.startswith(".tmp-")]
    found = latest(root)
    return {
        "error": error,
        "entries": entries,
        "latest": found.name if found else None,
        "tmp_files": sorted(p.name for p in tmp[0].iterdir()) if tmp else [],
    }


def corrupt_copies(checkpoint: str | os.PathLike, into: str | os.PathLike) -> dict[str, Path]:
    """Two copies of ``checkpoint`` under ``into``: one shard cut to half its size (a copy that
    stopped early), one with a single byte changed (bit rot). {"truncated": path, "altered": path}."""
    checkpoint, into = Path(checkpoint), Path(into)
    copies = {}
    for kind in ("truncated", "altered"):
        dest = into / kind / checkpoint.name
        shutil.copytree(checkpoint, dest)
        shard = sorted(dest.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        if kind == "truncated":
            data = data[: len(data) // 2]
        else:
            data[len(data) // 2] ^= 0x01  # one bit
        shard.write_bytes(bytes(data))
        copies[kind] = dest
    return copies


def same(a, b) -> bool:
    """Bit-identical tensors (torch.equal), or equal plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _tensors(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _files(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in path.iterdir()}


def _sizes_rank(root: str, block_incremental: int, block_quantized: int) -> dict:
    rank = dist.get_rank()
    out = {}
    for scenario in ("full training", "frozen"):
        torch.manual_seed(0)
        model = Transformer(configs.get("tiny", **MODEL)).to(device())
        if scenario == "frozen":  # fine-tune only the last block and the output layer
            for unit in (model.tok_embeddings, model.layers[0], model.norm):
                unit.requires_grad_(False)
        # weight decay 0: a frozen parameter with zero gradient and zero moments then stays bit-equal
        zero = Zero(model, 1, lr=LR, weight_decay=0.0)
        torch.manual_seed(1000 + rank)
        batches = TrainState(0, DATA_SEED, GLOBAL_BATCH).batches(dataset(), rank, dist.get_world_size())
        where = Path(root) / scenario.replace(" ", "-")
        for step in range(1, 6):
            x, y = next(batches)
            model.loss(_token_dropout(x).to(device()), y.to(device())).backward()
            zero.step()
            zero.zero_grad()
            if step == 4:  # the base: a full checkpoint and this rank's snapshot of it
                state = _tensors(zero_state_dict(zero))  # tensors only: the sizes are the lesson
                base_path = sharded.save(where, step, state)
                base = incremental.snapshot(state)
        state = _tensors(zero_state_dict(zero))
        inc_path = incremental.save(where, 5, state, base_path, base, block=block_incremental)
        entries = incremental.delta(state, base, block_incremental)
        truth = full_state(zero)
        # rebuild step 5 from base + increments in a fresh optimizer: it must be the state bit for bit
        torch.manual_seed(1)
        fresh = Zero(Transformer(configs.get("tiny", **MODEL)).to(device()), 1, lr=LR, weight_decay=0.0)
        incremental.load(inc_path, _tensors(zero_state_dict(fresh)))
        load_zero_state(fresh, {"optim.step": 5})  # the step count was not saved (tensors only)
        rebuilt = full_state(fresh)
        out[scenario] = {
            "n_params": sum(u.numel for u in zero.units),
            "keys": len(state),
            "base": base_path,
            "incremental": inc_path,
            "changed_elements": sum(v.numel() for k, v in entries.items() if k.endswith(".values")),
            "changed_blocks": sum(v.numel() for k, v in entries.items() if k.endswith(".blocks")),
            "exact": all(same(rebuilt[k], truth[k]) for k in truth),
        }
        if scenario == "full training":  # and a quantized copy of the same state
            q_path = quantized.save(Path(root) / "quantized", 5, state, block=block_quantized)
            fresh_state = _tensors(zero_state_dict(fresh))
            quantized.load(q_path, fresh_state)
            worst = 0.0  # the largest |error| / bound over all elements: <= 1 when every bound holds
            for key, value in state.items():
                mine = sharded.local(value).reshape(-1)
                _, scale = quantized.quantize(mine, block_quantized)
                err = (sharded.local(fresh_state[key]).reshape(-1) - mine).abs()
                bound = quantized.error_bound(scale, mine.numel(), block_quantized)
                if mine.numel():
                    worst = max(worst, float((err / bound.clamp_min(1e-38)).max()))
            numels = [sharded.local(v).numel() for v in state.values()]
            out["quantized"] = {"path": q_path, "numels": numels, "worst": worst}
    return out


def checkpoint_sizes(root: str, world_size: int = 2, block_incremental: int = 256, block_quantized: int = 256) -> dict:
    """Bytes on disk of full, incremental and quantized checkpoints of the same training, with formulas.

    Returns {"full", "incremental (full training)", "incremental (frozen)", "quantized"}: each a dict
    of "files" (bytes of the .distcp files, summed over ranks), "payload" (the formula of
    :mod:`course_lib.cost.checkpoint`), "items" (tensors written), "bounds" (:func:`dcp_file_bytes`),
    plus "exact" (incremental: the rebuilt state equals the true one bit for bit) and "worst"
    (quantized: the largest |error| / its bound, over all elements; <= 1 means every bound holds).
    """
    per_rank = launch(_sizes_rank, world_size, root, block_incremental, block_quantized, timeout=TIMEOUT_S)

    def distcp(path: Path) -> int:
        return sum(size for name, size in _files(path).items() if name.endswith(".distcp"))

    result = {}
    r0 = per_rank[0]
    n_params, keys = r0["full training"]["n_params"], r0["full training"]["keys"]
    payload = full_checkpoint_bytes(n_params, param_bytes=4, moment_bytes=8)
    items = keys * world_size  # every rank writes its chunk of each tensor
    result["full"] = dict(files=distcp(r0["full training"]["base"]), payload=payload, items=items)
    for scenario in ("full training", "frozen"):
        changed_elements = sum(r[scenario]["changed_elements"] for r in per_rank)
        changed_blocks = sum(r[scenario]["changed_blocks"] for r in per_rank)
        result[f"incremental ({scenario})"] = dict(
            files=distcp(r0[scenario]["incremental"]),
            payload=incremental_checkpoint_bytes(changed_elements, changed_blocks, 4),
            items=2 * keys * world_size,  # blocks and values of each tensor, per rank
            changed_fraction=changed_elements / (3 * n_params),
            exact=all(r[scenario]["exact"] for r in per_rank),
        )
    numels = [n for r in per_rank for n in r["quantized"]["numels"]]
    result["quantized"] = dict(
        files=distcp(r0["quantized"]["path"]),
        payload=quantized_checkpoint_bytes(numels, block_quantized),
        items=2 * len(numels),
        worst=max(r["quantized"]["worst"] for r in per_rank),
    )
    for row in result.values():
        row["bounds"] = dcp_file_bytes(row["payload"], row["items"])
    return result
