"""This CPU's roofline, measured, with the course model's kernels placed on it.

:mod:`course_lib.cost.roofline` draws each accelerator's roofline from its datasheet figures. Here
the two figures are measured on the machine in front of you (Williams, Waterman & Patterson 2009 do
the same: their rooflines use measured peaks, "the STREAM benchmark" for bandwidth):

* **peak FLOP/s**: the fastest of many timings of square fp32 ``torch.matmul`` calls small enough to
  stay in the caches (:data:`PEAK_GEMMS`), the BLAS routine at its best;
* **memory bandwidth**: STREAM's *copy* (b = a, 2 arrays counted) and *triad* (a = b + s·c, 3 arrays)
  on arrays much larger than the caches (McCalpin 1995: each array several times the last-level
  cache), the faster of the two.

Then the kernels of :func:`course_lib.cost.roofline.training_kernels` and
:func:`~course_lib.cost.roofline.decode_kernels` are run in fp32 and timed: a training GEMM, the
attention of a training sequence, the LM head, decoding GEMVs at batch 1 and 16, one new token's
attention over a KV cache. Each lands at its intensity (from ``cost``) and its measured FLOP/s
(FLOPs from ``cost``, seconds from the clock).

The model is the course's ``small`` model widened to ``d_model`` 2048 (:data:`CPU_MODEL`): the
course models' own matrices (64 × 192 floats) fit in the L1/L2 caches, where no DRAM roofline
applies. Every memory-bound kernel is run on enough distinct copies of its operands to fill
:data:`WORKING_SET_BYTES`, the same working set as the STREAM arrays, so that it streams from
DRAM as the bandwidth measurement does, whatever the cache sizes.

The measurements are interleaved: every round times the peak, the bandwidth and each kernel once, and
each keeps its fastest round. A machine that is busy for part of the run then slows the roof and the
kernels alike, instead of lowering one against the other. Threads: torch's setting as it is (lecture
07 and tests/measure/test_roofline.py set one thread, and say why).

Host by design, on a GPU machine too: what is measured is the CPU (its BLAS, its caches, its DRAM), so
every operand is made on the host and timed with the host's clock — a CPU kernel has returned when
its call returns, and :func:`course_lib.dist.timing.clock` would only add a wait on an accelerator
that takes no part (creating its context, in a process that needs none). An accelerator's roofline
comes from its datasheet (:mod:`course_lib.cost.hardware`), or from a benchmark run on it.
"""

# device-guard: host-only: this CPU's roofline is the measurement; no tensor here meets an accelerator

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from course_lib.cost import roofline as cost_roofline
from course_lib.model import configs

MiB = 2**20
# STREAM's rule: each array at least 4x the last-level cache (McCalpin); 256 MiB in all covers the
# 32 MiB L3 of the course machine 8 times. Raise it on a CPU with a larger cache.
WORKING_SET_BYTES = 256 * MiB
BYTES_PER_ELEMENT = 4  # fp32: the precision a CPU's BLAS is fastest in
# The course's small model at Llama-1B width: each weight matrix is 16-45 MB in fp32.
CPU_MODEL = configs.get("small", d_model=2048, n_heads=16, n_kv_heads=4, d_ff=None, max_seq_len=2048)
# The peak: the best of two square fp32 matmuls whose operands stay in the caches (3 and 12 MB), each
# timed alone, five times a round. On the course machine, shared with other jobs, a 2048³ matmul
# measured 35-50% below the 512³ figure on one thread (its blocks stream through a contended L3), and
# a training GEMM of the course model then ran faster than that "peak". Short timings matter too: a
# busy machine interrupts a 20 ms timing more often than a 3 ms one, and the best of many short ones
# is the undisturbed speed.
PEAK_GEMMS = ((512, 1), (1024, 1))  # (n, calls per timing)


@dataclass(frozen=True)
class MeasuredKernel:
    """A kernel of :mod:`course_lib.cost.roofline`, timed: ``seconds`` for one call (its fastest round);
    ``counted_flops``: what ``FlopCounterMode`` counts for one call (None where it has no formula,
    e.g. the CPU's fused attention)."""

    kernel: cost_roofline.Kernel
    seconds: float
    counted_flops: int | None

    @property
    def flops_per_second(self) -> float:
        return self.kernel.flops / self.seconds


@dataclass(frozen=True)
class CpuRoofline:
    """The measured peak (FLOP/s), STREAM copy and triad bandwidths (bytes/s) and kernels of this CPU."""

    peak_flops_per_second: float
    copy_bytes_per_second: float
    triad_bytes_per_second: float
    threads: int
    kernels: tuple[MeasuredKernel, ...]

    @property
    def bytes_per_second(self) -> float:
        """The roof's bandwidth: the faster STREAM kernel."""
        return max(self.copy_bytes_per_second, self.triad_bytes_per_second)

    @property
    def roofline(self) -> cost_roofline.Roofline:
        return cost_roofline.Roofline(
            f"this CPU ({self.threads} threads, fp32)", self.peak_flops_per_second, self.bytes_per_second, "fp32"
        )

    def kernel(self, name: str) -> MeasuredKernel:
        """The measured kernel called ``name`` (see :func:`course_kernels`)."""
        for measured in self.kernels:
            if measured.kernel.name == name:
                return measured
        raise KeyError(f"no measured kernel {name!r}; measured: {[m.kernel.name for m in self.kernels]}")


def _pick(kernels: list[cost_roofline.Kernel], name: str, label: str) -> cost_roofline.Kernel:
    (kern,) = [k for k in kernels if k.name == name]
    return cost_roofline.Kernel(label, kern.kind, kern.flops, kern.bytes_moved, 1, kern.shape)


def course_kernels(
    cfg=CPU_MODEL, seq_len: int = 256, decode_batch: int = 16, context: int = 2048, kv_batch: int = 4
) -> list[cost_roofline.Kernel]:
    """The kernels this module times, from :mod:`course_lib.cost.roofline` in fp32, renamed for the plot:
    'train w1' (the MLP's first GEMM on ``seq_len`` tokens), 'train attention' (FlashAttention-style,
    one sequence of ``seq_len``), 'train output' (the LM head: only 64 outputs, the course vocabulary),
    'decode w1, batch 1' and 'decode w1, batch {decode_batch}' (GEMVs), 'decode kv-read' (``kv_batch``
    sequences, one new token each, attending over ``context`` cached tokens)."""
    b = BYTES_PER_ELEMENT
    train = cost_roofline.training_kernels(cfg, 1, seq_len, b)
    out = [
        _pick(train, "w1", "train w1"),
        _pick(train, f"attention (flash, {seq_len} keys)", "train attention"),
        _pick(train, "output", "train output"),
        _pick(cost_roofline.decode_kernels(cfg, 1, context, b), "w1", "decode w1, batch 1"),
        _pick(cost_roofline.decode_kernels(cfg, decode_batch, context, b), "w1", f"decode w1, batch {decode_batch}"),
        _pick(cost_roofline.decode_kernels(cfg, kv_batch, context, b), f"kv-read ({context} tokens)", "decode kv-read"),
    ]
    return out


def _copies(bytes_each: float, working_set_bytes: int) -> int:
    """Distinct copies of an operand that fill the working set (one is enough when it is larger)."""
    return max(1, math.ceil(working_set_bytes / bytes_each))


def _runner(kern: cost_roofline.Kernel, cfg, working_set_bytes: int, weights: dict) -> tuple[Callable, int, Callable]:
    """(one pass over `copies` calls, copies, one call for FlopCounterMode) for a kernel of course_kernels.
    ``weights`` keeps the GEMVs' copies of a weight matrix, shared by the batch sizes."""
    fill = 0.01  # any normal value: random draws of 256 MiB would take longer than the measurement
    if kern.kind in ("gemm", "gemv"):
        m, n, k = kern.shape
        x = torch.full((int(m), k), fill)
        copies = _copies(BYTES_PER_ELEMENT * n * k, working_set_bytes) if kern.kind == "gemv" else 1
        if (n, k, copies) not in weights:
            weights[n, k, copies] = [torch.full((n, k), fill) for _ in range(copies)]
        ws = weights[n, k, copies]  # [n, k] as nn.Linear stores it: the course model's x @ Wᵀ
        return (lambda: [F.linear(x, w) for w in ws]), copies, (lambda: F.linear(x, ws[0]))
    h, kv_heads, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if kern.kind == "attention":  # non-causal: the kernel then does every FLOP the formula counts
        batch, t, _ = kern.shape
        q, k, v = (torch.full((batch, heads, t, d), fill) for heads in (h, kv_heads, kv_heads))
        call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return call, 1, call
    if kern.kind == "kv-read":
        batch, seen = kern.shape
        q = torch.full((batch, h, 1, d), fill)
        caches = [
            tuple(torch.full((batch, kv_heads, seen, d), fill) for _ in "kv")
            for _ in range(_copies(kern.bytes_moved, working_set_bytes))
        ]
        run = lambda: [F.scaled_dot_product_attention(q, k, v, enable_gqa=True) for k, v in caches]
        return run, len(caches), (lambda: F.scaled_dot_product_attention(q, *caches[0], enable_gqa=True))
    raise ValueError(f"no runner for kernel kind {kern.kind!r}")


def _seconds(fn: Callable[[], object]) -> float:
    # host: a CPU kernel, synchronous; see the module's docstring for why not course_lib.dist.timing.clock
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0  # host: as above


def measure_cpu_roofline(
    kernels: list[cost_roofline.Kernel] | None = None,
    cfg=CPU_MODEL,
    rounds: int = 3,
    working_set_bytes: int = WORKING_SET_BYTES,
) -> CpuRoofline:
    """Measure this CPU's roofline and time ``kernels`` (default :func:`course_kernels` of ``cfg``).

    Each of ``rounds`` rounds times, once each: the matmuls of :data:`PEAK_GEMMS`, STREAM copy over two
    arrays and triad over three (``working_set_bytes`` in all), and every kernel; each keeps its
    fastest round, and the peak is the best matmul. Every operand is allocated and run once before
    the first round (first-touch page faults are not bandwidth). About 3 s on one thread of the course
    machine when it is otherwise idle, up to 10 s when other jobs share it; about 1 GB of memory.
    """
    kernels = course_kernels(cfg) if kernels is None else kernels
    timed: dict[str, tuple[Callable, int, float]] = {}  # name: (run, calls per run, FLOPs or bytes per call)
    for n, calls in PEAK_GEMMS:
        a, b = torch.full((n, n), 0.01), torch.full((n, n), 0.01)
        timed[f"peak {n}"] = (
            (lambda a=a, b=b, calls=calls: [torch.matmul(a, b) for _ in range(calls)]),
            calls,
            2 * n**3,
        )
    n_copy = working_set_bytes // (2 * BYTES_PER_ELEMENT)
    n_triad = working_set_bytes // (3 * BYTES_PER_ELEMENT)
    src, dst = torch.ones(n_copy), torch.zeros(n_copy)
    tb, tc, ta = torch.ones(n_triad), torch.ones(n_triad), torch.zeros(n_triad)
    # STREAM's counting: copy reads one array and writes one, triad reads two and writes one
    timed["copy"] = (lambda: dst.copy_(src), 1, 2 * n_copy * BYTES_PER_ELEMENT)
    timed["triad"] = (lambda: torch.add(tb, tc, alpha=3.0, out=ta), 1, 3 * n_triad * BYTES_PER_ELEMENT)
    counted, weights = {}, {}
    for kern in kernels:
        run, copies, one_call = _runner(kern, cfg, working_set_bytes, weights)
        with FlopCounterMode(display=False) as counter:
            one_call()
        counted[kern.name] = counter.get_total_flops() or None
        timed[kern.name] = (run, copies, kern.flops)
    for fn, _, _ in timed.values():  # warm-up: page faults, BLAS threads, oneDNN kernel selection
        fn()
    best = dict.fromkeys(timed, math.inf)  # seconds per call
    for _ in range(rounds):
        for key, (fn, calls, _) in timed.items():
            # the peak matmuls are short: five tries each round give them more chances of a quiet moment
            for _ in range(5 if key.startswith("peak") else 1):
                best[key] = min(best[key], _seconds(fn) / calls)
    rate = {key: amount / best[key] for key, (_, _, amount) in timed.items()}
    return CpuRoofline(
        peak_flops_per_second=max(rate[f"peak {n}"] for n, _ in PEAK_GEMMS),
        copy_bytes_per_second=rate["copy"],
        triad_bytes_per_second=rate["triad"],
        threads=torch.get_num_threads(),
        kernels=tuple(MeasuredKernel(k, best[k.name], counted[k.name]) for k in kernels),
    )
