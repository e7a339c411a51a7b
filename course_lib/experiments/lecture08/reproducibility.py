"""Reproducibility measured: summation order, seeds, deterministic algorithms and TF32 (lecture 08b).

Three facts a run has to respect before "same seed, same result" holds:

1. **Floating-point addition is not associative.** (a + b) + c and a + (b + c) round differently, so
   a sum depends on the order of its terms. The order is an implementation detail: the vector width
   of the CPU, the number of threads, the all-reduce algorithm and the world size all change it.
   Float32 sums of the same numbers in different orders differ in their last bits; the error of
   any order is bounded by (n − 1)·u·Σ|xᵢ| with u = 2⁻²⁴ (Higham, *Accuracy and Stability of
   Numerical Algorithms*, 2nd ed., §4.2), so they differ by at most twice that. Exact arithmetic
   does not care: integers, and float64 when every partial sum is representable (see
   :func:`summation_orders`), give one answer in every order.
2. **Seeds fix the random numbers, nothing else.** With the model's init drawn from
   ``torch.manual_seed`` and the batches from the data's own generator, two runs on one machine
   give bit-identical losses (:func:`seeded_losses`); change either seed and they differ from the
   first step.
3. **Some kernels choose their order at run time.** On GPUs, kernels built on atomicAdd (index_add_,
   scatter_add_, embedding's backward) add in whatever order threads arrive, cuDNN may benchmark
   and pick different algorithms, and TF32 tensor cores round matmul inputs to 10 mantissa bits.
   ``torch.use_deterministic_algorithms(True)``, cuDNN's ``deterministic`` / ``benchmark`` flags,
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and the fp32-precision settings turn these off
   (PyTorch documentation, "Reproducibility" and "TensorFloat-32 (TF32) on Ampere (and later)
   devices"); :func:`deterministic_mode` sets them all and puts them back.

On a CPU, TF32 does not exist: ``torch.set_float32_matmul_precision("high")`` changes nothing here.
``"medium"`` does, though, on a CPU with bf16 units (AVX512-BF16, AMX): oneDNN then multiplies fp32
matrices in bf16 (torch's ``torch.backends.mkldnn.matmul.fp32_precision``); on the course machine
(AVX512-BF16) a 256 × 256 matmul changes by ~3e-5. TF32's effect is emulated with
:func:`tf32_matmul` instead. Since torch 2.9 the per-backend ``fp32_precision`` settings replace
``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32``, and torch refuses
to read a legacy flag after the new API has set it, so this file touches only the new one when it
exists (:func:`precision_flags`).

Re-running one run bit for bit is the *reproducibility* this buys. Getting the same bits on other
hardware needs a fixed reduction order in every kernel (batch-invariant kernels), which standard
libraries do not promise; lecture 08b discusses what that costs.

Tested in tests/experiments/test_reproducibility.py; lab 11's tests use it too (tests/lab_shims.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import random

import torch

from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.precision.formats import FloatFormat, round_to_format

__all__ = [
    "TF32",
    "allreduce_orders",
    "deterministic_mode",
    "precision_flags",
    "seeded_losses",
    "summation_orders",
    "tf32_matmul",
]

U32 = 2.0**-24  # unit roundoff of float32: |fl(x) − x| ≤ u·|x|
TF32 = FloatFormat("tf32", 8, 10, 127, "ieee", None)  # fp32's range, fp16's 10 mantissa bits


# ----------------------------------------------------------------------------------------------
# 1. Summation order
# ----------------------------------------------------------------------------------------------


def _grid_values(n: int, seed: int) -> torch.Tensor:
    """n float32 values in [−1, 1), each a multiple of 2⁻²⁴ (torch.rand draws k·2⁻²⁴; 2r − 1 keeps the grid)."""
    # host: the lecture's summation experiment runs on the CPU, from a CPU generator (the same values everywhere)
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.rand(n, generator=g) - 1  # host: drawn by g, as above


def summation_orders(n: int = 10_000, n_orders: int = 8, seed: int = 0) -> dict:
    """The same n float32 numbers summed in ``n_orders`` random orders, four ways.

    Returns {"float32": [torch.sum of each permutation, as Python floats], "float32_repeat": the first
    order summed again, "float64": [each permutation summed in float64], "int64": [each permutation
    of the integers xᵢ·2²⁴ summed], "exact": math.fsum of the values, "bound": (n − 1)·u·Σ|xᵢ|}.

    Why float64 is exact here: every xᵢ is a multiple of 2⁻²⁴ with |xᵢ| < 1, so every partial sum is
    a multiple of 2⁻²⁴ below n in magnitude, which needs 24 + log2(n) ≤ 53 bits for n ≤ 2²⁹: float64
    represents each partial sum exactly, so no addition rounds and the order cannot matter. For
    arbitrary float32 inputs float64 only makes the order effect ~2²⁹ times smaller, not zero.
    """
    if not 2 <= n <= 2**29:
        raise ValueError(f"n={n}: need 2 <= n <= 2**29 so that float64 sums of the grid values stay exact")
    x = _grid_values(n, seed)
    g = torch.Generator().manual_seed(seed + 1)  # host: the orders index the host values above
    perms = [torch.randperm(n, generator=g) for _ in range(n_orders)]  # host: drawn by g, as above
    as_int = (x.double() * 2**24).long()  # exact: the values are on the 2⁻²⁴ grid
    return {
        "float32": [torch.sum(x[p]).item() for p in perms],
        "float32_repeat": torch.sum(x[perms[0]]).item(),
        "float64": [torch.sum(x[p].double()).item() for p in perms],
        "int64": [int(torch.sum(as_int[p])) for p in perms],
        "exact": math.fsum(x.double().tolist()),
        "bound": (n - 1) * U32 * x.abs().double().sum().item(),
    }


def _ring_order(world_size: int, chunk: int) -> list[int]:
    # Ring reduce-scatter: chunk c starts at rank c + 1 and travels around, each rank adding its own
    # copy, so rank c adds last (course_lib.parallel's ring all-reduce, lecture 02).
    return [(chunk + 1 + k) % world_size for k in range(world_size)]


def _add_in_order(grads: torch.Tensor, order: list[int]) -> torch.Tensor:
    acc = grads[order[0]].clone()
    for r in order[1:]:
        acc = acc + grads[r]
    return acc


def _tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    while len(parts) > 1:  # pairwise: (g0 + g1) + (g2 + g3), as a recursive-halving all-reduce adds
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def allreduce_orders(grads: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sum over ranks of ``grads`` [world_size, n], in the orders three all-reduce algorithms add.

    "rank order": ((g0 + g1) + g2) + …, one accumulation (a reduce to rank 0);
    "ring": element j belongs to chunk c = j·W // n and is added starting at rank c + 1;
    "tree": pairwise, (g0 + g1) + (g2 + g3).
    All three are the same sum; in float32 they differ in some elements, in exact arithmetic never.
    """
    if grads.dim() != 2 or grads.shape[0] < 2:
        raise ValueError(f"grads must be [world_size >= 2, n], one row per rank; got {tuple(grads.shape)}")
    world, n = grads.shape
    ring = torch.empty_like(grads[0])
    bounds = [n * c // world for c in range(world + 1)]
    for c in range(world):
        lo, hi = bounds[c], bounds[c + 1]
        ring[lo:hi] = _add_in_order(grads[:, lo:hi], _ring_order(world, c))
    return {
        "rank order": _add_in_order(grads, list(range(world))),
        "ring": ring,
        "tree": _tree_sum(list(grads)),
    }


# ----------------------------------------------------------------------------------------------
# 2. Seeds
# ----------------------------------------------------------------------------------------------


def seeded_losses(seed: int = 0, data_seed: int = 0, steps: int = 20, lr: float = 3e-3) -> torch.Tensor:
    """Losses [steps] (float32) of the ``tiny`` model trained with AdamW: init from
    ``torch.manual_seed(seed)``, batches (8 × 32 tokens of the default language) from ``data_seed``.

    The data's generators are its own (course_lib.data never touches torch's global RNG), so the two
    seeds are independent knobs: each one alone changes the run, both fixed repeat it bit for bit.
    """
    torch.manual_seed(seed)
    model = Transformer(configs.get("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = small_run.train(model, opt, small_run.batches(steps, 8, 32, data_seed))
    return torch.tensor(losses, dtype=torch.float32)  # host: floats read back from float32 losses, exactly


# ----------------------------------------------------------------------------------------------
# 3. Deterministic algorithms and TF32
# ----------------------------------------------------------------------------------------------

# The fp32-precision settings of torch >= 2.9, parents before children ("none" = inherit the parent's).
_PRECISION_ATTRS = (
    ("fp32_precision",),
    ("cuda", "matmul", "fp32_precision"),
    ("cudnn", "fp32_precision"),
    ("cudnn", "conv", "fp32_precision"),
    ("cudnn", "rnn", "fp32_precision"),
    ("mkldnn", "fp32_precision"),
    ("mkldnn", "matmul", "fp32_precision"),
    ("mkldnn", "conv", "fp32_precision"),
    ("mkldnn", "rnn", "fp32_precision"),
)


def _has_new_precision_api() -> bool:
    return hasattr(torch.backends, "fp32_precision")


def _get(path):
    obj = torch.backends
    for name in path[:-1]:
        obj = getattr(obj, name)
    return getattr(obj, path[-1])


def _set(path, value) -> None:
    obj = torch.backends
    for name in path[:-1]:
        obj = getattr(obj, name)
    setattr(obj, path[-1], value)


def precision_flags() -> dict:
    """The settings that decide which algorithms and which fp32 arithmetic torch uses, by name.

    With torch >= 2.9 the fp32 settings are the ``fp32_precision`` attributes ("ieee": full fp32,
    "tf32": TF32 allowed, "bf16": bf16 allowed, "none": inherit); the legacy ``allow_tf32`` flags
    are not read, because torch raises when a legacy flag is read after the new API has set it.
    """
    flags = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if _has_new_precision_api():
        for path in _PRECISION_ATTRS:
            with contextlib.suppress(AttributeError):
                flags[".".join(path)] = _get(path)
    else:  # torch < 2.9: the two legacy switches
        flags["cuda.matmul.allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        flags["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return flags


@contextlib.contextmanager
def deterministic_mode(seed: int = 0, warn_only: bool = False):
    """Within the block: seeded RNGs, deterministic algorithms, no TF32/bf16 shortcuts for fp32.

    Sets Python's ``random``, torch's (every device) and, when installed, NumPy's seeds to ``seed``;
    ``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` (an op without a deterministic
    kernel then raises, or warns); cuDNN ``deterministic=True, benchmark=False``; every fp32
    precision setting to "ieee" (TF32 off on GPUs, bf16 off for oneDNN on CPUs); and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when it creates its handle: set it
    before the first CUDA matmul of the process (this block sets it for code that starts there).
    On exit everything is put back: the flags, the environment variable and the RNG states, so the
    code after the block draws the random numbers it would have drawn without it.
    """
    saved_flags = precision_flags()
    saved_precisions = (
        {path: _get(path) for path in _PRECISION_ATTRS if _try_get(path) is not None}
        if _has_new_precision_api()
        else None
    )
    saved_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    saved_rng = (random.getstate(), torch.get_rng_state(), _cuda_rng_states(), _numpy_state())
    try:
        random.seed(seed)
        torch.manual_seed(seed)  # seeds every CUDA device too
        np = _numpy()
        if np is not None:
            np.random.seed(seed)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        if saved_precisions is not None:
            for path in saved_precisions:
                _set(path, "ieee")
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.use_deterministic_algorithms(
            saved_flags["deterministic_algorithms"], warn_only=saved_flags["deterministic_warn_only"]
        )
        torch.backends.cudnn.deterministic = saved_flags["cudnn.deterministic"]
        torch.backends.cudnn.benchmark = saved_flags["cudnn.benchmark"]
        if saved_precisions is not None:
            for path, value in saved_precisions.items():
                _set(path, value)
        else:
            torch.backends.cuda.matmul.allow_tf32 = saved_flags["cuda.matmul.allow_tf32"]
            torch.backends.cudnn.allow_tf32 = saved_flags["cudnn.allow_tf32"]
        if saved_env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved_env
        py_state, torch_state, cuda_states, np_state = saved_rng
        random.setstate(py_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if np_state is not None:
            _numpy().random.set_state(np_state)


def _try_get(path):
    try:
        return _get(path)
    except AttributeError:
        return None


def _cuda_rng_states():
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _numpy():
    try:
        import numpy
    except ImportError:  # NumPy is optional for the course's own code
        return None
    return numpy


def _numpy_state():
    np = _numpy()
    return None if np is None else np.random.get_state()


def tf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as a TF32 tensor core computes it, emulated on any device: each fp32 input rounded to
    TF32's 10 mantissa bits (round to nearest even), products and sums in fp32.

    The relative error of each input is at most 2⁻¹¹ (against fp32's 2⁻²⁴), so the result is
    within about 2·2⁻¹¹·Σₖ|aᵢₖ bₖⱼ| of the exact product, which is what NVIDIA's TF32 gives up
    for 8× the fp32 throughput on an A100.
    """
    return round_to_format(a.float(), TF32) @ round_to_format(b.float(), TF32)
