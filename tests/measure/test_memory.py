"""ZeRO's memory and communication formulas (course_lib.cost) against measurement (course_lib.experiments.lecture02.zero_stages).

Lab 03's checks of bytes held (fp32, 4 ranks) and of ZeRO-3's bytes moved (fp32, 2 ranks) run on
course_lib's Zero in tests/grading/test_lab_checks.py; here every stage is measured, in bf16 and fp32,
through course_lib.experiments.lecture02.zero_stages, the code behind lecture 02's bars.
"""

import pytest
import torch
import torch.nn as nn

from course_lib.cost.collective_bytes import paper_comm_volume, ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero3_gathered_peak_bytes, zero_model_state_bytes
from course_lib.dist.census import held_bytes
from course_lib.experiments.lecture02.zero_stages import (
    measure_stages,
    measured_comm_bytes,
    measured_state_bytes,
    zero3_step_memory,
)
from course_lib.measure.allocations import AllocationTrace

GB = 1e9


def test_formula_reproduces_the_papers_example():
    """ZeRO paper, Figure 1: Ψ = 7.5B parameters, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device."""
    got = [zero_model_state_bytes(7_500_000_000, 64, stage) / GB for stage in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9], f"per-device GB for stages 0-3: {got}"


def test_formula_shapes():
    psi, n = 1000, 4
    assert zero_model_state_bytes(psi, 1, 3) == zero_model_state_bytes(psi, 1, 0) == 16 * psi, (
        "one rank: nothing to shard"
    )
    assert zero_model_state_bytes(psi, n, 2) == 2 * psi + 14 * psi / n
    assert zero_model_state_bytes(psi, n, 0, k=8, param_bytes=4, grad_bytes=4) == 16 * psi, "fp32 Adam: 4+4+8 bytes"
    assert [paper_comm_volume(s) for s in (0, 1, 2, 3)] == [2, 2, 2, 3], "ZeRO paper §7: 2Ψ, 2Ψ, 2Ψ, 3Ψ"
    assert zero_comm_bytes(psi, n, 3, bytes_per_element=2) == 3 * 3 / 4 * psi * 2


def test_deepspeed_estimators_count_an_fp32_gradient_partition_and_a_layer_buffer():
    """DeepSpeed's estimates differ from the paper's by exactly the terms memory.py's docstring names."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    psi, n, layer = 10**9, 8, 10**7
    # abs=1 byte: DeepSpeed computes in float64, exact to ~1e-6 on byte counts of ~1e10
    _, ds2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, cpu_offload=False)
    assert ds2 - zero_model_state_bytes(psi, n, 2) == pytest.approx(4 * psi / n, abs=1), (
        "ZeRO-2: DeepSpeed = paper + an fp32 copy of the gradient partition (4Ψ/N)"
    )
    _, ds3, _ = estimate_zero3_model_states_mem_needs(psi, layer, num_gpus_per_node=n, cpu_offload=False)
    assert ds3 - zero_model_state_bytes(psi, n, 3) == pytest.approx(2 * psi / n + 4 * layer, abs=1), (
        "ZeRO-3: DeepSpeed = paper with an fp32 instead of a 16-bit gradient partition (+2Ψ/N), plus the 16-bit "
        "parameters and gradients of the largest layer (4 bytes each)"
    )


def test_held_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:].view(5, 10)]
    assert held_bytes(views, flat) == 400, "views of one buffer cost the buffer, once"
    freed = torch.zeros(10)
    freed.untyped_storage().resize_(0)
    assert held_bytes(freed) == 0, "a freed (resized to 0) storage holds nothing"
    lin = nn.Linear(4, 3, bias=False)
    lin.weight.grad = torch.zeros(3, 4)
    lin.register_buffer("table", torch.zeros(1000))
    assert held_bytes(lin) == 2 * 12 * 4, "a module: its parameters and their gradients, not its buffers"


def test_ring_wire_bytes_from_counter_payloads():
    counts = {
        "all_reduce@world": {"calls": 1, "bytes": 400},
        "reduce_scatter_single@dp": {"calls": 2, "bytes": 400},
        "all_gather_single@dp": {"calls": 2, "bytes": 100},
    }
    assert ring_wire_bytes(counts, 4) == 2 * 3 / 4 * 400 + 3 / 4 * 400 + 3 * 100
    assert ring_wire_bytes(counts, 4, group="dp") == 3 / 4 * 400 + 3 * 100
    with pytest.raises(ValueError, match="'broadcast'"):
        ring_wire_bytes({"broadcast@world": {"calls": 1, "bytes": 4}}, 2)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="ZeRO stage 5 does not exist"):
        zero_model_state_bytes(100, 2, 5)
    with pytest.raises(ValueError, match="dp_size must be a positive int"):
        zero_model_state_bytes(100, 0, 1)
    with pytest.raises(ValueError, match="n_params must be a positive int"):
        zero_comm_bytes(-1, 2, 1)


# ------------------------------------------------------------------- measured against the formula

_MEASURED = {}


def _measured(world, precision):
    """One launch per (world, precision), shared by the memory and the communication test."""
    if (world, precision) not in _MEASURED:
        _MEASURED[world, precision] = measure_stages(world, "tiny", precision)
    return _MEASURED[world, precision]


CASES = [(2, "bf16"), (2, "fp32"), (4, "bf16")]


@pytest.mark.parametrize("world, precision", CASES)
def test_measured_bytes_per_rank_match_the_formula(world, precision):
    for stage, m in _measured(world, precision).items():
        for rank, measured in enumerate(m["state_bytes_per_rank"]):
            # a count, not a rounding: only padding (< N elements per unit; none in the course model, measured equal)
            assert abs(measured - m["state_formula"]) <= 0.05 * m["state_formula"], (
                f"ZeRO-{stage} ({precision}, N={world}): rank {rank} holds {measured} bytes of parameters, gradients "
                f"and optimizer state; the formula says {m['state_formula']:.0f}. Something is kept whole that "
                f"stage {stage} shards, or a buffer is leaked: breakdown {m['state_breakdown']}"
            )


@pytest.mark.parametrize("world, precision", CASES)
def test_communicated_bytes_per_step_match_the_formula(world, precision):
    for stage, m in _measured(world, precision).items():
        for rank, measured in enumerate(m["comm_bytes_per_rank"]):
            # a count, not a rounding: only padding (< N elements per unit; none in the course model, measured equal)
            assert abs(measured - m["comm_formula"]) <= 0.05 * m["comm_formula"], (
                f"ZeRO-{stage} ({precision}, N={world}): rank {rank} moved {measured:.0f} bytes in one step (ring "
                f"wire bytes from the counter), the formula {paper_comm_volume(stage)}(N-1)/N·Ψ·bytes says "
                f"{m['comm_formula']:.0f}"
            )


def test_lecture_helpers_give_one_bar_pair_per_stage():
    state, comm = measured_state_bytes(2), measured_comm_bytes(2)
    assert sorted(state) == sorted(comm) == [0, 1, 2, 3]
    assert state[0][0] > state[1][0] > state[2][0] > state[3][0], f"each stage holds less than the one before: {state}"
    assert comm[0][0] == comm[1][0] == comm[2][0] < comm[3][0], f"stages 0-2 move 2Ψ, stage 3 3Ψ: {comm}"


# ------------------------------------------------------------------- ZeRO-3's transient memory


def test_gathered_peak_formula():
    sizes = [10, 50, 50, 1, 10]
    assert zero3_gathered_peak_bytes(sizes) == 50, "without prefetch one unit is gathered at a time: the largest"
    assert zero3_gathered_peak_bytes(sizes, 1) == 100, "prefetch 1: the largest pair of consecutive units"
    assert zero3_gathered_peak_bytes(sizes, 2) == 110, "prefetch 2: the largest run of three"
    assert zero3_gathered_peak_bytes(sizes, 9) == 121, "prefetching past the end holds every unit"
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        zero3_gathered_peak_bytes(sizes, -1)
    with pytest.raises(ValueError, match="unit_bytes must be non-negative ints"):
        zero3_gathered_peak_bytes([])


def test_allocation_trace_sees_every_allocation_and_free():
    with AllocationTrace("cpu") as trace:
        with torch.profiler.record_function("two buffers"):
            a = torch.empty(1000)  # 4,000 B
            b = torch.empty(2000)  # 8,000 B
        del a
        c = torch.empty(500)  # 2,000 B
        del b, c
    sizes = [e.nbytes for e in trace.events]
    assert sizes == [4000, 8000, -4000, 2000, -8000, -2000] or sizes == [4000, 8000, -4000, 2000, -2000, -8000], (
        f"the profiler's memory events should be the three allocations and their frees, in order; got {sizes}"
    )
    assert trace.peak() == 12000, f"peak: a and b at once = 12,000 B; got {trace.peak()}"
    (labelled,) = trace.ranges("two ")
    assert [e.nbytes for e in trace.events if e.t_us in labelled] == [4000, 8000], "allocations inside the label"
    assert trace.events[trace.matching_free(0)].nbytes == -4000, "the free that returns a"


def test_zero3_transient_memory_matches_the_formula():
    measured = zero3_step_memory(2, "tiny", (0, 1, 2))
    n_units = len(measured[0]["units"])
    for prefetch, m in measured.items():
        for rank, peak in enumerate(m["gathered_peak_per_rank"]):
            # exact: the gathered buffers are whole units, allocated and freed as units
            assert peak == m["gathered_formula"], (
                f"ZeRO-3 with prefetch={prefetch}: rank {rank} held {peak} B of gathered parameters at once; the "
                f"largest {prefetch + 1} consecutive units hold {m['gathered_formula']} B ({m['units']}, "
                f"{m['unit_bytes']} B). More means a unit is not freed after its forward or after its reduce-scatter"
            )
        assert m["gathers_per_rank"] == [2 * n_units] * 2, (
            f"one step all-gathers each of the {n_units} units twice, prefetch or not; counted {m['gathers_per_rank']}"
        )
        assert m["activations"] == measured[0]["activations"], "prefetch does not change what autograd saves"
        assert m["peak"] >= max(m["activations"], m["gathered_peak"]), (
            f"the step's peak {m['peak']} B must hold at least the activations ({m['activations']} B) and the "
            f"gathered units ({m['gathered_peak']} B)"
        )
    assert measured[0]["peak"] < measured[1]["peak"], "gathering a unit ahead raises the step's peak"
