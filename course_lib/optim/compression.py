"""Gradient compression as DDP communication hooks: Top-K, QSGD and 1-bit sign, with error feedback.

Data parallelism all-reduces every gradient every step: 4 bytes per parameter, whatever the
network. When the network is the bottleneck, send less: a few coordinates (Top-K), a few bits per
coordinate (QSGD, sign) or a low-rank factorisation (PowerSGD, :mod:`course_lib.optim.powersgd`). Each is a DDP
*communication hook*, torch's interface for replacing a bucket's all-reduce:

    hook(state, bucket) -> torch.futures.Future[torch.Tensor]

``bucket`` is a ``torch.distributed.GradBucket`` (``buffer()``, ``index()``, ``is_last()``,
``parameters()``, ``gradients()``) or the course DDP's stand-in for it
(:mod:`course_lib.parallel.data.comm_hook`), so one hook runs under both
``torch.nn.parallel.DistributedDataParallel.register_comm_hook`` and the course's
``DistributedDataParallel.register_comm_hook``. Torch's convention, followed here: the bucket holds
this rank's *raw* local gradient g_r (not divided by W), and the Future's value is what every rank
then uses as the gradient, the average (1/W)·Σ_r C(g_r) of the decompressed messages.

Bytes this rank hands to the collective per bucket of n fp32 gradients (``course_lib.cost.compression_payload``):

    all-reduce (no hook)       4n
    Top-K, k coordinates       8k              fp32 value + int32 index each, one all-gather
    QSGD                       n + 4           an int8 level per coordinate + the fp32 norm
    sign                       ⌈n/8⌉ + 4       1 bit per coordinate + one fp32 scale
    PowerSGD, rank r           4·Σ r(rows + cols) over the compressed matrices (+ 4·numel of the rest)

Sparse and quantised messages cannot be summed on the way (two ranks' top-k indices differ, their
scales differ), so those hooks *all-gather* and every rank decodes and averages W messages: a rank
receives (W-1)× its payload, where a ring all-reduce receives 2(W-1)/W·4n. Top-K only saves while
8k(W-1) < 8n(W-1)/W, i.e. k < n/W. PowerSGD's factors *can* be summed (Σ_r M_r·Q = (Σ_r M_r)·Q), so
it all-reduces and scales to any W: why it is the one torch ships.

**Error feedback** (Seide et al. 2014, §3; Stich et al. 2018, "Sparsified SGD with memory";
Karimireddy et al. 2019, "Error feedback fixes SignSGD"). A biased compressor (Top-K, sign) loses
what it does not send, every step: small coordinates are never sent at all. Keep the loss as a
residual e_r and add it to the next gradient:

    p = g_r + e_r        send C(p)        e_r ← p − C(p)

Summed over steps this telescopes: Σ_t applied_t = Σ_t ḡ_t − (1/W)·Σ_r e_r. Nothing is lost, only
delayed, and the gap is one residual however long training runs (tests/optim/test_compression.py checks
the identity). QSGD needs none: it is unbiased, E[C(g)] = g.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: torch's register_comm_hook compares a hook's annotations,
# as objects, with dist.GradBucket and torch.futures.Future[torch.Tensor].
Future = torch.futures.Future[torch.Tensor]

# ----------------------------------------------------------------------------------------------
# Shared pieces: futures, payloads as bytes, residuals
# ----------------------------------------------------------------------------------------------


def completed(tensor: torch.Tensor) -> Future:
    """A Future that already holds ``tensor``: what a hook that has finished its work returns."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as a flat uint8 tensor (no copy when ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _all_gather_then(payload: torch.Tensor, group, decode) -> Future:
    """All-gather this rank's uint8 ``payload`` (same size on every rank) asynchronously; the Future's
    value is ``decode(payloads)``, ``payloads[r]`` being rank r's. One collective per bucket: the
    latency α is paid once, however many pieces (values, indices, scales) a message has."""
    gathered = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, payload, group=group, async_op=True)
    return work.get_future().then(lambda _: decode(gathered))


def _plus_residual(residuals: dict, bucket, error_feedback: bool) -> torch.Tensor:
    """p = g + e for this bucket (a new tensor; e = 0 the first time or without error feedback)."""
    g = bucket.buffer()
    e = residuals.get(bucket.index()) if error_feedback else None
    return g + e if e is not None else g.clone()


# ----------------------------------------------------------------------------------------------
# 1. Top-K sparsification with error feedback (Stich et al. 2018; Lin et al. 2018, DGC)
# ----------------------------------------------------------------------------------------------


@dataclass
class TopKState:
    """Keep the ``ratio``·n largest |g + e| of each bucket. ``residuals[bucket index]`` is e."""

    ratio: float = 0.01
    error_feedback: bool = True
    process_group: object = None
    residuals: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0 < self.ratio <= 1:
            raise ValueError(f"Top-K ratio={self.ratio} must be in (0, 1]: the fraction of coordinates sent")

    def k(self, n: int) -> int:
        """Coordinates sent for a bucket of n: ⌈ratio·n⌉, at least one."""
        return max(1, math.ceil(self.ratio * n))


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> Future:
    """Send the k largest |g + e| as (fp32 value, int32 index) pairs; average the W sparse messages.

    DGC (Lin et al. 2018, §3) adds momentum correction and local clipping on top; this is the core
    both papers share: top-k selection with a local residual ("memory", Stich et al. 2018, Alg. 1).
    """
    p = _plus_residual(state.residuals, bucket, state.error_feedback)
    n, k = p.numel(), state.k(p.numel())
    index = p.abs().topk(k, sorted=False).indices
    values = p[index]
    if state.error_feedback:
        p[index] = 0.0  # what was sent is no longer owed: e ← p − C(p)
        state.residuals[bucket.index()] = p
    world_size = dist.get_world_size(state.process_group)

    def decode(payloads):
        out = torch.zeros(n, dtype=values.dtype, device=values.device)
        for msg in payloads:  # rank order: the same sum, in the same order, on every rank
            out.index_add_(0, msg[4 * k :].view(torch.int32).long(), msg[: 4 * k].view(values.dtype))
        return out.div_(world_size)

    payload = torch.cat([_as_bytes(values), _as_bytes(index.to(torch.int32))])
    return _all_gather_then(payload, state.process_group, decode)


# ----------------------------------------------------------------------------------------------
# 2. QSGD: unbiased stochastic quantisation (Alistarh et al. 2017)
# ----------------------------------------------------------------------------------------------


@dataclass
class QSGDState:
    """``levels`` = s of the paper (≤ 127: a signed level fits in int8). Each rank draws its own
    rounding noise, from a generator seeded with ``seed`` and its rank."""

    levels: int = 127
    process_group: object = None
    seed: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self):
        if not 1 <= self.levels <= 127:
            raise ValueError(f"QSGD levels={self.levels} must be in 1..127: a level ±s is sent as one int8")


def qsgd_quantize(v: torch.Tensor, levels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 signed levels, fp32 norm) of Q_s(v) (Alistarh et al. 2017, §3.1):

        Q_s(v_i) = ‖v‖₂ · sgn(v_i) · ξ_i / s,   ξ_i = ⌊s|v_i|/‖v‖⌋ + Bernoulli(frac(s|v_i|/‖v‖))

    Rounding up with probability equal to the fraction makes E[ξ_i] = s|v_i|/‖v‖, so E[Q_s(v)] = v
    (unbiased); the variance is at most min(n/s², √n/s)·‖v‖² (their Lemma 3.1).
    """
    norm = torch.linalg.vector_norm(v)
    scaled = v.abs() / norm * levels if norm > 0 else torch.zeros_like(v)
    lower = scaled.floor()
    up = torch.rand(v.shape, generator=generator, dtype=v.dtype, device=v.device) < scaled - lower
    return (torch.sign(v) * (lower + up)).to(torch.int8), norm.reshape(1)


def qsgd_dequantize(level: torch.Tensor, norm: torch.Tensor, levels: int) -> torch.Tensor:
    """‖v‖ · level / s: the decoded vector (fp32)."""
    return norm * level.to(norm.dtype) / levels


def qsgd_hook(state: QSGDState, bucket: dist.GradBucket) -> Future:
    """Send each coordinate as an int8 level and the bucket as one fp32 norm; average the W decodings."""
    g = bucket.buffer()
    if state.generator is None:
        rank = dist.get_rank(state.process_group)
        state.generator = torch.Generator(device=g.device).manual_seed(state.seed * 100_003 + rank)
    level, norm = qsgd_quantize(g, state.levels, state.generator)
    world_size = dist.get_world_size(state.process_group)

    def decode(payloads):
        out = torch.zeros_like(g)
        for msg in payloads:
            out += qsgd_dequantize(msg[4:].view(torch.int8), msg[:4].view(g.dtype), state.levels)
        return out.div_(world_size)

    # the norm first: a view as fp32 must start at a multiple of 4 bytes
    return _all_gather_then(torch.cat([_as_bytes(norm), _as_bytes(level)]), state.process_group, decode)


# ----------------------------------------------------------------------------------------------
# 3. 1-bit sign with error feedback (Seide et al. 2014; the compression of 1-bit Adam, Tang et al. 2021)
# ----------------------------------------------------------------------------------------------


@dataclass
class SignState:
    """One bit per coordinate and one scale per bucket; ``residuals[bucket index]`` is e."""

    error_feedback: bool = True
    process_group: object = None
    residuals: dict = field(default_factory=dict)


# host: a constant table, moved to the bits' device where it is used; bit 0 of a group of 8 is the byte's top bit
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """n booleans → ⌈n/8⌉ uint8, 8 per byte (zero-padded at the end)."""
    b = torch.nn.functional.pad(bits.to(torch.uint8), (0, -bits.numel() % 8)).view(-1, 8)
    return (b << _SHIFTS.to(b.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: the first n booleans."""
    return ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).reshape(-1)[:n].bool()


def sign_hook(state: SignState, bucket: dist.GradBucket) -> Future:
    """Send sgn(p) as bits and s = mean|p| (p = g + e); every rank decodes s_r·sgn(p_r) and averages.

    mean|p| is the scale that minimises ‖p − s·sgn(p)‖² (set the derivative in s to zero), the
    scaled sign of Karimireddy et al. 2019 (EF-SignSGD, Alg. 1). sgn(0) is taken as +1: one bit has
    no room for zero. 1-bit Adam (Tang et al. 2021, §4) compresses Adam's momentum this way once its
    variance term has frozen; compressing the gradient is the 1-bit SGD of Seide et al.
    """
    p = _plus_residual(state.residuals, bucket, state.error_feedback)
    n, world_size = p.numel(), dist.get_world_size(state.process_group)
    positive = p >= 0
    scale = p.abs().mean().reshape(1)
    if state.error_feedback:
        state.residuals[bucket.index()] = p - torch.where(positive, scale, -scale)

    def decode(payloads):
        out = torch.zeros_like(p)
        for msg in payloads:
            s = msg[:4].view(p.dtype)
            out += torch.where(unpack_bits(msg[4:], n), s, -s)
        return out.div_(world_size)

    # the scale first: a view as fp32 must start at a multiple of 4 bytes
    return _all_gather_then(torch.cat([_as_bytes(scale), pack_bits(positive)]), state.process_group, decode)
