"""2D, 2.5D and 3D tensor parallelism: one matrix product Y = X·W split over a grid of p devices.

Megatron's 1D tensor parallelism (``course_lib.parallel.tensor``) keeps the activation X [b, h]
whole on every device and all-reduces it: each device moves ~2·b·h elements per layer pair, however
large p grows. Splitting X as well as W over a grid makes the traffic per device *shrink* with p.
Here are the three classic grids, each as a real distributed matmul whose communication is counted
by :mod:`course_lib.dist.counter` and checked in the tests against :func:`comm_elements`.

Notation: X is [b, h] (b = tokens of the micro-batch), W is [h, n], Y = X·W is [b, n].

* **2D** (SUMMA, van de Geijn & Watts 1997; as Optimus, Xu et al. 2021): p = q² devices in a q×q
  grid, device (i, j) holds blocks X_ij [b/q, h/q] and W_ij [h/q, n/q]. In step k every row i
  broadcasts X_ik and every column j broadcasts W_kj; device (i, j) accumulates X_ik·W_kj.
  Elements per device handed to broadcasts: q·(bh + hn)/q² = (bh + hn)/√p.
* **2.5D** (Solomonik & Demmel 2011; as Tesseract, Wang et al. 2021): p = d·q², d stacked q×q
  grids. X is split d ways along b, one slice per grid; W is replicated on every grid (memory
  traded for communication). Each grid runs SUMMA on its slice: q·(bh/d + hn)/q².
* **3D** (Agarwal et al. 1995; as in Bian et al. 2021): p = q³, device (i, j, l). Device (i, j, l)
  computes X_il·W_lj and the partial products are summed over l. X_il is stored in q pieces over j
  and all-gathered, W_lj in q pieces over i and all-gathered, and the sum over l is a
  reduce-scatter: shards of bh/q³ and hn/q³ in, bn/q² reduced: (bh + hn)/q³ + bn/q² payload.
  What a device *receives* is (q-1)/q · (bh + hn + bn)/q², i.e. O(p^(-2/3)).

* **1D** (Megatron, Shoeybi et al. 2019), for comparison: :func:`matmul_1d` is the row-parallel
  matmul, h split p ways and the partial [b, n] products all-reduced: 2(p-1)/p·bn received per
  device with a ring, whatever p is.

The counter records payloads per device (counter.py: a broadcast counts its block on every rank,
root included; all-gather counts the rank's shard; reduce-scatter its input), which
:func:`course_lib.cost.collective_bytes.comm_elements` predicts. The quantity to compare schemes by is what a
device *receives*: :func:`course_lib.cost.collective_bytes.tp_received_elements`, and
:func:`course_lib.cost.collective_bytes.received_bytes` derives it from the counted payloads.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.cost.collective_bytes import grid_side


def _groups(shape: tuple[int, ...], axis: int) -> dict[int, object]:
    """rank -> its process group along ``axis`` of the grid arange(p).view(shape) (all ranks create all)."""
    grid = torch.arange(math.prod(shape)).view(shape)  # host: rank numbers, read back with .tolist()
    lines = grid.movedim(axis, -1).reshape(-1, shape[axis])
    mine = {}
    for line in lines.tolist():
        group = dist.new_group(line)
        for r in line:
            mine[r] = (group, line)
    return mine


def _check_split(name: str, size: int, parts: int) -> None:
    if size % parts:
        raise ValueError(f"{name}={size} is not divisible by {parts}: the grid splits it into {parts} equal blocks")


def summa(x_block: torch.Tensor, w_block: torch.Tensor, q: int, offset: int = 0) -> torch.Tensor:
    """2D SUMMA on the q×q grid of ranks offset .. offset+q²-1; returns this rank's Y block.

    Row-major grid: local index r -> (i, j) = divmod(r, q). Every rank of the world must call it
    (group creation is collective), passing its own grid's offset.
    """
    p = dist.get_world_size()
    rows = _groups((p // q**2, q, q), 2)  # ranks sharing (depth, i): a grid row
    cols = _groups((p // q**2, q, q), 1)  # ranks sharing (depth, j): a grid column
    rank = dist.get_rank()
    i, j = divmod(rank - offset, q)
    row_group, row_ranks = rows[rank]
    col_group, col_ranks = cols[rank]
    y = torch.zeros(x_block.shape[0], w_block.shape[1], dtype=x_block.dtype, device=x_block.device)
    for k in range(q):
        x_k = x_block.clone() if j == k else torch.empty_like(x_block)
        w_k = w_block.clone() if i == k else torch.empty_like(w_block)
        dist.broadcast(x_k, src=row_ranks[k], group=row_group)  # X_ik travels along row i
        dist.broadcast(w_k, src=col_ranks[k], group=col_group)  # W_kj travels down column j
        y += x_k @ w_k
    return y


def matmul_1d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Megatron's row-parallel matmul on p ranks: X split along h, W along its rows, Y all-reduced.

    Returns the full Y on every rank (the all-reduce already assembles it).
    """
    p = dist.get_world_size()
    _check_split("h", x.shape[1], p)
    r = dist.get_rank()
    y = x.tensor_split(p, dim=1)[r] @ w.tensor_split(p, dim=0)[r]  # a partial sum of Y
    dist.all_reduce(y)
    return y


def matmul_2d(x: torch.Tensor, w: torch.Tensor, assemble: bool = True) -> torch.Tensor:
    """Every rank passes the full X and W (for the demo) and takes its blocks; returns the full Y
    gathered from all blocks, or with ``assemble=False`` only this rank's block (what is counted)."""
    p = dist.get_world_size()
    q = grid_side(p, 2, "2d")
    for name, size in (("b", x.shape[0]), ("h", x.shape[1]), ("n", w.shape[1])):
        _check_split(name, size, q)
    i, j = divmod(dist.get_rank(), q)
    y_block = summa(_block(x, q, q, i, j), _block(w, q, q, i, j), q)
    return _assemble(y_block, (q, q), (i, j)) if assemble else y_block


def matmul_2p5d(x: torch.Tensor, w: torch.Tensor, depth: int, assemble: bool = True) -> torch.Tensor:
    """2.5D: ``depth`` stacked q×q grids, X split along b over the grids, W replicated."""
    p = dist.get_world_size()
    if p % depth:
        raise ValueError(f"2.5D tensor parallel needs p = d·q²: depth d={depth} does not divide p={p}")
    q = grid_side(p // depth, 2, "2.5d")
    _check_split("b", x.shape[0], depth * q)
    for name, size in (("h", x.shape[1]), ("n", w.shape[1])):
        _check_split(name, size, q)
    k, local = divmod(dist.get_rank(), q * q)
    i, j = divmod(local, q)
    x_slice = x.tensor_split(depth)[k]
    y_block = summa(_block(x_slice, q, q, i, j), _block(w, q, q, i, j), q, offset=k * q * q)
    return _assemble(y_block, (depth * q, q), (k * q + i, j)) if assemble else y_block


def matmul_3d(x: torch.Tensor, w: torch.Tensor, assemble: bool = True) -> torch.Tensor:
    """3D on a q×q×q grid, rank -> (i, j, l) row-major; returns the full Y assembled from shards."""
    p = dist.get_world_size()
    q = grid_side(p, 3, "3d")
    _check_split("b", x.shape[0], q * q)
    _check_split("h", x.shape[1], q)
    _check_split("n", w.shape[1], q * q)
    rank = dist.get_rank()
    i, j, l = rank // (q * q), (rank // q) % q, rank % q  # noqa: E741 - the paper's index l
    along_i, along_j, along_l = (_groups((q, q, q), a)[rank][0] for a in (0, 1, 2))
    # Stored shards: X_il split over j along b, W_lj split over i along n.
    x_shard = _block(x, q, q, i, l).tensor_split(q, dim=0)[j].contiguous()
    w_shard = _block(w, q, q, l, j).tensor_split(q, dim=1)[i].contiguous()
    x_il = torch.empty(q * x_shard.shape[0], x_shard.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_single(x_il, x_shard, group=along_j)
    w_parts = torch.empty(q * w_shard.shape[0], w_shard.shape[1], dtype=w.dtype, device=w.device)
    dist.all_gather_single(w_parts, w_shard, group=along_i)
    w_lj = torch.cat(w_parts.chunk(q, dim=0), dim=1)  # the shards were split along n
    partial = x_il @ w_lj  # [b/q, n/q], to be summed over l
    y_shard = torch.empty(partial.shape[0] // q, partial.shape[1], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(y_shard, partial.contiguous(), group=along_l)
    if not assemble:
        return y_shard
    # y_shard is rows l of block Y_ij; gather the whole Y to check it (not part of the algorithm).
    full = torch.empty(p * y_shard.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_single(full, y_shard.flatten().contiguous())
    pieces = full.view(q, q, q, *y_shard.shape)  # [i, j, l, rows, cols]
    return pieces.permute(0, 2, 3, 1, 4).reshape(x.shape[0], w.shape[1])


def _block(m: torch.Tensor, rows: int, cols: int, i: int, j: int) -> torch.Tensor:
    return m.tensor_split(rows, dim=0)[i].tensor_split(cols, dim=1)[j].contiguous()


def _assemble(block: torch.Tensor, grid: tuple[int, int], where: tuple[int, int]) -> torch.Tensor:
    """All-gather every rank's block and place it; only for checking results against X·W."""
    p = dist.get_world_size()
    everything = torch.empty(p * block.numel(), dtype=block.dtype, device=block.device)
    dist.all_gather_single(everything, block.flatten().contiguous())
    coords = torch.tensor([where], dtype=torch.long, device=block.device)
    all_coords = torch.empty(p * 2, dtype=torch.long, device=block.device)
    dist.all_gather_single(all_coords, coords.flatten())
    out = torch.empty(grid[0] * block.shape[0], grid[1] * block.shape[1], dtype=block.dtype, device=block.device)
    for r, (bi, bj) in enumerate(all_coords.view(p, 2).tolist()):
        out[bi * block.shape[0] : (bi + 1) * block.shape[0], bj * block.shape[1] : (bj + 1) * block.shape[1]] = (
            everything[r * block.numel() : (r + 1) * block.numel()].view(block.shape)
        )
    return out
