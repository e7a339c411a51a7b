"""The auto-planner (course_lib.cost.planner): it refuses what cannot run and says why, its terms are
the course's formulas, and on published set-ups it reasons as the text says.

The planner's ranking against measured step times on this machine is a benchmark
(benchmarks/bench_planner.py, BENCHMARKS.md), not a timed test; here, its shared-cores terms and the
fit of their constants are checked as arithmetic, and the measuring harness on 2 ranks.
"""

import pytest

from course_lib.cost import planner
from course_lib.cost.flops import train_flops_per_token
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.cost.planner import Cluster, Layout, plan, predict, reasons
from course_lib.experiments.lecture10.layout_timing import (
    as_planned,
    candidates,
    fit_shared_cores,
    shared_cores_cluster,
    step_times,
)
from course_lib.model import configs
from course_lib.parallel.compose import Layout as ComposedLayout

TINY4 = configs.get("tiny", n_layers=4)


def test_layouts_the_model_cannot_take_are_refused_naming_the_constraint():
    cluster = Cluster("H100", 8)
    said = reasons(TINY4, cluster, Layout(dp=1, tp=8), 8, 16)
    assert any("tensor parallel size 8 does not divide 4 attention heads" in r for r in said), said
    said = reasons(TINY4, cluster, Layout(dp=1, pp=8), 8, 16)
    assert any("8 pipeline stages need at least 8 blocks; the model has 4" in r for r in said), said
    said = reasons(TINY4, cluster, Layout(dp=8, micro_batch=3), 8, 16)
    assert any("does not split into dp=8 replicas of micro-batches of 3" in r for r in said), said
    said = reasons(TINY4, cluster, Layout(dp=4, ep=2), 8, 16)
    assert any("needs a mixture of experts" in r for r in said) and any("is not the cluster's 8" in r for r in said)
    with pytest.raises(ValueError, match="tensor parallel size 8"):
        predict(TINY4, cluster, Layout(dp=1, tp=8), 8, 16)
    assert not reasons(TINY4, cluster, Layout(dp=2, tp=2, pp=2), 8, 16)


def test_a_layout_beyond_memory_is_ranked_after_those_that_fit_and_says_so():
    cfg = configs.get("llama-3.1-405b")
    cluster = Cluster("H100", 64)
    dp_only = predict(cfg, cluster, Layout(dp=64), 64, 4096)
    assert not dp_only.fits and dp_only.memory["model states"] > 405e9 * 4, "every rank holds 2Ψ + 2Ψ and more"
    ranked = plan(cfg, cluster, 64, 4096)
    fits = [p.fits for p in ranked]
    assert fits == sorted(fits, reverse=True), "layouts that fit come first"


def test_memory_terms_are_the_course_formulas():
    cfg = configs.get("qwen2.5-72b")
    p = predict(cfg, Cluster("H100", 64), Layout(dp=8, tp=8, zero=1), 64, 4096)
    dense, expert, layers = planner._stage_params(cfg, 1, 8, 1)
    assert expert == 0 and layers == cfg.n_layers
    assert dense == pytest.approx(cfg.n_params() / 8, rel=1e-9), "pp=1: every parameter, split over tp"
    assert p.memory["model states"] == zero_model_state_bytes(round(dense), 8, 1)
    assert p.links == {"tp": "scale_up", "dp": "scale_out"}, p.links


def test_the_last_stage_carries_the_output_layer():
    cfg = configs.get("qwen2.5-72b")  # 80 blocks, vocabulary 152k: the head is about 1.5 blocks' worth
    assert planner.stage_imbalance(cfg, 1) == 1.0
    assert planner.stage_imbalance(cfg, 16) > planner.stage_imbalance(cfg, 2) > 1.0


def test_tensor_parallel_stays_inside_a_node_without_being_told():
    """'TP within a node' falls out of the links' bandwidths: across nodes its all-reduces pay the
    network's bandwidth, 9× slower on an H100 cluster, four times per layer."""
    cfg = configs.get("qwen2.5-72b")
    for per_node in (8, 4):
        best = next(p for p in plan(cfg, Cluster("H100", 256, devices_per_node=per_node), 1024, 4096) if p.fits)
        assert 1 < best.layout.tp <= per_node and best.links["tp"] == "scale_up", planner.explain(best)


def test_published_layouts_as_what_ifs():
    """Llama 3 405B on 16,384 H100s (TP 8, PP 16, DP 128, 8K sequences, 16M tokens a batch: Dubey et al.
    2024, Table 4) and DeepSeek-V3 on 2,048 H800s (PP 16, EP 64, ZeRO-1, no TP: DeepSeek-V3 report §3.2).
    The planner predicts both and ranks its own pick no slower; each prediction explains itself."""
    llama = configs.get("llama-3.1-405b")
    cluster = Cluster("H100", 16384)
    published = predict(llama, cluster, Layout(dp=128, tp=8, pp=16, micro_batch=1, recompute="full"), 2048, 8192)
    assert published.fits, planner.explain(published)
    best = next(p for p in plan(llama, cluster, 2048, 8192) if p.fits)
    assert best.step_seconds <= published.step_seconds
    assert best.layout.tp == 8 and "beats" in planner.explain(best, published)
    ds = configs.get("deepseek-v3")
    published = predict(ds, Cluster("H800", 2048), Layout(dp=128, pp=16, ep=64), 15360, 4096)
    assert published.fits and published.links["ep"] == "scale_out" and "ep" in published.seconds


def test_on_shared_cores_the_bubble_costs_nothing_and_every_pass_is_paid():
    """8 ranks on 2 cores: a rank idle in the bubble lends its core, so compute is every rank's work over the
    cores whatever pp is; on 8 devices of their own the same layout pays (pp − 1)/m of its work as bubble."""
    G, S, rate = 16, 32, 1e11
    flops = train_flops_per_token(TINY4, S) * G * S
    shared = shared_cores_cluster(8, cores=2, rate=rate, pass_seconds=0.0, alpha=0.0)
    own = Cluster("H100", 8, peak_flops=rate, links=shared.links)
    for ly in (Layout(dp=8, micro_batch=2), Layout(dp=2, pp=4, micro_batch=8), Layout(dp=2, pp=4, micro_batch=2)):
        got = predict(TINY4, shared, ly, G, S).seconds["compute"]
        assert got == pytest.approx(flops / (2 * rate), rel=1e-12), f"{ly}: shared cores pay no bubble"
    bubbly = predict(TINY4, own, Layout(dp=2, pp=4, micro_batch=8), G, S).seconds
    assert bubbly["bubble"] == pytest.approx(3 * bubbly["compute"], rel=1e-12), (
        "with a core each, pp=4, m=1: 3 idle slots of 4"
    )
    # a pass's fixed cost is paid dp·tp·m·(L + 1) times over all ranks, shared by the cores
    costly = shared_cores_cluster(8, cores=2, rate=rate, pass_seconds=1e-3, alpha=0.0)
    ly = Layout(dp=2, tp=2, pp=2, micro_batch=4)  # m = 2
    extra = predict(TINY4, costly, ly, G, S).seconds["compute"] - predict(TINY4, shared, ly, G, S).seconds["compute"]
    assert extra == pytest.approx(2 * 2 * 2 * (4 + 1) * 1e-3 / 2, rel=1e-9)
    with pytest.raises(ValueError, match="cores=0 must be >= 1"):
        Cluster("H100", 8, cores=0)


def test_the_shared_cores_fit_recovers_the_constants_it_was_made_with():
    """fit_shared_cores is least squares on the planner's own (linear) prediction: made-up step times from
    known constants must give those constants back, whatever the probe layouts' sizes."""
    G, S, rate = 16, 32, 1e11
    truth = shared_cores_cluster(8, cores=2, rate=rate, pass_seconds=2e-3, alpha=1e-3)
    probes = [ly for ly in candidates(TINY4, 8, G, S) if ly.m == 1]
    made_up = {ly: predict(TINY4, truth, as_planned(ly, G), G, S, dp_overlap=0.0).step_seconds + 0.01 for ly in probes}
    fitted, constant = fit_shared_cores(TINY4, made_up, G, S, 8, 2, rate)
    assert fitted.pass_seconds == pytest.approx(2e-3, rel=1e-6) and constant == pytest.approx(0.01, rel=1e-6)
    assert fitted.links["scale_up"][0] == pytest.approx(1e-3, rel=1e-6)


def test_the_candidates_are_the_composable_layouts_of_8_ranks():
    """tp ≤ 2 (the tiny model's 2 key/value heads), pp ∈ {1, 2, 4}, dp the rest, m ≤ 4 with dp·m | 16: 17 layouts."""
    found = candidates(TINY4, 8, 16, 32)
    assert len(found) == len(set(found)) == 17, [str(ly) for ly in found]
    assert all(ly.world_size == 8 and ly.tp <= 2 and ly.m <= 4 and 16 % (ly.dp * ly.m) == 0 for ly in found)
    assert as_planned(ComposedLayout(dp=2, tp=1, pp=4, m=2), 16) == Layout(dp=2, pp=4, micro_batch=4, zero=0)


def test_step_times_are_measured_for_every_layout_in_one_launch():
    """Two 2-rank layouts, one round: every layout gets a positive median step time under its own name."""
    layouts = [ComposedLayout(dp=2), ComposedLayout(pp=2, m=2)]
    got = step_times(layouts, overrides={"n_layers": 2}, global_batch=4, seq_len=8, rounds=1, steps=1, warmup=1)
    assert set(got) == {str(ly) for ly in layouts} and all(t > 0 for t in got.values()), got
    with pytest.raises(ValueError, match="one world size"):
        step_times([ComposedLayout(dp=2), ComposedLayout(dp=4)])
