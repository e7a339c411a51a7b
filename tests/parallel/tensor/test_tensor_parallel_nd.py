"""2D / 2.5D / 3D tensor parallel matmuls: equal to X·W, and their counted traffic equals the formulas."""

import pytest
import torch

from course_lib.cost.collective_bytes import comm_elements
from course_lib.dist import counter, device, launch
from course_lib.parallel.tensor.nd import matmul_2d, matmul_2p5d, matmul_3d

B, H, N = 16, 8, 12  # tokens, hidden in, hidden out: divisible by every grid used below


def _operands():
    g = torch.Generator().manual_seed(0)  # host: the same operands in the parent and on every rank
    # Integer-valued: block products summed in any order are exact, so equality can be exact.
    return torch.randint(-4, 5, (B, H), generator=g).float(), torch.randint(-4, 5, (H, N), generator=g).float()


def _run(scheme, depth=1):
    x, w = (t.to(device()) for t in _operands())
    fn = {"2d": matmul_2d, "3d": matmul_3d}.get(scheme)
    call = (lambda **k: matmul_2p5d(x, w, depth, **k)) if scheme == "2.5d" else (lambda **k: fn(x, w, **k))
    with counter.count() as c:
        call(assemble=False)
    return call(), c.bytes() // 4  # fp32 elements


@pytest.mark.parametrize("scheme, p, depth", [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_grid_matmul_equals_dense_and_traffic_equals_formula(scheme, p, depth):
    x, w = _operands()
    out = launch(_run, p, scheme, depth, timeout=90)
    for rank, (y, elements) in enumerate(out):
        assert torch.equal(y, x @ w), (
            f"{scheme} on rank {rank}: the blocks do not assemble into X·W; check the block indices"
        )
        want = comm_elements(scheme, B, H, N, p, depth)
        assert elements == want, f"{scheme} rank {rank}: counted {elements} elements, formula says {want}"


def test_traffic_per_device_shrinks_with_the_grid():
    b, h = 8 * 4096, 8192  # a real layer: 8 sequences of 4k tokens, hidden 8192
    assert comm_elements("1d", b, h, h, 64) == b * h, "1D all-reduces the whole [b, n] output of a row-parallel matmul"
    one_d = comm_elements("1d", b, h, h, 64)
    assert comm_elements("2d", b, h, h, 64) < one_d
    assert comm_elements("3d", b, h, h, 64) < comm_elements("2d", b, h, h, 64)
    assert comm_elements("2d", b, h, h, 256) < comm_elements("2d", b, h, h, 64), "2D traffic falls as 1/√p"
    assert comm_elements("1d", b, h, h, 256) == one_d, "1D traffic per device does not fall with p"


@pytest.mark.parametrize(
    "args, why",
    [
        (("2d", 8, 8, 8, 8), "perfect square"),
        (("3d", 8, 8, 8, 4), "perfect cube"),
        (("2.5d", 8, 8, 8, 8, 3), "d=3 does not divide p=8"),
        (("4d", 8, 8, 8, 8), "unknown scheme"),
    ],
)
def test_bad_grids_are_explained(args, why):
    with pytest.raises(ValueError, match=why):
        comm_elements(*args)
