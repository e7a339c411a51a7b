"""Lab 02's rank side: what each rank runs for the grader's checks (lab02_ddp.py compares the results).

The learner's DDP and torch's ``DistributedDataParallel`` are built from one initial model on each
rank (:func:`_pair`), fed the same rows of the course language, and their gradients, parameters,
bucket plans, trace spans and all-reduce counts come back to the grader as plain numbers. A
data-parallel group may be a sub-group of the world: 4 ranks as {0, 1} and {2, 3} (:func:`_pairs`).
"""

import contextlib
import copy
import hashlib
import inspect

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course_lib import data
from course_lib.dist import counter, device, trace
from course_lib.grading.adapter import Adapter
from course_lib.model import configs
from course_lib.model.transformer import Transformer, next_token_loss

PAIRS_TIMEOUT_S = 30  # the broadcast on 4 ranks as two groups: ~1 s here; a wrong group hangs until then
CAP_MB = 0.05  # the tiny model's 417 KiB of gradients -> 5 buckets
GLOBAL_BATCH, SEQ = 12, 32  # splits over 2, 3 and 4 ranks
_LANGUAGE = []


def _pairs():
    """(this rank's group, its index) when 4 ranks form the data-parallel groups {0, 1} and {2, 3}.

    ``dist.new_group`` is collective: every rank creates both groups, in the same order."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return groups[dist.get_rank() // 2], dist.get_rank() // 2


def _batches(n: int, seed: int = 0, group=None):
    """``n`` global batches, this rank's rows of each, on its device (the language is drawn on the host).

    On a sub-group: the group's global batches split over the group's ranks (``seed`` is the group's)."""
    if not _LANGUAGE:
        _LANGUAGE.append(data.MarkovLanguage())
    ds = data.make_dataset(_LANGUAGE[0], GLOBAL_BATCH * SEQ * n + 1, SEQ, seed=seed)
    r, w = dist.get_rank(group), dist.get_world_size(group)
    rows = list(ds.batches(GLOBAL_BATCH // w, rank=r, world_size=w, seed=seed))[:n]
    return [(x.to(device()), y.to(device())) for x, y in rows]


def _backward(model, x, y) -> None:
    next_token_loss(model(x), y).backward()


def _pair(impl: Adapter, register_before=None, group=None):
    """(the DDP under test, torch DDP past its warm-up, a plain copy), all from one initial model,
    data-parallel over ``group`` (None: the world)."""
    torch.manual_seed(0)
    base = Transformer(configs.get("tiny")).to(device())  # initialised on the host: the same weights everywhere
    module = copy.deepcopy(base)
    if register_before is not None:
        register_before(module)
    mine = impl["DDP"](module, bucket_cap_mb=CAP_MB, group=group)
    ref = TorchDDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, process_group=group)
    _backward(ref, *_batches(1, seed=99, group=group)[0])
    ref.zero_grad(set_to_none=True)
    return mine, ref, base


def _n_different(a, b) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------------------- per-rank checks


def _digest(module) -> str:
    """A fingerprint of every parameter and buffer, bit for bit (small to return, unlike the tensors)."""
    flat = torch.cat([t.detach().flatten() for t in [*module.parameters(), *module.buffers()]])
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()


class _WorldBroadcast(Exception):
    """A broadcast on the world where the caller gave a sub-group: it would wait forever for the other group."""


@contextlib.contextmanager
def _refuse_world_broadcast():
    """While it is open, ``dist.broadcast`` without a sub-group raises at once instead of hanging: on two
    groups, the world's broadcast from two sources never completes (it would cost the check its timeout)."""
    real = dist.broadcast

    def broadcast(tensor, *args, **kwargs):
        group = inspect.signature(real).bind(tensor, *args, **kwargs).arguments.get("group")
        if group is None or group == dist.group.WORLD:
            raise _WorldBroadcast("dist.broadcast was called on the world (no group=): pass group=group")
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast
    try:
        yield
    finally:
        dist.broadcast = real


def _broadcast(impl: Adapter, pairs: bool):
    """Each rank starts from its own random model; returns the fingerprints (its own, after
    broadcast_parameters) and the text of the error broadcast_parameters raised, if it did."""
    group = _pairs()[0] if pairs else None
    torch.manual_seed(dist.get_rank())
    module = Transformer(configs.get("tiny")).to(device())  # initialised on the host from this rank's seed
    own = _digest(module)
    try:
        if pairs:
            with _refuse_world_broadcast():
                impl["broadcast_parameters"](module, group)
        else:
            impl["broadcast_parameters"](module)
    except NotImplementedError:
        raise
    except Exception as e:  # e.g. a src outside the group: reported with the group in the grader's words
        return own, None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return own, _digest(module), None


def _torch_buckets(impl: Adapter):
    mine, ref, _ = _pair(impl)
    _backward(ref, *_batches(1)[0])  # the forward of this step rebuilds torch's buckets
    names = {id(p): n for n, p in ref.module.named_parameters()}
    theirs = [[names[id(p)] for p in b.parameters()] for b in ref.reducer._get_zeros_like_grad_buckets()]
    return mine.bucket_names(), theirs


def _against_torch(impl: Adapter, steps: int, accumulate: bool, pairs: bool = False):
    group, index = _pairs() if pairs else (None, 0)
    mine, ref, _ = _pair(impl, group=group)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mine, ref)]
    batches = _batches(2 * steps, seed=7 * index, group=group)  # the two groups train on different rows
    diffs = []
    for step in range(steps):
        micro = batches[2 * step : 2 * step + 2] if accumulate else [batches[step]]
        for model, opt in zip((mine, ref), opts):
            opt.zero_grad(set_to_none=True)
            if accumulate:
                with model.no_sync():
                    _backward(model, *micro[0])
            _backward(model, *micro[-1])
        diffs.append(_n_different(_grads(mine.module), _grads(ref.module)))
        for opt in opts:
            opt.step()
    return diffs, _n_different(list(mine.module.parameters()), list(ref.module.parameters()))


def _overlap(impl: Adapter):
    arrived = []

    def register(module):  # hooks registered before the DDP's own fire first: "gradient arrived"
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: arrived.append(trace.now()))

    mine, _, _ = _pair(impl, register)
    x, y = _batches(1)[0]
    _backward(mine, x, y)  # warm-up
    mine.zero_grad(set_to_none=True)
    arrived.clear()
    with trace.record() as tl:
        with trace.span("backward"):
            _backward(mine, x, y)
    return tl.spans, max(arrived), len(mine.buckets)


def _no_sync(impl: Adapter):
    mine, _, base = _pair(impl)
    x, y = _batches(1)[0]
    with counter.count() as c:
        with mine.no_sync():
            _backward(mine, x, y)
    _backward(base, x, y)
    return c.calls("all_reduce"), _n_different(_grads(mine.module), _grads(base))


class _Interrupted(Exception):
    """What the grader raises inside ``with ddp.no_sync():`` (a learner's loop stopped by an error)."""


def _no_sync_as_context(impl: Adapter):
    """All-reduces of one backward after an exception inside no_sync, inside nested blocks (after the
    inner one ended) and after both ended; whether the exception reached the caller; the bucket count."""
    mine, _, _ = _pair(impl)
    x, y = _batches(1)[0]
    calls = {}
    reached = False
    try:
        with mine.no_sync():
            raise _Interrupted("raised inside no_sync")
    except _Interrupted:
        reached = True
    for when, nested in (("after the exception", False), ("nested", True), ("after both", False)):
        mine.zero_grad(set_to_none=True)
        if nested:
            with mine.no_sync():
                with mine.no_sync():
                    pass
                with counter.count() as c:
                    _backward(mine, x, y)
        else:
            with counter.count() as c:
                _backward(mine, x, y)
        calls[when] = c.calls("all_reduce")
    return reached, calls, len(mine.buckets)


def _world_then_pairs(impl: Adapter, steps: int):
    """4 ranks: against torch on the world, then on the groups {0, 1} and {2, 3} (one launch for both)."""
    return _against_torch(impl, steps, False), _against_torch(impl, steps, False, True)
