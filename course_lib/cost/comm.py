"""Communication volume: bytes and elements each rank moves, per strategy. Pure arithmetic.

Every formula here is set beside a measurement from :mod:`course_lib.dist.counter` in a test.

* ZeRO (Rajbhandari et al. 2020, §7): :func:`paper_comm_volume`, :func:`zero_comm_bytes`;
* ring collectives (lab 01): :func:`ring_wire_bytes` turns counted payloads into wire bytes;
* ring attention and Ulysses (lecture 03): :func:`ring_comm_bytes`, :func:`ulysses_comm_bytes`;
* 1D/2D/2.5D/3D tensor parallel matmuls (lecture 02): :func:`comm_elements` (payload, what the
  counter records), :func:`tp_received_elements` (what a device receives), :func:`received_bytes`
  (counted payloads turned into received bytes);
* DDP's overlap (lecture 02): :func:`ring_all_reduce_seconds` (the alpha-beta model) and
  :func:`ddp_step_timeline` (a modelled step, buckets all-reduced after or during backward);
* the bucket-size trade-off (lecture 02): :func:`fit_alpha_beta` (α, β from measured all-reduces),
  :func:`bucketed_all_reduce_seconds`;
* 1D tensor parallelism's share of communication as its degree grows (lecture 02):
  :func:`tp_block_comm_share`;
* expert parallelism's dispatch and combine (lecture 03): :func:`ep_dispatch_bytes`,
  :func:`fp8_bytes_per_element` (FP8 dispatch), :func:`ep_comm_time`;
* gradient compression hooks (:mod:`course_lib.optim.compression`): :func:`topk_comm_bytes`,
  :func:`qsgd_comm_bytes`, :func:`sign_comm_bytes`, :func:`powersgd_comm_bytes`.
"""

from __future__ import annotations

import math

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


def ring_all_reduce_seconds(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of a ring all-reduce of ``nbytes``: 2(N-1) steps of α + (nbytes/N)·β.

    α: seconds of fixed cost per message; β: seconds per byte (1 / link bandwidth). The ring's
    reduce-scatter and all-gather each take N-1 steps moving 1/N of the buffer (Thakur et al. 2005;
    lab 01).
    """
    n = world_size
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (alpha + nbytes / n * beta)


def fit_alpha_beta(nbytes: list[float], seconds: list[float], world_size: int) -> tuple[float, float]:
    """Least-squares α, β ≥ 0 so that :func:`ring_all_reduce_seconds` fits measured all-reduce times.

    The model is linear in (α, β): t = 2(N-1)·α + 2(N-1)/N·S·β. A negative α (noise on small
    messages) is clipped to 0 and β refitted alone.
    """
    n = world_size
    xs = [2 * (n - 1) / n * s for s in nbytes]
    c, k = 2 * (n - 1), len(xs)
    mx, my = sum(xs) / k, sum(seconds) / k
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_alpha_beta needs at least two different message sizes")
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sxx
    alpha = (my - beta * mx) / c
    if alpha < 0:
        alpha, beta = 0.0, sum(x * y for x, y in zip(xs, seconds)) / sum(x * x for x in xs)
    return alpha, max(beta, 0.0)


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
    comm = 2 * ring_all_reduce_seconds(tokens * hidden * bytes_per_element, tp_size, alpha, beta)
    return {"compute_s": compute, "comm_s": comm, "share": comm / (comm + compute)}


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
