"""Activation checkpointing (recomputation) of the course model's blocks (lecture 06).

Training keeps, for every layer, the tensors its backward pass reads (the activations): for the
course block about 22 [b, s, d]-sized tensors (:mod:`course_lib.cost.activations`). Checkpointing
keeps fewer and recomputes the rest during the backward pass:

* ``"none"``       keep everything autograd saves.
* ``"full"``       keep only each block's input x; in backward, when the gradient reaches a block,
                   run its forward again (one block's activations alive at a time), then its
                   backward. Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost", §4)
                   keep one input per segment of layers (√L segments: O(√L) memory); one segment per
                   block is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
                   Transformer Models", §5)'s "full activation recomputation": 2·sbh bytes per layer
                   in 16 bits, for one more forward pass (+33% of the step's FLOPs).
* ``"selective"``  torch's selective activation checkpointing (SAC): op by op, keep the outputs of
                   the matmuls and of the attention kernel, recompute the pointwise rest
                   (:func:`selective_policy`).

Each sets ``Block.recompute`` (see :class:`course_lib.model.transformer.Block`), which the block
calls as ``recompute(forward, x, cos, sin)`` when grad is enabled and no KV cache is in use.
Both use non-reentrant checkpointing (``use_reentrant=False``), the implementation torch
recommends: it saves the inputs itself, works with ``torch.autograd.grad`` and with inputs that do
not require grad, and stops recomputing as soon as backward has what it needs ("early stop").

Gradients are bit-equal to those without checkpointing (tests/model/test_recompute.py): the recompute
replays the same kernels on the same inputs in the same order. checkpoint also restores the RNG
state before it recomputes (``preserve_rng_state``, on by default), so a random op (the noisy MoE
router) draws the same numbers twice.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from course_lib.model.transformer import Block

__all__ = ["POLICIES", "SAVED_OPS", "full_recompute", "selective_policy", "selective_recompute", "set_recompute"]

POLICIES = ("none", "full", "selective")

aten = torch.ops.aten
# The ops whose outputs selective checkpointing keeps: the matmuls of every linear layer (a bias-free
# nn.Linear runs aten.mm on a 2-D view; with a bias, aten.addmm), the batched matmuls of the math
# attention kernel (QKᵀ and P·V), and the fused attention kernels, whose outputs (o and the per-row
# log-sum-exp) are what their backward reads. Names that a build of torch lacks are skipped.
SAVED_OPS = frozenset(
    getattr(aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(aten, name)
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save what is expensive to recompute, recompute what is cheap: MUST_SAVE for :data:`SAVED_OPS`,
    PREFER_RECOMPUTE for everything else (norms, RoPE, SiLU, the SwiGLU product, residual adds, copies).

    The trade, per token of one block (d model width, f FFN width): a matmul's output of n columns
    costs 2·k·n FLOPs to recompute and n elements to keep, 2k FLOPs per element kept (k = d or f:
    hundreds to thousands); a pointwise op costs ~1 FLOP per element. The pointwise outputs are most
    of the memory (the norms' normalised copies and outputs, q and k after RoPE, the repeated k and
    v, SiLU's output, the SwiGLU product), so recomputing them frees about half of the block's
    activations for no matmul FLOPs (they cost memory traffic and per-op overhead: time, which
    benchmarks/bench_recompute.py measures). Backward then holds, per block: the input x (kept by
    checkpoint), the outputs of wq, wk, wv, wo, w1, w3, w2 and the attention kernel's o and
    log-sum-exp (:func:`course_lib.cost.activations.recompute_terms` counts them). wo's output is
    kept because ffn_norm's backward needs h = x + wo(·); w2's output is kept although nothing reads
    it (the policy sees ops, not roles; the early-stopped recompute ends before w2).

    FlashAttention is the same idea inside one kernel: it keeps o and the log-sum-exp and
    recomputes the s×s softmax in its backward (Dao et al. 2022, §3.1), which is Korthikanti et
    al.'s selective recomputation (§5) of the attention core. The math kernel keeps the s×s
    scores (QKᵀ is a bmm) and recomputes only the softmax.

    ``MUST_SAVE``, not ``PREFER_SAVE``: torch.compile may override a PREFER_* choice.
    """
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def full_recompute(forward, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """forward(x, cos, sin) under ``torch.utils.checkpoint.checkpoint``: only the inputs are kept."""
    return checkpoint(forward, x, cos, sin, use_reentrant=False)


def selective_recompute(forward, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """forward(x, cos, sin) under selective checkpointing with :func:`selective_policy`."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    return checkpoint(forward, x, cos, sin, use_reentrant=False, context_fn=context_fn)


_RECOMPUTE = {"none": None, "full": full_recompute, "selective": selective_recompute}


def set_recompute(model: torch.nn.Module, policy: str, layers=None) -> list[int]:
    """Set ``policy`` on the blocks ``model.layers[i]`` for i in ``layers`` (default all); the others
    are left as they are. Returns the indices set. ``"none"`` removes checkpointing.

        set_recompute(model, "full")                  every block
        set_recompute(model, "selective", [0, 1])     the first two (e.g. under a memory budget)
    """
    if policy not in POLICIES:
        raise ValueError(
            f"recompute policy {policy!r}: use one of {POLICIES} ('none' keeps every activation, 'full' only "
            "each block's input, 'selective' the matmul and attention outputs)"
        )
    blocks = getattr(model, "layers", None)
    if blocks is None or not all(isinstance(b, Block) for b in blocks):
        raise TypeError(
            f"set_recompute sets Block.recompute on model.layers; {type(model).__name__} has no list of "
            "course_lib.model.transformer.Block there. Pass a course_lib.model.transformer.Transformer"
        )
    indices = list(range(len(blocks))) if layers is None else [int(i) for i in layers]
    bad = [i for i in indices if not 0 <= i < len(blocks)]
    if bad:
        raise IndexError(f"layers {bad} out of range: the model has {len(blocks)} layers (0 … {len(blocks) - 1})")
    for i in indices:
        blocks[i].recompute = _RECOMPUTE[policy]
    return indices
