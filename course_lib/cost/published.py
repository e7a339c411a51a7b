"""Published training runs, as their papers state them, and the step time each paper's figures imply.

The planner is checked against these rows: a model of real systems is worth what it predicts for runs
that were measured. Each row keeps the layout as its paper states it (not as a planner would choose it),
the batch, and the one figure the paper gives for speed. :meth:`PublishedRun.step_seconds` turns that
figure into seconds per optimizer step, the same way for every row of a kind:

* **TFLOP/s per GPU** (Llama 3): step = tokens per step × training FLOPs per token / (GPUs × TFLOP/s).
  The paper does not say how it counts FLOPs; the course's count is used
  (:func:`course_lib.cost.flops.train_flops_per_token`: 6N plus the attention matmuls over the whole
  T × T matrix, as PaLM counts them), so the step time carries that convention.
* **GPU-hours per trillion tokens** (DeepSeek-V3): step = hours × 3600 / GPUs × tokens per step / 10¹².
  No FLOP count enters. The FLOP rate this implies with the course's count, 434 TFLOP/s per GPU, is
  within 1% of the 432 TFLOP/s (non-causal) that Zhao et al. report for the same model on 2048 H800s
  (ISCA 2025, Table 4): the two sources and the course's FLOP count agree.

Each row also gives the layout in the planner's terms (:meth:`PublishedRun.layout`), with what the paper
leaves unsaid chosen and named in :attr:`PublishedRun.unstated`. The planner predicts each row within
15% (:meth:`PublishedRun.predicted`). :func:`fit_efficiency` fits the one constant of
:mod:`course_lib.cost.step_time` on :data:`CALIBRATION`. BENCHMARKS.md shows the table.

Sources:

* Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783 (2024). Table 3: the 405B model. Table 4:
  the three layouts of 405B pre-training on 8,192 and 16,384 H100s (TP, CP, PP, DP, sequence length,
  batch per DP group, TFLOP/s per GPU, 38–43% BF16 MFU). §3.3.2: DP is FSDP sharding optimizer states and
  gradients, with the parameters not re-sharded after the forward pass (ZeRO-2's memory); the pipeline
  runs an interleaved schedule; after the paper's memory optimizations the 8K-sequence pre-training ran
  without activation checkpointing.
* DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437 (2024). §3.1–3.2: 2,048 H800s, 16-way
  pipeline parallelism with DualPipe, 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no
  tensor parallelism; §3.2.3: RMSNorm and MLA up-projections recomputed in backward (selective); §3.3: FP8
  GEMMs; §4.2: 4K sequences, batch size 15,360 after the first 469B tokens; Table 1: 180K H800 GPU-hours
  per trillion tokens.
* Zhao et al., "Insights into DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI
  Architectures", ISCA 2025, Table 4 (DeepSeek-V3 on 2,048 H800s: 432 TFLOP/s non-causal, 385 causal).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.cost.flops import train_flops_per_token
from course_lib.cost.planner import Cluster, Layout, Prediction, predict
from course_lib.model.config import ModelConfig

LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models"
DSV3 = "DeepSeek-AI 2024, DeepSeek-V3 Technical Report"


@dataclass(frozen=True)
class PublishedRun:
    """One published pre-training configuration: its model, cluster, layout and speed figure.

    ``global_batch`` counts sequences of ``seq_len`` tokens. ``zero`` is the stage of ZeRO whose memory
    the run's data parallelism has (FSDP without re-sharding after forward = 2). ``recompute``: "none",
    "selective" or "full". ``pipeline``: the schedule ("interleaved-1f1b", "dualpipe"). ``figure`` is
    "tflops_per_gpu" or "gpu_hours_per_trillion_tokens", ``value`` that figure as published.
    """

    name: str
    model: str  # a name of course_lib.model.configs
    accelerator: str  # a name of course_lib.cost.hardware
    gpus: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    seq_len: int
    global_batch: int
    zero: int
    recompute: str
    pipeline: str
    precision: str
    figure: str
    value: float
    source: str
    micro_batch: int = 1
    virtual_stages: int = 1
    node_limit: int = 0
    unstated: str = ""  # layout choices the paper does not state, and how they were chosen

    def __post_init__(self):
        if self.dp * self.tp * self.pp * self.cp != self.gpus:
            raise ValueError(f"{self.name}: dp·tp·pp·cp = {self.dp * self.tp * self.pp * self.cp} ≠ {self.gpus} GPUs")
        if self.dp % self.ep:
            raise ValueError(f"{self.name}: ep = {self.ep} ranks are carved out of dp = {self.dp}")
        if self.figure not in ("tflops_per_gpu", "gpu_hours_per_trillion_tokens"):
            raise ValueError(f"{self.name}: unknown figure {self.figure!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def flops_per_step(self, cfg: ModelConfig) -> float:
        """Training FLOPs of one step in the course's count (model FLOPs: no recomputation). ``cfg``:
        the run's model, ``course_lib.model.configs.get(run.model)`` (cost/ reads no model table itself)."""
        return train_flops_per_token(cfg, self.seq_len) * self.tokens_per_step

    def step_seconds(self, cfg: ModelConfig) -> float:
        """Seconds per optimizer step implied by the published figure (module docstring)."""
        if self.figure == "tflops_per_gpu":
            return self.flops_per_step(cfg) / (self.gpus * self.value * 1e12)
        return self.value * 3600 / self.gpus * self.tokens_per_step / 1e12

    def layout(self) -> Layout:
        """The run's layout in the planner's terms, as the paper states it (and :attr:`unstated` chooses)."""
        return Layout(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            micro_batch=self.micro_batch,
            zero=self.zero,
            recompute=self.recompute,
            virtual_stages=self.virtual_stages,
            schedule="dualpipe" if self.pipeline == "dualpipe" else "1f1b",
            balanced=self.pipeline != "dualpipe",  # Llama 3 §3.3.2 evens its first and last stages
            ep_node_limit=self.node_limit,
        )

    def cluster(self, gemm_efficiency: float | None = None) -> Cluster:
        return Cluster(self.accelerator, self.gpus, precision=self.precision, gemm_efficiency=gemm_efficiency)

    def predicted(self, cfg: ModelConfig, gemm_efficiency: float | None = None) -> Prediction:
        """The planner's prediction for this run (``gemm_efficiency``: instead of the fitted η)."""
        return predict(cfg, self.cluster(gemm_efficiency), self.layout(), self.global_batch, self.seq_len)

    def tflops_per_gpu(self, cfg: ModelConfig) -> float:
        """Model TFLOP/s per GPU in the course's count: the published figure, or what it implies."""
        return self.flops_per_step(cfg) / (self.gpus * self.step_seconds(cfg)) / 1e12


def _llama3(gpus: int, cp: int, pp_dp: tuple[int, int], seq_len: int, batch_per_dp: int, tflops: float):
    pp, dp = pp_dp
    return PublishedRun(
        name=f"Llama 3 405B, {gpus:,} H100s, {seq_len // 1024}K tokens",
        model="llama-3.1-405b",
        accelerator="H100",
        gpus=gpus,
        dp=dp,
        tp=8,
        pp=pp,
        cp=cp,
        ep=1,
        seq_len=seq_len,
        global_batch=dp * batch_per_dp,
        zero=2,
        recompute="none" if seq_len <= 8192 else "full",
        pipeline="interleaved-1f1b",
        precision="bf16",
        figure="tflops_per_gpu",
        value=tflops,
        source=f"{LLAMA3}, Table 4 and §3.3.2" + ("" if seq_len <= 8192 else "; full recomputation assumed"),
        virtual_stages=2,
        unstated="micro-batch 1 sequence; v = 2 chunks per rank, the least interleaving (§3.3.2 names the "
        "interleaved schedule, not its v)",
    )


# Llama 3's long-context row: the paper says only that the 8K pre-training needed no checkpointing,
# so the 128K row is taken with full recomputation (an assumption, named in its source).
RUNS = (
    _llama3(8192, 1, (16, 64), 8192, 32, 430),
    _llama3(16384, 1, (16, 128), 8192, 16, 400),
    _llama3(16384, 16, (16, 8), 131072, 16, 380),
    PublishedRun(
        name="DeepSeek-V3, 2,048 H800s, 4K tokens",
        model="deepseek-v3",
        accelerator="H800",
        gpus=2048,
        dp=128,
        tp=1,
        pp=16,
        cp=1,
        ep=64,
        seq_len=4096,
        global_batch=15360,
        zero=1,
        recompute="selective",
        pipeline="dualpipe",
        precision="fp8",
        figure="gpu_hours_per_trillion_tokens",
        value=180_000,
        source=f"{DSV3}, §3.1-3.3, §4.2, Table 1",
        micro_batch=3,
        node_limit=4,
        unstated="micro-batch 3 sequences (m = 40 ≥ 2·pp, as DualPipe requires): the one that gives DualPipe's "
        "bubble formula Zhao et al.'s measured 2.06 s (ISCA 2025, Table 4); b = 1, 2 give 0.8 s, 1.6 s",
    ),
)


def get(name_start: str) -> PublishedRun:
    """The run whose name starts with ``name_start`` (exactly one)."""
    found = [r for r in RUNS if r.name.startswith(name_start)]
    if len(found) != 1:
        raise KeyError(f"{name_start!r} matches {len(found)} published runs; names: {[r.name for r in RUNS]}")
    return found[0]


CALIBRATION = RUNS  # the runs GEMM_EFFICIENCY is fitted on


def fit_efficiency(configs_get, grid=tuple(i / 100 for i in range(50, 91))) -> tuple[float, list[float]]:
    """The η of :data:`course_lib.cost.step_time.GEMM_EFFICIENCY` that minimises the largest relative error of
    the predicted step time over :data:`CALIBRATION`, and those errors. ``configs_get``:
    ``course_lib.model.configs.get`` (cost/ reads no model table itself)."""
    best = None
    for eta in grid:
        errors = [
            run.predicted(configs_get(run.model), eta).step_seconds / run.step_seconds(configs_get(run.model)) - 1
            for run in CALIBRATION
        ]
        worst = max(map(abs, errors))
        if best is None or worst < best[0]:
            best = (worst, eta, errors)
    return best[1], best[2]
