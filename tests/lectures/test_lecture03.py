"""Lecture 03's pipeline and overlap arithmetic (course_lib.cost.pipeline, course_lib.cost.overlap), the ring
timeline (course_lib.experiments.lecture03.ring_attention_trace, course_lib.plots.context_parallel), and that the lecture's
long-context memory conclusion counts the micro-batches a 1F1B pipeline keeps in flight.
"""

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from course_lib.cost import activations as am
from course_lib.cost.overlap import ring_min_block_tokens, ring_step_bytes, ring_step_flops
from course_lib.cost.pipeline import in_flight_microbatches
from course_lib.dist.trace import Span
from course_lib.experiments.lecture03.ring_attention_trace import trace_ring_attention
from course_lib.model import configs
from course_lib.plots.context_parallel import comm_intervals, ring_timeline

LECTURE = Path(__file__).resolve().parents[2] / "lectures" / "03_pipeline_sequence_expert_parallelism.ipynb"
GiB = 2**30


def _cell(cell_id: str) -> tuple[str, str]:
    """(source, stored text output) of the lecture cell with this id."""
    cells = {c["id"]: c for c in json.loads(LECTURE.read_text())["cells"]}
    cell = cells[cell_id]
    text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
    return "".join(cell["source"]), text


# ------------------------------------------------------------------------------ in flight


@pytest.mark.parametrize("p", [1, 2, 4, 16])
def test_1f1b_stage_i_holds_p_minus_i_micro_batches(p):
    got = [in_flight_microbatches("1f1b", p, stage) for stage in range(p)]
    assert got == list(range(p, 0, -1)), f"1F1B: stage i runs p - i warm-up forwards (Narayanan et al. 2021), got {got}"


def test_1f1b_is_capped_by_the_micro_batches_of_a_step():
    assert in_flight_microbatches("1f1b", 16, 0, m=8) == 8, "8 micro-batches cannot put 16 in flight"
    assert in_flight_microbatches("1f1b", 16, 15, m=8) == 1
    assert in_flight_microbatches("1f1b", 4, 1, m=16) == 3


def test_gpipe_keeps_all_micro_batches_on_every_stage():
    assert [in_flight_microbatches("gpipe", 4, stage, m=12) for stage in range(4)] == [12] * 4
    with pytest.raises(ValueError, match="pass m"):
        in_flight_microbatches("gpipe", 4, 0)


def test_1f1b_first_stage_holds_every_layer_once():
    """Korthikanti et al. 2022, §4.2.3: L/p layers x p micro-batches = L layers' worth, whatever p."""
    n_layers = 128
    for p in (2, 4, 8, 16, 32):
        assert n_layers // p * in_flight_microbatches("1f1b", p, 0) == n_layers


def test_in_flight_rejects_what_does_not_exist():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        in_flight_microbatches("zero-bubble", 4, 0, 8)
    with pytest.raises(ValueError, match="does not exist"):
        in_flight_microbatches("1f1b", 4, 4)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        in_flight_microbatches("1f1b", 4, 0, m=0)


# ------------------------------------------------------------------- the lecture's conclusion


def test_lecture_first_stage_figure_counts_the_micro_batches_in_flight():
    """§2.1's table: the first stage's figure is p x the one-micro-batch figure, and CP divides that one."""
    source, output = _cell("50e0ce26")
    assert "pipeline.in_flight_microbatches(" in source, "§2.1 should count in-flight micro-batches with cost.pipeline"
    cfg = configs.get("llama-3.1-405b")
    per_layer = am.activation_bytes_per_layer(cfg, 1, 131072, 8, True, "flash", bytes_per_element=2)
    one = per_layer * math.ceil(cfg.n_layers / 16)
    first = one * in_flight_microbatches("1f1b", 16, 0, m=16)
    row = next(line.split() for line in output.splitlines() if line.startswith(" 131072"))
    assert row[-3:] == [f"{one / GiB:.1f}", f"{first / GiB:.0f}", f"{first / 16 / GiB:.1f}"], (
        f"the 128k row should read one micro-batch {one / GiB:.1f} GiB, first stage under 1F1B {first / GiB:.0f} GiB, "
        f"and with CP 16 {first / 16 / GiB:.1f} GiB; it reads {row}"
    )
    prose, _ = _cell("c5579bd2")
    assert "brings it to ~6 GiB" not in prose, (
        "the one-micro-batch conclusion (CP 16 -> ~6 GiB per GPU) is wrong under 1F1B"
    )
    assert "§4.2.3" in prose and "first stage" in prose, "the conclusion should cite the in-flight count"


def test_lecture_micro_batch_cell_shows_the_first_stage():
    source, output = _cell("82cdc8f9")
    assert "pipeline.in_flight_microbatches(" in source
    rows = [line.split() for line in output.splitlines() if line.strip()[:1].isdigit() and "GiB" in line]
    assert [r[:2] for r in rows] == [["1", "16"], ["2", "8"], ["4", "4"]], rows
    assert {r[4] for r in rows} == {"92.0"}, "with 16 sequences a step and m <= p, the first stage holds all 16"


# ------------------------------------------------------------------------- ring overlap


def test_ring_step_flops_are_two_matmuls():
    b, h, c, d = 2, 8, 32, 16
    qk = 2 * c * c * d  # a [c, d] x [d, c] matmul: c*c outputs of d multiply-adds
    pv = 2 * c * d * c  # a [c, c] x [c, d] matmul
    assert ring_step_flops(b, h, c, d) == b * h * (qk + pv)
    assert ring_step_flops(b, h, c, d, computed_fraction=0.5) == b * h * (qk + pv) / 2
    assert ring_step_bytes(b, 4, c, d, 2) == 2 * b * 4 * c * d * 2, "one K and one V block"


@pytest.mark.parametrize(
    ("h", "hkv", "e", "fraction"), [(8, 8, 2, 1.0), (128, 8, 2, 1.0), (128, 8, 2, 0.5), (32, 4, 4, 1.0)]
)
def test_at_the_bound_compute_time_equals_transfer_time(h, hkv, e, fraction):
    flops, bandwidth, b, d = 989e12, 50e9, 1, 128
    c = ring_min_block_tokens(h, hkv, flops, bandwidth, e, fraction)
    compute = ring_step_flops(b, h, c, d, fraction) / flops
    transfer = ring_step_bytes(b, hkv, c, d, e) / bandwidth
    assert compute == pytest.approx(transfer, rel=1e-12), "the bound is where the two times balance"
    longer = 2 * c  # compute grows as c², the transfer as c: a longer block hides it
    assert ring_step_flops(b, h, longer, d, fraction) / flops > ring_step_bytes(b, hkv, longer, d, e) / bandwidth


def test_ring_bound_is_the_papers_without_gqa_and_the_lectures_for_llama():
    assert ring_min_block_tokens(8, 8, 989e12, 450e9) == pytest.approx(989e12 / 450e9), "Liu et al.: c >= F/B"
    cfg = configs.get("llama-3.1-405b")
    assert round(ring_min_block_tokens(cfg.n_heads, cfg.n_kv_heads, 989e12, 450e9)) == 137
    assert round(ring_min_block_tokens(cfg.n_heads, cfg.n_kv_heads, 989e12, 50e9)) == 1236
    assert ring_min_block_tokens(cfg.n_heads, cfg.n_kv_heads, 989e12, 50e9, computed_fraction=0.5) == pytest.approx(
        2 * ring_min_block_tokens(cfg.n_heads, cfg.n_kv_heads, 989e12, 50e9)
    )
    with pytest.raises(ValueError, match="share of a block"):
        ring_min_block_tokens(8, 8, 1.0, 1.0, computed_fraction=0)
    with pytest.raises(ValueError, match="not a multiple"):
        ring_min_block_tokens(8, 3, 1.0, 1.0)


# ------------------------------------------------------------------------- the timeline


def _spans():
    return [
        Span("isend", "comm", 0.0, 3.0),
        Span("irecv", "comm", 0.5, 2.5),
        Span("ring.forward block", "compute", 1.0, 2.0, {"step": 0}),
        Span("isend", "comm", 3.0, 4.0),  # touches the first transfer: a new step, kept apart
        Span("ring.forward block", "compute", 4.0, 5.0, {"step": 1}),
        Span("ring.dkv hop", "comm", 5.0, 5.5),
    ]


def test_comm_intervals_merge_a_steps_transfers_and_keep_steps_apart():
    assert comm_intervals(_spans()) == [(0.0, 3.0), (3.0, 4.0), (5.0, 5.5)]


def test_ring_timeline_draws_compute_and_transfer_lanes():
    fig, ax = plt.subplots()
    ring_timeline([_spans(), _spans()], ax=ax, unit="s")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 compute", "rank 0 in flight", "rank 1 compute", "rank 1 in flight"]
    # per rank: two forward blocks and one dK/dV hop above, one collection of three transfer bars below
    assert len(ax.collections) == 2 * (3 + 1)
    plt.close(fig)
    with pytest.raises(ValueError, match="no spans"):
        ring_timeline([])


def test_traced_ring_attention_marks_every_step():
    spans = trace_ring_attention(2, n_heads=4, n_kv_heads=2, seq_len=32, head_dim=8)
    for rank, rank_spans in enumerate(spans):
        forward = [s.meta["step"] for s in rank_spans if s.name == "ring.forward block"]
        backward = [s.meta["step"] for s in rank_spans if s.name == "ring.backward block"]
        assert forward == backward == [0, 1], f"rank {rank}: one block span per ring step and pass"
        assert len([s for s in rank_spans if s.name == "ring.dkv hop"]) == 2
        sends = [s for s in rank_spans if s.name == "isend"]
        assert len(sends) == 2 + (2 + 4), f"rank {rank}: K, V forward once; backward K, V once and dK, dV twice"
