"""Quantized checkpoints: fp32 tensors stored as int8 with one absmax scale per block.

A checkpoint of AdamW training is mostly fp32 (master weights, m, v: 12 of the 12-14 bytes per
parameter, :func:`course_lib.cost.checkpoint.full_checkpoint_bytes`). Check-N-Run (Eisenman et al.,
NSDI 2022) showed that checkpoints can be quantized; the per-block absmax scaling is that of 8-bit
optimizers (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022), which keep
an outlier from costing the precision of the whole tensor. For a block x of ``block`` elements:

    s = max|x| / 127,    q = round(x / s) ∈ [-127, 127] (int8),    x̂ = q·s

and every element's error |x − x̂| is at most s/2 (plus float32 rounding of x/s and q·s:
``error_bound``). The file holds 1 byte per element and 4 per block
(:func:`course_lib.cost.checkpoint.quantized_checkpoint_bytes`): about a quarter of fp32.

It is lossy, so a run resumed from it is not the uninterrupted run: use it for what tolerates
that (an archive, an evaluation copy, a rollback point), not as the only checkpoint. Adam's v
spans many orders of magnitude and linear int8 sends its small entries to 0, after which the
update m/(√v + ε) of those elements is huge: Dettmers et al. use a non-linear (dynamic) code for
that reason. Here ``skip`` lists keys to keep exact (e.g. those ending in ``exp_avg_sq``).
Tensors that are not fp32 (bf16 parameters, integers) are stored as they are. Entries are per rank
(``quant.<rank>.<key>.q`` / ``.scale``): load at the saving world size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from course_lib.checkpoint import sharded
from course_lib.checkpoint.commit import commit, rank_world, verify_per_rank

BLOCK = 256
_U = 2.0**-24  # unit roundoff of float32


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [numel], scale fp32 [ceil(numel/block)]) of the flattened fp32 tensor ``x``."""
    flat = x.detach().reshape(-1).float()
    pad = -flat.numel() % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    scale = blocks.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: q = 0 whatever s
    q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[: flat.numel()].clone(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x̂ = q·s, flat fp32 of q's length."""
    return q.float() * scale.repeat_interleave(block)[: q.numel()]


def error_bound(scale: torch.Tensor, numel: int, block: int = BLOCK) -> torch.Tensor:
    """Per-element bound on |x − x̂|: s/2 from rounding to an integer, plus float32's rounding of x/s
    (at most 127·u in units of s) and of q·s (at most 127·u·s): s·(1/2 + 254·u), u = 2^-24."""
    return (scale * (0.5 + 254 * _U)).repeat_interleave(block)[:numel]


def _skipped(key: str, skip: Sequence[str]) -> bool:
    return any(key.endswith(s) for s in skip)


def save(
    root: str | os.PathLike,
    step: int,
    state: dict,
    *,
    block: int = BLOCK,
    skip: Sequence[str] = (),
    keep: int | None = None,
) -> Path:
    """Commit ``<root>/step_XXXXXXXX`` with this rank's fp32 tensors of ``state`` quantized (keys
    ending in one of ``skip`` and non-fp32 tensors kept exact). Collective."""
    rank, _ = rank_world()
    entries = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            entries[key] = value
            continue
        mine = sharded.local(value).detach()
        if mine.dtype == torch.float32 and not _skipped(key, skip):
            entries[f"quant.{rank}.{key}.q"], entries[f"quant.{rank}.{key}.scale"] = quantize(mine, block)
        else:
            entries[f"quant.{rank}.{key}.exact"] = mine.clone()
    info = {"block": block, "skip": list(skip)}
    return commit(root, step, lambda d: sharded.write(entries, d), kind="quantized", info=info, keep=keep)


def load(path: str | os.PathLike, state: dict) -> dict:
    """Fill ``state`` in place with the dequantized tensors (and the saved objects). Collective;
    needs the saving world size; returns the manifest."""
    path = Path(path)
    manifest = verify_per_rank(path, "quantized")
    rank = rank_world()[0]
    block, saved = manifest["info"]["block"], sharded.entries(path)
    wanted = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            for name in (f"quant.{rank}.{key}.q", f"quant.{rank}.{key}.scale", f"quant.{rank}.{key}.exact"):
                if name in saved:
                    # host: DCP reads the file into it; copied onto the state's device below
                    wanted[name] = torch.empty(saved[name][0], dtype=saved[name][1])
    sharded.read(path, wanted)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            state[key] = wanted[key]
            continue
        mine = sharded.local(value)
        exact = wanted.get(f"quant.{rank}.{key}.exact")
        if exact is None:
            exact = dequantize(wanted[f"quant.{rank}.{key}.q"], wanted[f"quant.{rank}.{key}.scale"], block)
        with torch.no_grad():
            mine.view(-1).copy_(exact.reshape(-1))
    return manifest
