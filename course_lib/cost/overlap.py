"""When a transfer hides behind compute: ring attention's block-size condition.

At every step of ring attention (Liu, Zaharia & Abbeel 2023, *Ring Attention with Blockwise
Transformers for Near-Infinite Context*) a rank attends its c = s/N local queries to the K/V
block it holds while the next block travels to it. The transfer is hidden when the block's compute
takes at least as long as the transfer:

    compute  4·b·h·c²·d·f FLOPs       (QKᵀ and PV, 2 FLOPs per multiply-add, f = the block's
                                        computed fraction: 1 without a mask, 1/2 for the zigzag
                                        layout's steps after the first, lecture 03 §2.6)
    transfer 2·b·h_kv·c·d·e bytes      (one block of K and one of V, e bytes per element)

    4·b·h·c²·d·f / F  ≥  2·b·h_kv·c·d·e / B    ⇔    c  ≥  (h_kv / h) · (e / 2) · (F / B) / f

with F the FLOP/s the attention kernel reaches and B the link's bytes/s. Batch and head size cancel.
In bf16 (e = 2), without GQA (h_kv = h) and without a mask (f = 1) it is the paper's condition,
block size ≥ F / B; grouped-query attention divides it by h / h_kv, a causal mask that halves each
step's work doubles it. The condition is about the forward: a backward step runs five block matmuls
against the forward's two (S recomputed, dV, dP, dQ, dK: FlashAttention-2, Dao 2023, Alg. 2), 2.5
times the FLOPs for the same K/V transfer, so the forward is the binding case for K/V; the dK/dV hop
of ``course_lib.parallel.context.ring_attention`` does not overlap at all.
"""

from __future__ import annotations


def ring_step_flops(
    batch: int, n_heads: int, block_tokens: int, head_dim: int, computed_fraction: float = 1.0
) -> float:
    """Forward FLOPs of one ring step: c queries against c keys and values, 4·b·h·c²·d·f."""
    return 4 * batch * n_heads * block_tokens**2 * head_dim * computed_fraction


def ring_step_bytes(batch: int, n_kv_heads: int, block_tokens: int, head_dim: int, bytes_per_element: int = 2) -> float:
    """Bytes of one K/V block on the wire in one ring step: K and V, 2·b·h_kv·c·d·e."""
    return 2 * batch * n_kv_heads * block_tokens * head_dim * bytes_per_element


def ring_min_block_tokens(
    n_heads: int,
    n_kv_heads: int,
    flops_per_s: float,
    bytes_per_s: float,
    bytes_per_element: int = 2,
    computed_fraction: float = 1.0,
) -> float:
    """The smallest local length c = s/N at which a step's compute time covers its K/V transfer (module doc).

    ``computed_fraction`` is the share of the c x c block a step computes (1/2 for the zigzag layout).
    """
    if not 0 < computed_fraction <= 1:
        raise ValueError(f"computed_fraction={computed_fraction}: the share of a block computed is in (0, 1]")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} key/value heads")
    return n_kv_heads / n_heads * bytes_per_element / 2 * flops_per_s / bytes_per_s / computed_fraction
