"""The device mesh: which ranks talk to which, for each kind of parallelism.

The world's ranks are laid out as a grid ``torch.arange(world_size).view(dp, pp, cp, tp)``: tensor
parallel innermost (its ranks are neighbours — on real machines, GPUs of one NVLink domain, since
TP communicates most), then context parallel, then pipeline stages, data parallel outermost.
A rank's coordinate along one axis is found with ``nonzero()``; its group along that axis is the
line of the grid through it. This is the layout of Megatron-LM and picotron.

Expert parallelism does not add ranks: the ``ep`` ranks that share one set of experts are carved
out of the data-parallel ranks (consecutive along dp), so ``ep`` must divide ``dp``. Expert
weights are then replicated over ``dp // ep`` copies (the "expert data parallel" group).

    mesh = Mesh(dp=2, tp=2)                 # world size 4
    mesh.group("tp"), mesh.rank("tp"), mesh.size("tp"), mesh.coords  # {"dp": 1, "pp": 0, ...}
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.dist import intercept

AXES = ("dp", "pp", "cp", "tp")


class Mesh:
    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, world_size: int | None = None):
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for name, size in {**sizes, "ep": ep}.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh size {name}={size!r} must be a positive integer")
        world_size = world_size if world_size is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        product = dp * pp * cp * tp
        if product != world_size:
            raise ValueError(
                f"mesh dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {product} does not equal the world size {world_size}: "
                f"choose sizes whose product is {world_size}"
            )
        if dp % ep != 0:
            raise ValueError(
                f"expert parallel size ep={ep} does not divide dp={dp}: expert-parallel ranks are carved "
                f"out of the data-parallel ranks, so choose ep among the divisors of {dp}"
            )
        self.sizes = {**sizes, "ep": ep}
        self.world_size = world_size
        self.grid = torch.arange(world_size).view(dp, pp, cp, tp)  # host: rank bookkeeping, read as Python ints
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.coords = {a: int(c) for a, c in zip(AXES, (self.grid == rank).nonzero()[0])}
        self._groups: dict[str, object] = {}
        self._ranks: dict[str, list[int]] = {}
        if dist.is_initialized():
            self._build_groups(rank)

    def lines(self, axis: str) -> list[list[int]]:
        """All the groups along one axis: the lines of the grid parallel to that axis."""
        if axis == "ep":
            # consecutive blocks of `ep` data-parallel ranks, for every (pp, cp, tp) position
            dp_lines = self.lines("dp")
            ep_size = self.sizes["ep"]
            return [line[i : i + ep_size] for line in dp_lines for i in range(0, len(line), ep_size)]
        dim = AXES.index(axis)
        moved = self.grid.movedim(dim, -1).reshape(-1, self.grid.shape[dim])
        return [row.tolist() for row in moved]

    def _build_groups(self, rank: int) -> None:
        # new_group is collective: every rank creates every group, in the same order.
        for axis in (*AXES, "ep"):
            for ranks in self.lines(axis):
                group = dist.new_group(ranks)
                if rank in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks
                    intercept.name_group(group, axis)

    def _check(self, axis: str) -> None:
        if axis not in self.sizes:
            raise KeyError(f"unknown mesh axis {axis!r}: use one of {', '.join(self.sizes)}")

    def group(self, axis: str):
        """This rank's process group along ``axis``."""
        self._check(axis)
        if not self._groups:
            raise RuntimeError("the mesh has no process groups: initialise torch.distributed first")
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks in this rank's group along ``axis``, in group order."""
        self._check(axis)
        return self._ranks[axis] if self._ranks else [0]

    def size(self, axis: str) -> int:
        self._check(axis)
        return self.sizes[axis]

    def rank(self, axis: str) -> int:
        """This rank's index inside its group along ``axis``."""
        self._check(axis)
        if axis == "ep":
            return self.coords["dp"] % self.sizes["ep"]
        return self.coords[axis]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={s}" for a, s in self.sizes.items())
        return f"Mesh({sizes}; world {self.world_size})"
