"""ZeRO's memory and communication formulas (course_lib.cost) against measurement (course_lib.measure.zero).

Lab 03's checks of bytes held (fp32, 4 ranks) and of ZeRO-3's bytes moved (fp32, 2 ranks) run on
course_lib's Zero in tests/test_lab_checks.py; here every stage is measured, in bf16 and fp32,
through course_lib.measure.zero, the code behind lecture 02's bars.
"""

import pytest
import torch
import torch.nn as nn

from course_lib.cost.comm import paper_comm_volume, ring_wire_bytes, zero_comm_bytes
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist.census import held_bytes
from course_lib.measure.zero import measure_stages, measured_comm_bytes, measured_state_bytes

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
