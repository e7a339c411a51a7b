"""One layer's activation bytes per rank under each tensor-parallel layout (dense, TP, TP+SP), measured
and set beside :func:`course_lib.cost.activations.activation_bytes_per_layer` (lecture 03;
Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models*, 2022, §4, Table 2).

Each rank measures its own block with :func:`course_lib.measure.saved_tensors.measure_block`. On CUDA the
bytes differ from the CPU model by :func:`~course_lib.cost.activations.sdpa_extra_bytes`
(:func:`model_vs_measurement` adds it to the model of the device that measured).
Tested in tests/measure/test_activation_memory.py and tests/measure/test_device_measure.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.cost.activations import activation_bytes_per_layer, sdpa_extra_bytes
from course_lib.dist import Mesh, device, launch
from course_lib.measure.saved_tensors import measure_block
from course_lib.model.config import ModelConfig
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPBlock
from course_lib.parallel.tensor.sequence import shard_sequence


def _measure_rank(cfg, batch, seq_lens, settings, attention, seed):
    """On each rank of a TP group: measured bytes for every (seq_len, sequence_parallel) asked for,
    and the type of the rank's device."""

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dev = device()
    dense = Transformer(cfg).to(dev)
    out = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        for s in seq_lens:
            # host: drawn on the CPU generator so that every rank (and every machine) holds the same x
            x = torch.randn(batch, s, cfg.d_model, generator=torch.Generator().manual_seed(seed + s)).to(dev)
            x = shard_sequence(x, mesh.group("tp")) if sp else x
            out[(s, sp)] = measure_block(block, x, dense.rope_cos[:s], dense.rope_sin[:s], attention)
    return out, dev.type


def _measure(cfg, batch, seq_lens, tp_size, settings, attention, seed, on) -> tuple[dict, str]:
    """:func:`measure_layer_bytes`'s numbers and the type of the device that measured them."""
    seq_lens = list(seq_lens)
    if tp_size > 1:
        if on is not None:
            raise ValueError(f"device={on!r} with tp_size={tp_size}: the ranks measure on their own device()")
        return launch(_measure_rank, tp_size, cfg, batch, seq_lens, tuple(settings), attention, seed, timeout=120)[0]
    dev = torch.device(on) if on is not None else device()
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(dev)
    out = {}
    for s in seq_lens:
        x = torch.randn(batch, s, cfg.d_model, device=dev)
        out[(s, False)] = measure_block(dense.layers[0], x, dense.rope_cos[:s], dense.rope_sin[:s], attention)
    return out, dev.type


def measure_layer_bytes(
    cfg: ModelConfig,
    batch: int,
    seq_lens,
    tp_size: int = 1,
    settings=(False,),
    attention: str = "flash",
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict:
    """Measured bytes per rank for one layer: {(seq_len, sequence_parallel): bytes}.

    tp_size = 1 measures ``course_lib.model.transformer.Block`` in this process, on ``device``
    (default :func:`course_lib.dist.device`: in a process no launcher started, a notebook kernel or
    pytest, that is cuda:0 on a GPU machine; pass ``device="cpu"`` for the CPU kernels' bytes that
    :mod:`course_lib.cost.activations` counts). More launches tp_size ranks that each measure their
    ``TPBlock`` on their own device (one launch for all seq_lens and settings; rank 0's numbers,
    since every rank holds the same shapes). On CUDA the bytes differ from the model by
    :func:`~course_lib.cost.activations.sdpa_extra_bytes`.
    """
    return _measure(cfg, batch, seq_lens, tp_size, settings, attention, seed, device)[0]


def model_vs_measurement(
    cfg: ModelConfig, seq_lens, batch: int = 1, tp_size: int = 2, attention: str = "flash"
) -> list[dict]:
    """For the lecture: one row per (layout, seq_len) with the model's and the measured bytes per rank.

    Layouts: "dense" (t = 1), "TP" and "TP+SP" (t = ``tp_size``). Two launches at most in all.
    Each row's model is that of the device which measured it (``"device"``: the dense layer here,
    the TP layouts on the ranks): :func:`activation_bytes_per_layer` plus ``sdpa_extra_bytes``,
    which is 0 on CPU.
    """
    dense, dense_on = _measure(cfg, batch, seq_lens, 1, (False,), attention, 0, None)
    measured = {("dense", s): (v, dense_on) for (s, _), v in dense.items()}
    split, split_on = _measure(cfg, batch, seq_lens, tp_size, (False, True), attention, 0, None)
    for (s, sp), v in split.items():
        measured[("TP+SP" if sp else "TP", s)] = (v, split_on)
    rows = []
    for (layout, s), (got, on) in sorted(measured.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        t = 1 if layout == "dense" else tp_size
        model = activation_bytes_per_layer(cfg, batch, s, t, layout == "TP+SP", attention)
        model += sdpa_extra_bytes(cfg, batch, s, attention, on, t)
        rows.append(
            {
                "layout": layout,
                "tp": t,
                "seq_len": s,
                "device": on,
                "model_bytes": model,
                "measured_bytes": got,
                "rel_error": (got - model) / model,
            }
        )
    return rows
