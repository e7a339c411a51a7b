"""FP8 against bf16: GEMM throughput per scaling granularity, and the step time of an FP8 linear layer.

    .venv/bin/python benchmarks/bench_fp8.py                          # CUDA: n = 4096 and 8192
    .venv/bin/python benchmarks/bench_fp8.py --sizes 256 512 1024     # the CPU default: small sizes

**GEMMs** y = a bᵀ with M = N = K = n, 2n³ FLOPs, output bf16:

* ``bf16``            — torch.mm on bf16 operands (the baseline; fp32 too, for reference);
* ``fp8 tensor-wise`` — torch._scaled_mm on e4m3 operands, one fp32 scale each;
* ``fp8 row-wise``    — torch._scaled_mm, one scale per row of a and of b (torchao's "rowwise");
* ``fp8 block-wise``  — DeepSeek-V3's 1 x 128 tiles for a, 128 x 128 blocks for b (report §3.3.2):
  torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 where torch has the kernel
  (Hopper, CUDA >= 12.9); the row says "unsupported" and why otherwise. Their scales vary along K, so a
  kernel applies them per 128-element chunk of K (the promotion to fp32 of
  :mod:`course_lib.precision.fp8_gemm`);
* ``fp8 block-wise (emulated)`` — :func:`course_lib.precision.fp8_gemm.fp8_matmul`: dequantize, then an
  fp32 GEMM; what the course runs where no block-wise kernel exists.

**Linear layer**: forward + backward (three GEMMs, 6n³ FLOPs) of an n x n layer on n tokens:
nn.Linear in fp32 and under bf16 autocast, course FP8Linear ("tensor", "block"), and torchao's
Float8Linear (tensorwise, rowwise) where torchao imports. FP8Linear's casts are eager PyTorch
(amax, divide, clamp, cast: several passes over memory per operand, unfused), so it pays for them;
torchao under torch.compile fuses them.

**What to run when a GPU is lent** (H100/H200 and a CUDA build of torch), and record in BENCHMARKS.md
with the GPU, driver and CUDA versions, the command and the date:

    python benchmarks/bench_fp8.py --sizes 4096 8192

and read off: FP8 over bf16 GEMM throughput at 4096³ and 8192³ per granularity (the datasheet
ratio for H100/H200 SXM is 2: 1979 against 989 dense TFLOP/s; tensor-wise comes closest, row-wise
and block-wise pay for their scales), and FP8Linear's / Float8Linear's step time against bf16's
(whether the casts eat the GEMM's gain at this size). On a CPU torch._scaled_mm runs tensor- and
row-wise scales but a CPU has no FP8 arithmetic: the FP8 rows measure what emulation costs, never
a speed-up. Times are the best of ``--repeats`` after a warm-up call; the device is printed first.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.dist import device
from course_lib.dist.timing import time_calls
from course_lib.precision.fp8_gemm import fp8_matmul
from course_lib.precision.fp8_linear import FP8Linear
from course_lib.precision.fp8_scaling import quantize

E4M3 = torch.float8_e4m3fn


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (CUDA {torch.version.cuda}, torch {torch.__version__})"
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"CPU {model}, {torch.get_num_threads()} threads, kernels {torch.backends.cpu.get_cpu_capability()} "
        f"(torch {torch.__version__})"
    )


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up (the minimum is the least disturbed run),
    each timed until the device has finished it (:func:`course_lib.dist.timing.time_calls`)."""
    return min(time_calls(fn, repeats, warmup=1))


def block_wise_kernel(a, b):
    """DeepSeek-V3's scales through torch's block-wise kernel; raises where torch has none (CPU).

    The layouts are those of torch's own samples for F.scaled_mm (torch/testing/_internal/
    common_methods_invocations.py, "1x128 x 128x128"; Hopper with CUDA >= 12.9): a's [M, K/128]
    scales column-major; b's [N/128, K/128] with K/128 padded to a multiple of 4, handed over
    transposed ([L4, N/128], column-major); b itself column-major (qb.t() of our row-major [N, K]).
    """
    (qa, sa), (qb, sb) = a, b
    l4 = -(-sb.shape[1] // 4) * 4
    sb_k = F.pad(sb, (0, l4 - sb.shape[1])).contiguous().t()
    return F.scaled_mm(
        qa,
        qb.t(),
        sa.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        sb_k,
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )


def gemm_rows(n: int, dev: torch.device, repeats: int) -> list[tuple[str, float | str]]:
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=dev)
    b = torch.randn(n, n, generator=g, device=dev)
    a16, b16 = a.bfloat16(), b.bfloat16()
    q = {r: (quantize(a, "e4m3", r), quantize(b, "e4m3", r)) for r in ("tensor", "row")}
    blocks = (quantize(a, "e4m3", "tile"), quantize(b, "e4m3", "block"))

    def scaled(recipe):
        (qa, sa), (qb, sb) = q[recipe]
        sb = sb.reshape(1, -1) if recipe == "row" else sb  # _scaled_mm's row-wise b scale is [1, N]
        return lambda: torch._scaled_mm(qa, qb.t(), sa, sb, out_dtype=torch.bfloat16)

    cases = [
        ("fp32", lambda: a @ b.T),
        ("bf16", lambda: a16 @ b16.T),
        ("fp8 tensor-wise", scaled("tensor")),
        ("fp8 row-wise", scaled("row")),
        ("fp8 block-wise", lambda: block_wise_kernel(*blocks)),
        ("fp8 block-wise (emulated)", lambda: fp8_matmul(*blocks, backend="emulate", out_dtype=torch.bfloat16)),
    ]
    rows = []
    for name, fn in cases:
        try:
            rows.append((name, best_seconds(fn, repeats)))
        except (RuntimeError, ValueError, NotImplementedError) as e:  # no kernel for these scales here
            rows.append((name, f"unsupported: {str(e).splitlines()[0][:70]}"))
    return rows


def torchao_linear(lin: nn.Linear, recipe: str) -> nn.Module:
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(copy.deepcopy(lin))  # the converter swaps children, not the module it is given
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def linear_rows(n: int, dev: torch.device, repeats: int) -> list[tuple[str, float | str]]:
    torch.manual_seed(0)
    lin = nn.Linear(n, n, bias=False, device=dev)
    x = torch.randn(n, n, device=dev)
    gy = torch.randn(n, n, device=dev)

    def step(layer, autocast=False):
        def run():
            xi = x.detach().requires_grad_()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                y = layer(xi)
            y.backward(gy.to(y.dtype))
            layer.zero_grad(set_to_none=True)

        return run

    cases = [
        ("nn.Linear fp32", lambda: step(lin)),
        ("nn.Linear bf16 autocast", lambda: step(lin, autocast=True)),
        ("course FP8Linear tensor", lambda: step(FP8Linear.from_linear(lin, "tensor"))),
        ("course FP8Linear block", lambda: step(FP8Linear.from_linear(lin, "block"))),
        ("torchao Float8Linear tensorwise", lambda: step(torchao_linear(lin, "tensorwise"))),
        ("torchao Float8Linear rowwise", lambda: step(torchao_linear(lin, "rowwise"))),
    ]
    rows = []
    for name, make in cases:
        try:
            rows.append((name, best_seconds(make(), repeats)))
        except (ImportError, RuntimeError, ValueError, AssertionError) as e:
            rows.append((name, f"unsupported: {str(e).splitlines()[0][:70]}"))
    return rows


def table(title: str, n: int, rows, flops: float, baseline: str) -> None:
    base = dict(rows).get(baseline)
    print(f"\n{title}, n = {n}  ({flops:.3g} FLOPs per call)")
    print(f"  {'':32} {'ms':>10} {'TFLOP/s':>9} {'vs ' + baseline:>12}")
    for name, sec in rows:
        if isinstance(sec, str):
            print(f"  {name:32} {sec}")
            continue
        ratio = f"{base / sec:.2f}x" if isinstance(base, float) else "-"
        print(f"  {name:32} {sec * 1e3:10.3f} {flops / sec / 1e12:9.4f} {ratio:>12}")


def main() -> None:
    dev = device()  # this process's accelerator (cuda:0 on a GPU machine), else the CPU
    default_sizes = [4096, 8192] if dev.type == "cuda" else [256, 512, 1024]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=default_sizes, help="n of the n x n x n GEMMs")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bad = [n for n in args.sizes if n % 128]
    if bad:
        parser.error(f"sizes must be multiples of 128 (the block-wise scales tile whole 128 x 128 blocks): {bad}")
    print(f"device: {device_name(dev)}")
    for n in args.sizes:
        table("GEMM y = a b^T", n, gemm_rows(n, dev, args.repeats), 2 * n**3, "bf16")
        table("linear forward + backward", n, linear_rows(n, dev, args.repeats), 6 * n**3, "nn.Linear bf16 autocast")


if __name__ == "__main__":
    main()
