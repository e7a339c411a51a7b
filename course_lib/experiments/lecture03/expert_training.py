"""Expert parallelism measured (lecture 03, tests/experiments/test_expert_training.py, benchmarks/bench_expert.py).

* :func:`train_moe` trains the small MoE course model at ``ep_size`` ranks (expert parallel, each rank
  a share of every global batch; ep_size 1 runs the plain model) and returns its loss curve, the
  per-expert load of every step and the routing decisions, so that ranks can be set against one;
* :func:`train_dense` trains the dense model with as many active parameters (:func:`dense_config`);
* :func:`load_over_training`: max/mean expert load per step without balancing, with the Switch
  auxiliary loss and with DeepSeek-V3's auxiliary-loss-free bias;
* :func:`a2a_bytes`: the all-to-all bytes a rank hands over per MoE layer, beside
  :func:`course_lib.cost.expert_dispatch.ep_dispatch_bytes`.

Sizes are tiny (d_model 64, 2 MoE layers, 8 routed experts top-2 plus one shared, 32-token
sequences) so that 4 ranks over gloo on 2 CPU cores finish a call in seconds. The batches come from
:func:`course_lib.experiments.small_run.batches`; the loop is its own, not the shared one: each step runs
under the counter and the trace (the all-to-all bytes and seconds are the measurement), synchronises the
experts' gradients and moves the routing biases between backward and the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.cost.expert_dispatch import ep_dispatch_bytes, fp8_bytes_per_element
from course_lib.data import MarkovLanguage
from course_lib.dist import counter, device, launch, trace
from course_lib.dist.timing import clock
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.parallel.expert.layer import expert_parallel, global_loads, sync_gradients, update_biases

BALANCING = ("none", "aux_loss", "aux_free")


def moe_config(
    d_model: int = 64, n_experts: int = 8, top_k: int = 2, n_shared: int = 1, moe_d_ff: int = 64, seq_len: int = 32
) -> ModelConfig:
    """The course's ``tiny`` model (2 layers) with every feed-forward a MoE: ``n_shared`` always-on
    experts and the top-``top_k`` of ``n_experts`` routed ones, each a SwiGLU of width ``moe_d_ff``."""
    return configs.get(
        "tiny",
        d_model=d_model,
        max_seq_len=seq_len,
        n_routed_experts=n_experts,
        n_activated_experts=top_k,
        n_shared_experts=n_shared,
        moe_d_ff=moe_d_ff,
    )


def dense_config(moe: ModelConfig) -> ModelConfig:
    """The dense model whose ``n_active_params`` is closest to the MoE's: per layer the MoE activates
    3·d·moe_d_ff·(k + shared) expert weights plus the d·E router, the dense MLP 3·d·d_ff, so
    d_ff = round((3·d·moe_d_ff·(k + shared) + d·E) / (3·d)). Equal up to d·|remainder| per layer."""
    d = moe.d_model
    active_ffn = 3 * d * moe.moe_d_ff * (moe.n_activated_experts + moe.n_shared_experts) + d * moe.n_routed_experts
    return configs.get(
        "tiny", d_model=d, max_seq_len=moe.max_seq_len, n_layers=moe.n_layers, d_ff=round(active_ffn / (3 * d))
    )


def _batches(cfg: ModelConfig, steps: int, batch: int, rank: int, world: int, seed: int, lang=None):
    return small_run.batches(steps, batch, cfg.max_seq_len, seed, lang=lang, rank=rank, world_size=world)


def _train_rank(
    cfg: ModelConfig,
    steps: int,
    batch: int,
    lr: float,
    balance: str,
    rate: float,
    aux_coef: float,
    fp8: bool,
    lang: MarkovLanguage | None = None,
) -> dict:
    """One rank: the model (expert parallel when there is more than one rank), AdamW, ``steps`` steps."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)  # the same model on every rank
    model = Transformer(cfg).to(dev)
    for m in model.moe_layers():
        m.coefs["aux"] = aux_coef if balance == "aux_loss" else 0.0
    if world > 1:
        expert_parallel(model, fp8=fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)  # elementwise: any split of the params
    out = {"loss": [], "ce": [], "loads": [], "experts": [], "spread": []}
    out |= {"seconds": [], "a2a_bytes": [], "a2a_seconds": []}
    for x, y in _batches(cfg, steps, batch, rank, world, seed=0, lang=lang):
        x, y = x.to(dev), y.to(dev)
        dist.barrier()
        start = clock()
        with trace.record() as timeline, counter.count() as sent:
            ce = next_token_loss(model(x), y)
            loss = ce + sum((v for m in model.moe_layers() for v in m.losses.values()), torch.zeros((), device=dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                sync_gradients(model)
            opt.step()
            loads = global_loads(model)
            if balance == "aux_free":
                update_biases(model, loads, rate)
        out["seconds"].append(clock() - start)
        a2a = timeline.named("all_to_all_single")
        nbytes = torch.tensor(float(sent.bytes("all_to_all_single")), device=dev)  # NCCL reduces device tensors only
        dist.all_reduce(nbytes)  # the mean over ranks: a rank's combine sends back what it happened to receive
        out["a2a_bytes"].append(nbytes.item() / world)
        out["a2a_seconds"].append(sum(s.duration for s in a2a))
        both = torch.stack([loss.detach(), ce.detach()]).float()
        dist.all_reduce(both)  # the mean over ranks of equal shares is the whole batch's mean
        out["loss"].append(both[0].item() / world)
        out["ce"].append(both[1].item() / world)
        out["loads"].append([load.tolist() for load in loads])
        out["experts"].append([m.routing.experts.cpu() for m in model.moe_layers()])
        # how much the router's scores differ between this rank's tokens (mean over experts of the std)
        out["spread"].append([m.routing.scores.std(0).mean().item() for m in model.moe_layers()])
    out["bias"] = [m.router.bias.tolist() for m in model.moe_layers()]
    return out


def train_moe(
    ep_size: int = 1,
    steps: int = 10,
    batch: int = 8,
    lr: float = 3e-3,
    balance: str = "aux_free",
    rate: float = 1e-3,
    aux_coef: float = 1e-2,
    fp8: bool = False,
    cfg: ModelConfig | None = None,
    timeout: float = 120,
    lang: MarkovLanguage | None = None,
) -> dict:
    """Train the MoE model for ``steps`` steps of ``batch`` sequences at ``ep_size`` ranks, on ``lang``
    (default the course language; lecture 03 passes :func:`~course_lib.experiments.small_run.quality_language`).

    Returns (rank 0's view, every figure a whole-batch one): ``loss`` and ``ce`` (the cross-entropy
    alone) per step; ``loads`` [step][layer][expert]; ``experts`` [step][layer] the chosen experts of
    every token of the global batch [B·s, k] (ranks' tokens in rank order, as one rank sees them);
    ``spread`` [step][layer] the std over (rank 0's) tokens of the router scores, mean over experts;
    ``seconds`` and ``a2a_seconds`` per step (rank 0's), ``a2a_bytes`` per step (forward and backward,
    the mean over ranks); ``bias`` per layer at the end.
    """
    if balance not in BALANCING:
        raise ValueError(f"balance={balance!r}: choose one of {BALANCING}")
    if batch % ep_size:
        raise ValueError(f"batch={batch} sequences do not split over ep_size={ep_size} ranks")
    cfg = cfg or moe_config()
    ranks = launch(_train_rank, ep_size, cfg, steps, batch, lr, balance, rate, aux_coef, fp8, lang, timeout=timeout)
    result = ranks[0]
    result["experts"] = [
        [torch.cat([r["experts"][s][layer] for r in ranks]) for layer in range(cfg.n_layers)] for s in range(steps)
    ]
    return result


def train_dense(
    steps: int = 10,
    batch: int = 8,
    lr: float = 3e-3,
    cfg: ModelConfig | None = None,
    lang: MarkovLanguage | None = None,
) -> dict:
    """The dense model of :func:`dense_config` under the same data, steps and optimizer, on one rank."""
    cfg = cfg or dense_config(moe_config())
    return launch(_train_rank, 1, cfg, steps, batch, lr, "none", 0.0, 0.0, False, lang, timeout=120)[0]


def load_over_training(method: str, steps: int = 40, batch: int = 8, rate: float = 1e-3, **kwargs) -> dict:
    """max/mean expert load per step (each layer's, and their mean) under ``method``: "none", "aux_loss"
    (the Switch loss, coefficient ``aux_coef``) or "aux_free" (DeepSeek-V3's bias, step ``rate``)."""
    r = train_moe(1, steps, batch, balance=method, rate=rate, **kwargs)
    per_layer = [[max(load) / (sum(load) / len(load)) for load in step] for step in r["loads"]]
    mean = [sum(s) / len(s) for s in per_layer]
    return {"max_over_mean": mean, "per_layer": per_layer, "ce": r["ce"], "spread": r["spread"], "bias": r["bias"]}


def _a2a_rank(cfg: ModelConfig, batch: int, fp8: bool) -> dict:
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)
    model = expert_parallel(Transformer(cfg).to(dev), fp8=fp8)
    x, y = next(iter(_batches(cfg, 1, batch, rank, world, seed=0)))
    with torch.no_grad(), trace.record() as timeline:  # the forward's all-to-alls
        loss = next_token_loss(model(x.to(dev)), y.to(dev))
    phases = {"ep.dispatch": [], "ep.combine": []}
    for name, spans in phases.items():
        for outer in timeline.named(name):  # one per MoE layer, in layer order
            inside = [s for s in timeline.named("all_to_all_single") if outer.start <= s.start <= outer.end]
            spans.append(sum(s.meta["bytes"] for s in inside))
    del loss
    return {"dispatch": phases["ep.dispatch"], "combine": phases["ep.combine"], "tokens": x.numel()}


def a2a_bytes(ep_size: int = 2, batch: int = 8, fp8: bool = False, cfg: ModelConfig | None = None) -> dict:
    """All-to-all bytes each rank hands over per MoE layer in one forward, beside the formula.

    Per rank and layer (no capacity limit, so all T·k assignments leave): the dispatch counts
    ``ep`` split sizes (8 B each), the T·k token rows (``ep_dispatch_bytes``, 4 B per element or
    fp8's 1 + 4/128) and their T·k expert ids (8 B each); the combine sends back the rows this rank
    received — uneven per rank, T·k rows on average, since every row sent is received once.
    Returns ``dispatch`` and ``combine`` [rank][layer] (measured), ``formula_dispatch`` (per rank and
    layer) and ``formula_combine_mean`` (the mean over ranks), and the parts of the formula.
    """
    cfg = cfg or moe_config()
    ranks = launch(_a2a_rank, ep_size, cfg, batch, fp8, timeout=120)
    tokens, k, d = ranks[0]["tokens"], cfg.n_activated_experts, cfg.d_model
    bpe = fp8_bytes_per_element(min(128, d)) if fp8 else 4
    rows = ep_dispatch_bytes(tokens, d, k, bpe)
    return {
        "dispatch": [r["dispatch"] for r in ranks],
        "combine": [r["combine"] for r in ranks],
        "rows": rows,
        "ids": tokens * k * 8,
        "counts": ep_size * 8,
        "formula_dispatch": rows + tokens * k * 8 + ep_size * 8,
        "formula_combine_mean": ep_dispatch_bytes(tokens, d, k, 4),
        "tokens_per_rank": tokens,
    }


def _bandwidth_rank(nbytes: int, repeats: int) -> float:
    world = dist.get_world_size()
    x = torch.zeros(nbytes // 4, device=device())
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)  # warm-up: connections
    dist.barrier()
    start = clock()
    for _ in range(repeats):
        dist.all_to_all_single(y, x)
    seconds = (clock() - start) / repeats
    return nbytes * (world - 1) / world / seconds  # the bytes that leave the rank, per second


def a2a_bandwidth(ep_size: int, nbytes: int = 4 << 20, repeats: int = 5) -> float:
    """Measured all-to-all bandwidth (bytes leaving a rank per second, rank 0's) for ``nbytes`` per rank."""
    return launch(_bandwidth_rank, ep_size, nbytes, repeats, timeout=120)[0]
