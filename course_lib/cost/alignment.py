"""Alignment arithmetic: padding to a multiple, and how much of a GPU's GEMM tiles a shape fills
(lecture 01). Pure arithmetic.
"""

from __future__ import annotations


def pad_to_multiple(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ≥ n (how vocabularies and widths get padded)."""
    if n < 0 or multiple < 1:
        raise ValueError(f"need n >= 0 and multiple >= 1, got n={n}, multiple={multiple}")
    return -(-n // multiple) * multiple


def tile_utilisation(m: int, n: int, k: int, tile: tuple[int, int, int] = (128, 128, 64)) -> float:
    """Useful fraction of the multiply-adds a tiled kernel performs for C[m,n] = A[m,k] · B[k,n].

    A GPU matmul kernel covers C with whole tiles and walks k in whole steps; a ragged edge still
    costs a full tile. ``(m·n·k) / (padded m · padded n · padded k)``. The default is a common
    (M, N, K) tile of a tensor-core kernel. Below the tile, NVIDIA's performance guides ask for
    dimensions that are multiples of 16 bytes (8 fp16/bf16 elements, 16 fp8): rows then start on
    aligned addresses and the tensor-core instructions' k-steps divide evenly; older cuBLAS
    versions used no tensor cores at all otherwise. That is the "multiple of 8" rule.
    """
    tm, tn, tk = tile
    return (m * n * k) / (pad_to_multiple(m, tm) * pad_to_multiple(n, tn) * pad_to_multiple(k, tk))
