"""course_lib.model.moe: routing, capacity, balancing losses and the layer against a per-token reference."""

from __future__ import annotations

import pytest
import torch

from course_lib.data import MarkovLanguage
from course_lib.model import configs, moe
from course_lib.model.transformer import Transformer

E, D, FF = 8, 16, 32


def _balanced_routing(t=16, k=2):
    """Every expert gets the same share of assignments and the same mean score 1/E (exact in binary)."""
    experts = (torch.arange(t * k) % E).view(t, k)
    scores = torch.full((t, E), 1 / E)
    return moe.Routing(experts, torch.full((t, k), 1 / k), torch.ones(t, k, dtype=torch.bool), scores, scores.log())


def test_balancing_losses_are_one_at_perfect_balance():
    routing = _balanced_routing()
    assert moe.switch_aux_loss(routing, E).item() == 1.0, "E·Σ f_i P_i = E·E·(1/E)(1/E) = 1 exactly"
    assert moe.sequence_balance_loss(routing, E, seq_len=8).item() == 1.0, "f_i = 1 and P_i = 1/E per sequence"
    skewed = moe.Routing(
        torch.zeros(16, 1, dtype=torch.long),
        torch.ones(16, 1),
        torch.ones(16, 1, dtype=torch.bool),
        torch.eye(E)[torch.zeros(16, dtype=torch.long)],
        torch.zeros(16, E),
    )
    assert moe.switch_aux_loss(skewed, E).item() == E, "everything on one expert with probability 1: E"


def test_capacity_drops_the_late_assignments():
    torch.manual_seed(0)
    router = moe.Router(D, E, 2, capacity_factor=1.0)
    x = torch.randn(64, D)
    r = router(x)
    cap = moe.capacity(64, 2, E, 1.0)
    assert not r.kept.all(), "this seed overfills some expert: the test must see drops"
    assert cap == 16 and r.load(E).max().item() <= cap, f"an expert took {r.load(E).max()} > capacity {cap}"
    for e in range(E):  # first come, first served: the kept ones are the earliest assignments
        order = r.kept.flatten()[r.experts.flatten() == e]
        assert not (~order[:-1] & order[1:]).any(), f"expert {e} kept a later assignment after dropping an earlier one"
    assert r.kept.all() == (r.load(E).sum() == 128), "nothing dropped exactly when every assignment is kept"


def test_node_limited_routing_stays_within_m_groups():
    torch.manual_seed(0)
    router = moe.Router(D, 16, 4, score="sigmoid", n_groups=4, topk_groups=2)
    r = router(torch.randn(256, D))
    groups = (r.experts // 4).sort(-1).values
    n_groups = 1 + (groups[:, 1:] != groups[:, :-1]).sum(-1)
    assert n_groups.max().item() <= 2, f"a token reached {n_groups.max().item()} groups; at most topk_groups = 2"


def test_the_balancing_bias_chooses_but_does_not_weigh():
    torch.manual_seed(0)
    router = moe.Router(D, E, 2, score="sigmoid")
    x = torch.randn(32, D)
    before = router(x)
    router.bias[3] = 10.0  # expert 3 now wins every selection
    after = router(x)
    assert (after.experts == 3).any(-1).all(), "with a large bias expert 3 is chosen by every token"
    want = after.scores.gather(1, after.experts)
    assert torch.equal(after.weights, want / want.sum(-1, keepdim=True)), "the gates come from the scores, not the bias"
    assert torch.equal(before.scores, after.scores), "the bias leaves the scores alone"
    router.update_bias(torch.tensor([0, 0, 0, 64, 0, 0, 0, 0]), rate=0.5)
    assert router.bias[3].item() == 9.5 and router.bias[0].item() == 0.5, "over-loaded down, under-loaded up"


@pytest.mark.parametrize(
    "score, k, shared, cf", [("softmax", 1, 0, None), ("softmax", 2, 1, 1.0), ("sigmoid", 2, 1, 1.25)]
)
def test_layer_equals_a_per_token_reference(score, k, shared, cf):
    torch.manual_seed(0)
    layer = moe.MoE(D, FF, E, k, n_shared=shared, score=score, capacity_factor=cf, aux_coef=0.01, z_coef=1e-3)
    x = torch.randn(2, 12, D)
    y = layer(x)
    r, flat = layer.routing, x.reshape(-1, D)
    want = torch.stack(
        [
            sum(
                (r.weights[t, j] * layer.experts[int(r.experts[t, j])](flat[t]) for j in range(k) if r.kept[t, j]),
                torch.zeros(D),
            )
            + sum((s(flat[t]) for s in layer.shared), torch.zeros(D))
            for t in range(len(flat))
        ]
    )
    # at most k + shared + 1 = 4 terms per output, added in another order: 3·u·Σ|terms| with u = 2^-24;
    # 1e-6 of the largest entry bounds it for these sizes
    assert (y.reshape(-1, D) - want).abs().max() <= 1e-6 * want.abs().max(), "MoE output differs from the per-token sum"
    assert set(layer.losses) == {"aux", "z"}, layer.losses
    (y.square().sum() + sum(layer.losses.values())).backward()
    assert layer.router.gate.weight.grad.abs().sum() > 0, "the router learns through the gates and the losses"


def test_bad_configurations_are_clear_errors():
    with pytest.raises(ValueError, match="top_k=9 must be in 1..n_experts=8"):
        moe.Router(D, 8, 9)
    with pytest.raises(ValueError, match="8 experts do not split into n_groups=3"):
        moe.Router(D, 8, 2, n_groups=3)
    with pytest.raises(ValueError, match="cannot offer top_k=4"):
        moe.Router(D, 8, 4, n_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="router score 'relu'"):
        moe.Router(D, 8, 2, score="relu")


def _moe_cfg():
    return configs.get("tiny", n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_d_ff=64)


def test_moe_course_model_counts_and_trains_with_balancing():
    cfg = _moe_cfg()
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params(), "ModelConfig.n_params counts the MoE model"
    tokens = MarkovLanguage(seed=0).sample(32 * 33, seed=1).view(32, 33)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ratios, losses = [], []
    for _ in range(30):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        load = sum(layer.routing.load(8) for layer in model.moe_layers())
        ratios.append((load.max() / load.float().mean()).item())
        for layer in model.moe_layers():  # aux-loss-free balancing, after each step
            layer.router.update_bias(layer.routing.load(8), rate=1e-2)
        losses.append(loss.item())
    assert losses[-1] < losses[0], f"the MoE model should learn: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    early, late = sum(ratios[:5]) / 5, sum(ratios[-5:]) / 5
    assert late < early, f"the bias should even out the load: max/mean {early:.2f} early, {late:.2f} late"


def test_moe_layer_equals_transformers_deepseek_v3_moe():
    """Our MoE with DeepSeek-V3's choices (sigmoid scores, node-limited groups, selection bias, one
    shared expert) against transformers' own DeepseekV3MoE on the same weights.

    The same experts chosen (same fp32 scores and biases); gates within k ulps (the renormalising sum
    runs in another order); the outputs add the same products in
    the same expert order, but each expert's matmul runs on its rows in another order (token-major
    here, slot-major there), which may move a row's result by an ulp: 1e-6 of the output's scale.
    """
    import transformers as hf  # heavy; only this test needs it

    d, ff, e, k = 32, 16, 16, 4
    config = hf.DeepseekV3Config(
        hidden_size=d,
        moe_intermediate_size=ff,
        n_routed_experts=e,
        num_experts_per_tok=k,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
    theirs = hf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
    torch.manual_seed(0)
    ours = moe.MoE(d, ff, e, k, n_shared=1, score="sigmoid", n_groups=4, topk_groups=2)
    ours.router.bias.copy_(torch.randn(e) * 0.05)  # a trained aux-loss-free bias
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.router.bias)
        for i, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[i].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            theirs.experts.down_proj[i].copy_(expert.w2.weight)
        shared = ours.shared[0]
        for mine, hf_name in ((shared.w1, "gate_proj"), (shared.w3, "up_proj"), (shared.w2, "down_proj")):
            getattr(theirs.shared_experts, hf_name).weight.copy_(mine.weight)
        x = torch.randn(2, 24, d)
        _, hf_weights, hf_experts = theirs.gate(x)
        y_theirs, y_ours = theirs(x), ours(x)
    chosen = lambda idx: idx.sort(-1).values
    assert torch.equal(chosen(ours.routing.experts), chosen(hf_experts)), (
        "the experts chosen differ from transformers' DeepseekV3TopkRouter: compare the group score "
        "(sum of each group's two best biased scores), the kept groups and the top-k among them"
    )
    order = lambda idx, w: w.gather(1, idx.argsort(-1))
    # the k = 4 chosen scores are summed in another order (sorted here, unsorted there) before the
    # division: (k - 1) u for the sum and u for the quotient, relative, u = 2^-24
    ours_w, theirs_w = order(ours.routing.experts, ours.routing.weights), order(hf_experts, hf_weights)
    assert torch.allclose(ours_w, theirs_w, rtol=k * 2**-24, atol=0), (
        "gates differ from transformers': they are the chosen sigmoid scores without the bias, renormalised"
    )
    assert (y_ours - y_theirs).abs().max() <= 1e-6 * y_theirs.abs().max(), (
        f"MoE output differs from transformers' DeepseekV3MoE by {(y_ours - y_theirs).abs().max():.2e}"
    )


def test_the_switch_loss_of_a_sigmoid_router_uses_normalised_affinities():
    """Fedus et al.'s P_i are probabilities; sigmoid scores are not, so MoE.aux_loss normalises them first
    (as DeepSeek-V3's sequence-wise loss does): at perfect balance the loss is 1 whatever the scores' sum."""
    T, E, k = 64, 8, 2
    balanced = moe.Routing(
        experts=torch.arange(T * k).view(T, k) % E,
        weights=torch.full((T, k), 0.5),
        kept=torch.ones(T, k, dtype=torch.bool),
        scores=torch.full((T, E), 0.9),  # sigmoids, summing to 7.2 per token
        logits=torch.zeros(T, E),
    )
    assert moe.switch_aux_loss(balanced, E).item() > 7, "on raw sigmoid scores the loss is E·0.9 at balance"
    normalised = moe.as_probabilities(balanced, "sigmoid")
    torch.testing.assert_close(moe.switch_aux_loss(normalised, E), torch.tensor(1.0))
    assert moe.as_probabilities(balanced, "softmax") is balanced, "softmax scores are probabilities already"
