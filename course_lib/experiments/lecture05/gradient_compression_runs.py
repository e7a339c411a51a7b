"""Training the tiny course model under data parallelism with each gradient-compression hook.

One launch trains the same model from the same seed on the same batches once per hook (and once
uncompressed), on 2 ranks of the course DDP, and records per step the global loss and the bytes
this rank handed to the collectives (``course_lib.dist.counter``): the two axes of the
bytes-versus-quality trade-off of lecture 05 and the convergence checks of tests/optim/test_compression.py.
The batches come from :func:`course_lib.experiments.small_run.batches`; the loop is its own, not the shared
one: the counter must enclose forward and backward together (the hooks' collectives run inside backward),
and the loss is averaged over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import counter, device, launch
from course_lib.experiments.small_run import RECIPE
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.compression import QSGDState, SignState, TopKState, qsgd_hook, sign_hook, topk_hook
from course_lib.optim.powersgd import PowerSGDState, powersgd_hook
from course_lib.parallel.data.ddp import DistributedDataParallel, split_batch

CAP_MB = 0.05  # ~52 KB buckets: the tiny model's 415 KiB of gradients make 5 of them

HOOKS = {  # name -> (a fresh per-rank state, the hook); "none" is the plain all-reduce; Top-K keeps 1% or 25%
    "none": (lambda: None, None),
    "topk": (lambda: TopKState(ratio=0.01), topk_hook),
    "topk_no_ef": (lambda: TopKState(ratio=0.01, error_feedback=False), topk_hook),
    "topk25": (lambda: TopKState(ratio=0.25), topk_hook),
    "topk25_no_ef": (lambda: TopKState(ratio=0.25, error_feedback=False), topk_hook),
    "qsgd": (lambda: QSGDState(levels=127), qsgd_hook),
    "sign": (lambda: SignState(), sign_hook),
    "powersgd": (lambda: PowerSGDState(matrix_approximation_rank=2), powersgd_hook),
}


def global_batches(n: int, seed: int = 0) -> list:
    """``n`` global batches of the recipe (:data:`~course_lib.experiments.small_run.RECIPE`), drawn from ``seed``."""
    return RECIPE.batches(seed, steps=n)


def _train_one(name: str, batches: list, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same initial model for every hook
    dev = device()
    model = DistributedDataParallel(Transformer(RECIPE.model_config()).to(dev), bucket_cap_mb=CAP_MB)
    make, hook = HOOKS[name]
    if hook is not None:
        model.register_comm_hook(make(), hook)
    opt = RECIPE.optimizer(model.parameters())
    losses, sent = [], []
    for batch in batches:
        x, y = (split_batch(t, rank, world).to(dev) for t in batch)  # the batches are drawn on the host
        opt.zero_grad(set_to_none=True)
        with counter.count() as c:
            loss = next_token_loss(model(x), y)
            loss.backward()  # the buckets' all-reduces (or hooks) run inside backward
        sent.append(c.bytes())
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"loss": losses, "bytes": sent}


def _train_rank(runs: tuple[tuple[str, int], ...], steps: int) -> dict:
    return {(name, seed): _train_one(name, RECIPE.batches(seed, steps=steps), seed) for name, seed in runs}


def train_with_hooks(
    names=("none", "topk", "topk_no_ef", "qsgd", "sign", "powersgd"),
    seeds=(0,),
    steps: int = RECIPE.steps,
    world_size: int = 2,
    timeout: float = 300,
) -> dict[str, list[dict]]:
    """{hook name: [{"loss": [global mean loss per step], "bytes": [bytes rank 0 handed to collectives per step]}
    for each seed]}.

    :data:`~course_lib.experiments.small_run.RECIPE` (the tiny model, AdamW, the quality language) for
    ``steps`` global batches, on ``world_size`` ranks of the course DDP. Seed s draws the initial model
    and the batches; every hook starts from the same model as "none" at the same seed.
    """
    unknown = [n for n in names if n not in HOOKS]
    if unknown:
        raise ValueError(f"unknown hooks {unknown}; choose from {list(HOOKS)}")
    runs = tuple((name, seed) for name in names for seed in seeds)
    out = launch(_train_rank, world_size, runs, steps, timeout=timeout)[0]
    return {name: [out[(name, seed)] for seed in seeds] for name in names}
