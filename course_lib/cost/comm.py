"""Communication volume: bytes and elements each rank moves, per strategy. Pure arithmetic.

Every formula here is set beside a measurement from :mod:`course_lib.dist.counter` in a test.

* ZeRO (Rajbhandari et al. 2020, §7): :func:`paper_comm_volume`, :func:`zero_comm_bytes`;
* ring collectives (lab 01): :func:`ring_wire_bytes` turns counted payloads into wire bytes;
* ring attention and Ulysses (lecture 03): :func:`ring_comm_bytes`, :func:`ulysses_comm_bytes`;
* 1D/2D/2.5D/3D tensor parallel matmuls (lecture 02): :func:`comm_elements` (payload, what the
  counter records), :func:`tp_received_elements` (what a device receives), :func:`received_bytes`
  (counted payloads turned into received bytes);
* the alpha-beta model of every collective (lectures 02, 07, 08; Hockney 1994, Thakur et al. 2005,
  Sanders et al. 2009): :func:`ring_all_reduce_seconds`, :func:`tree_all_reduce_seconds`,
  :func:`ring_all_gather_seconds`, :func:`ring_reduce_scatter_seconds`, :func:`all_to_all_seconds`,
  :func:`p2p_seconds`, all through :data:`ALPHA_BETA` / :func:`collective_seconds`; :func:`fit_alpha_beta`
  (α, β from measured times, plain or relative least squares) and :func:`relative_errors`;
* DDP's overlap (lecture 02): :func:`ddp_step_timeline` (a modelled step, buckets all-reduced after
  or during backward); the bucket-size trade-off: :func:`bucketed_all_reduce_seconds`;
* 1D tensor parallelism's share of communication as its degree grows (lecture 02):
  :func:`tp_block_comm_share`, :func:`tp_layer_comm_seconds`;
* expert parallelism's dispatch and combine (lecture 03): :func:`ep_dispatch_bytes`,
  :func:`fp8_bytes_per_element` (FP8 dispatch), :func:`ep_comm_time`;
* the links of the hardware table (lecture 07; seed 001 §2.3.2, §4.2-4.3): :func:`link_alpha_beta`,
  :func:`tp_step_comm_seconds`, :func:`ep_layer_comm_seconds` (InfiniBand and NVLink forwarding),
  :func:`step_comm_on` (H800 against H100), and node-limited routing's :func:`expected_distinct_nodes`,
  :func:`distinct_nodes_variance`;
* gradient compression hooks (:mod:`course_lib.optim.compression`): :func:`topk_comm_bytes`,
  :func:`qsgd_comm_bytes`, :func:`sign_comm_bytes`, :func:`powersgd_comm_bytes`.
"""

from __future__ import annotations

import math

from course_lib.cost import hardware
from course_lib.cost.flops import gpt_block_forward_flops
from course_lib.cost.memory import check_zero_args
from course_lib.dist.trace import Span


def paper_comm_volume(stage: int) -> int:
    """Elements each rank moves per step, in units of Ψ, as the ZeRO paper §7 counts them.

    Stage 0 all-reduces the gradients: a reduce-scatter plus an all-gather, 2Ψ. Stages 1 and 2 do
    the same two halves apart: reduce-scatter the gradients (each rank needs only its shard to
    update), then all-gather the updated parameters: 2Ψ, no more than DDP. Stage 3 all-gathers
    every layer's parameters twice (forward and backward) and reduce-scatters gradients: 3Ψ.
    """
    check_zero_args(1, 1, stage)
    return 3 if stage == 3 else 2


def zero_comm_bytes(n_params: int, dp_size: int, stage: int, bytes_per_element: int = 2) -> float:
    """Bytes each rank sends per step with ring collectives: paper volume · (N-1)/N · Ψ · bytes.

    A ring reduce-scatter or all-gather of S bytes sends (N-1)/N·S per rank (lab 01), so the
    paper's 2Ψ and 3Ψ become 2(N-1)/N·Ψ and 3(N-1)/N·Ψ elements; they tend to 2Ψ, 3Ψ for large N.
    """
    check_zero_args(n_params, dp_size, stage)
    return paper_comm_volume(stage) * (dp_size - 1) / dp_size * n_params * bytes_per_element


def _ring_factors(n: int) -> dict[str, float]:
    """Bytes a rank sends (and receives) per byte of counted payload, for each ring collective in a group of n."""
    return {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter_single": (n - 1) / n,
        "reduce_scatter_tensor": (n - 1) / n,
        "all_gather_single": n - 1,
        "all_gather_into_tensor": n - 1,
    }


def ring_wire_bytes(counts: dict, group_size: int, group: str | None = None) -> float:
    """Per-rank bytes on the wire, with ring algorithms, for counts from :mod:`course_lib.dist.counter`.

    ``counts`` is ``CommCounter.as_dict()`` ({"op@group": {"calls", "bytes"}}), whose bytes are the
    payload a rank hands over: the whole tensor of an all-reduce, the input of a reduce-scatter,
    this rank's shard of an all-gather. A ring sends 2(N-1)/N of an all-reduce's payload,
    (N-1)/N of a reduce-scatter's input and (N-1) times an all-gather's shard.
    """
    factor = _ring_factors(group_size)
    total = 0.0
    for key, entry in counts.items():
        op, grp = key.split("@")
        if group is not None and grp != group:
            continue
        if op not in factor:
            raise ValueError(
                f"ring_wire_bytes knows all-reduce, reduce-scatter and all-gather; the counts "
                f"also hold {op!r}: count that region separately"
            )
        total += factor[op] * entry["bytes"]
    return total


def ring_comm_bytes(
    batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp_size: int, bytes_per_element: int = 4
) -> dict:
    """What one rank sends per attention layer, all of it on its one link (to its right neighbour).

    A K/V block is b·h_kv·(s/N)·d elements. Forward: K and V each make N-1 hops. Backward: K and V
    make N-1 hops again, and dK, dV (fp32 accumulators) make N hops, the last one bringing them home.
    """
    block = batch * n_kv_heads * (seq_len // cp_size) * head_dim
    hops = cp_size - 1
    grad_hops = cp_size if cp_size > 1 else 0
    return {
        "forward_sends": 2 * hops,
        "forward_bytes": 2 * hops * block * bytes_per_element,
        "backward_sends": 2 * hops + 2 * grad_hops,
        "backward_bytes": 2 * hops * block * bytes_per_element + 2 * grad_hops * block * 4,
    }


def ulysses_comm_bytes(
    batch: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int, cp_size: int, bytes_per_element: int = 4
) -> dict:
    """Communication of one attention layer, forward (the backward moves the same again).

    An activation of this rank in the sequence layout holds b·(s/N)·heads·d elements; that is the
    payload it hands to the all-to-all (what ``course_lib.dist.counter`` counts). Forward: q and
    out (h heads), k and v (h_kv heads):

        payload per rank  P = b·(s/N)·(2h + 2h_kv)·d·bytes   (h_kv = h: 4·b·s·h·d/N, the paper's 4Nh/P)
        to each peer          P/N        (the all-to-all cuts it into N equal pieces)
        leaving the rank      P·(N-1)/N  (the piece for itself stays)

    It falls as 1/N: grow N with s and each device's traffic stays constant. Jacobs et al. set this
    against Megatron-LM's sequence parallelism, whose all-gathers and reduce-scatters of the full
    activation do not shrink with the degree.
    """
    payload = batch * (seq_len // cp_size) * (2 * n_heads + 2 * n_kv_heads) * head_dim * bytes_per_element
    return {
        "forward_calls": 4,
        "backward_calls": 4,
        "payload_per_rank": payload,
        "per_peer": payload // cp_size,
        "leaving_rank": payload * (cp_size - 1) // cp_size,
    }


def comm_elements(scheme: str, b: int, h: int, n: int, p: int, d: int = 1) -> float:
    """Payload elements per device for one forward Y = X·W under ``scheme``: what the counter records.

    Payload is not traffic (a broadcast's root counts its block too, an all-gather counts only the
    rank's shard): to compare schemes use :func:`tp_received_elements`.
    """
    if scheme == "1d":
        return b * n
    if scheme == "2d":
        q = grid_side(p, 2, "2d")
        return q * (b * h + h * n) / q**2
    if scheme == "2.5d":
        if p % d:
            raise ValueError(f"2.5D tensor parallel needs p = d·q²: depth d={d} does not divide p={p}")
        q = grid_side(p // d, 2, "2.5d")
        return q * (b * h / d + h * n) / q**2
    if scheme == "3d":
        q = grid_side(p, 3, "3d")
        return (b * h + h * n) / q**3 + b * n / q**2
    raise ValueError(f"unknown scheme {scheme!r}: use '1d', '2d', '2.5d' or '3d'")


def tp_received_elements(scheme: str, b: int, h: int, n: int, p: int, d: int = 1) -> float:
    """Elements one device receives for one forward Y = X·W (X [b, h], W [h, n]) on p devices.

    The same quantity for every scheme, with ring all-reduce and reduce-scatter and any broadcast
    (a non-root receives the block once, whatever the algorithm):

    * 1D (Megatron row parallel, Shoeybi et al. 2019 §3): all-reduce of the [b, n] output,
      2(p-1)/p · bn; it does not fall with p.
    * 2D (SUMMA; Optimus, Xu et al. 2021), p = q²: in q steps a device receives the q-1 blocks of X
      of its grid row and the q-1 blocks of W of its grid column: (q-1)(bh + hn)/q².
    * 2.5D (Tesseract, Wang et al. 2021), p = d·q²: SUMMA on a b/d slice: (q-1)(bh/d + hn)/q².
    * 3D (Bian et al. 2021), p = q³: all-gathers of X and W shards, (q-1)(bh + hn)/q³, and a ring
      reduce-scatter of the [b/q, n/q] partial product, (q-1)/q · bn/q²: (q-1)(bh + hn + bn)/q³.

    :func:`received_bytes` derives the same from counted payloads (tests/test_lecture02.py).
    """
    if scheme == "1d":
        return 2 * (p - 1) / p * b * n
    if scheme == "2d":
        q = grid_side(p, 2, "2d")
        return (q - 1) * (b * h + h * n) / q**2
    if scheme == "2.5d":
        if p % d:
            raise ValueError(f"2.5D tensor parallel needs p = d·q²: depth d={d} does not divide p={p}")
        q = grid_side(p // d, 2, "2.5d")
        return (q - 1) * (b * h / d + h * n) / q**2
    if scheme == "3d":
        q = grid_side(p, 3, "3d")
        return (q - 1) * (b * h + h * n + b * n) / q**3
    raise ValueError(f"unknown scheme {scheme!r}: use '1d', '2d', '2.5d' or '3d'")


def received_bytes(counts: dict, group_size: int) -> float:
    """Bytes one rank receives, from counted payloads (``CommCounter.as_dict()``) in groups of ``group_size``.

    Ring all-reduce: 2(N-1)/N of the payload; ring reduce-scatter: (N-1)/N of the input; all-gather:
    the N-1 other shards, (N-1) × the rank's shard (any algorithm). Broadcast: a non-root receives
    the whole block, the root nothing; the counter does not record the root, so the factor (N-1)/N
    holds for a sequence of broadcasts in which every member of the group is root equally often —
    as in SUMMA, where each rank is root once in its row and once in its column per matmul.
    """
    # in a ring every rank receives what it sends; a broadcast adds the non-roots' share
    factor = {**_ring_factors(group_size), "broadcast": (group_size - 1) / group_size}
    total = 0.0
    for key, entry in counts.items():
        op = key.split("@")[0]
        if op not in factor:
            raise ValueError(f"received_bytes knows {sorted(factor)}; the counts also hold {op!r}")
        total += factor[op] * entry["bytes"]
    return total


# ----------------------------------------------------------------------------------------------
# The alpha-beta model of collectives (lectures 02, 07 and 08)
# ----------------------------------------------------------------------------------------------
# Hockney (1994, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
# Computing 20(3)): one message of S bytes between two processes takes α + S·β, α the fixed cost of
# a message (software, NIC, switch: the latency), β the seconds per byte (1 / bandwidth). A
# collective is a schedule of such messages; Thakur, Rabenseifner & Gropp (2005, "Optimization of
# Collective Communication Operations in MPICH", IJHPCA 19(1)) count, for each algorithm, the
# messages on its critical path and the bytes they carry. Every model below has the form
#
#     t = a·α + b·β,   a = messages in sequence,  b = bytes on the critical path
#
# linear in (α, β), so one least-squares fit serves them all (fit_alpha_beta). Thakur et al. add
# γ per byte for a reduction's arithmetic; here it is folded into a fitted β (the sum runs at memory
# speed, like the copy it follows). S is the buffer the formula is written for: the whole buffer
# of an all-reduce, the gathered output of an all-gather, the input of a reduce-scatter, one rank's
# input of an all-to-all, the message of a send.


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


def bucketed_all_reduce_seconds(
    total_bytes: int, bucket_bytes: int, world_size: int, alpha: float, beta: float
) -> float:
    """All-reduce ``total_bytes`` as consecutive ring all-reduces of ``bucket_bytes`` (the last one smaller).

    Each bucket pays the ring's 2(N-1)·α again, the bytes cost the same in total: small buckets are
    all latency, one big bucket cannot start before the whole backward is done (Li et al. 2020, §3.2).
    """
    full, rest = divmod(total_bytes, bucket_bytes)
    sizes = [bucket_bytes] * full + ([rest] if rest else [])
    return sum(ring_all_reduce_seconds(s, world_size, alpha, beta) for s in sizes)


def ddp_step_timeline(
    bucket_bytes: list[int],
    backward_seconds: list[float],
    forward_seconds: float,
    optimizer_seconds: float,
    world_size: int,
    alpha: float,
    beta: float,
    overlap: bool,
) -> list[Span]:
    """One modelled DDP step on one rank, as spans that ``plots.data_parallel.ddp_timeline`` draws.

    ``bucket_bytes[k]`` is bucket k in launch order; ``backward_seconds[k]`` the autograd time that
    produces its gradients. One communication channel: bucket k starts when it is complete (with
    ``overlap``; after the whole backward without) and when bucket k-1 has finished. The optimizer
    runs once autograd and every all-reduce are done (Li et al. 2020, DDP's overlap).
    """
    if len(bucket_bytes) != len(backward_seconds):
        raise ValueError("one backward time per bucket: backward_seconds[k] produces bucket k")
    spans = [Span("forward", "compute", 0.0, forward_seconds)]
    t, ready = forward_seconds, []
    for seconds in backward_seconds:
        t += seconds
        ready.append(t)
    backward_end = t
    spans.append(Span("backward", "compute", forward_seconds, backward_end))
    free = 0.0
    for k, nbytes in enumerate(bucket_bytes):
        start = max(ready[k] if overlap else backward_end, free)
        free = start + ring_all_reduce_seconds(nbytes, world_size, alpha, beta)
        spans.append(Span("all_reduce", "comm", start, free, {"bucket": k, "bytes": nbytes}))
    if free > backward_end:
        spans.append(Span("ddp.wait", "compute", backward_end, free))
    end = max(free, backward_end)
    spans.append(Span("optimizer", "compute", end, end + optimizer_seconds))
    return spans


def tp_block_comm_share(
    tokens: int,
    hidden: int,
    seq_len: int,
    tp_size: int,
    flops_per_second: float,
    alpha: float,
    beta: float,
    bytes_per_element: int = 2,
) -> dict:
    """Forward of one transformer block under Megatron 1D TP: compute and communication seconds per rank.

    Compute: :func:`course_lib.cost.flops.gpt_block_forward_flops`, 24·T·h²·(1 + s/(6h)), split over t ranks.
    Communication: the two g all-reduces of a [T, h] activation (Shoeybi et al. 2019, §3), each a
    ring all-reduce (:func:`ring_all_reduce_seconds`); nothing overlapped. Returns
    {"compute_s", "comm_s", "share"}, share = comm / (comm + compute).
    """
    compute = gpt_block_forward_flops(tokens, hidden, seq_len) / tp_size / flops_per_second
    comm = tp_layer_comm_seconds(tokens, hidden, tp_size, alpha, beta, bytes_per_element, backward=False)
    return {"compute_s": compute, "comm_s": comm, "share": comm / (comm + compute)}


def tp_layer_comm_seconds(
    tokens: int,
    hidden: int,
    tp_size: int,
    alpha: float,
    beta: float,
    bytes_per_element: int = 2,
    backward: bool = True,
) -> float:
    """Seconds of Megatron 1D TP's all-reduces in one transformer layer (Shoeybi et al. 2019, §3):
    forward, the two g (after attention's row-parallel projection and after the MLP's), each a ring
    all-reduce of the [T, h] activation; backward, the two f, the same size again. Nothing overlapped:
    4 · :func:`ring_all_reduce_seconds` (T·h·bytes) with ``backward``, 2 without."""
    calls = 4 if backward else 2
    return calls * ring_all_reduce_seconds(tokens * hidden * bytes_per_element, tp_size, alpha, beta)


def grid_side(p: int, k: int, scheme: str) -> int:
    """q with q**k = p: the side of the square (k = 2) or cube (k = 3) grid of p devices."""
    q = round(p ** (1 / k))
    if q**k != p:
        raise ValueError(
            f"{scheme} tensor parallel needs a perfect {'square' if k == 2 else 'cube'} "
            f"number of devices, got p={p}: use {sorted({max(1, q - 1) ** k, q**k, (q + 1) ** k})}"
        )
    return q


def check_ulysses_divisible(n_heads: int, n_kv_heads: int, degree: int, seq_len: int | None = None) -> None:
    """Raise a ValueError naming the constraint Ulysses needs and how to meet it."""
    divisors = lambda x: [i for i in range(1, x + 1) if x % i == 0]
    if n_heads % degree:
        raise ValueError(
            f"Ulysses degree {degree} does not divide {n_heads} query heads: after the all-to-all each rank "
            f"attends with whole heads; choose a degree among {divisors(n_heads)}, or add ring attention for the rest"
        )
    if n_kv_heads % degree:
        raise ValueError(
            f"Ulysses degree {degree} does not divide {n_kv_heads} key/value heads (grouped-query attention): "
            f"each rank needs whole K/V heads for its query heads; choose a degree among {divisors(n_kv_heads)}, "
            f"or repeat the K/V heads (k.repeat_interleave) up to a multiple of {degree}, which costs all-to-all bytes"
        )
    if seq_len is not None and seq_len % degree:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the Ulysses degree {degree}: every rank must hold "
            f"s/N tokens; pad the sequence to a multiple of {degree}"
        )


def ep_dispatch_bytes(tokens: int, hidden: int, n_experts_per_token: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank's dispatch all-to-all carries for one MoE layer: every token goes once to each
    of its k experts, a row of ``hidden`` elements each (GShard, Lepikhin et al. 2020, §2.2). The
    combine sends as many rows back. DeepSeek-V3 (§3.3) dispatches in FP8 (1 byte, plus scales)
    and combines in BF16 (2 bytes). Of these, (ep - 1)/ep leave the rank when experts are spread
    evenly; the rest stays local."""
    if min(tokens, hidden, n_experts_per_token) < 0 or bytes_per_element <= 0:
        raise ValueError("tokens, hidden and n_experts_per_token must be >= 0 and bytes_per_element > 0")
    return tokens * n_experts_per_token * hidden * bytes_per_element


def padded_dispatch_bytes(n_experts: int, capacity: int, hidden: int, bytes_per_element: float = 2) -> float:
    """Bytes one rank's dispatch carries when every expert receives a fixed buffer of ``capacity`` rows
    (GShard §2.2, Switch §2.2: an all-to-all of equal splits, rows of unused slots sent as zeros):
    E · C · hidden · bytes, whatever the routing. With C = ⌈cf · T · k / E⌉ that is about cf times the
    T · k rows of :func:`ep_dispatch_bytes`, which a padding-free dispatch (uneven splits, as
    course_lib's all_to_all_single with split sizes; X-MoE's "no-padding" routing) sends instead —
    and the padded one also drops what overflows C."""
    if min(n_experts, capacity, hidden) < 0 or bytes_per_element <= 0:
        raise ValueError("n_experts, capacity and hidden must be >= 0 and bytes_per_element > 0")
    return n_experts * capacity * hidden * bytes_per_element


def fp8_bytes_per_element(block: int = 128, scale_bytes: int = 4) -> float:
    """Bytes per element of an FP8 dispatch: the 1-byte e4m3 value plus one fp32 scale per ``block``
    channels, 1 + 4/block (DeepSeek-V3 report, §3.3.2: activations scaled per 1 x 128 tile; §3.3.3:
    the dispatch all-to-all carries them in FP8). Against fp32 rows that is (1 + 4/block)/4 of the
    bytes: 0.2578 at block 128, 0.3125 for a per-row scale of a 64-wide row. Pass it to
    :func:`ep_dispatch_bytes` as ``bytes_per_element``."""
    if block < 1 or scale_bytes < 0:
        raise ValueError(f"block={block} channels per scale must be >= 1 and scale_bytes={scale_bytes} >= 0")
    return 1 + scale_bytes / block


def ep_comm_time(
    tokens: int,
    hidden: int,
    n_experts_per_token: int,
    bytes_dispatch: float,
    bytes_combine: float,
    bandwidth: float,
    remote_fraction: float = 1.0,
) -> float:
    """Seconds of one MoE layer's dispatch + combine all-to-alls on one rank's link: the bytes of
    :func:`ep_dispatch_bytes` each way, times the share that leaves the rank, over ``bandwidth``
    (bytes/s). Bandwidth-bound: no latency term, no overlap with compute (DualPipe hides it)."""
    if bandwidth <= 0 or not 0 <= remote_fraction <= 1:
        raise ValueError(
            f"bandwidth must be > 0 (bytes/s) and 0 <= remote_fraction <= 1; got {bandwidth}, {remote_fraction}"
        )
    moved = ep_dispatch_bytes(tokens, hidden, n_experts_per_token, bytes_dispatch)
    moved += ep_dispatch_bytes(tokens, hidden, n_experts_per_token, bytes_combine)
    return remote_fraction * moved / bandwidth


# ----------------------------------------------------------------------------------------------
# Node-limited routing and the links of one accelerator (lecture 07; seed 001 §2.3.2, §4.2-4.3)
# ----------------------------------------------------------------------------------------------


def expected_distinct_nodes(n_experts: int, n_nodes: int, top_k: int, node_limit: int | None = None) -> float:
    """Expected number of distinct nodes a token's ``top_k`` experts live on, the experts drawn uniformly
    without replacement from ``n_experts`` spread evenly over ``n_nodes`` (E/n to a node):

        𝔼[D] = n · (1 − C(E − E/n, k) / C(E, k))

    by linearity: a node is missed when all k experts fall among the other E − E/n, with probability
    C(E − E/n, k)/C(E, k). With IB traffic deduplicated per node (one crossing per node, then NVLink
    forwarding; Zhao et al., *Insights into DeepSeek-V3*, ISCA 2025, §4.3) this is the IB copies per
    token; DeepSeek-V3 (E = 256, n = 8, k = 8): 5.30 instead of 8.

    ``node_limit`` M (DeepSeek-V3's node-limited routing, report §2.1.2): the same formula over the M
    allowed nodes, M · (1 − C((M−1)·E/n, k) / C(M·E/n, k)), as if the k experts were uniform among
    their M·E/n experts. DeepSeek's rule picks the M nodes *for* their strongest experts, so each
    chosen node almost always receives one: the measured mean lies between this value and M (3.63 and
    4 for M = 4; measured ≈ 3.97: :func:`course_lib.measure.collectives.route_distinct_nodes`), and
    never above M, which is the bound that matters.
    """
    if n_experts % n_nodes or not 0 < top_k <= n_experts:
        raise ValueError(f"need E={n_experts} divisible by n_nodes={n_nodes} and 1 <= k={top_k} <= E")
    per_node = n_experts // n_nodes
    nodes = n_nodes if node_limit is None else node_limit
    if not 1 <= nodes <= n_nodes or top_k > nodes * per_node:
        raise ValueError(f"node_limit={node_limit}: need 1 <= M <= {n_nodes} and M·E/n >= k={top_k}")
    pool = nodes * per_node
    return nodes * (1 - math.comb(pool - per_node, top_k) / math.comb(pool, top_k))


def distinct_nodes_variance(n_experts: int, n_nodes: int, top_k: int) -> float:
    """Variance of the distinct nodes D of :func:`expected_distinct_nodes` (no node limit), from the
    indicators of the nodes hit: Var D = Σ_i Var 1_i + Σ_{i≠j} Cov(1_i, 1_j), with P(miss i) = q₁ =
    C(E − m, k)/C(E, k) and P(miss i and j) = q₂ = C(E − 2m, k)/C(E, k), m = E/n:

        Var D = n(1 − q₁) + n(n − 1)(1 − 2q₁ + q₂) − (n(1 − q₁))²

    sd/√T is then the standard error of a mean over T independent tokens."""
    m, total = n_experts // n_nodes, math.comb(n_experts, top_k)
    q1 = math.comb(n_experts - m, top_k) / total
    q2 = math.comb(n_experts - 2 * m, top_k) / total if n_nodes > 1 else 0.0
    mean = n_nodes * (1 - q1)
    return mean + n_nodes * (n_nodes - 1) * (1 - 2 * q1 + q2) - mean**2


LINK_LATENCY_S = {"scale_up": 3.33e-6, "scale_out": 2.8e-6}
"""α per message on each link: seed 001 Table 5, CPU-side end-to-end latency of a 64-byte transfer on
DeepSeek's H800 cluster (NVLink 3.33 µs, InfiniBand within one leaf switch 2.8 µs; 3.7 µs across
leaves). Used for every accelerator: the hardware table has bandwidths only."""


def link_alpha_beta(accelerator, link: str = "scale_up", alpha: float | None = None) -> tuple[float, float]:
    """(α, β) of one GPU's ``link`` ("scale_up": NVLink and kin; "scale_out": its share of the NICs) from
    :mod:`course_lib.cost.hardware`: β = 1 / per-direction bandwidth, α from :data:`LINK_LATENCY_S`
    unless given. ``accelerator``: a name in the table or an :class:`~course_lib.cost.hardware.Accelerator`."""
    if link not in LINK_LATENCY_S:
        raise ValueError(f"link {link!r}: choose 'scale_up' or 'scale_out'")
    acc = hardware.get(accelerator)
    figure = acc.scale_up_bytes_per_s if link == "scale_up" else acc.scale_out_bytes_per_s
    if figure.value is None:
        raise ValueError(f"{acc.name} has no published {link} bandwidth ({figure.source}): pass one explicitly")
    return (LINK_LATENCY_S[link] if alpha is None else alpha), 1 / figure.value


def tp_step_comm_seconds(
    accelerator,
    tokens: int,
    hidden: int,
    n_layers: int,
    tp_size: int,
    bytes_per_element: int = 2,
    alpha: float | None = None,
    backward: bool = True,
) -> float:
    """Seconds of TP all-reduces in one step on ``accelerator``'s scale-up link: ``n_layers`` ×
    :func:`tp_layer_comm_seconds` (2 all-reduces of T·h forward, 2 backward), the TP group inside one
    node. The bytes do not depend on the hardware, so the bandwidth-bound part scales as 1/bandwidth:
    an H800 (200 GB/s each way) takes 450/200 = 2.25× an H100's time, less only the latency terms."""
    a, b = link_alpha_beta(accelerator, "scale_up", alpha)
    return n_layers * tp_layer_comm_seconds(tokens, hidden, tp_size, a, b, bytes_per_element, backward)


def ep_layer_comm_seconds(
    tokens: int,
    hidden: int,
    top_k: int,
    ib_copies: float,
    scale_up_bytes_per_s: float,
    scale_out_bytes_per_s: float,
    bytes_dispatch: float = 1,
    bytes_combine: float = 2,
) -> dict:
    """One MoE layer's dispatch + combine on one GPU, over both of its links (seed 001 §4.3):

    * InfiniBand: each token crosses it ``ib_copies`` times — k without deduplication (each expert its
      own copy: seed 001's "8t"), the distinct nodes it reaches with it
      (:func:`expected_distinct_nodes`), at most M with node-limited routing —
      :func:`ep_comm_time` with k → ib_copies on the scale-out bandwidth;
    * NVLink: inside a node the copy is forwarded to each expert's GPU, at most k copies a token (the
      one landing on its expert's GPU needs no hop): :func:`ep_comm_time` on the scale-up bandwidth.

    The two links run at once (DeepEP overlaps them), so the layer takes the slower:
    {"ib_s", "nvlink_s", "seconds": max}. Bandwidth-bound, as :func:`ep_comm_time`: with
    ib_copies = k = 9, 32 tokens of 7K, FP8 dispatch and BF16 combine at 50 GB/s, ib_s is seed 001
    §2.3.2's 120.96 µs.
    """
    if not 0 <= ib_copies <= top_k:
        raise ValueError(f"ib_copies={ib_copies} per token must lie in 0..top_k={top_k}")
    ib = ep_comm_time(tokens, hidden, 1, bytes_dispatch, bytes_combine, scale_out_bytes_per_s) * ib_copies
    nvlink = ep_comm_time(tokens, hidden, top_k, bytes_dispatch, bytes_combine, scale_up_bytes_per_s)
    return {"ib_s": ib, "nvlink_s": nvlink, "seconds": max(ib, nvlink)}


def step_comm_on(
    accelerator,
    *,
    tokens: int,
    hidden: int,
    n_layers: int,
    tp_size: int,
    top_k: int,
    ib_copies: float,
    moe_tokens: int | None = None,
    bytes_per_element: int = 2,
    bytes_dispatch: float = 1,
    bytes_combine: float = 2,
    passes: int = 2,
) -> dict:
    """TP and EP communication of one step on ``accelerator``, every figure from the hardware table.

    TP: :func:`tp_step_comm_seconds` for ``tokens`` per TP group (2 all-reduces forward, 2 backward,
    when ``passes`` = 2; forward only with 1). EP: ``passes`` × ``n_layers`` ×
    :func:`ep_layer_comm_seconds` for ``moe_tokens`` per GPU (default ``tokens``; the backward moves
    the same bytes as the forward, gradients instead of activations). Returns {"tp_s", "ep_s",
    "ep_ib_s", "ep_nvlink_s"}: what the same model and batch cost on different parts.
    """
    if passes not in (1, 2):
        raise ValueError(f"passes={passes}: 1 (forward, inference) or 2 (forward and backward, training)")
    acc = hardware.get(accelerator)
    up, out = acc.scale_up_bytes_per_s.value, acc.scale_out_bytes_per_s.value
    if up is None or out is None:
        raise ValueError(f"{acc.name} lacks a published scale-up or scale-out bandwidth")
    tp = tp_step_comm_seconds(acc, tokens, hidden, n_layers, tp_size, bytes_per_element, backward=passes == 2)
    ep = ep_layer_comm_seconds(
        tokens if moe_tokens is None else moe_tokens, hidden, top_k, ib_copies, up, out, bytes_dispatch, bytes_combine
    )
    scale = passes * n_layers
    return {
        "tp_s": tp,
        "ep_s": scale * ep["seconds"],
        "ep_ib_s": scale * ep["ib_s"],
        "ep_nvlink_s": scale * ep["nvlink_s"],
    }


# ----------------------------------------------------------------------------------------------
# Gradient compression: bytes per rank per bucket (course_lib.optim.compression)
# ----------------------------------------------------------------------------------------------
# Each is the payload this rank hands to the collective for one bucket, what course_lib.dist.counter
# counts: this rank's message for an all-gather (it *receives* W-1 such messages; received_bytes
# converts), the whole tensor for an all-reduce. Uncompressed, a bucket of n fp32 gradients is 4n.


def topk_comm_bytes(k: int, value_bytes: int = 4, index_bytes: int = 4) -> int:
    """Top-K (Stich et al. 2018; Lin et al. 2018, DGC §3): k (value, index) pairs, k·(value + index)
    bytes, all-gathered (indices differ per rank, so the messages cannot be summed on the way)."""
    if k < 0:
        raise ValueError(f"k={k} coordinates must be >= 0")
    return k * (value_bytes + index_bytes)


def qsgd_comm_bytes(n: int, level_bytes: int = 1, norm_bytes: int = 4) -> int:
    """QSGD (Alistarh et al. 2017, §3.1) with s ≤ 127 levels: one int8 signed level per coordinate
    and one fp32 norm per bucket, n + 4 bytes (the paper's Elias coding of the levels, §3.2, would
    send fewer; this is the fixed-width version)."""
    return n * level_bytes + norm_bytes


def sign_comm_bytes(n: int, scale_bytes: int = 4) -> int:
    """1-bit sign (Seide et al. 2014; 1-bit Adam, Tang et al. 2021): n bits packed 8 per byte and
    one fp32 scale, ⌈n/8⌉ + 4 bytes: 32× less than fp32 for large n."""
    return -(-n // 8) + scale_bytes


def powersgd_comm_bytes(
    shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float = 2.0, bytes_per_element: int = 4
) -> int:
    """PowerSGD (Vogels et al. 2019, Alg. 1), one bucket holding gradients of ``shapes``: each seen as
    an n × m matrix (n = shape[0], m = the rest) is sent as P (n × r) and Q (m × r), r = min(n, m, rank),
    r·(n + m) elements, when r(n + m)·min_compression_rate < nm (torch's rule); else as its n·m
    elements. All three are all-reduced, so the bytes do not grow with W."""
    total = 0
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:])
        r = min(n, m, rank)
        total += r * (n + m) if r * (n + m) * min_compression_rate < n * m else n * m
    return total * bytes_per_element
