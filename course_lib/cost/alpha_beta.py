"""The alpha-beta model of collectives: seconds of each collective, and α, β fitted to measured times.

Hockney (1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
Computing 20(3)): one message of S bytes between two processes takes α + S·β, α the fixed cost of
a message (software, NIC, switch: the latency), β the seconds per byte (1 / bandwidth). A
collective is a schedule of such messages; Thakur, Rabenseifner & Gropp (2005, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 19(1)) count, for each algorithm, the
messages on its critical path and the bytes they carry. Every model below has the form

    t = a·α + b·β,   a = messages in sequence,  b = bytes on the critical path

with N = ``world_size`` ranks. Linear in (α, β), so one least-squares fit serves them all
(:func:`fit_alpha_beta`). Thakur et al. add γ per byte for a reduction's arithmetic; here it is folded
into a fitted β (the sum runs at memory speed, like the copy it follows). S is the buffer the formula
is written for: the whole buffer of an all-reduce, the gathered output of an all-gather, the input of
a reduce-scatter, one rank's input of an all-to-all, the message of a send.

:data:`ALPHA_BETA` holds the (a, b) of each collective; :func:`collective_seconds` evaluates one;
:func:`ring_all_reduce_seconds`, :func:`tree_all_reduce_seconds` (binomial and double binary tree,
Sanders, Speck & Träff 2009), :func:`ring_all_gather_seconds`, :func:`ring_reduce_scatter_seconds`,
:func:`all_to_all_seconds`, :func:`p2p_seconds` say where each entry comes from. Used by lectures 02,
07 and 08; the α, β of a real link are :mod:`course_lib.cost.links`. Tested in tests/cost/test_comm_model.py.
"""

from __future__ import annotations


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


ALPHA_BETA = {
    "ring_all_reduce": lambda n, s: (2 * (n - 1), 2 * (n - 1) / n * s),
    "tree_all_reduce": lambda n, s: (2 * _log2_ceil(n), 2 * _log2_ceil(n) * s),
    "double_tree_all_reduce": lambda n, s: (2 * _log2_ceil(n), 2 * s if n > 1 else 0.0),
    "all_gather": lambda n, s: (n - 1, (n - 1) / n * s),
    "reduce_scatter": lambda n, s: (n - 1, (n - 1) / n * s),
    "all_to_all": lambda n, s: (n - 1, (n - 1) / n * s),
    "p2p": lambda n, s: (1, s),
}
"""collective -> (N, S) -> (a, b): the terms of t = a·α + b·β. One function per entry below says where each comes from."""


def alpha_beta_terms(collective: str, nbytes: float, world_size: int) -> tuple[float, float]:
    """(a, b) such that ``collective`` of ``nbytes`` on ``world_size`` ranks takes a·α + b·β seconds."""
    if collective not in ALPHA_BETA:
        raise ValueError(f"no alpha-beta model for {collective!r}: choose from {sorted(ALPHA_BETA)}")
    if world_size < 1 or nbytes < 0:
        raise ValueError(f"world_size={world_size} must be >= 1 and nbytes={nbytes} >= 0")
    if world_size == 1 and collective != "p2p":
        return 0.0, 0.0  # one rank: nothing to send
    a, b = ALPHA_BETA[collective](world_size, nbytes)
    return float(a), float(b)


def collective_seconds(collective: str, nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of ``collective`` (a key of :data:`ALPHA_BETA`): a·α + b·β."""
    a, b = alpha_beta_terms(collective, nbytes, world_size)
    return a * alpha + b * beta


def ring_all_reduce_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of a ring all-reduce of ``nbytes``: 2(N-1) steps of α + (nbytes/N)·β.

    α: seconds of fixed cost per message; β: seconds per byte (1 / link bandwidth). The ring's
    reduce-scatter and all-gather each take N-1 steps moving 1/N of the buffer (Thakur et al. 2005:
    all-reduce as a reduce-scatter followed by an all-gather, here both rings; lab 01):
    2(N-1)·α + 2(N-1)/N·S·β, nearly 2S·β whatever N.
    """
    return collective_seconds("ring_all_reduce", nbytes, world_size, alpha, beta)


def tree_all_reduce_seconds(
    nbytes: float, world_size: int, alpha: float, beta: float, pipelined: bool = False
) -> float:
    """Alpha-beta time of a tree all-reduce: a reduce to the root, then a broadcast back, ⌈log2 N⌉ levels each.

    ``pipelined=False``, binomial tree with whole messages (the reduce followed by a broadcast that
    Thakur et al. 2005 take as the baseline all-reduce): every level moves all of S, 2⌈log2 N⌉·(α + S·β). Few
    latency terms, but the bytes grow with log N: right for small messages, wrong for large.
    ``pipelined=True``, double binary tree (Sanders, Speck & Träff 2009, "Two-tree algorithms for full
    bandwidth broadcast, reduction and scan", Parallel Computing 35(12); NCCL's tree since 2.4): two
    trees each carry half of S in small chunks, every rank a leaf in one tree, so in the large-message
    limit 2⌈log2 N⌉·α + 2S·β — the ring's bandwidth with a latency that grows as log N, not N. (The
    pipeline's per-chunk latency is left out: the limit, not a chunk-size optimum.)
    """
    name = "double_tree_all_reduce" if pipelined else "tree_all_reduce"
    return collective_seconds(name, nbytes, world_size, alpha, beta)


def ring_all_gather_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring all-gather of an ``nbytes`` result (each rank contributes nbytes/N): N-1 steps, each passing
    one block to the right neighbour, (N-1)·α + (N-1)/N·S·β (Thakur et al. 2005, ring all-gather)."""
    return collective_seconds("all_gather", nbytes, world_size, alpha, beta)


def ring_reduce_scatter_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of an ``nbytes`` input (each rank keeps the sum of one 1/N block): N-1 steps,
    (N-1)·α + (N-1)/N·S·β (Thakur et al. 2005, reduce-scatter for long messages, γ folded into β).
    Half of :func:`ring_all_reduce_seconds`."""
    return collective_seconds("reduce_scatter", nbytes, world_size, alpha, beta)


def all_to_all_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """All-to-all by pairwise exchange of ``nbytes`` per rank (1/N to each rank, its own block stays):
    N-1 steps, in step i rank r sends to r+i and receives from r-i, (N-1)·α + (N-1)/N·S·β (Thakur et
    al. 2005, the pairwise-exchange all-to-all for long messages). No step can be saved:
    every rank owes every other a distinct block, which is why expert parallelism pays its full volume."""
    return collective_seconds("all_to_all", nbytes, world_size, alpha, beta)


def p2p_seconds(nbytes: float, alpha: float, beta: float) -> float:
    """One point-to-point message of ``nbytes``: α + S·β (Hockney 1994), as pipeline stages exchange
    activations. A ping-pong's round trip is twice this: the way α and β are measured."""
    return collective_seconds("p2p", nbytes, 2, alpha, beta)


def fit_alpha_beta(
    nbytes: list[float],
    seconds: list[float],
    world_size: int,
    collective: str = "ring_all_reduce",
    relative: bool = False,
) -> tuple[float, float]:
    """Least-squares α, β ≥ 0 so that :func:`collective_seconds` of ``collective`` fits measured times.

    Every model is linear in (α, β), t = a·α + b·β (:func:`alpha_beta_terms`), so the fit is a
    weighted 2 x 2 linear system, Σ w·(a·α + b·β − t)² minimal:

    * ``relative=False``, plain least squares, w = 1 (lecture 02's fit, over a few decades of size).
      Over bytes to tens of MiB it listens to the largest messages only: their seconds are ~100× the
      smallest's, so their squared misses weigh ~10⁴× more, and the small messages, which alone
      determine α, miss by whatever is left.
    * ``relative=True``, w = 1/t²: the squared *relative* error Σ ((model − t)/t)², so a 10% miss
      weighs the same at 16 bytes as at 24 MiB: the small messages set α, the large ones β. It is
      the first-order form of a fit in log space (log(m/t) ≈ (m − t)/t), and
      unlike log space it keeps the closed form. A relative error is also what a held-out prediction
      is judged by.

    A negative α or β (noise) is clipped to 0 and the other refitted alone.
    """
    if len(nbytes) != len(seconds) or not nbytes:
        raise ValueError(f"one time per size: got {len(nbytes)} sizes and {len(seconds)} times")
    if relative and min(seconds) <= 0:
        raise ValueError("a relative fit divides by each measured time: all must be > 0")
    terms = [alpha_beta_terms(collective, s, world_size) for s in nbytes]
    w = [1 / t**2 if relative else 1.0 for t in seconds]
    saa = sum(wi * a * a for wi, (a, _) in zip(w, terms))
    sab = sum(wi * a * b for wi, (a, b) in zip(w, terms))
    sbb = sum(wi * b * b for wi, (_, b) in zip(w, terms))
    sat = sum(wi * a * t for wi, (a, _), t in zip(w, terms, seconds))
    sbt = sum(wi * b * t for wi, (_, b), t in zip(w, terms, seconds))
    det = saa * sbb - sab * sab
    if saa == 0 or sbb == 0 or det <= 1e-12 * saa * sbb:
        raise ValueError("fit_alpha_beta needs at least two different message sizes (and more than one rank)")
    alpha, beta = (sat * sbb - sbt * sab) / det, (sbt * saa - sat * sab) / det
    if alpha < 0:
        alpha, beta = 0.0, sbt / sbb
    elif beta < 0:
        alpha, beta = sat / saa, 0.0
    return alpha, max(beta, 0.0)


def relative_errors(
    measured: dict[float, float], collective: str, world_size: int, alpha: float, beta: float
) -> dict[float, float]:
    """(model − measured) / measured for each size of ``measured`` ({bytes: seconds})."""
    return {s: collective_seconds(collective, s, world_size, alpha, beta) / t - 1 for s, t in measured.items()}
