"""Measured step times of the composed DP × TP × PP step, layout by layout, to check the planner with.

:func:`step_times` runs every candidate layout of one world inside one launch (start-up is the
costly part on 2 cores), in interleaved rounds — layout A, B, C, then A, B, C again — so that a burst
of load on the machine spreads over all of them instead of spoiling one: the ratios between layouts
measured side by side are the figures that count on a shared machine.

:func:`calibrate` measures, in one process on one thread, what the planner's shared-cores mode takes
from this CPU: the rate of the block's matmuls and the fixed cost of one block pass (Python dispatch
and kernel launches). :func:`fit_shared_cores` fits the two constants that only show under
time-sharing — the fixed cost of a pass and the α of a message when 8 ranks take turns on 2 cores —
on a few probe layouts, so that the planner can rank the others.

Tested in tests/cost/test_planner.py; benchmarks/bench_planner.py runs it at full size.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from course_lib.cost import planner
from course_lib.dist import device
from course_lib.dist.launch import launch
from course_lib.dist.timing import clock, time_calls
from course_lib.model import configs
from course_lib.model.layers import rope_cos_sin
from course_lib.model.transformer import Block, Transformer
from course_lib.parallel.compose import Composed, Layout, check_layout


def _timed_step(composed: Composed, opt, x, y) -> float:
    dist.barrier()
    start = clock()
    composed.step(x, y)
    opt.step()
    opt.zero_grad()
    dist.barrier()
    return clock() - start


def _rank(layouts, cfg_name, overrides, global_batch, seq_len, rounds, steps, warmup) -> dict | None:
    torch.set_num_threads(1)  # 8 ranks share 2 cores: each computes on one thread, as the planner assumes
    cfg = configs.get(cfg_name, **overrides)
    # host: drawn from a CPU generator so that every machine gets the same tokens; moved to the device
    g = torch.Generator().manual_seed(0)
    x = torch.randint(cfg.vocab_size, (global_batch, seq_len), generator=g)  # host: drawn on the host, as g
    y = torch.randint(cfg.vocab_size, (global_batch, seq_len), generator=g)  # host: drawn on the host, as g
    x, y = x.to(device()), y.to(device())
    built = []
    for layout in layouts:
        torch.manual_seed(0)
        composed = Composed(Transformer(cfg).to(device()), layout, global_batch)
        opt = torch.optim.SGD(composed.parameters(), lr=1e-3)
        for _ in range(warmup):
            _timed_step(composed, opt, x, y)
        built.append((composed, opt))
    times: dict[str, list[float]] = {str(ly): [] for ly in layouts}
    for _ in range(rounds):
        for layout, (composed, opt) in zip(layouts, built):
            times[str(layout)] += [_timed_step(composed, opt, x, y) for _ in range(steps)]
    return times if dist.get_rank() == 0 else None


def step_times(
    layouts: list[Layout],
    cfg_name: str = "tiny",
    overrides: dict | None = None,
    global_batch: int = 16,
    seq_len: int = 32,
    rounds: int = 3,
    steps: int = 3,
    warmup: int = 2,
    timeout: float = 300,
) -> dict[str, float]:
    """Median step time (seconds, barrier to barrier) of each layout, all of one world size, measured in
    one launch in ``rounds`` interleaved rounds of ``steps`` steps each. Keys: ``str(layout)``."""
    worlds = {ly.world_size for ly in layouts}
    if len(worlds) != 1:
        raise ValueError(f"step_times compares layouts of one world size; got world sizes {sorted(worlds)}")
    args = (layouts, cfg_name, overrides or {}, global_batch, seq_len, rounds, steps, warmup)
    times = launch(_rank, worlds.pop(), *args, timeout=timeout)[0]
    return {name: statistics.median(ts) for name, ts in times.items()}


def _median_seconds(fn, repeats: int) -> float:
    # three untimed calls first: they warm the allocator and the caches
    return statistics.median(time_calls(fn, repeats, warmup=3))


def calibrate(cfg_name: str = "tiny", overrides: dict | None = None, seq_len: int = 32, repeats: int = 20):
    """(seconds of fixed cost of one block pass, FLOP/s of its matmuls), in one process on one thread.

    The rate: the feed-forward's up-projection, [16·s, d] @ [d, d_ff], forward (2 FLOPs per
    multiply-add) — the block's largest matmul at the composed run's largest micro-batch. The fixed
    cost: one block's forward + backward on a single sequence, less its 6 · (matmul parameters) · s
    FLOPs at that rate (forward 2, backward 4 FLOPs per parameter per token). Both on one thread,
    because each of the composed run's ranks computes on one.

    A host measurement: the planner's shared-cores mode (:func:`shared_cores_cluster`) models CPU ranks
    time-sharing this machine's cores, so the rate it needs is this CPU's, whatever accelerator is present
    (on GPUs the planner reads the datasheet figures of ``course_lib.cost.hardware`` instead).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = configs.get(cfg_name, **(overrides or {}))
        # host: this CPU's matmul rate is the quantity measured (see the docstring)
        a, w = torch.randn(16 * seq_len, cfg.d_model), torch.randn(cfg.d_model, cfg.d_ff)
        rate = 2 * a.shape[0] * cfg.d_model * cfg.d_ff / _median_seconds(lambda: a @ w, repeats)
        torch.manual_seed(0)
        block = Block(cfg)
        cos, sin = rope_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta)
        h = torch.randn(1, seq_len, cfg.d_model, requires_grad=True)  # host: a CPU block pass, as `a` above
        params = sum(p.numel() for p in block.parameters() if p.dim() == 2)
        one_pass = _median_seconds(lambda: block(h, cos, sin).sum().backward(), repeats)
    finally:
        torch.set_num_threads(threads)
    return max(0.0, one_pass - 6.0 * params * seq_len / rate), rate


def as_planned(layout: Layout, global_batch: int) -> planner.Layout:
    """The planner's name for a composed layout: m micro-batches per replica is a micro-batch of G/(dp·m) rows;
    the composed step keeps whole replicas (ZeRO-0) and every activation (no recomputation)."""
    return planner.Layout(
        layout.dp, layout.tp, layout.pp, micro_batch=global_batch // (layout.dp * layout.m), zero=0, recompute="none"
    )


def shared_cores_cluster(
    world_size: int, cores: int, rate: float, pass_seconds: float, alpha: float
) -> planner.Cluster:
    """This machine as the planner sees it: ``world_size`` CPU ranks on ``cores`` cores computing at ``rate``
    FLOP/s each (a measured rate), messages costing ``alpha`` each plus 1 ns per byte (about
    1 GB/s over loopback; the composed step's messages are at most a few tens of kB, so α dominates)."""
    link = (alpha, 1e-9)
    return planner.Cluster(
        "H100",  # only for the table's name: memory, peak and links are all given
        world_size,
        devices_per_node=world_size,
        links={"scale_up": link, "scale_out": link},
        memory_bytes=2**30,
        peak_flops=rate,
        cores=cores,
        pass_seconds=pass_seconds,
    )


def fit_shared_cores(
    cfg, measured: dict[Layout, float], global_batch: int, seq_len: int, world_size: int, cores: int, rate: float
) -> tuple[planner.Cluster, float]:
    """The cluster whose ``pass_seconds`` and α make the planner's step times fit ``measured`` (least squares,
    with a constant for what every layout pays alike: the barriers and the optimizer), and that constant.

    The planner's prediction is linear in (pass_seconds, α) once the rate is fixed, so three predictions
    per layout — with both at 0, with pass_seconds = 1, with α = 1 — give the least-squares system.
    """

    def predicted(pass_seconds, alpha, layout):
        cluster = shared_cores_cluster(world_size, cores, rate, pass_seconds, alpha)
        return planner.predict(cfg, cluster, as_planned(layout, global_batch), global_batch, seq_len, dp_overlap=0.0)

    rows, ys = [], []
    for layout, seconds in measured.items():
        base = predicted(0.0, 0.0, layout).step_seconds
        rows.append(
            [
                predicted(1.0, 0.0, layout).step_seconds - base,
                predicted(0.0, 1.0, layout).step_seconds - base,
                1.0,
            ]
        )
        ys.append(seconds - base)
    solution = torch.linalg.lstsq(  # host: a least-squares fit of a few measured seconds, arithmetic only
        torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)[:, None]
    )
    pass_seconds, alpha, constant = solution.solution[:, 0].tolist()
    if pass_seconds < 0 or alpha < 0:
        raise ValueError(
            f"the fit gave pass_seconds={pass_seconds:.2e}, α={alpha:.2e}: the probe layouts do not pin the two "
            "constants down (choose probes that differ in micro-batches and in tensor parallelism)"
        )
    return shared_cores_cluster(world_size, cores, rate, pass_seconds, alpha), constant


def candidates(cfg, world_size: int, global_batch: int, seq_len: int, max_m: int = 4) -> list[Layout]:
    """The composed layouts of ``world_size`` ranks the planner accepts and the composed step can run (no
    context or expert parallelism), with at most ``max_m`` micro-batches per replica (more only repeats
    the pattern on 2 cores, slower)."""
    cluster = shared_cores_cluster(world_size, 1, 1.0, 0.0, 0.0)
    out = []
    sizes = tuple(2**i for i in range(global_batch.bit_length()))
    for ly in planner.layouts(cfg, cluster, global_batch, seq_len, zero=(0,), recompute=("none",), micro_batches=sizes):
        m = global_batch // (ly.dp * ly.micro_batch)
        composed = Layout(ly.dp, ly.tp, ly.pp, m)
        if ly.cp == 1 and ly.ep == 1 and m <= max_m:
            try:
                check_layout(composed, cfg, global_batch)
            except ValueError:
                continue
            out.append(composed)
    return out
