"""Bytes each rank moves, per collective and per strategy: pure arithmetic on payloads.

Every formula here is set beside a measurement from :mod:`course_lib.dist.counter` in a test. N is the
group's size (``group_size``, ``dp_size``, ``cp_size``: the ranks of one collective).

* Counted payloads to wire bytes (lab 01): a ring all-reduce sends 2(N-1)/N of its payload, a ring
  reduce-scatter (N-1)/N of its input, a ring all-gather (N-1) times the rank's shard (Thakur,
  Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH", the
  ring algorithms): :func:`ring_wire_bytes` (sent), :func:`received_bytes` (received, with broadcasts);
* ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", §7): 2Ψ per step for stages 0-2, 3Ψ for stage 3: :func:`paper_comm_volume`,
  :func:`zero_comm_bytes`;
* ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers") and Ulysses (Jacobs
  et al. 2023, "DeepSpeed Ulysses", §3), lecture 03: :func:`ring_comm_bytes`,
  :func:`ulysses_comm_bytes`, and the divisibility Ulysses needs, :func:`check_ulysses_divisible`
  (the validator :mod:`course_lib.cost.activations` and :mod:`course_lib.parallel.context.ulysses`
  share);
* 1D/2D/2.5D/3D tensor-parallel matmuls Y = X·W, X [b, h], W [h, n] on p devices (Megatron,
  Shoeybi et al. 2019 §3; Optimus, Xu et al. 2021; Tesseract, Wang et al. 2021, depth d; 3D, Bian
  et al. 2021), lecture 02: :func:`comm_elements` (payload, what the counter records),
  :func:`tp_received_elements` (what a device receives), :func:`grid_side` (q with q² or q³ = p).

Time, not bytes, is :mod:`course_lib.cost.alpha_beta`. Tested in tests/measure/test_memory.py (ZeRO),
tests/lectures/test_lecture02.py (tensor-parallel schemes), tests/parallel/context/test_ring_attention.py and tests/parallel/context/test_ulysses.py.
"""

from __future__ import annotations

from course_lib.cost.memory import check_zero_args


def _ring_factors(group_size: int) -> dict[str, float]:
    """Bytes a rank sends (and receives) per byte of counted payload, for each ring collective in a group of N."""
    return {
        "all_reduce": 2 * (group_size - 1) / group_size,
        "reduce_scatter_single": (group_size - 1) / group_size,
        "reduce_scatter_tensor": (group_size - 1) / group_size,
        "all_gather_single": group_size - 1,
        "all_gather_into_tensor": group_size - 1,
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


def check_ulysses_divisible(n_heads: int, n_kv_heads: int, cp_size: int, seq_len: int | None = None) -> None:
    """Raise a ValueError naming the constraint Ulysses needs and how to meet it: the degree ``cp_size``
    divides the query heads, the K/V heads and (when given) the sequence length (Jacobs et al. 2023, §3)."""
    divisors = lambda x: [i for i in range(1, x + 1) if x % i == 0]
    if n_heads % cp_size:
        raise ValueError(
            f"Ulysses degree {cp_size} does not divide {n_heads} query heads: after the all-to-all each rank "
            f"attends with whole heads; choose a degree among {divisors(n_heads)}, or add ring attention for the rest"
        )
    if n_kv_heads % cp_size:
        raise ValueError(
            f"Ulysses degree {cp_size} does not divide {n_kv_heads} key/value heads (grouped-query attention): "
            f"each rank needs whole K/V heads for its query heads; choose a degree among {divisors(n_kv_heads)}, "
            f"or repeat the K/V heads (k.repeat_interleave) up to a multiple of {cp_size}, which costs all-to-all bytes"
        )
    if seq_len is not None and seq_len % cp_size:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the Ulysses degree {cp_size}: every rank must hold "
            f"s/N tokens; pad the sequence to a multiple of {cp_size}"
        )


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

    :func:`received_bytes` derives the same from counted payloads (tests/lectures/test_lecture02.py).
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


def grid_side(p: int, k: int, scheme: str) -> int:
    """q with q**k = p: the side of the square (k = 2) or cube (k = 3) grid of p devices."""
    q = round(p ** (1 / k))
    if q**k != p:
        raise ValueError(
            f"{scheme} tensor parallel needs a perfect {'square' if k == 2 else 'cube'} "
            f"number of devices, got p={p}: use {sorted({max(1, q - 1) ** k, q**k, (q + 1) ** k})}"
        )
    return q
