"""Collectives one rank issues in one tensor-parallel block, TP against TP+SP (lecture 02).

Used again by lectures 03 (collectives per layer) and 09 (Megatron-Core). Tested in
tests/parallel/tensor/test_sequence_parallel.py, tests/parallel/tensor/test_tensor_parallel.py and tests/grading/test_exercises.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import Mesh, counter, device, launch
from course_lib.experiments.third_party import framework_devices
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPBlock, TPTransformer
from course_lib.parallel.tensor.sequence import shard_sequence, sync_sequence_parallel_grads
from course_lib.parallel.tensor.sharded_layers import ColumnParallelLinear, RowParallelLinear


def _count_block_rank(cfg, batch, seq_len, settings, seed):

    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    dense = Transformer(cfg).to(device())
    cos, sin = dense.rope_cos[:seq_len], dense.rope_sin[:seq_len]
    results = {}
    for sp in settings:
        block = TPBlock(dense.layers[0], mesh, sequence_parallel=sp)
        # host: drawn from a CPU generator, so every machine gets the same input; moved to the device
        x = torch.randn(batch, seq_len, cfg.d_model, generator=torch.Generator().manual_seed(seed)).to(device())
        x = (shard_sequence(x, mesh.group("tp")) if sp else x).clone().requires_grad_(True)
        with counter.count() as fwd:
            y = block(x, cos, sin)
        with counter.count() as bwd:
            y.sum().backward()
        with counter.count() as sync:
            sync_sequence_parallel_grads(block, mesh.group("tp")) if sp else None
        results["TP+SP" if sp else "TP"] = {
            "forward": fwd.as_dict(),
            "backward": bwd.as_dict(),
            "norm gradients": sync.as_dict(),
        }
    return results


def collectives_per_layer(cfg, tp_size: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0) -> dict:
    """For the lecture: collectives one rank issues in one ``TPBlock``, TP and TP+SP, from the counter.

    Returns {"TP": {"forward": {...}, "backward": {...}, "norm gradients": {...}}, "TP+SP": {...}},
    each a ``CommCounter.as_dict()`` ({"all_reduce@tp": {"calls": 2, "bytes": ...}, ...}); feed one to
    :func:`course_lib.cost.collective_bytes.ring_wire_bytes` for the ring traffic. One launch of ``tp_size`` ranks.
    """

    return launch(_count_block_rank, tp_size, cfg, batch, seq_len, (False, True), seed, timeout=120)[0]


def _tp_step_rank(n_layers: int, batch: int, seq_len: int, seed: int):
    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(seed)
    cfg = configs.get("tiny", n_layers=n_layers)
    dense = Transformer(cfg).to(device())
    model = TPTransformer.from_dense(dense, mesh)
    gen = torch.Generator().manual_seed(seed + 1)  # host: a CPU generator, so every machine draws the same tokens
    # host: drawn by gen (above), then moved to the device
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen).to(device()) for _ in range(2))
    with counter.count() as fwd:
        loss = model.loss(tokens, targets)
    with counter.count() as bwd:
        loss.backward()
    dense_loss = dense.loss(tokens, targets).item()
    return fwd.calls("all_reduce"), bwd.calls("all_reduce"), fwd.bytes() + bwd.bytes(), loss.item() - dense_loss


def tp_step_collectives(n_layers: int, tp_size: int = 2, batch: int = 2, seq_len: int = 16, seed: int = 0):
    """One training step of the tiny model under 1D TP (vocabulary included), counted on rank 0.

    Returns (forward all-reduces, backward all-reduces, all bytes moved, TP loss − dense loss).
    """
    return launch(_tp_step_rank, tp_size, n_layers, batch, seq_len, seed, timeout=120)[0]


def _versus_megatron_core_rank(d_model: int, hidden: int, seed: int) -> dict:
    import warnings

    with warnings.catch_warnings():  # no Apex / Transformer Engine on a CPU, no CUDA stream tuning: noted, not needed
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear as MegatronColumn
        from megatron.core.tensor_parallel import RowParallelLinear as MegatronRow

        t = dist.get_world_size()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=t)
        # Megatron makes its weights on the current CUDA device unless told to initialise on the CPU: the
        # course's device decides (experiments/third_party.py's rule: CPU ranks over gloo, or cuda:<local rank>)
        rule = framework_devices()
        on = rule.device
        config = ModelParallelConfig(tensor_model_parallel_size=t, use_cpu_initialization=rule.megatron_cpu_init)
        torch.manual_seed(seed)
        fc1, fc2 = torch.nn.Linear(d_model, hidden, bias=False), torch.nn.Linear(hidden, d_model, bias=False)
        fc1, fc2 = fc1.to(on), fc2.to(on)
        group = Mesh(tp=t).group("tp")
        ours = ColumnParallelLinear.from_dense(fc1, group), RowParallelLinear.from_dense(fc2, group)
        zeros = torch.nn.init.zeros_  # the weights are copied from ours below
        theirs = (
            MegatronColumn(d_model, hidden, config=config, init_method=zeros, bias=False, gather_output=False),
            MegatronRow(
                hidden,
                d_model,
                config=config,
                init_method=zeros,
                bias=False,
                input_is_parallel=True,
                skip_bias_add=False,
            ),
        )
        with torch.no_grad():
            for a, b in zip(ours, theirs, strict=True):
                b.weight.copy_(a.weight)
        # host: drawn from a CPU generator, so every machine gets the same input; moved to the device
        x = torch.randn(4, 8, d_model, generator=torch.Generator().manual_seed(seed + 1)).to(on)
        x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y_ours = ours[1](torch.nn.functional.gelu(ours[0](x_ours)))
        hidden_theirs, _ = theirs[0](x_theirs)  # Megatron returns (output, bias) so the bias add can be fused
        y_theirs, _ = theirs[1](torch.nn.functional.gelu(hidden_theirs))
        y_ours.square().sum().backward()
        y_theirs.square().sum().backward()
        parallel_state.destroy_model_parallel()
    return {
        "output": torch.equal(y_ours, y_theirs),
        "input gradient": torch.equal(x_ours.grad, x_theirs.grad),
        "column weight gradient": torch.equal(ours[0].weight.grad, theirs[0].weight.grad),
        "row weight gradient": torch.equal(ours[1].weight.grad, theirs[1].weight.grad),
    }


def versus_megatron_core(tp_size: int = 2, d_model: int = 16, hidden: int = 64, seed: int = 0) -> list[dict]:
    """An MLP, GeLU(X·A)·B, made of course_lib's column- and row-parallel layers and of Megatron-Core's
    (``megatron.core.tensor_parallel``, 0.16.1) with the same weights, both on the course's device
    (CPU initialisation on gloo; see :func:`course_lib.experiments.third_party.framework_devices`).

    Per rank: is each of output, input gradient and the two weight gradients bit-equal? They should be:
    both sides run the same matmuls on the same slices and the same all-reduces.
    """
    return launch(_versus_megatron_core_rank, tp_size, d_model, hidden, seed, timeout=180)
