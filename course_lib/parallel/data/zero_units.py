"""What ZeRO shards: a model cut into units, each unit's parameters one flat buffer in equal shards.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020),
§5: every model state is partitioned into N_d equal parts over the N_d data-parallel ranks, and
rank i owns part i. :mod:`course_lib.parallel.data.zero` does that per *unit*: one child module of
the model (each entry of a ModuleList or Sequential counts as one), for the course Transformer the
embedding, each Block, the final norm and the output layer.

A unit's parameters are laid out back to back in one flat buffer whose length is **padded up to a
multiple of world_size**, so it splits into world_size shards of equal length: reduce-scatter and
all-gather exchange equal-sized pieces (NCCL and gloo require it). A shard boundary may fall inside
a parameter; AdamW is elementwise, so it does not care. The padding (< world_size elements per unit)
is zero and stays zero: its gradient is zero.

Every rank keeps its shards of all units concatenated in *rank-local shard tensors* (the Adam
moments, the master weights, the gradient shard, the parameter shard); a unit's piece of such a
tensor starts at ``Unit.offset``. Tested in tests/parallel/data/test_zero.py.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def padded_size(numel: int, world_size: int) -> int:
    """The smallest multiple of ``world_size`` that is >= ``numel``: every shard gets the same length."""
    return -(-numel // world_size) * world_size


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units: its children, with ModuleList/Sequential entries as units of their own."""
    direct = [name for name, _ in model.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"parameters {direct} are registered on the root module; ZeRO shards per child "
            "module (unit): move them into a submodule"
        )
    found = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            found += [(f"{name}.{i}", c) for i, c in child.named_children()]
        else:
            found.append((name, child))
    found = [(name, module) for name, module in found if any(True for _ in module.parameters())]
    owner: dict[int, str] = {}
    for name, module in found:
        for p in module.parameters():
            if id(p) in owner:
                raise ValueError(
                    f"a parameter is shared by units {owner[id(p)]!r} and {name!r} (tied weights); "
                    "ZeRO shards each unit on its own: untie them or group both modules in one unit"
                )
            owner[id(p)] = name
    if not found:
        raise ValueError("the model has no parameters to shard")
    return found


class Unit:
    """One unit's flat buffers, and where its shard sits in this rank's shard tensors.

    ``full`` (the flat parameters, the name lab 03 uses) and ``padded`` are whole-unit sizes;
    ``shard_numel`` is the length of one rank's shard, ``offset`` where this unit's shard starts in
    the rank-local shard tensors.
    """

    def __init__(self, name: str, module: nn.Module, num_shards: int, offset: int):
        self.name, self.module = name, module
        self.params = list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_size(self.numel, num_shards)
        self.shard_numel = self.padded // num_shards
        self.offset = offset
        self.full = None  # flat parameters (stage 3: allocated only while gathered)
        self.flat_grads = None  # flat gradients, stages 0-1
        self.pending = len(self.params)  # gradients still to arrive in this backward, stages 2-3
        self.reduced = False  # reduce-scattered since the last step, stages 2-3

    def views(self, flat: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its slice of ``flat`` shaped like it) for each parameter of the unit."""
        out, at = [], 0
        for p in self.params:
            out.append((p, flat[at : at + p.numel()].view_as(p)))
            at += p.numel()
        return out

    def shard(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Shard ``index`` of a whole-unit flat buffer (a view)."""
        return flat[index * self.shard_numel : (index + 1) * self.shard_numel]

    def in_local(self, local: torch.Tensor) -> torch.Tensor:
        """This unit's piece of a rank-local shard tensor (a view)."""
        return local[self.offset : self.offset + self.shard_numel]
