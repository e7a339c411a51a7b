"""The package-level calculators of course_lib.cost against counted parameters and known figures."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from course_lib import cost
from course_lib.cost import dollars, hardware
from course_lib.cost.expert_dispatch import ep_dispatch_bytes, padded_dispatch_bytes
from course_lib.model import configs, moe
from course_lib.model.transformer import Block


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_moe_layer_parameters_total_and_active_match_a_built_layer():
    cfg = configs.get("tiny", n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_d_ff=32)
    dense = configs.get("tiny")
    block = Block(dense)
    attention_and_norms = _count(block) - _count(block.feed_forward)
    layer = moe.MoE(cfg.d_model, cfg.moe_d_ff, 8, 2, n_shared=1)
    per_expert = _count(layer.experts[0])
    assert cfg.layer_params(0) == attention_and_norms + _count(layer), "total: every expert, shared, router"
    active = attention_and_norms + _count(layer) - (8 - 2) * per_expert
    assert cfg.layer_params(0, active=True) == active, "active: k routed experts, the shared one and the router"
    total, active_model = cost.param_count(cfg)
    assert (total, active_model) == (cfg.n_params(), cfg.n_active_params())


def test_published_figures():
    total, active = cost.param_count(configs.get("deepseek-v3"))
    assert abs(total / 671e9 - 1) < 0.01 and abs(active / 37e9 - 1) < 0.03, (total, active)  # the report's 671B/37B
    # DeepSeek-V3's MLA cache: 61 layers x (512 latent + 64 RoPE key) x 2 bytes
    assert cost.kv_cache_bytes_per_token(configs.get("deepseek-v3")) == 61 * 576 * 2
    assert cost.training_cost(2.788e6, 2.0) == 5.576e6, "DeepSeek-V3 report §1: 2.788M H800 hours at $2"
    cfg = configs.get("tiny")
    # 6N (N without the 2L + 1 norm gains) + per layer 6·T·H·(d_qk + d_v): 2 layers, T = 64, H = 4, head_dim 16
    six_n = 6 * (cfg.n_active_params() - (2 * 2 + 1) * 64)
    assert cost.train_flops_per_token(cfg, 64) == six_n + 2 * 6 * 64 * 4 * (16 + 16)


def test_ep_comm_time():
    # 4096 tokens, hidden 7168, 8 experts each, FP8 out (1 B) and BF16 back (2 B), 50 GB/s
    seconds = cost.ep_comm_time(4096, 7168, 8, 1, 2, 50e9)
    assert seconds == 4096 * 8 * 7168 * 3 / 50e9
    assert cost.ep_comm_time(4096, 7168, 8, 1, 2, 50e9, remote_fraction=0.75) == 0.75 * seconds
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        cost.ep_comm_time(1, 1, 1, 1, 1, 0)


def test_padded_dispatch_bytes_are_the_buffers_a_capacity_router_fills():
    """A capacity-padded dispatch sends E buffers of C rows; the rows the router actually kept are what a
    padding-free dispatch sends (ep_dispatch_bytes of the kept assignments)."""
    torch.manual_seed(0)
    tokens, d, n_experts, k, cf = 512, 32, 8, 2, 1.25
    router = moe.Router(d, n_experts, k, capacity_factor=cf)
    routing = router(torch.randn(tokens, d) + torch.randn(d))  # a shared offset: an unbalanced router
    cap = moe.capacity(tokens, k, n_experts, cf)
    buffers = torch.zeros(n_experts, cap, d)  # GShard's dispatch tensor, one slot per accepted assignment
    kept = int(routing.kept.sum())
    assert buffers.numel() * 2 == padded_dispatch_bytes(n_experts, cap, d, 2)
    assert kept <= n_experts * cap, "a capacity router never keeps more than E·C assignments"
    padded, free = padded_dispatch_bytes(n_experts, cap, d, 2), ep_dispatch_bytes(kept, d, 1, 2)
    # padding costs at least cf x the T·k rows when nothing is dropped, more as the router drops tokens
    assert padded >= cf * free, (padded, free)


# ---------------------------------------------------------------------- total cost of ownership (lecture 07)


def test_tco_parts_by_hand():
    assert dollars.amortised_capex_per_hour(4 * 8766.0, years=4) == 1.0, "a year is 365.25 days"
    assert dollars.power_cost_per_hour(1000, system_power_factor=1.0, pue=1.0, usd_per_kwh=0.1) == pytest.approx(0.1)
    h800 = hardware.get("H800")
    t = dollars.tco(h800, 30_000)  # the defaults: 4 years, server x1.8, PUE 1.3, $0.08/kWh, 90% useful
    power = 700 * 1.8 * 1.3 / 1000 * 0.08
    assert t.usd_per_hour == pytest.approx(30_000 / (4 * 8766) + power, rel=1e-12)
    assert t.usd_per_useful_hour == pytest.approx(t.usd_per_hour / 0.9, rel=1e-12)


def test_cost_per_useful_flop_and_per_run_follow_from_the_hour():
    h800 = hardware.get("H800")
    peak = h800.peak_flops("bf16")
    t = dollars.tco(h800, 30_000)
    per_flop = dollars.usd_per_useful_flop(t, peak, mfu=0.4)
    assert per_flop * peak * 0.4 * 3600 == pytest.approx(t.usd_per_useful_hour, rel=1e-12)
    idle = dollars.tco(h800, 30_000, utilisation=0.45)
    assert dollars.usd_per_useful_flop(idle, peak, 0.4) == pytest.approx(2 * per_flop, rel=1e-12), (
        "half the useful hours, twice the cost per FLOP: idle hardware still depreciates"
    )
    total = 4.16e24  # DeepSeek-V3's pre-training, 6N + attention over 14.8T tokens (lecture 04)
    run = dollars.training_run_usd(total, t, peak, mfu=0.4)
    assert run == pytest.approx(cost.training_cost(dollars.gpu_hours(total, 1, peak, 0.4), t.usd_per_useful_hour))


def test_tco_refuses_a_part_without_a_power_figure_and_bad_assumptions():
    ascend = hardware.get("Ascend 910C")
    assert ascend.power_watts.value is None
    with pytest.raises(ValueError, match="Ascend 910C has no published power"):
        dollars.tco(ascend, 20_000)
    stated = dollars.tco(ascend, 20_000, power_watts=600)  # an assumption, stated by the caller
    assert stated.power_usd_per_hour == pytest.approx(dollars.power_cost_per_hour(600))
    with pytest.raises(ValueError, match="utilisation"):
        dollars.tco(hardware.get("H100"), 30_000, utilisation=1.5)
    with pytest.raises(ValueError, match="pue"):
        dollars.power_cost_per_hour(700, pue=0.9)
