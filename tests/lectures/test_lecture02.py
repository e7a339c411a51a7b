"""Lecture 02's formulas against counts, and its prose against its code.

* every tensor-parallel scheme's received elements (the one quantity the lecture compares them by)
  equal what ``received_bytes`` derives from the counter's payloads;
* the alpha-beta DDP timeline the lecture draws hides communication under backward;
* the ZeRO part states communication in bytes, like its memory column;
* the DeepSpeed paragraph describes the cell that follows it.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from course_lib.cost.alpha_beta import fit_alpha_beta, ring_all_reduce_seconds
from course_lib.cost.collective_bytes import (
    comm_elements,
    grid_side,
    paper_comm_volume,
    received_bytes,
    tp_received_elements,
)
from course_lib.cost.ddp_timeline import bucketed_all_reduce_seconds, ddp_step_timeline
from course_lib.cost.tp_comm_time import tp_block_comm_share
from course_lib.dist import counter, device, launch
from course_lib.parallel.tensor.nd import matmul_1d, matmul_2d, matmul_2p5d, matmul_3d

LECTURE = Path(__file__).resolve().parents[2] / "lectures" / "02_data_and_tensor_parallelism.ipynb"
B, H, N = 16, 8, 12  # tokens, hidden in, hidden out: divisible by every grid used below


def _count(scheme, depth):
    g = torch.Generator().manual_seed(0)
    # host: drawn with a CPU generator (the same operands on any machine), then moved to the rank's device
    x = torch.randint(-4, 5, (B, H), generator=g).float().to(device())  # integers: block sums are exact
    w = torch.randint(-4, 5, (H, N), generator=g).float().to(device())
    run = {
        "1d": lambda: matmul_1d(x, w),
        "2d": lambda: matmul_2d(x, w, assemble=False),
        "2.5d": lambda: matmul_2p5d(x, w, depth, assemble=False),
        "3d": lambda: matmul_3d(x, w, assemble=False),
    }[scheme]
    with counter.count() as c:
        y = run()
    equal = torch.equal(y, x @ w) if scheme == "1d" else True  # the grids' products: test_tensor_parallel_nd
    return c.as_dict(), equal


@pytest.mark.parametrize("scheme, p, depth", [("1d", 4, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_received_elements_equal_the_counted_traffic(scheme, p, depth):
    # every collective of a scheme runs in groups of one size: the world (1D) or a grid line of q ranks
    group = p if scheme == "1d" else grid_side(p // depth, 3 if scheme == "3d" else 2, scheme)
    want = tp_received_elements(scheme, B, H, N, p, depth)
    for rank, (counts, equal) in enumerate(launch(_count, p, scheme, depth, timeout=90)):
        assert equal, f"{scheme} rank {rank}: the row-parallel matmul does not give X·W"
        payload = sum(e["bytes"] for e in counts.values()) // 4
        assert payload == comm_elements(scheme, B, H, N, p, depth), f"{scheme} rank {rank}: payload {counts}"
        got = received_bytes(counts, group) / 4  # fp32 elements
        assert got == want, f"{scheme} rank {rank}: received {got} elements (from {counts}), formula {want}"


def test_received_elements_are_what_the_lecture_compares():
    b, h = 8 * 4096, 8192
    one_d = tp_received_elements("1d", b, h, h, 64)
    assert one_d == 2 * 63 / 64 * b * h, "1D: a ring all-reduce of the [b, n] output"
    assert tp_received_elements("1d", b, h, h, 512) > one_d, "1D traffic per device does not fall with p"
    assert tp_received_elements("3d", b, h, h, 64) < tp_received_elements("2d", b, h, h, 64) < one_d
    with pytest.raises(ValueError, match="perfect cube"):
        tp_received_elements("3d", b, h, h, 16)


def test_received_bytes_rejects_unknown_collectives():
    with pytest.raises(ValueError, match="all_to_all"):
        received_bytes({"all_to_all_single@world": {"calls": 1, "bytes": 8}}, 2)


def test_alpha_beta_ddp_timeline_hides_communication_under_backward():
    buckets, backward = [1_000_000] * 4, [0.004] * 4
    kw = dict(forward_seconds=0.008, optimizer_seconds=0.001, world_size=2, alpha=2e-5, beta=1e-9)
    after = ddp_step_timeline(buckets, backward, overlap=False, **kw)
    during = ddp_step_timeline(buckets, backward, overlap=True, **kw)
    comm = ring_all_reduce_seconds(1_000_000, 2, 2e-5, 1e-9)
    assert comm == pytest.approx(2 * (2e-5 + 5e5 * 1e-9)), "ring: 2(N-1) steps of α + S/N·β"
    assert after[-1].end == pytest.approx(0.008 + 0.016 + 4 * comm + 0.001), "after backward: nothing hidden"
    assert during[-1].end == pytest.approx(0.008 + 0.016 + comm + 0.001), "overlap: only the last bucket shows"
    starts = [s.start for s in during if s.kind == "comm"]
    assert starts == pytest.approx([0.012, 0.016, 0.020, 0.024]), "each bucket leaves when it is complete"


def test_tp_comm_share_counts_two_all_reduces_against_the_block_flops():
    tokens, h, s = 1024, 512, 256
    one = tp_block_comm_share(tokens, h, s, 1, 1e12, alpha=1e-5, beta=1e-9)
    assert one["comm_s"] == 0 and one["compute_s"] == pytest.approx(24 * tokens * h * h * (1 + s / (6 * h)) / 1e12)
    four = tp_block_comm_share(tokens, h, s, 4, 1e12, alpha=1e-5, beta=1e-9)
    assert four["compute_s"] == pytest.approx(one["compute_s"] / 4), "compute splits over the t ranks"
    assert four["comm_s"] == pytest.approx(2 * ring_all_reduce_seconds(tokens * h * 2, 4, 1e-5, 1e-9)), "two g"
    assert four["share"] == pytest.approx(four["comm_s"] / (four["comm_s"] + four["compute_s"]))


def test_alpha_beta_fit_recovers_the_model_and_buckets_pay_alpha_each():
    sizes = [4096, 65536, 1 << 20, 1 << 22]
    seconds = [ring_all_reduce_seconds(s, 4, 3e-5, 2e-9) for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, seconds, 4)
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-9), "exact data: the fit is exact"
    total = 10 * 4096 + 100
    want = 10 * ring_all_reduce_seconds(4096, 4, alpha, beta) + ring_all_reduce_seconds(100, 4, alpha, beta)
    assert bucketed_all_reduce_seconds(total, 4096, 4, alpha, beta) == pytest.approx(want), "the last bucket is smaller"
    assert fit_alpha_beta([1, 2], [1.0, 3.0], 2) == (0.0, pytest.approx(1.4)), "a negative α is clipped, β refitted"


def _cells():
    return json.loads(LECTURE.read_text())["cells"]


def _markdown_with(text):
    cells = _cells()
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown" and text in "".join(c["source"]):
            return "".join(c["source"]), cells[i + 1 :]
    raise AssertionError(f"no markdown cell of lecture 02 contains {text!r}")


def test_zero_table_states_communication_in_bytes_like_its_memory_column():
    md, _ = _markdown_with("| stage | sharded | bytes per rank |")
    rows = [r for r in md.splitlines() if re.match(r"\| [0-3] ", r)]
    assert len(rows) == 4, rows
    for stage, row in enumerate(rows):
        last = row.strip("| ").split("|")[-1]
        volume = re.findall(r"(\d+)\\Psi", last)[-1]
        assert int(volume) == 2 * paper_comm_volume(stage), (
            f"stage {stage}: the communication column says {volume}Ψ, but the memory column counts bytes: "
            f"the paper's {paper_comm_volume(stage)}Ψ elements of 2 bytes are {2 * paper_comm_volume(stage)}Ψ bytes"
        )


def test_deepspeed_paragraph_describes_the_cell_that_follows():
    md, rest = _markdown_with("### Running DeepSpeed ZeRO-3 on the course model")
    code = "".join(next(c for c in rest if c["cell_type"] == "code")["source"])
    conditional = re.search(r"^if .*(built|exists|is_file)", code, re.M)
    claims_conditional = re.search(r"only \**if", md) or "Otherwise it" in md
    assert bool(conditional) == bool(claims_conditional), (
        "the paragraph says DeepSpeed runs only if its op is built, the cell runs it unconditionally (or vice versa)"
    )
