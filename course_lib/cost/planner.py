"""The auto-planner: enumerate the layouts of a training job, predict each one's memory and step time
from the course's models, refuse what cannot run (saying why), rank the rest and explain the pick.

A layout splits N devices as dp × pp × cp × tp (the course mesh's order: tp innermost, so its
ranks share a node first; :mod:`course_lib.dist.mesh`), carves ep expert-parallel ranks out of dp,
and chooses a micro-batch b (so m = G / (dp·b) micro-batches per step), a ZeRO stage over dp,
activation recomputation ("none", "selective" or "full") and the pipeline schedule. Nothing below prefers one axis to another: each
prediction is a sum of terms from the formulas of :mod:`course_lib.cost`, each with its source.

**Memory per device** (the busiest pipeline stage: stage 0 holds the most micro-batches in flight):

    model states   :func:`~course_lib.cost.memory.zero_model_state_bytes` of the stage's parameters
                   (dense part / tp sharded over dp, expert part / ep sharded over dp/ep; ZeRO §5)
    activations    in-flight micro-batches (1F1B: min(pp, m), Narayanan et al. 2021 §2.2.1) ×
                   layers of the stage × :func:`~course_lib.cost.activations.korthikanti_bytes_per_layer`
                   (with sequence parallelism whenever tp > 1, on s/cp tokens); under full
                   recomputation only each layer's 16-bit input, 2·s·b·h/(tp·cp), plus one layer's full set
                   (Korthikanti et al. 2022, §5)
    logits         b·(s/cp)·V/tp fp32 values on the last stage (the loss reads them in fp32)

compared with ``memory_fraction`` of the device's HBM (the allocator, NCCL's buffers and the CUDA
context take the rest).

**Step time** on devices with a chip each: :func:`course_lib.cost.step_time.step_seconds`, from the
work each rank does. GEMMs are timed by the roofline of their shapes at the accelerator's fitted
sustained efficiency, with attention's causal half skipped. Communication is exposed unless the
stack hides it: DP behind backward, TP with Megatron-Core's overlap, EP under DualPipe. The bubble
follows the schedule: 1F1B, interleaved 1F1B and DualPipe. No input is an end-to-end efficiency. Its
predictions for the published runs of :mod:`course_lib.cost.published` are within 15%, and
BENCHMARKS.md shows them with their errors.

A group's link is NVLink-class ("scale_up") when its ranks fit in one node, the network
("scale_out") otherwise; α and β come from :func:`~course_lib.cost.links.link_alpha_beta`.

**Shared cores** (``Cluster(cores=C)`` with C < N: N CPU ranks time-sharing C cores, as the course
runs 8 ranks on a 2-core machine). A rank waiting in the bubble gives its core to another rank, so the
bubble costs nothing; what the step costs is every rank's work divided by the cores:

    compute        (training FLOPs / rate + passes · pass_seconds) / C, where passes = dp·tp·m·(L + 1)
                   block forward-backward passes over all ranks (+1: the output layer and the loss) and
                   ``pass_seconds`` is the fixed cost of one pass whatever its size (Python dispatch,
                   kernel launches: on a tiny model it outweighs the arithmetic)

The communication terms stay on the critical path, through all m + pp − 1 slots of the schedule (a
TP rank waits for its partner in every slot it computes); under time-sharing their α is mostly the
wait for the partner to be scheduled, so it is measured under load, not on an idle pair. The rate
is measured too (``Cluster(peak_flops=...)``): the shared-cores mode takes no table figure.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from course_lib.cost import hardware
from course_lib.cost.activations import korthikanti_bytes_per_layer
from course_lib.cost.alpha_beta import collective_seconds
from course_lib.cost.flops import train_flops_per_token
from course_lib.cost.links import link_alpha_beta
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.cost.pipeline import in_flight_microbatches
from course_lib.cost.step_time import step_seconds
from course_lib.model.config import ModelConfig

RECOMPUTE = ("none", "selective", "full")
SEARCHED_RECOMPUTE = ("none", "full")  # what plan() tries unless told
SCHEDULES = ("1f1b", "dualpipe")  # 1F1B with virtual_stages > 1 is Megatron's interleaved schedule


@dataclass(frozen=True)
class Cluster:
    """N devices of one kind, ``devices_per_node`` to a node. ``precision``: the GEMMs' ("bf16" or "fp8");
    ``links``: optional {"scale_up" | "scale_out": (α, β)} measured figures instead of the table's;
    ``peak_flops``: a measured sustained rate instead of the table's peak × the fitted GEMM efficiency
    (:data:`course_lib.cost.step_time.GEMM_EFFICIENCY`). No input is an end-to-end efficiency."""

    accelerator: str | hardware.Accelerator
    n_devices: int
    devices_per_node: int = 8
    memory_fraction: float = 0.9
    precision: str = "bf16"
    links: dict = field(default_factory=dict)
    memory_bytes: float | None = None  # instead of the table's HBM (a CPU rank's share of RAM, say)
    peak_flops: float | None = None  # instead of the table's peak (a measured figure)
    gemm_efficiency: float | None = None  # instead of cost.step_time.GEMM_EFFICIENCY (to fit it)
    cores: int | None = None  # the devices time-share this many cores (CPU ranks); None: each its own
    pass_seconds: float = 0.0  # fixed cost of one block's forward + backward on one micro-batch

    def __post_init__(self):
        if self.n_devices < 1 or self.devices_per_node < 1:
            raise ValueError(f"a cluster needs n_devices >= 1 and devices_per_node >= 1, got {self}")
        if (self.cores is not None and self.cores < 1) or self.pass_seconds < 0:
            raise ValueError(f"cores={self.cores} must be >= 1 and pass_seconds={self.pass_seconds} >= 0")
        if not 0 < self.memory_fraction <= 1 or self.precision not in ("bf16", "fp8"):
            raise ValueError(
                f"memory_fraction={self.memory_fraction} must lie in (0, 1] and precision={self.precision!r} be "
                "'bf16' or 'fp8' (the GEMMs' precision; attention and the output layer stay in bf16)"
            )

    @property
    def shared(self) -> bool:
        """More ranks than cores: the ranks take turns, and the bubble's idle time goes to others."""
        return self.cores is not None and self.cores < self.n_devices

    @property
    def device(self) -> hardware.Accelerator:
        return hardware.get(self.accelerator)

    def usable_bytes(self) -> float:
        total = self.memory_bytes if self.memory_bytes is not None else self.device.hbm_bytes.value
        return self.memory_fraction * total

    def flops(self) -> float:
        return self.peak_flops if self.peak_flops is not None else self.device.peak_flops(self.precision)

    def link(self, span: int) -> tuple[str, tuple[float, float]]:
        """The link a group of ``span`` consecutive ranks talks over, and its (α, β)."""
        name = "scale_up" if span <= self.devices_per_node else "scale_out"
        return name, self.links.get(name) or link_alpha_beta(self.accelerator, name)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    zero: int = 1
    recompute: str = "none"
    virtual_stages: int = 1  # v pipeline chunks per rank: Megatron's interleaved 1F1B when > 1
    schedule: str = "1f1b"
    tp_overlap: bool = False  # Megatron-Core's --tp-comm-overlap
    balanced: bool = False  # stages sized to equal work (the output layer's rank gets fewer blocks)
    ep_node_limit: int = 0  # a token's experts on at most this many nodes (DeepSeek-V3 §2.1.2: 4); 0: any

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("v", self.virtual_stages)) if v > 1)
        extra += " dualpipe" if self.schedule == "dualpipe" else ""
        return (
            f"dp={self.dp} tp={self.tp} pp={self.pp}{extra} b={self.micro_batch} ZeRO-{self.zero} "
            f"recompute={self.recompute}"
        )


@dataclass
class Prediction:
    layout: Layout
    memory: dict[str, float]  # bytes per device, by term
    seconds: dict[str, float]  # step time, by term
    usable_bytes: float
    links: dict[str, str]  # axis -> "scale_up" | "scale_out"

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def reasons(cfg: ModelConfig, cluster: Cluster, layout: Layout, global_batch: int, seq_len: int) -> list[str]:
    """Why ``layout`` cannot run this job ([] when it can), each naming the constraint and the fix.
    Memory is judged by :func:`predict`."""
    out, ly = [], layout
    world = ly.dp * ly.tp * ly.pp * ly.cp
    if world != cluster.n_devices:
        out.append(f"dp·tp·pp·cp = {world} is not the cluster's {cluster.n_devices} devices")
    if cfg.n_heads % ly.tp or cfg.n_kv_heads % ly.tp:
        out.append(
            f"tensor parallel size {ly.tp} does not divide {cfg.n_heads} attention heads and {cfg.n_kv_heads} "
            "key/value heads: choose tp among their common divisors"
        )
    if ly.pp > cfg.n_layers:
        out.append(f"{ly.pp} pipeline stages need at least {ly.pp} blocks; the model has {cfg.n_layers}")
    if seq_len % (2 * ly.cp) and ly.cp > 1:
        out.append(f"context parallel size {ly.cp} needs the sequence ({seq_len}) in 2·cp equal chunks (load balance)")
    if ly.ep > 1 and (not cfg.is_moe or cfg.n_routed_experts % ly.ep):
        out.append(
            f"expert parallel size {ly.ep} needs a mixture of experts whose {cfg.n_routed_experts} experts it divides"
        )
    if ly.dp % ly.ep:
        out.append(f"ep={ly.ep} ranks are carved out of dp={ly.dp}: choose ep dividing dp")
    if global_batch % (ly.dp * ly.micro_batch):
        out.append(
            f"the global batch of {global_batch} sequences does not split into dp={ly.dp} replicas of micro-batches "
            f"of {ly.micro_batch}: choose dp·b dividing {global_batch}"
        )
    if ly.schedule not in SCHEDULES or ly.virtual_stages < 1 or (ly.schedule == "dualpipe" and ly.virtual_stages > 1):
        out.append(
            f"schedule {ly.schedule!r} with virtual_stages={ly.virtual_stages}: choose one of {SCHEDULES}; "
            "interleaving is 1f1b with virtual_stages > 1, and DualPipe has its own two chunks per rank"
        )
    if ly.pp * ly.virtual_stages > cfg.n_layers and ly.virtual_stages > 1:
        out.append(
            f"pp·v = {ly.pp * ly.virtual_stages} chunks need at least as many blocks; the model has {cfg.n_layers}"
        )
    if ly.schedule == "dualpipe" and ly.pp % 2:
        out.append(f"DualPipe needs an even number of pipeline stages (DeepSeek-V3 §3.2.1), got pp={ly.pp}")
    if ly.zero not in (0, 1, 2, 3) or ly.recompute not in RECOMPUTE:
        out.append(f"ZeRO stage {ly.zero} / recompute {ly.recompute!r}: stages are 0-3, recompute one of {RECOMPUTE}")
    return out


def rank_params(cfg: ModelConfig, layers, tp_size: int, ep_size: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters one rank holds for the blocks ``layers``: the dense ones split over tp,
    the routed experts over ep, the embedding on the first stage and the output layer on the last.
    tests/measure/test_simulated_ranks.py counts them on the composed model's stages, built at full size."""
    dense = expert = 0.0
    for i in layers:
        total = cfg.layer_params(i)
        routed = 3 * cfg.d_model * cfg.moe_d_ff * cfg.n_routed_experts if cfg.is_moe_layer(i) else 0
        dense, expert = dense + (total - routed) / tp_size, expert + routed / ep_size
    if first and not cfg.tie_embeddings:
        dense += cfg.vocab_size * cfg.d_model / tp_size
    if last:
        dense += (cfg.vocab_size * cfg.d_model + cfg.d_model) / tp_size
    return dense, expert


def _stage_params(cfg: ModelConfig, pp_size: int, tp_size: int, ep_size: int) -> tuple[float, float, int]:
    """(dense parameters per device, expert parameters per device, layers) on the busiest stage."""
    best = (0.0, 0.0, 0)
    for s in range(pp_size):
        layers = range(s * cfg.n_layers // pp_size, (s + 1) * cfg.n_layers // pp_size)
        dense, expert = rank_params(cfg, layers, tp_size, ep_size, s == 0, s == pp_size - 1)
        if dense + expert > sum(best[:2]):
            best = (dense, expert, len(layers))
    return best


def stage_imbalance(cfg: ModelConfig, pp_size: int) -> float:
    """The busiest stage's matmul parameters over the average stage's (1.0: perfectly balanced).

    A pipeline runs at the pace of its slowest stage. Blocks are shared out evenly, so the output
    layer (V·d, a sizeable block's worth for a large vocabulary) makes the last stage the slowest;
    Llama 3 moved a block off its first and last stages for this reason (Dubey et al. 2024, §3.3.2).
    """
    stages = []
    for s in range(pp_size):
        work = sum(
            cfg.layer_params(i, active=True)
            for i in range(s * cfg.n_layers // pp_size, (s + 1) * cfg.n_layers // pp_size)
        )
        stages.append(work + (cfg.vocab_size * cfg.d_model if s == pp_size - 1 else 0))
    return max(stages) * pp_size / sum(stages)


def predict(
    cfg: ModelConfig,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
    seq_len: int,
    dp_overlap: float = 1.0,
    flash: bool = True,
) -> Prediction:
    """Memory per device and step time of ``layout`` (see the module docstring for every term).
    ``flash``: attention keeps no s×s matrix for backward (FlashAttention; the course's SDPA on CPU too)."""
    problems = reasons(cfg, cluster, layout, global_batch, seq_len)
    if problems:
        raise ValueError(f"layout {layout} cannot run: " + "; ".join(problems))
    ly, h = layout, cfg.d_model
    b, s = ly.micro_batch, seq_len // ly.cp
    m = global_batch // (ly.dp * b)
    dense, expert, layers = _stage_params(cfg, ly.pp, ly.tp, ly.ep)
    memory = {
        "model states": zero_model_state_bytes(max(1, round(dense)), ly.dp, ly.zero)
        + (zero_model_state_bytes(max(1, round(expert)), ly.dp // ly.ep, ly.zero) if expert else 0.0),
    }
    if ly.schedule == "dualpipe":  # a second copy of the stage's bf16 parameters (DeepSeek-V3 Table 2)
        memory["model states"] += 2 * (dense + expert)
    # micro-batches' worth of the stage's layers that rank 0 holds (cost.pipeline; DeepSeek-V3 Table 2: PP + 1)
    if ly.schedule == "dualpipe":
        in_flight = ly.pp + 1
    elif ly.virtual_stages > 1:
        in_flight = in_flight_microbatches("interleaved", ly.pp, 0, m, ly.virtual_stages) / ly.virtual_stages
    else:
        in_flight = in_flight_microbatches("1f1b", ly.pp, 0, m)
    # FlashAttention (Dao et al. 2022) never stores the a·s×s attention matrix: Korthikanti's 5as/h term is 0
    heads = 0 if flash else cfg.n_heads
    full_layer = korthikanti_bytes_per_layer(s, b, h, heads, ly.tp, sequence_parallel=ly.tp > 1)
    if ly.recompute == "full":
        memory["activations"] = in_flight * layers * 2 * s * b * h / ly.tp + full_layer
    else:
        memory["activations"] = in_flight * layers * full_layer
    memory["logits"] = 4.0 * b * s * cfg.vocab_size / ly.tp
    links = {}

    def on(axis: str, span: int) -> tuple[float, float]:
        links[axis], ab = cluster.link(span)
        return ab

    spans = {"tp": ly.tp, "pp": ly.tp * ly.cp * ly.pp, "cp": ly.tp * ly.cp, "ep": ly.ep * ly.tp * ly.cp}
    spans["dp"] = cluster.n_devices
    for axis, span in spans.items():
        if getattr(ly, axis) > 1:
            on(axis, span)
    if cluster.shared:
        seconds = _shared_cores_seconds(cfg, cluster, ly, global_batch, seq_len, dense + expert, dp_overlap)
    else:
        seconds = step_seconds(cfg, cluster, ly, global_batch, seq_len, dense + expert)
    return Prediction(layout, memory, seconds, cluster.usable_bytes(), links)


def _shared_cores_seconds(cfg, cluster, ly, global_batch: int, seq_len: int, params: float, dp_overlap: float) -> dict:
    """Step time of N CPU ranks time-sharing C cores (module docstring, "Shared cores")."""
    b, s, h, bpe = ly.micro_batch, seq_len // ly.cp, cfg.d_model, 2
    m = global_batch // (ly.dp * b)
    layers = _stage_params(cfg, ly.pp, ly.tp, ly.ep)[2]
    flops = train_flops_per_token(cfg, seq_len) * global_batch * seq_len * (4 / 3 if ly.recompute == "full" else 1)
    slots = m + ly.pp - 1  # the schedule's length in micro-batch slots: m of work, pp − 1 of bubble
    passes = ly.dp * ly.tp * m * (cfg.n_layers + 1)  # over all ranks; each pass pays pass_seconds once
    seconds = {"compute": (flops / cluster.flops() + passes * cluster.pass_seconds) / cluster.cores}
    act = b * s * h * bpe  # one micro-batch's hidden state on this rank (replicated over tp)
    if ly.tp > 1:  # time-shared ranks wait for their partner in every slot
        per_layer = (6 if ly.recompute == "full" else 4) * collective_seconds(
            "ring_all_reduce", act, ly.tp, *cluster.link(ly.tp)[1]
        )
        seconds["tp"] = slots * layers * per_layer
    if ly.pp > 1:
        seconds["pp"] = 2 * slots * collective_seconds("p2p", act, 2, *cluster.link(ly.tp * ly.cp * ly.pp)[1])
    if ly.dp > 1:
        t = collective_seconds("ring_all_reduce", params * bpe, ly.dp, *cluster.link(cluster.n_devices)[1])
        busy = flops / (cluster.n_devices * cluster.flops()) * stage_imbalance(cfg, ly.pp)
        # buckets reduce while the backward pass (2/3 of the FLOPs) goes on: only what outlasts it shows
        seconds["dp"] = max(0.0, (1.5 if ly.zero == 3 else 1.0) * t - dp_overlap * busy * 2 / 3)
    return seconds


def layouts(
    cfg: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    zero=(1,),
    recompute=SEARCHED_RECOMPUTE,
    micro_batches=(1, 2, 4, 8),
):
    """Every layout :func:`reasons` accepts (memory not yet judged), in a fixed order."""
    n = cluster.n_devices
    out = []
    for tp, pp, cp in itertools.product(_divisors(n), repeat=3):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        for ep in _divisors(dp) if cfg.is_moe else [1]:
            for b in micro_batches:
                for z, r in itertools.product(zero, recompute):
                    ly = Layout(dp, tp, pp, cp, ep, b, z, r)
                    if not reasons(cfg, cluster, ly, global_batch, seq_len):
                        out.append(ly)
    return out


def plan(
    cfg: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    dp_overlap: float = 1.0,
    flash: bool = True,
    **search,
) -> list[Prediction]:
    """Predictions of every valid layout, those that fit in memory first, each group fastest first.
    ``search``: the choices :func:`layouts` tries (zero, recompute, micro_batches)."""
    valid = layouts(cfg, cluster, global_batch, seq_len, **search)
    predictions = [predict(cfg, cluster, ly, global_batch, seq_len, dp_overlap, flash) for ly in valid]
    return sorted(predictions, key=lambda p: (not p.fits, p.step_seconds))


def explain(prediction: Prediction, runner_up: Prediction | None = None) -> str:
    """A few lines: the layout, its memory and time by term, its links, and what beat the runner-up."""
    p = prediction
    gib = lambda x: f"{x / 2**30:.1f} GiB"
    lines = [
        f"{p.layout}: {p.step_seconds:.3f} s per step, {gib(p.memory_bytes)} of {gib(p.usable_bytes)} per device",
        "  time:   " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(p.seconds.items(), key=lambda kv: -kv[1])),
        "  memory: " + ", ".join(f"{k} {gib(v)}" for k, v in p.memory.items()),
    ]
    if p.links:
        lines.append("  links:  " + ", ".join(f"{a} on {link}" for a, link in p.links.items()))
    if runner_up is not None:
        diffs = {
            k: runner_up.seconds.get(k, 0.0) - p.seconds.get(k, 0.0) for k in set(p.seconds) | set(runner_up.seconds)
        }
        top = max(diffs, key=lambda k: abs(diffs[k]))
        lines.append(
            f"  beats {runner_up.layout} ({runner_up.step_seconds:.3f} s) mostly on {top} "
            f"({'saves' if diffs[top] > 0 else 'costs'} {abs(diffs[top]):.3f} s)"
        )
    return "\n".join(lines)
