"""Gradient compression as DDP communication hooks: Top-K, QSGD, 1-bit sign, PowerSGD (issue 11).

Data parallelism all-reduces every gradient every step: 4 bytes per parameter, whatever the
network. When the network is the bottleneck, send less: a few coordinates (Top-K), a few bits per
coordinate (QSGD, sign) or a low-rank factorisation (PowerSGD). Each compressor here is a DDP
*communication hook*, torch's interface for replacing a bucket's all-reduce:

    hook(state, bucket) -> torch.futures.Future[torch.Tensor]

``bucket`` is a ``torch.distributed.GradBucket`` (``buffer()``, ``index()``, ``is_last()``,
``parameters()``, ``gradients()``) or the course DDP's stand-in for it
(:mod:`course_lib.parallel.data.comm_hook`), so one hook runs under both
``torch.nn.parallel.DistributedDataParallel.register_comm_hook`` and the course's
``DistributedDataParallel.register_comm_hook``. Torch's convention, followed here: the bucket holds
this rank's *raw* local gradient g_r (not divided by W), and the Future's value is what every rank
then uses as the gradient, the average (1/W)·Σ_r C(g_r) of the decompressed messages.

Bytes this rank hands to the collective per bucket of n fp32 gradients (``course_lib.cost.comm``):

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
delayed, and the gap is one residual however long training runs (tests/test_compression.py checks
the identity). QSGD needs none: it is unbiased, E[C(g)] = g.
"""

import math
from dataclasses import dataclass, field

import numpy as np
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


# ----------------------------------------------------------------------------------------------
# 4. PowerSGD: rank-r approximation by one power iteration (Vogels et al. 2019)
# ----------------------------------------------------------------------------------------------


class PowerSGDState:
    """State of :func:`powersgd_hook`; the arguments and their meaning are torch's ``PowerSGDState``'s.

    * ``matrix_approximation_rank`` r; ``min_compression_rate``: a matrix n×m is compressed only if
      r(n + m)·rate < nm (else it is all-reduced as it is);
    * ``start_powerSGD_iter``: plain all-reduce for that many steps first. Torch insists on ≥ 2 with
      error feedback or warm start because its DDP rebuilds its buckets after the first step; the
      course DDP's buckets never change, so 0 is allowed here;
    * ``use_error_feedback``; ``warm_start`` (reuse last step's Q instead of a fresh random one);
    * ``random_seed``: each bucket's first Q is drawn from a torch generator seeded by a numpy
      ``RandomState(random_seed)``, as torch does, so the two hooks start from the same Q.

    Per bucket index: ``error_dict`` (e), ``p_memory_dict`` and ``q_memory_dict`` (the flat P and Q
    of all its compressed matrices, all-reduced as one buffer each).
    """

    def __init__(
        self,
        process_group=None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 0,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
    ):
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank={matrix_approximation_rank} must be >= 1")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0  # steps done: counted when the last bucket of a step has been handled

    def rank_of(self, shape) -> int | None:
        """The rank r used for a gradient of ``shape`` (seen as shape[0] × rest), or None: sent uncompressed."""
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, self.matrix_approximation_rank)
        return r if r * (n + m) * self.min_compression_rate < n * m else None


def orthogonalize(m: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the r columns of ``m`` (n × r) orthonormal, in place, spanning the same space.

    Gram-Schmidt for r ≤ 2, a QR factorisation beyond (torch's choice: QR is faster for larger r).
    Only the span matters for the result P̂P̂ᵀM, so the two are interchangeable up to rounding.
    """
    r = m.shape[1]
    if r > 2:
        m.copy_(torch.linalg.qr(m).Q)
        return
    for i in range(r):
        col = m[:, i : i + 1]
        col /= torch.linalg.vector_norm(col, dim=0, keepdim=True) + epsilon
        if i + 1 < r:
            rest = m[:, i + 1 :]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future:
    """Rank-r PowerSGD with warm start and error feedback (Vogels et al. 2019, Alg. 1), as torch's hook.

    Each gradient is seen as a matrix M_r = g.view(shape[0], -1) (a bias of n elements: n × 1;
    rank 1 reproduces an n × 1 matrix exactly, at (n + 1)/n the bytes, so the default
    ``min_compression_rate`` sends vectors uncompressed). For every matrix worth compressing:

        Q ← orthogonalise(Q)                      (warm start: last step's Q)
        P = Σ_r M_r Q          all-reduce         (n × r)
        P̂ = orthogonalise(P)
        Q = Σ_r M_rᵀ P̂         all-reduce         (m × r)
        M ≈ P̂ Qᵀ / W                              (= P̂P̂ᵀ · mean_r M_r: a projection of the mean)

    Error feedback as torch does it: e_r ← (g_r + e_r) − (what the step applies). The three rounds
    depend on each other, so they run here one after the other and the Future is already complete;
    torch chains them as futures so that the first can overlap the rest of backward.
    """
    group, g = state.process_group, bucket.buffer()
    world_size, i = dist.get_world_size(group), bucket.index()
    if state.iter < state.start_powerSGD_iter:
        state.iter += bucket.is_last()
        g.div_(world_size)
        dist.all_reduce(g, group=group)
        return completed(g)

    if state.use_error_feedback and i in state.error_dict:
        g.add_(state.error_dict[i])
    owed = g.clone() if state.use_error_feedback else None  # g + e: what this rank owes
    grads = bucket.gradients()  # views into g: writing them writes the buffer
    ranks = [state.rank_of(t.shape) for t in grads]
    matrices = [(t.view(t.shape[0], -1), r) for t, r in zip(grads, ranks) if r is not None]
    plain = [t for t, r in zip(grads, ranks) if r is None]
    # torch's order: grouped by shape, shapes in order of first appearance (it can batch equal shapes);
    # following it puts the same random first Q on the same matrix
    first_seen = {}
    for m, _ in matrices:
        first_seen.setdefault(m.shape, len(first_seen))
    matrices.sort(key=lambda item: first_seen[item[0].shape])

    # 0. matrices not worth compressing: one plain all-reduce of all of them
    if plain:
        flat = torch.cat([t.reshape(-1) for t in plain])
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)
        for t, part in zip(plain, flat.split([t.numel() for t in plain])):
            t.copy_(part.view_as(t))
    if not matrices:
        return _finish_powersgd(state, bucket, g, owed)

    # P and Q of every matrix are views into one flat buffer each, so each round is one all-reduce
    fresh = not state.warm_start or i not in state.q_memory_dict
    if fresh:
        state.p_memory_dict[i] = g.new_empty(sum(m.shape[0] * r for m, r in matrices))
        state.q_memory_dict[i] = g.new_empty(sum(m.shape[1] * r for m, r in matrices))
    ps = _views(state.p_memory_dict[i], [(m.shape[0], r) for m, r in matrices])
    qs = _views(state.q_memory_dict[i], [(m.shape[1], r) for m, r in matrices])
    if fresh:  # a random start: Q ~ N(0, 1), drawn on the CPU as torch does
        # host: torch's PowerSGD hook draws Q on the CPU, so every rank and machine starts from the same Q
        gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=gen, dtype=g.dtype))  # host: drawn by gen, copied to the device
    for q in qs:
        orthogonalize(q, state.orthogonalization_epsilon)

    # 1. P = M Q, summed over ranks
    for (m, _), q, p in zip(matrices, qs, ps):
        torch.matmul(m, q, out=p)
    dist.all_reduce(state.p_memory_dict[i], group=group)
    # 2. Q = Mᵀ P̂, summed over ranks
    for p in ps:
        orthogonalize(p, state.orthogonalization_epsilon)
    for (m, _), p, q in zip(matrices, ps, qs):
        torch.matmul(m.t(), p, out=q)
    dist.all_reduce(state.q_memory_dict[i], group=group)
    state.q_memory_dict[i].div_(world_size)
    # 3. M ≈ P̂ Qᵀ, written into the bucket
    for (m, _), p, q in zip(matrices, ps, qs):
        torch.matmul(p, q.t(), out=m)
    return _finish_powersgd(state, bucket, g, owed)


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` with the given 2-D shapes."""
    out, offset = [], 0
    for n, r in shapes:
        out.append(flat[offset : offset + n * r].view(n, r))
        offset += n * r
    return out


def _finish_powersgd(state: PowerSGDState, bucket, g: torch.Tensor, owed: torch.Tensor | None):
    if owed is not None:
        state.error_dict[bucket.index()] = owed - g
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.iter += bucket.is_last()
    return completed(g)
