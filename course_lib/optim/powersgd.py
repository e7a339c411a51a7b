"""PowerSGD as a DDP communication hook: each gradient matrix sent as a rank-r factorisation (Vogels et al. 2019).

PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization (NeurIPS 2019), Alg. 1,
as torch's ``powerSGD_hook`` implements it: one power iteration per step, warm-started from last
step's Q, with error feedback. Unlike the sparse and quantised hooks of
:mod:`course_lib.optim.compression` (the hook interface, the byte table and error feedback are
explained there), its factors can be summed on the way, Σ_r M_r·Q = (Σ_r M_r)·Q, so it all-reduces
and its traffic does not grow with the world size. Tested in tests/optim/test_compression.py, against torch's hook.
"""

import math

import numpy as np
import torch
import torch.distributed as dist

from course_lib.optim.compression import Future, completed

# No `from __future__ import annotations` here: torch's register_comm_hook compares a hook's annotations,
# as objects, with dist.GradBucket and torch.futures.Future[torch.Tensor].


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
