"""Activation checkpointing (course_lib.model.recompute) against no checkpointing and against the model
of course_lib.cost.activations (lecture 06).

* Gradients are bit-equal: recomputation replays the same kernels on the same inputs in the same
  order, so every float comes out the same (torch.compile's decompositions are the exception: they
  reorder fp32 reductions, so the budget test allows fp32 rounding, torch's default tolerance).
* Bytes are exact: LiveTensorMeter counts every storage the blocks' ops create, and the model names
  every one of them (recompute_terms), so a measured byte the model does not name fails the test.
* The FLOPs of the recompute are exact too: FlopCounterMode counts the matmuls backward runs again.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.cost.activations import (
    RECOMPUTE_POLICIES,
    recompute_bytes_per_layer,
    recompute_flops,
    recompute_kernel_extra,
    recompute_peak_bytes,
    recompute_terms,
)
from course_lib.experiments.lecture06.recompute_memory import (
    build,
    measure_memory_budget,
    measure_recompute,
    model_vs_measurement,
)
from course_lib.measure.live_tensors import LiveTensorMeter
from course_lib.model import configs
from course_lib.model.recompute import POLICIES, set_recompute
from course_lib.plots.recompute import memory_budget, recompute_memory

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = configs.get("tiny")


def _train_grads(cfg, policy, tokens):
    model = build(cfg, policy)
    tokens = tokens.to(model.tok_embeddings.weight.device)  # build() places the model on course_lib.dist.device()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_live_tensor_meter_counts_storages_not_views():
    x = torch.ones(256)  # made before the meter: not counted
    with LiveTensorMeter() as meter:
        a = x * 2  # 1 KiB
        view = a.view(16, 16)  # no new storage
        b = a + 1  # 1 KiB more: the peak
        del a, view
        meter.mark("after del")  # a's storage is free once its last view is gone
    assert meter.peak() == 2048 and meter.bytes_at("after del") == 1024 and meter.curve()[0] == 0, meter.curve()
    assert meter.peak(exclude=[b]) == 1024, "an excluded storage leaves the whole curve"


@pytest.mark.parametrize("policy", ["full", "selective", ["full", "selective"]])
def test_checkpointed_gradients_are_bit_equal(policy):
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    reference = _train_grads(TINY, "none", tokens)
    got = _train_grads(TINY, policy, tokens)
    for name, grad in reference.items():
        assert torch.equal(got[name], grad), (
            f"policy {policy!r}: the gradient of {name} differs from the one without checkpointing by up to "
            f"{(got[name] - grad).abs().max():.3g}. Recomputation must replay the forward exactly: same ops, "
            "same inputs, same order (a random op needs its RNG state restored)"
        )


CASES = [(TINY, 2, 16, "flash"), (TINY, 1, 64, "math"), (configs.get("small"), 1, 32, "flash")]


@pytest.mark.parametrize(("cfg", "batch", "seq_len", "attention"), CASES, ids=["tiny-flash", "tiny-math", "small"])
def test_measured_bytes_equal_the_model(cfg, batch, seq_len, attention):
    rows = model_vs_measurement(cfg, batch, seq_len, attention=attention)
    for row in rows:
        for what in ("saved", "peak"):
            model, got = row[f"model_{what}"], row[f"measured_{what}"]
            assert got == model, (
                f"{row['policy']}, {attention} attention, b={batch}, s={seq_len}: measured {got} B "
                f"{'kept after the forward pass' if what == 'saved' else 'at the peak of the backward pass'}, "
                f"the model says {model:.0f} B ({got - model:+.0f} B = {(got - model) / (4 * batch * seq_len):+.1f} "
                "floats per token). Compare recompute_terms() with what the block's ops keep"
            )
    by = {row["policy"]: row for row in rows}
    for what in ("saved", "peak"):
        assert by["none"][f"measured_{what}"] > by["selective"][f"measured_{what}"] > by["full"][f"measured_{what}"]
    # Saved-tensor hooks do not see inside a checkpoint: only what checkpoint saves, each block's input.
    assert by["selective"]["saved_hooks"] == by["full"]["saved_hooks"] == by["full"]["measured_saved"]
    assert by["none"]["saved_hooks"] == by["none"]["measured_saved"]


def test_policy_per_layer():
    policy = ["full", "selective"]
    got = measure_recompute(TINY, 2, 16, policy)
    model = recompute_peak_bytes(TINY, 2, 16, policy)
    extra = recompute_kernel_extra(TINY, 2, 16, policy, device_type=got["grads"][0].device.type)  # 0 on a CPU
    model = {k: model[k] + extra[k] for k in extra}
    assert (got["saved"], got["peak"]) == (model["saved"], model["peak"]), (
        f"full on layer 0, selective on layer 1: measured {got['saved']} B kept and {got['peak']} B peak, "
        f"the model {model['saved']:.0f} and {model['peak']:.0f}"
    )


def test_full_recompute_reruns_the_forward_matmuls_except_w2():
    batch, seq_len = 2, 24
    tokens = torch.randint(0, TINY.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(2))
    backward_flops = {}
    for policy in RECOMPUTE_POLICIES:
        model = build(TINY, policy)
        on = model.tok_embeddings.weight.device
        loss = model.loss(tokens[:, :-1].to(on), tokens[:, 1:].to(on))
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        backward_flops[policy] = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    for policy in RECOMPUTE_POLICIES:
        extra = backward_flops[policy] - backward_flops["none"]
        predicted = recompute_flops(TINY, batch, seq_len, policy)["recompute_matmul"]
        assert extra == predicted, (
            f"{policy}: backward ran {extra} more matmul FLOPs than without checkpointing, the model says "
            f"{predicted:.0f}. Full recomputation reruns wq, wk, wv, wo, w1, w3 (not w2: the recompute stops "
            "once backward has w2's input); selective reruns none"
        )
    ratio = recompute_flops(TINY, batch, seq_len, "full")["ratio"]
    assert 1.0 < ratio < 4 / 3, f"full recomputation costs {ratio:.3f}× the step: at most Korthikanti's 4/3"


# torch's own: importing inductor imports torch.utils.mkldnn, which still uses torch.jit.script_method
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_memory_budget_knob():
    batch, seq_len = 2, 16
    results = measure_memory_budget(TINY, batch, seq_len, budgets=(1.0, 0.5, 0.0))
    saved = {budget: r["saved"] for budget, r in results.items()}
    block_input = 4 * batch * seq_len * TINY.d_model
    eager_none = recompute_peak_bytes(TINY, batch, seq_len, "none")["saved"]
    assert saved[0.0] == block_input, (
        f"budget 0 should checkpoint the whole compiled region, keeping only its input ({block_input} B); "
        f"it kept {saved[0.0]} B"
    )
    assert eager_none >= saved[1.0] > saved[0.5] > saved[0.0], (
        f"bytes saved should fall with the budget (and budget 1.0 save no more than eager, {eager_none:.0f} B): {saved}"
    )
    reference = measure_recompute(TINY, batch, seq_len, "none")["grads"]
    for budget, r in results.items():
        for got, want in zip(r["grads"], reference):
            torch.testing.assert_close(got, want, msg=lambda m, b=budget: f"budget {b}: gradients differ. {m}")


def test_bad_policy_is_refused():
    model = build(TINY)
    with pytest.raises(ValueError, match="recompute policy 'partial'"):
        set_recompute(model, "partial")
    with pytest.raises(IndexError, match="out of range"):
        set_recompute(model, "full", [TINY.n_layers])
    with pytest.raises(TypeError, match="Transformer"):
        set_recompute(model.layers[0], "full")
    with pytest.raises(ValueError, match="one of"):
        recompute_terms(TINY, 1, 8, "partial")
    assert set(POLICIES) == set(RECOMPUTE_POLICIES), "the model's and the cost model's policy names must agree"


def test_none_undoes_checkpointing():
    model = build(TINY, "full")
    set_recompute(model, "none")
    assert all(layer.recompute is None for layer in model.layers)
    assert recompute_bytes_per_layer(TINY, 2, 16, "full") == 4 * 2 * 16 * TINY.d_model


def test_plots_draw_what_they_are_given():
    rows = [
        {
            "policy": p,
            "model_saved": 1024.0 * i,
            "measured_saved": 1024 * i,
            "model_peak": 2048.0,
            "measured_peak": 2048,
        }
        for i, p in enumerate(RECOMPUTE_POLICIES, 1)
    ]
    ax = recompute_memory(rows)
    assert len(ax.patches) == 4 * len(rows)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(RECOMPUTE_POLICIES)
    ax = memory_budget({1.0: 4096, 0.5: 2048, 0.0: 1024}, references={"eager none": 8192})
    assert list(ax.lines[0].get_ydata()) == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="keys"):
        recompute_memory([{"policy": "none"}])
