"""Memory and communication of data-parallel training: ZeRO's accounting, and a census to check it.

The ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054, §3.1 and §5) splits what a data-parallel rank holds into *model
states* — parameters, gradients, optimizer state — and *residual states* (activations, temporary
buffers, fragmentation). This module is about the model states:

* :func:`zero_model_state_bytes` — bytes per rank that each ZeRO stage predicts (paper Figure 1);
* :func:`zero_comm_bytes`, :func:`paper_comm_volume` — bytes each rank moves per step (paper §7);
* :func:`ring_wire_bytes` — turns the payloads that :mod:`course_lib.dist.counter` records into
  the bytes a ring algorithm puts on the wire, so a measurement can be set next to the formula;
* :func:`held_bytes` — a census of the tensors a rank actually holds (parameters, gradients,
  optimizer state), by storage, so the formula is checked against memory that really exists;
* :func:`measure_stages` (and :func:`measured_state_bytes`, :func:`measured_comm_bytes`) — one
  step of each ZeRO stage on N ranks, measured bytes held and moved next to the formulas: the
  bars of lecture 02.

:mod:`course_lib.zero` implements the stages; ``tests/test_memory.py`` checks formula against census.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.dist import counter, device, launch

STAGES = (0, 1, 2, 3)


def _check(n_params: int, dp_size: int, stage: int) -> None:
    if not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"ZeRO stage {stage!r} does not exist: choose 0 (plain data parallel), 1 (optimizer "
                         "state sharded), 2 (+ gradients) or 3 (+ parameters)")
    if not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"n_params must be a positive int (Ψ, the model's parameter count), got {n_params!r}")
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int (N_d, the data-parallel ranks), got {dp_size!r}")


def zero_model_state_bytes(n_params: int, dp_size: int, stage: int, k: int = 12,
                           param_bytes: int = 2, grad_bytes: int = 2) -> float:
    """Bytes of model states per rank under ZeRO ``stage`` (ZeRO paper §3.1, §5.1-5.3, Figure 1).

    Mixed-precision Adam keeps, per parameter, a 16-bit parameter (2 bytes) and a 16-bit gradient
    (2 bytes) for the forward and backward passes, and K bytes of optimizer state: fp32 master
    weight, momentum and variance, K = 4 + 4 + 4 = 12. With Ψ parameters and N = ``dp_size`` ranks:

        stage 0 (DDP):               (2 + 2 + K)·Ψ           = 16Ψ
        stage 1 (P_os):   2Ψ + 2Ψ +   K·Ψ/N                  optimizer state sharded
        stage 2 (P_os+g): 2Ψ +      (2 + K)·Ψ/N              + gradients
        stage 3 (P_os+g+p):         (2 + 2 + K)·Ψ/N          + parameters

    The paper's example: Ψ = 7.5B, N = 64 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB. Pure fp32 training
    has no separate master copy: ``param_bytes=4, grad_bytes=4, k=8`` (momentum and variance).

    Where DeepSpeed's own estimators count differently (``estimate_zero2_model_states_mem_needs``,
    ``estimate_zero3_model_states_mem_needs`` in deepspeed.runtime.zero), and why: both charge 18Ψ/N
    for the sharded part. DeepSpeed hands its optimizer an fp32 gradient for the fp32 master weights,
    and keeps that fp32 gradient partition for the whole step: ZeRO-2 counts it next to the 16-bit
    gradient shard (2 + 4 + 12 = 18 instead of the paper's 2 + 12, so +4Ψ/N); ZeRO-3 counts it
    instead of the 16-bit one (2 + 4 + 12 = 18 instead of 2 + 2 + 12, so +2Ψ/N). ZeRO-3 adds
    4·(largest layer's parameters) for the 16-bit parameters and gradients of the layer being
    computed — a temporary buffer, a *residual* state in the paper's terms — and the CPU-side
    figures carry an ``additional_buffer_factor`` of 1.5 for staging buffers. These are costs of an
    implementation, not of the algorithm; this function is the algorithm (course_lib.zero casts a
    shard's gradient to fp32 only for the duration of the update, as the paper accounts).
    """
    _check(n_params, dp_size, stage)
    n = dp_size
    params = param_bytes * n_params / (n if stage >= 3 else 1)
    grads = grad_bytes * n_params / (n if stage >= 2 else 1)
    optim = k * n_params / (n if stage >= 1 else 1)
    return params + grads + optim


def paper_comm_volume(stage: int) -> int:
    """Elements each rank moves per step, in units of Ψ, as the ZeRO paper §7 counts them.

    Stage 0 all-reduces the gradients: a reduce-scatter plus an all-gather, 2Ψ. Stages 1 and 2 do
    the same two halves apart: reduce-scatter the gradients (each rank needs only its shard to
    update), then all-gather the updated parameters: 2Ψ, no more than DDP. Stage 3 all-gathers
    every layer's parameters twice (forward and backward) and reduce-scatters gradients: 3Ψ.
    """
    _check(1, 1, stage)
    return 3 if stage == 3 else 2


def zero_comm_bytes(n_params: int, dp_size: int, stage: int, bytes_per_element: int = 2) -> float:
    """Bytes each rank sends per step with ring collectives: paper volume · (N-1)/N · Ψ · bytes.

    A ring reduce-scatter or all-gather of S bytes sends (N-1)/N·S per rank (lab 01), so the
    paper's 2Ψ and 3Ψ become 2(N-1)/N·Ψ and 3(N-1)/N·Ψ elements; they tend to 2Ψ, 3Ψ for large N.
    """
    _check(n_params, dp_size, stage)
    return paper_comm_volume(stage) * (dp_size - 1) / dp_size * n_params * bytes_per_element


def ring_wire_bytes(counts: dict, dp_size: int, group: str | None = None) -> float:
    """Per-rank bytes on the wire, with ring algorithms, for counts from :mod:`course_lib.dist.counter`.

    ``counts`` is ``CommCounter.as_dict()`` ({"op@group": {"calls", "bytes"}}), whose bytes are the
    payload a rank hands over: the whole tensor of an all-reduce, the input of a reduce-scatter,
    this rank's shard of an all-gather. A ring sends 2(N-1)/N of an all-reduce's payload,
    (N-1)/N of a reduce-scatter's input and (N-1) times an all-gather's shard.
    """
    n = dp_size
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter_single": (n - 1) / n, "reduce_scatter_tensor": (n - 1) / n,
        "all_gather_single": n - 1, "all_gather_into_tensor": n - 1,
    }
    total = 0.0
    for key, entry in counts.items():
        op, grp = key.split("@")
        if group is not None and grp != group:
            continue
        if op not in factor:
            raise ValueError(f"ring_wire_bytes knows all-reduce, reduce-scatter and all-gather; the counts "
                             f"also hold {op!r}: count that region separately")
        total += factor[op] * entry["bytes"]
    return total


def held_bytes(*roots, max_depth: int = 6) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots``: a census of what is held.

    ``nn.Module`` roots contribute their parameters and the parameters' ``.grad`` (not buffers:
    the RoPE tables are neither parameters, gradients nor optimizer state). Any other object is
    searched through tensors, lists, tuples, dicts and its ``__dict__``. Storages are counted once
    each, at their allocated size (``untyped_storage().nbytes()``): a view costs nothing extra, a
    freed ZeRO-3 buffer (storage resized to 0) costs 0, padding costs what it costs.
    """
    seen_storages: dict[int, int] = {}
    seen_objects: set[int] = set()

    def add(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return
        seen_storages[storage.data_ptr()] = max(seen_storages.get(storage.data_ptr(), 0), storage.nbytes())

    def visit(obj, depth: int) -> None:
        if id(obj) in seen_objects or depth > max_depth:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            add(obj)
            if obj.grad is not None:
                add(obj.grad)
        elif isinstance(obj, nn.Module):
            for p in obj.parameters():
                visit(p, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                visit(v, depth + 1)

    for root in roots:
        visit(root, 0)
    return sum(seen_storages.values())


# ------------------------------------------------------------------ measured, for lecture 02's bars


def _measure_rank(config: str, precision: str, stages, seed: int, batch: int, seq: int) -> dict:
    from course_lib import configs
    from course_lib.model import Transformer
    from course_lib.zero import Zero  # zero.py imports this module: import it only when measuring

    out = {}
    for stage in stages:
        torch.manual_seed(seed)
        model = Transformer(configs.get(config)).to(device())
        zero = Zero(model, stage, lr=1e-3, precision=precision)
        g = torch.Generator().manual_seed(seed + dist.get_rank())
        x = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=g).to(device())
        with counter.count() as c:
            model.loss(x[:, :-1], x[:, 1:]).backward()
            zero.step()
        out[stage] = {"state": zero.model_state_bytes(), "counts": c.as_dict(),
                      "n_params": sum(u.numel for u in zero.units)}
    return out


def measured_state_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured bytes of model states on rank 0, formula)} — one bar pair per stage."""
    return {s: (m["state_bytes"], m["state_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measured_comm_bytes(world_size: int = 2, config: str = "tiny", precision: str = "bf16") -> dict[int, tuple]:
    """{stage: (measured ring bytes rank 0 moves in one step, formula)} — one bar pair per stage."""
    return {s: (m["comm_bytes"], m["comm_formula"]) for s, m in measure_stages(world_size, config, precision).items()}


def measure_stages(world_size: int = 2, config: str = "tiny", precision: str = "bf16", stages=STAGES,
                   seed: int = 0, batch: int = 2, seq: int = 16) -> dict[int, dict]:
    """Run one training step of each stage on ``world_size`` ranks; measurement next to formula.

    Returns {stage: {"n_params", "state_bytes" (rank 0's census), "state_bytes_per_rank",
    "state_formula", "state_breakdown" (params/grads/optimizer), "comm_bytes" (rank 0, ring wire
    bytes from the counter), "comm_bytes_per_rank", "comm_formula"}} — the numbers for a bar chart.
    """
    per_rank = launch(_measure_rank, world_size, config, precision, tuple(stages), seed, batch, seq, timeout=120)
    width = {"fp32": dict(k=8, param_bytes=4, grad_bytes=4), "bf16": dict(k=12, param_bytes=2, grad_bytes=2)}[precision]
    result = {}
    for stage in stages:
        psi = per_rank[0][stage]["n_params"]
        comm = [ring_wire_bytes(r[stage]["counts"], world_size) for r in per_rank]
        result[stage] = {
            "n_params": psi,
            "state_bytes": per_rank[0][stage]["state"]["total"],
            "state_bytes_per_rank": [r[stage]["state"]["total"] for r in per_rank],
            "state_breakdown": {k: v for k, v in per_rank[0][stage]["state"].items() if k != "total"},
            "state_formula": zero_model_state_bytes(psi, world_size, stage, **width),
            "comm_bytes": comm[0], "comm_bytes_per_rank": comm,
            "comm_formula": zero_comm_bytes(psi, world_size, stage, width["param_bytes"]),
        }
    return result
