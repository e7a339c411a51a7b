"""Checkpoints: bytes on disk (full, incremental, quantized) and how often to write one. Pure arithmetic.

What a checkpoint of ZeRO training holds is the model states of :mod:`course_lib.cost.memory`
without the gradients (they are recomputed by the next step): the parameters in their compute
precision, the fp32 master copy when there is one, and Adam's two fp32 moments. Lecture 08b writes
each kind with :mod:`course_lib.checkpoint` and :mod:`course_lib.experiments.lecture08.checkpoint_runs` sets the
files' sizes beside these formulas (tests/checkpoint/test_checkpoint.py).

* :func:`full_checkpoint_bytes` — the payload of a full checkpoint;
* :func:`incremental_checkpoint_bytes` — only the blocks that changed since a base checkpoint
  (Check-N-Run, Eisenman et al., NSDI 2022: write what was modified since the last checkpoint,
  and a full one from time to time);
* :func:`quantized_checkpoint_bytes` — int8 with one absmax scale per block (Check-N-Run also
  quantizes its checkpoints; the per-block absmax normalisation is that of Dettmers et al., "8-bit
  Optimizers via Block-wise Quantization", ICLR 2022, who then use a non-linear 8-bit code where
  this course uses plain linear int8);
* :func:`dcp_file_bytes` — the same payloads as torch.distributed.checkpoint lays them out on disk;
* :func:`young_interval`, :func:`daly_interval`, :func:`checkpoint_overhead` — how often to
  checkpoint given the cost of one and the mean time between failures (Young 1974; Daly 2006).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# torch.distributed.checkpoint's default FileSystemWriter stores every tensor with torch.save into
# its rank's .distcp file: a zip archive per tensor (data.pkl, byteorder, version, the storage record
# aligned to 64 bytes, a central directory). Measured with torch 2.13: 1,513 bytes for an empty
# tensor, at most 1,577 with the alignment padding; an object (an int, pickled bytes) is its pickle
# inside the same framing. This is a property of the file format, not of any paper.
TORCH_SAVE_FRAMING_BYTES = (1_500, 1_600)


def _positive_int(name: str, value, zero_ok: bool = False) -> None:
    if not isinstance(value, int) or value < (0 if zero_ok else 1):
        raise ValueError(f"{name} must be an int >= {0 if zero_ok else 1}, got {value!r}")


def full_checkpoint_bytes(n_params: int, param_bytes: int = 4, master_bytes: int = 0, moment_bytes: int = 8) -> int:
    """Payload of a full checkpoint of AdamW training: Ψ·(param + master + moments) bytes.

    ZeRO paper (Rajbhandari et al. 2020, §3.1) with the gradients left out: fp32 training stores
    4 + 0 + 8 = 12 bytes per parameter (Adam's m and v); bf16 mixed precision 2 + 4 + 8 = 14 (the
    bf16 parameters, the fp32 master weights, the moments). The sum over ranks does not depend on
    the world size: ZeRO shards the state, it does not copy it (stages 1-3).
    """
    _positive_int("n_params", n_params, zero_ok=True)
    return n_params * (param_bytes + master_bytes + moment_bytes)


def quantized_checkpoint_bytes(numels: Iterable[int], block: int, bits: int = 8, scale_bytes: int = 4) -> int:
    """Payload of tensors of ``numels`` elements quantized to ``bits`` with one scale per block:

        sum_t  numel_t·bits/8 + ceil(numel_t / block)·scale_bytes

    Blockwise absmax (after Dettmers et al. 2022): a block's scale is max|x|/127 and each element is
    round(x/scale) in int8; the error of an element is at most scale/2. Against 4 bytes per fp32
    element the ratio tends to (bits/8 + scale_bytes/block)/4: 0.254 for int8 and block = 256.
    """
    _positive_int("block", block)
    total = 0
    for n in numels:
        _positive_int("numel", n, zero_ok=True)
        total += math.ceil(n * bits / 8) + math.ceil(n / block) * scale_bytes
    return total


def incremental_checkpoint_bytes(
    changed_elements: int, changed_blocks: int, bytes_per_element: int, index_bytes: int = 8
) -> int:
    """Payload of an incremental checkpoint: the changed blocks' elements and one index per block.

        changed_elements·bytes_per_element + changed_blocks·index_bytes

    Check-N-Run (Eisenman et al. 2022) saves only the embedding rows touched since the last
    checkpoint; here a block of the flat ZeRO shard plays the row. It pays only where most of the
    state stands still: AdamW moves every parameter and moment that has a gradient (and every one
    under weight decay), so in full training nearly every block changes and an incremental
    checkpoint is a full one plus its indices; in fine-tuning with frozen layers it is the
    trained fraction.
    """
    _positive_int("changed_elements", changed_elements, zero_ok=True)
    _positive_int("changed_blocks", changed_blocks, zero_ok=True)
    return changed_elements * bytes_per_element + changed_blocks * index_bytes


def dcp_file_bytes(payload_bytes: int, items: int) -> tuple[int, int]:
    """(least, most) bytes of the .distcp files holding ``items`` tensors/objects of ``payload_bytes``:
    the payload plus torch.save's framing per item (:data:`TORCH_SAVE_FRAMING_BYTES`). The
    ``.metadata`` file (the global index of every chunk) is not included."""
    low, high = TORCH_SAVE_FRAMING_BYTES
    return payload_bytes + items * low, payload_bytes + items * high


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal time between checkpoints, τ = sqrt(2·C·M) seconds.

    J. W. Young, "A first order approximation to the optimum checkpoint interval", Communications of
    the ACM 17(9), 1974. With C the time to write one checkpoint and M the mean time between
    failures, the time lost per unit of work is about C/τ (writing) + τ/(2M) (on a failure, half an
    interval is redone on average); the derivative vanishes at τ = sqrt(2CM).
    """
    if not checkpoint_s > 0 or not mtbf_s > 0:
        raise ValueError(f"checkpoint_s and mtbf_s must be > 0 seconds, got {checkpoint_s!r}, {mtbf_s!r}")
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", Future Generation Computer Systems 22(3), 2006):

        τ = sqrt(2CM)·[1 + (1/3)·sqrt(C/(2M)) + C/(18M)] − C   for C < 2M,   τ = M otherwise.

    It agrees with Young's when C << M and stays sensible when checkpoints are slow."""
    if not checkpoint_s > 0 or not mtbf_s > 0:
        raise ValueError(f"checkpoint_s and mtbf_s must be > 0 seconds, got {checkpoint_s!r}, {mtbf_s!r}")
    c, m = checkpoint_s, mtbf_s
    if c >= 2 * m:
        return m
    return math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c


def checkpoint_overhead(interval_s: float, checkpoint_s: float, mtbf_s: float) -> float:
    """First-order fraction of time lost, C/τ + τ/(2M) (Young 1974): writing checkpoints every τ
    seconds, plus on average half an interval redone per failure. Minimal at τ = sqrt(2CM), where
    it equals sqrt(2C/M)."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s)
