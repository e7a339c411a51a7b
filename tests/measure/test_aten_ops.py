"""course_lib.measure.aten_ops: the operator list a port starts from holds what the step must run,
counts what the FLOP formula counts, and a missing operator is reported."""

from __future__ import annotations

import runpy
import sys

import pytest

from course_lib.measure import aten_ops
from course_lib.model import configs
from course_lib.model.transformer import Transformer


@pytest.fixture(scope="module")
def tiny():
    return aten_ops.course_model_ops("tiny")


@pytest.fixture(scope="module")
def deepseek_mini():
    return aten_ops.course_model_ops("deepseek-v3-mini")


def test_the_core_operators_of_a_training_step_are_listed(tiny):
    expected = {
        "aten.mm.default",  # every nn.Linear, forward and backward
        "aten.embedding.default",
        "aten.embedding_dense_backward.default",
        "aten.nll_loss_forward.default",  # cross-entropy = log_softmax + nll_loss
        "aten._log_softmax.default",
        "aten._log_softmax_backward_data.default",
        "aten.silu.default",
        "aten.silu_backward.default",
        "aten.rsqrt.default",  # RMSNorm
        "aten.lerp_.Scalar",  # AdamW's first moment
        "aten.addcmul_.default",  # ... its second
        "aten.addcdiv_.default",  # ... and the update
    }
    assert expected <= tiny.ops, f"missing from the census: {sorted(expected - tiny.ops)}"
    assert any("scaled_dot_product" in op for op in tiny.ops), "attention: one fused SDPA operator on this device"
    assert any("scaled_dot_product" in op and op.endswith("_backward.default") for op in tiny.ops)
    assert all(op.startswith("aten.") for op in tiny.ops)
    assert {"aten.view.default", "aten.t.default"} <= tiny.views and "aten.mm.default" not in tiny.views
    assert "aten.mm.default" in tiny.core


def test_phases_split_where_the_step_does(tiny):
    """Every nn.Linear is one mm forward and two backward (dX = dY·Wᵀ, dW = Xᵀ·dY): the 2N + 4N of
    the 6N rule, counted by the dispatcher. The optimizer does no matmul; the forward no update."""
    cfg = configs.get("tiny")
    linears = 7 * cfg.n_layers + 1  # wq, wk, wv, wo, w1, w3, w2 per layer, and the output head
    counts = tiny.counts
    assert (counts["forward"]["aten.mm.default"], counts["backward"]["aten.mm.default"]) == (linears, 2 * linears)
    assert counts["optimizer"]["aten.mm.default"] == 0 and counts["forward"]["aten.lerp_.Scalar"] == 0
    n_tensors = 9 * cfg.n_layers + 3  # 7 matrices and 2 norm gains per layer; embedding, final norm, head
    assert n_tensors == len(list(Transformer(cfg).parameters()))
    assert counts["optimizer"]["aten.lerp_.Scalar"] == n_tensors, "AdamW (foreach=False): one lerp_ per parameter"


def test_a_planted_absence_is_reported(tiny):
    """A backend that lacks one operator: missing_ops names it, and only it."""
    supported = tiny.ops - {"aten.mm.default"}
    assert aten_ops.missing_ops(tiny.ops, supported) == ["aten.mm.default"]
    assert aten_ops.missing_ops(tiny.ops, tiny.ops) == []


def test_moe_and_mla_add_routing_operators(tiny, deepseek_mini):
    """What a port of the DeepSeek-V3 architecture needs beyond the dense model: the router's sigmoid
    and top-k, the dispatch's index_add, and attention with a mask (the math path's bmm)."""
    added = set(aten_ops.missing_ops(deepseek_mini.ops, tiny.ops))
    needed = {"aten.topk.default", "aten.sigmoid.default", "aten.index_add.default", "aten.bmm.default"}
    assert needed <= added, f"expected among the added operators: {sorted(needed - added)}"


@pytest.mark.slow
def test_python_dash_m_prints_the_list(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["aten_ops", "--config", "tiny", "--compare", "deepseek-v3-mini"])
    sys.modules.pop("course_lib.measure.aten_ops", None)  # run_module would warn about a loaded module
    try:
        runpy.run_module("course_lib.measure.aten_ops", run_name="__main__")
    finally:
        sys.modules["course_lib.measure.aten_ops"] = aten_ops
    out = capsys.readouterr().out
    assert "aten operators in one AdamW training step" in out and "aten.mm.default" in out
    assert "deepseek-v3-mini adds" in out and "aten.topk.default" in out
