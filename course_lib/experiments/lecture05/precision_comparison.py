"""Training in low precision measured: the course model in fp32, bf16 mixed precision and FP8 (lecture 05).

One model, one seed, one stream of batches, one optimizer (AdamW, fp32 master weights and state);
only the arithmetic of the GEMMs changes between runs:

    precision     the linears' GEMMs                               everything else
    "fp32"        fp32                                             fp32
    "bf16"        bf16 operands (torch.autocast)                   autocast's choice per op; the loss in fp32
    "fp8-tensor"  e4m3 x and W, e5m2 dy; one scale per tensor      fp32, the output head included
    "fp8-block"   e4m3 x in 1x128 tiles, W in 128x128 blocks,      fp32, the output head included
                  e5m2 dy in 1x128 tiles (DeepSeek-V3 §3.3.2)

The FP8 runs swap the linears for :class:`~course_lib.precision.fp8_linear.FP8Linear` with
:func:`~course_lib.precision.fp8_linear.convert_to_fp8_training`, keeping the output head in fp32 as
DeepSeek-V3 keeps its embedding, head, MoE gate, normalizations and attention in higher precision
(§3.3.1). DeepSeek-V3 trained FP8 beside BF16 at two scales for about 1T tokens: a relative loss
error below 0.25 % (§3.3, Appendix B.1). :func:`compare_precisions` gives each run's loss curve,
the mean loss of the last ``last_k`` steps and its relative gap to bf16.

Measured (defaults: 100 steps, batch 16 x 32 tokens, last 10 steps; one thread; loss from 4.19):

    kernels   fp32              bf16      fp8-tensor        fp8-block
    AVX512    0.998 (+0.73 %)   0.991     0.990 (-0.09 %)   0.981 (-0.98 %)
    default   1.034 (+4.21 %)   0.992     1.000 (+0.80 %)   1.004 (+1.14 %)

Over 6 seeds the gaps to bf16 reach 4.7 % for fp32 and 5.4 % for FP8, with no sign in their mean,
against a seed-to-seed spread of bf16 of 4 % (std): at 100 steps of a tiny model the gap is the
noise of a fast-descending trajectory, not FP8's bias (tests/experiments/test_fp8_training.py derives its
threshold from this). An FP8 step costs 2-3 times a bf16 one here: the casts and the GEMM are
emulated in eager PyTorch (benchmarks/bench_fp8.py times the GEMMs on their own).

* :func:`precision_config` — the model; the data is the quality runs' language, :func:`course_lib.experiments.small_run.quality_language`;
* :func:`train_precision` — one run: per-step losses and seconds;
* :func:`compare_precisions` — the same run in several precisions, final losses and gaps vs bf16.
"""

from __future__ import annotations

import contextlib

import torch

from course_lib.data import MarkovLanguage
from course_lib.dist.timing import clock
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer, next_token_loss
from course_lib.precision import fp8_linear, fp8_scaling
from course_lib.precision.fp8_linear import convert_to_fp8_training

__all__ = ["PRECISIONS", "compare_precisions", "miscalibrated_scales", "precision_config", "train_precision"]

PRECISIONS = ("fp32", "bf16", "fp8-tensor", "fp8-block")
FP8_KEEP = ("output",)  # the head stays in fp32 (DeepSeek-V3 §3.3.1: embedding and output head in high precision)


def precision_config(d_model: int = 128, d_ff: int = 384, seq_len: int = 32, **overrides) -> ModelConfig:
    """The course's ``tiny`` model (2 layers, 4 heads) at width ``d_model`` with SwiGLU width ``d_ff``.

    128 x 128 blocks must tile every weight (quantize takes min(128, dim) for a shorter dimension,
    but a longer one must be a multiple of 128): tiny's own d_ff = 192 is not. At d_model 128,
    d_ff 384 the FFN weights hold three blocks and their activations three 1 x 128 tiles per row,
    so "fp8-block" differs from "fp8-tensor" in the GEMMs that matter most.
    """
    return configs.get("tiny", d_model=d_model, d_ff=d_ff, max_seq_len=seq_len, **overrides)


@contextlib.contextmanager
def miscalibrated_scales(factor: float = 16.0):
    """The negative control of the FP8 runs: inside the block, every scale FP8Linear computes is ``factor``
    times too small (s = amax/448/factor), so every value above amax/factor saturates at ±448·s.

    A planted bug, not a recipe: with ``factor`` = 16 the FP8 runs stall above the bigram floor, which
    is what shows that the comparison with bf16 can fail. It patches the name ``quantize`` in
    :mod:`course_lib.precision.fp8_linear` for the duration of the block and restores it after.
    """
    original = fp8_linear.quantize

    def too_small(x, fmt, recipe="tensor", **kwargs):
        _, s = original(x, fmt, recipe, **kwargs)
        f = fp8_scaling.fp8_format(fmt)
        s = s / factor
        q = (x.detach().float() / fp8_scaling.expand_scale(s, x.shape)).clamp(-f.max, f.max).to(f.dtype)
        return q, s

    fp8_linear.quantize = too_small
    try:
        yield
    finally:
        fp8_linear.quantize = original


def train_precision(
    precision: str,
    steps: int = 100,
    *,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    data_seed: int = 0,
    cfg: ModelConfig | None = None,
    lang: MarkovLanguage | None = None,
    keep: tuple[str, ...] = FP8_KEEP,
) -> dict:
    """Train the course model ``steps`` steps of AdamW in ``precision`` (one of :data:`PRECISIONS`).

    ``seed`` draws the initial weights (the same for every precision: the FP8 swap draws nothing),
    ``data_seed`` the Markov stream and its order; ``lang`` the language (:func:`course_lib.experiments.small_run.quality_language`);
    ``cfg`` the model (:func:`precision_config`). ``keep``: linears the FP8 runs leave in fp32.

    **bf16 is mixed precision** (Micikevicius et al. 2018, "Mixed Precision Training"): the weights,
    gradients and AdamW state stay fp32 (the master copy) and ``torch.autocast("cpu", torch.bfloat16)``
    runs the linears' matmuls in bf16 (its CPU op list), casting the fp32 weights on the way in.
    That is what "training in bf16" means in practice. The alternative, bf16 *weights*, loses
    updates: w + Δw rounds back to w when |Δw| is under half of bf16's spacing at w (2^-9 to 2^-8
    of |w|). An RMSNorm gain starts at 1, whose bf16 neighbours are 1 − 2^-8 and 1 + 2^-7: an
    AdamW step of about lr = 3e-3 upwards rounds back to 1, and downwards lands on 1 − 2^-8, a step
    30 % too large. That is the master weights' reason to exist, not a recipe to compare against.

    **FP8** runs use :class:`~course_lib.precision.fp8_linear.FP8Linear` (fp32 master weights, quantized at
    every call; three FP8 GEMMs each with fp32 accumulation) and fp32 for the rest, without autocast:
    FP8Linear's emulated GEMM (dequantize, then matmul) must not be cast to bf16 by autocast.

    Returns ``{"precision", "loss": [steps floats], "seconds": [per step], "params": n}``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    cfg = cfg or precision_config()
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if precision.startswith("fp8-"):
        convert_to_fp8_training(model, precision.removeprefix("fp8-"), skip=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    bf16 = precision == "bf16"
    starts, seconds = [], []

    def objective(model, x, y):
        starts.append(clock())
        # only the forward under autocast: the loop's backward runs outside it, as torch recommends
        # (backward ops run in their forward's dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return next_token_loss(model(x), y)  # cross-entropy in fp32 whatever the logits' dtype

    data = small_run.batches(steps, batch, cfg.max_seq_len, data_seed, lang=lang or small_run.quality_language())
    loss = small_run.train(
        model, opt, data, objective=objective, after_step=lambda step, _: seconds.append(clock() - starts[step])
    )
    return {
        "precision": precision,
        "loss": loss,
        "seconds": seconds,
        "params": sum(p.numel() for p in model.parameters()),
    }


def compare_precisions(precisions: tuple[str, ...] = PRECISIONS, steps: int = 100, last_k: int = 10, **kwargs) -> dict:
    """:func:`train_precision` for each of ``precisions`` on the same seed and batches, side by side.

    The final loss of a run is the mean over its last ``last_k`` steps: each step's loss is measured
    on a different batch, so one step's loss carries that batch's noise; the mean divides it by
    about √last_k. The relative gap to bf16 is (L_final − L_final^bf16) / L_final^bf16 (DeepSeek-V3's
    "relative loss error"; positive: worse than bf16). Needs "bf16" among ``precisions``.

    Returns ``{"loss": {p: [steps]}, "final": {p: float}, "gap_vs_bf16": {p: float},
    "seconds_per_step": {p: median seconds}, "steps", "last_k"}``.
    """
    if "bf16" not in precisions:
        raise ValueError("the gaps are measured against bf16: include 'bf16' in precisions")
    if not 1 <= last_k <= steps:
        raise ValueError(f"last_k must be in 1..steps={steps}, got {last_k}")
    runs = {p: train_precision(p, steps, **kwargs) for p in precisions}
    final = {p: sum(r["loss"][-last_k:]) / last_k for p, r in runs.items()}
    return {
        "loss": {p: r["loss"] for p, r in runs.items()},
        "final": final,
        "gap_vs_bf16": {p: (final[p] - final["bf16"]) / final["bf16"] for p in precisions},
        "seconds_per_step": {p: sorted(r["seconds"])[len(r["seconds"]) // 2] for p, r in runs.items()},
        "steps": steps,
        "last_k": last_k,
    }
