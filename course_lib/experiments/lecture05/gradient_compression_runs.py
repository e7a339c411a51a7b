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
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.optim.compression import QSGDState, SignState, TopKState, qsgd_hook, sign_hook, topk_hook
from course_lib.optim.powersgd import PowerSGDState, powersgd_hook
from course_lib.parallel.data.ddp import DistributedDataParallel, split_batch

CAP_MB = 0.05  # ~52 KB buckets: the tiny model's 417 KiB of gradients make 5 of them
GLOBAL_BATCH, SEQ = 8, 32

HOOKS = {  # name -> (a fresh per-rank state, the hook); "none" is the plain all-reduce
    "none": (lambda: None, None),
    "topk": (lambda: TopKState(ratio=0.01), topk_hook),
    "topk_no_ef": (lambda: TopKState(ratio=0.01, error_feedback=False), topk_hook),
    "qsgd": (lambda: QSGDState(levels=127), qsgd_hook),
    "sign": (lambda: SignState(), sign_hook),
    "powersgd": (lambda: PowerSGDState(matrix_approximation_rank=2), powersgd_hook),
}


def global_batches(n: int, seed: int = 0) -> list:
    """``n`` global batches of the course's Markov language, GLOBAL_BATCH sequences of SEQ tokens."""
    return small_run.batches(n, GLOBAL_BATCH, SEQ, seed)


def _train_one(name: str, batches: list, lr: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model for every hook
    dev = device()
    model = DistributedDataParallel(Transformer(configs.get("tiny")).to(dev), bucket_cap_mb=CAP_MB)
    make, hook = HOOKS[name]
    if hook is not None:
        model.register_comm_hook(make(), hook)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
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


def _train_rank(names: tuple[str, ...], batches: list, lr: float) -> dict:
    return {name: _train_one(name, batches, lr) for name in names}


def train_with_hooks(
    names=("none", "topk", "topk_no_ef", "qsgd", "sign", "powersgd"),
    steps: int = 30,
    seed: int = 1,
    lr: float = 3e-3,
    world_size: int = 2,
    timeout: float = 120,
) -> dict[str, dict]:
    """{hook name: {"loss": [global mean loss per step], "bytes": [bytes rank 0 handed to collectives per step]}}.

    AdamW at ``lr``, the tiny config, ``steps`` global batches of the Markov language (``seed``),
    ``world_size`` ranks of the course DDP; every hook starts from the same model.
    """
    unknown = [n for n in names if n not in HOOKS]
    if unknown:
        raise ValueError(f"unknown hooks {unknown}; choose from {list(HOOKS)}")
    return launch(_train_rank, world_size, tuple(names), global_batches(steps, seed), lr, timeout=timeout)[0]
