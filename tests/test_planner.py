"""The auto-planner (course_lib.cost.planner): it refuses what cannot run and says why, its terms are
the course's formulas, and on published set-ups it reasons as the text says.

The planner's ranking against measured step times on this machine is a benchmark
(benchmarks/bench_planner.py, BENCHMARKS.md), not a timed test.
"""

import pytest

from course_lib.cost import planner
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.cost.planner import Cluster, Layout, plan, predict, reasons
from course_lib.model import config as configs

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
