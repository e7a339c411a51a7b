"""The composed model at 256 simulated ranks (course_lib.measure.simulated_ranks) against the planner's terms.

Qwen2.5-72B (80 blocks) on dp × tp × pp = 8 × 8 × 4, built on the meta device and split as the
composed step splits it, one rank at a time under torch's fake process group. What each rank holds
and sends must be what the planner charges for it.
"""

import pytest

from course_lib.cost.alpha_beta import alpha_beta_terms
from course_lib.cost.planner import rank_params
from course_lib.cost.step_time import tp_layer_collectives
from course_lib.measure.simulated_ranks import simulate_ranks
from course_lib.model import configs
from course_lib.parallel.compose import Layout

CFG = configs.get("qwen2.5-72b")
LAYOUT = Layout(dp=8, tp=8, pp=4)
B, S = 1, 4096


@pytest.fixture(scope="module")
def ranks():
    """All 256 ranks built; the step run on the first and last TP rank of every stage of replica 0 and on
    one rank of each other replica (the step is 5x the cost of building: 15 ranks keep this under 30 s)."""
    world = LAYOUT.dp * LAYOUT.tp * LAYOUT.pp
    per_replica = LAYOUT.pp * LAYOUT.tp
    stepped = [s * LAYOUT.tp + t for s in range(LAYOUT.pp) for t in (0, LAYOUT.tp - 1)]
    stepped += [d * per_replica + d % per_replica for d in range(1, LAYOUT.dp)]
    return simulate_ranks(CFG, LAYOUT, range(world), micro_batch=B, seq_len=S, stepped=stepped)


def test_the_world_is_256_ranks_and_each_replica_builds_the_same_stages(ranks):
    assert len(ranks) == LAYOUT.dp * LAYOUT.tp * LAYOUT.pp == 256 and CFG.n_params() > 8e9
    assert len({tuple(r["coords"].values()) for r in ranks}) == 256, "every rank has its own mesh coordinates"
    by_coords = {(r["coords"]["pp"], r["coords"]["tp"]): r for r in ranks if r["coords"]["dp"] == 0}
    assert sorted({b for r in by_coords.values() for b in r["blocks"]}) == list(range(CFG.n_layers))
    for r in ranks:
        twin = by_coords[(r["coords"]["pp"], r["coords"]["tp"])]
        assert (r["params"], r["blocks"]) == (twin["params"], twin["blocks"])
        if r["comm"] is not None and twin["comm"] is not None:
            assert r["comm"] == twin["comm"]


def test_each_rank_holds_the_parameters_the_planner_charges(ranks):
    """rank_params splits every dense parameter over tp; the composed TP block keeps its two RMSNorm gains
    whole on every TP rank (as Megatron does), and the last stage its final norm: 2·d·(1 − 1/tp) more per
    block, d·(1 − 1/tp) on the last stage. Nothing else may differ: the difference is checked exactly."""
    d, tp = CFG.d_model, LAYOUT.tp
    for r in ranks:
        dense, expert = rank_params(CFG, r["blocks"], tp, 1, r["first"], r["last"])
        replicated = (2 * len(r["blocks"]) + (1 if r["last"] else 0)) * d * (1 - 1 / tp)
        assert expert == 0 and r["params"] == pytest.approx(dense + replicated, rel=1e-12, abs=0.5), r["rank"]


def test_each_rank_sends_the_tp_bytes_the_planner_charges(ranks):
    """The composed TP block (no sequence parallelism) all-reduces b·s·h twice per block forward and twice
    backward; the planner's model (with it) all-gathers and reduce-scatters the same tensor twice each per
    pass. Per rank on the wire both are 4·2(N − 1)/N·S a block (alpha_beta's ring terms). On top, the first
    stage's vocabulary-parallel embedding and the last stage's column-parallel output layer add one
    all-reduce each, which the planner leaves out (under 2% of a stage's TP traffic here)."""
    act_elements = B * S * CFG.d_model
    planned_per_block = 2 * sum(alpha_beta_terms(op, n, LAYOUT.tp)[1] for op, n in tp_layer_collectives(act_elements))
    stepped = [r for r in ranks if r["comm"] is not None]
    assert len(stepped) == 15
    for r in stepped:
        (key, comm), *others = r["comm"].items()
        assert key == "all_reduce@tp" and not others, r["comm"]
        elements = comm["bytes"] / 4  # the meta model is float32
        ends = int(r["first"]) + int(r["last"])
        assert comm["calls"] == 4 * len(r["blocks"]) + ends
        wire = comm["calls"] * alpha_beta_terms("ring_all_reduce", elements / comm["calls"], LAYOUT.tp)[1]
        assert elements == comm["calls"] * act_elements, "every collective carries one micro-batch's hidden state"
        assert wire == pytest.approx(len(r["blocks"]) * planned_per_block + ends * wire / comm["calls"], rel=1e-12)
