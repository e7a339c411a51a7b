"""course_lib.optim: update rules against torch.optim, defining properties, bytes of state."""

import copy

import pytest
import torch
import torch.nn as nn

from course_lib.cost import memory as cost_memory
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import census
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.optim import optimizers as optim


def _tiny_and_batches(n_batches=4):
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny", n_layers=1))
    ds = make_dataset(MarkovLanguage(), 8 * 64 * n_batches + 1, 64, seed=1)
    return model, list(ds.batches(8, shuffle=False))


def _train_side_by_side(make_a, make_b, steps=4):
    model, batches = _tiny_and_batches(steps)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a, opt_b = make_a(a.parameters()), make_b(b.parameters())
    for x, y in batches[:steps]:
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            m.loss(x, y).backward()
            opt.step()
    return a, b, opt_a, opt_b


TORCH_PAIRS = {
    "sgd + L2": (
        lambda p: optim.SGD(p, lr=0.1, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
    ),
    "momentum": (lambda p: optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "adam + L2": (
        lambda p: optim.Adam(p, lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": (
        lambda p: optim.AdamW(p, lr=3e-3, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    ),
    "adagrad": (lambda p: optim.Adagrad(p, lr=1e-2), lambda p: torch.optim.Adagrad(p, lr=1e-2)),
    "rmsprop": (
        lambda p: optim.RMSprop(p, lr=1e-3, alpha=0.95, eps=1e-6),
        lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.95, eps=1e-6),
    ),
}


@pytest.mark.parametrize("name", list(TORCH_PAIRS))
def test_matches_torch_optim_bit_for_bit(name):
    a, b, _, _ = _train_side_by_side(*TORCH_PAIRS[name])
    for (pname, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), (
            f"{name}: parameter {pname} differs from torch.optim after 4 steps (max |diff| "
            f"{(pa - pb).abs().max().item():.3g}); the update must use torch's operations in torch's order "
            "(lerp_ for m, bias corrections as Python floats), since any reordering changes the last bit"
        )


def test_param_groups_keep_their_own_hyperparameters():
    def groups(p):
        p = list(p)
        return [{"params": p[:3], "lr": 1e-2}, {"params": p[3:], "weight_decay": 0.0}]

    a, b, _, _ = _train_side_by_side(
        lambda p: optim.AdamW(groups(p), lr=1e-3, weight_decay=0.1),
        lambda p: torch.optim.AdamW(groups(p), lr=1e-3, weight_decay=0.1),
        steps=2,
    )
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())), (
        "each param group must use its own lr / weight_decay, as torch's do"
    )


def test_adafactor_agrees_with_torch_adafactor():
    a, b, _, _ = _train_side_by_side(
        lambda p: optim.Adafactor(p, lr=1e-2, weight_decay=0.01),
        lambda p: torch.optim.Adafactor(p, lr=1e-2, weight_decay=0.01),
    )
    for (pname, pa), pb in zip(a.named_parameters(), b.parameters()):
        # Not bit-equal: torch forms row means as norm(g)²/m, we as mean(g²) (one sqrt and one
        # square fewer). Those orderings differ by a few ulps in V̂, hence 1e-5 relative.
        torch.testing.assert_close(
            pa,
            pb,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, pname=pname: f"Adafactor {pname} drifted from torch.optim.Adafactor beyond rounding: {m}",
        )


def test_factored_second_moment_is_exact_for_rank_one():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(6, 1, generator=g, dtype=torch.float64), torch.rand(1, 5, generator=g, dtype=torch.float64)
    v = a @ b  # rank 1
    v_hat = optim.factored_second_moment(v.mean(-1, keepdim=True), v.mean(-2, keepdim=True))
    torch.testing.assert_close(
        v_hat, v, rtol=1e-12, atol=0, msg="R Cᵀ / 1ᵀR must reconstruct a rank-1 V exactly (Shazeer & Stern 2018, §3)"
    )
    v_full = torch.rand(6, 5, generator=g, dtype=torch.float64)  # rank 5: the estimate must now be off
    v_hat = optim.factored_second_moment(v_full.mean(-1, keepdim=True), v_full.mean(-2, keepdim=True))
    assert (v_hat - v_full).abs().max() > 1e-2, "a full-rank V cannot be rebuilt from n + m numbers"
    torch.testing.assert_close(v_hat.sum(), v_full.sum(), msg="the estimate keeps V's total (row sums are exact)")


def test_adafactor_first_step_uses_rank_one_reconstruction_of_g_squared():
    """At t = 1, 1 − β̂₂ = 1, so the stored R, C are those of g²; with g² rank 1, the update is exactly g/|g| = sign·1."""
    u, w = torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([[0.5, -1.0, 2.0, -0.25]])
    p = nn.Parameter(torch.zeros(3, 4))
    p.grad = u @ w  # rank 1, so g² = u² (w²)ᵀ is rank 1 too
    opt = optim.Adafactor([p], lr=1e-2, eps=(1e-30, 1e-3))
    opt.step()
    st = opt.state[p]
    assert st["row_var"].shape == (3, 1) and st["col_var"].shape == (1, 4), "state is one value per row and per column"
    v_hat = optim.factored_second_moment(st["row_var"], st["col_var"])
    torch.testing.assert_close(
        v_hat, p.grad.square(), rtol=1e-6, atol=0, msg="the factored estimate must equal g² when g² has rank 1"
    )
    # U = g/√V̂ = sign(g): RMS 1, no clipping; α = max(ε₂, RMS(0)) · min(lr, 1/√1) = 1e-3 · 1e-2
    torch.testing.assert_close(p.detach(), -1e-5 * p.grad.sign(), rtol=1e-5, atol=0)


def test_lion_step_is_sign_valued():
    # Parameters, lr and gradients on a coarse binary grid make p − lr·sign(c) exact, so (p_before −
    # p_after)/lr must be exactly −1, 0 or +1 for every coordinate.
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randint(-64, 64, (16, 8), generator=g).float() / 1024)
    opt = optim.Lion([p], lr=2.0**-6, betas=(0.9, 0.99))
    seen = set()
    for _ in range(5):
        p.grad = torch.randn(16, 8, generator=g) * 10 ** torch.randint(-3, 3, (16, 8), generator=g)
        p.grad[0, 0] = 0.0  # c = β₁m + (1−β₁)g with m = g = 0 at step 1 has sign 0: no move
        before = p.detach().clone()
        opt.step()
        step = (before - p.detach()) / 2.0**-6
        seen |= set(step.unique().tolist())
    assert seen <= {-1.0, 0.0, 1.0} and {-1.0, 1.0} <= seen, (
        f"Lion moves each coordinate by exactly ±lr (or 0 where c = 0); saw steps of {sorted(seen)} x lr"
    )


def test_lion_matches_its_equations_in_float64():
    g = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.randn(5, 3, generator=g, dtype=torch.float64))
    ref, m = p.detach().clone(), torch.zeros_like(p)
    opt = optim.Lion([p], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(4):
        grad = torch.randn(5, 3, generator=g, dtype=torch.float64)
        p.grad = grad.clone()
        opt.step()
        c = 0.9 * m + 0.1 * grad
        ref = ref * (1 - 1e-3 * 0.1) - 1e-3 * torch.sign(c)
        m = 0.99 * m + 0.01 * grad
    torch.testing.assert_close(
        p.detach(), ref, rtol=0, atol=1e-12, msg="Lion must follow Chen et al. 2023, Alg. 2: c, then θ, then m"
    )


def test_lion_ignores_gradient_scale():
    grads = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    results = []
    for scale in (1.0, 1000.0):
        p = nn.Parameter(torch.ones(4, 4))
        opt = optim.Lion([p], lr=0.01)
        for gr in grads:
            p.grad = gr * scale
            opt.step()
        results.append(p.detach())
    assert torch.equal(*results), "sign(c) does not depend on the gradient's scale, so neither may Lion's step"


# ---- bytes of state --------------------------------------------------------------------------------

EXPECTED_BYTES_PER_PARAM = {"sgd": 0, "momentum": 4, "adagrad": 4, "rmsprop": 4, "adam": 8, "adamw": 8, "lion": 4}


@pytest.mark.parametrize("name", list(EXPECTED_BYTES_PER_PARAM))
def test_state_bytes_per_param_fp32(name):
    assert cost_memory.state_bytes_per_param(name) == EXPECTED_BYTES_PER_PARAM[name]


def test_adafactor_state_is_rows_plus_columns():
    assert cost_memory.state_bytes("adafactor", [(1024, 256)]) == 4 * (1024 + 256)
    assert cost_memory.state_bytes("adafactor", [(1024,)]) == 4 * 1024, "vectors keep the full second moment"
    assert cost_memory.state_bytes_per_param("adafactor", [(4096, 4096)]) == pytest.approx(4 * 2 / 4096)


def _measure(make):
    model, batches = _tiny_and_batches(1)
    opt = make(model.parameters())
    x, y = batches[0]
    model.loss(x, y).backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "rmsprop", "adam", "adamw", "lion", "adafactor"])
def test_state_bytes_formula_matches_measured_state(name):
    model, opt = _measure(lambda p: optim.build(name, p))
    assert census.optimizer_state_bytes(opt) == cost_memory.state_bytes(name, model.parameters()), (
        f"{name}: the bytes held in optimizer.state must equal the formula; a mismatch means the formula "
        "forgot a state tensor or the optimizer keeps one it should not"
    )


@pytest.mark.parametrize(
    "name,make",
    [
        ("momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("adam", lambda p: torch.optim.Adam(p)),
        ("adamw", lambda p: torch.optim.AdamW(p)),
        ("adafactor", lambda p: torch.optim.Adafactor(p)),
        ("adagrad", lambda p: torch.optim.Adagrad(p)),
        ("rmsprop", lambda p: torch.optim.RMSprop(p)),
    ],
)
def test_state_bytes_formula_matches_torch_optimizers(name, make):
    model, opt = _measure(make)
    assert census.optimizer_state_bytes(opt) == cost_memory.state_bytes(name, model.parameters()), (
        f"torch.optim's {name} keeps a different amount of per-element state than state_bytes() says"
    )


def test_mixed_precision_adam_is_sixteen_bytes_per_param():
    assert cost_memory.training_bytes_per_param("adam") == 16, "ZeRO §3.1: 2 + 2 + (4 + 4 + 4)"
    assert cost_memory.training_bytes_per_param("adamw", param_bytes=4, grad_bytes=4, master_bytes=0) == 16
    assert cost_memory.training_bytes_per_param("sgd", param_bytes=4, grad_bytes=4, master_bytes=0) == 8


def test_bad_input_is_explained():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="choose one of"):
        optim.build("adadelta", p)
    with pytest.raises(ValueError, match="learning rate must be >= 0"):
        optim.AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas must be in"):
        optim.Lion(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas must be in"):  # RMSprop's alpha is a moving-average decay too
        optim.RMSprop(p, alpha=1.0)
    with pytest.raises(ValueError, match="no parameters"):
        cost_memory.state_bytes_per_param("adam", [])
    assert optim.build("momentum", p).defaults["momentum"] == 0.9
