"""DP × TP × PP on one mesh (course_lib.parallel.compose) against single-process training.

Two layouts of 8 ranks (and two more of 8 with one of the three sizes at 1) train the course model
(4 blocks, so that 4 stages are possible) for 3 SGD steps on the same global batches as one process
does; losses and parameters must agree within what float32 summation in another order allows.

Tolerances. The composed step computes the same sums as one process in other orders: TP adds two
partial products, the pipeline adds the micro-batches' gradients one by one, DP adds the replicas'.
Reordering a float32 sum of n terms changes it by at most about n·u·Σ|terms| (Higham, *Accuracy and
Stability of Numerical Algorithms*, §4.2; u = 2⁻²⁴ ≈ 6e-8). The loss is a mean of G·S = 128 token
losses of about 4.2: n·u ≈ 7.6e-6 relative, so 1e-5 relative. Parameters move by lr·g per step with
|g| ≲ 1 here; three steps of gradients off by at most 128·u·Σ|g terms| give well under 1e-6 at
lr = 0.1 (measured: under 1e-7). SGD rather than Adam for this check: Adam's g/√v turns a rounding
difference of a near-zero gradient into a full-size step, which says nothing about the composition.
"""

import pytest
import torch

from course_lib.dist import device, launch
from course_lib.experiments.lecture10 import capstone_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.compose import Composed, Layout, check_layout, sgd_one_process

G, S, LR, STEPS = 8, 16, 0.1, 3
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-6  # see the module docstring


def _model():
    torch.manual_seed(0)
    return Transformer(configs.get("tiny", n_layers=4))


def _batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        # host: the same batches in the parent's reference and on every rank; ranks move them to their device
        t = torch.randint(0, 64, (G, S + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _reference(make=_model):
    return sgd_one_process(make(), _batches(), LR)


def _composed_rank(layout, make=_model):
    composed = Composed(make().to(device()), layout, G)
    opt = torch.optim.SGD(composed.parameters(), lr=LR)
    losses = []
    for x, y in _batches():  # drawn on the host, as the one-process reference draws them
        losses.append(composed.step(x.to(device()), y.to(device())))
        opt.step()
        opt.zero_grad()
    return losses, composed.dense_state()


@pytest.mark.parametrize(
    "layout",
    [Layout(dp=2, tp=2, pp=2, m=2), Layout(dp=1, tp=2, pp=4, m=4), Layout(dp=2, tp=1, pp=4, m=2), Layout(dp=4, tp=2)],
    ids=str,
)
def test_composed_training_follows_one_process(layout):
    ref_losses, ref_params = _reference()
    out = launch(_composed_rank, layout.world_size, layout, timeout=240)
    reporting = [losses for losses, _ in out if losses[0] is not None]
    assert len(reporting) == layout.dp * layout.tp, "every rank of the last stage reports the loss"
    for losses in reporting:
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), (
                f"{layout}: loss of step {step} is {got}, one process has {want}: look at the micro-batch split "
                "(run_step divides each loss by m) and the dp average"
            )
    for rank, (_, params) in enumerate(out):
        assert sorted(params) == sorted(ref_params), f"rank {rank} gathered {len(params)} of {len(ref_params)} tensors"
        for name, want in ref_params.items():
            gap = (params[name] - want).abs().max().item()
            assert gap <= PARAM_ATOL, f"{layout}: {name} is off by {gap:.2e} after {STEPS} steps on rank {rank}"


def test_a_layout_the_model_cannot_take_is_refused_with_the_reason():
    cfg = configs.get("tiny", n_layers=4)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide 4 attention heads"):
        check_layout(Layout(tp=3), cfg, G)
    with pytest.raises(ValueError, match="8 pipeline stages need at least 8 blocks; the model has 4"):
        check_layout(Layout(pp=8), cfg, G)
    with pytest.raises(ValueError, match="does not split into dp=2 replicas × m=3 micro-batches"):
        check_layout(Layout(dp=2, m=3), cfg, G)
    with pytest.raises(ValueError, match="expert parallel size 2 needs a mixture of experts"):
        check_layout(Layout(dp=2, ep=2), cfg, G)
    with pytest.raises(ValueError, match="composed here with tp=1"):
        check_layout(Layout(dp=2, tp=2, ep=2), configs.get("tiny", **MOE), G)


MOE = dict(n_layers=4, n_routed_experts=4, n_activated_experts=2, moe_d_ff=32)


def _moe_model():
    torch.manual_seed(0)
    return Transformer(configs.get("tiny", **MOE))


@pytest.mark.parametrize("layout", [Layout(dp=4, pp=2, m=2, ep=2), Layout(dp=2, pp=2, m=2, ep=2)], ids=str)
def test_composed_mixture_of_experts_with_expert_parallel_follows_one_process(layout):
    """DP × EP × PP on the MoE variant: each stage's MoE layers hold E/ep experts, tokens reach them by
    all-to-all. Same tolerances as the dense layouts (module docstring): the experts' rows and their
    gradients are summed in another order, nothing else changes."""
    ref_losses, ref_params = _reference(_moe_model)
    out = launch(_composed_rank, layout.world_size, layout, _moe_model, timeout=240)
    for losses, _ in out:
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert got is None or abs(got - want) <= LOSS_RTOL * abs(want), (
                f"{layout}: loss of step {step} is {got}, one process has {want}"
            )
    for rank, (_, params) in enumerate(out):
        assert sorted(params) == sorted(ref_params), f"rank {rank}: gathered names differ from the model's"
        for name, want in ref_params.items():
            gap = (params[name] - want).abs().max().item()
            assert gap <= PARAM_ATOL, (
                f"{layout}: {name} is off by {gap:.2e} on rank {rank}: an expert's gradient arrives summed over "
                "its ep group; it needs the sum over the dp/ep copies and 1/dp, not a second all-reduce over dp"
            )


def test_an_expert_no_token_of_a_replica_reaches_still_joins_the_gradient_average():
    """With dp = 4 and ep = 2, each expert has two copies; in step 3 of this run (32-token sequences) one
    replica routes no token to one of them, so that copy has no gradient. The copies' all-reduce must
    still add equal-sized buffers on every rank: before the fix, gloo failed with "Received data size
    doesn't match expected size". The result must be one process's, as in the other layouts."""
    run = capstone_run.composed_vs_one_process(
        Layout(dp=4, m=2, ep=2), steps=3, global_batch=8, seq_len=32, overrides=capstone_run.MOE
    )
    assert run["loss_rel_gap"] <= LOSS_RTOL and run["param_gap"] <= PARAM_ATOL, run["param_gap"]
