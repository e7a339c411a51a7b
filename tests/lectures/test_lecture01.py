"""Lecture 01's measurements and rules: the memory census of one training step against the formulas,
its plot, and a check on the notebook's text (e4m3 overflow is stated as this build's convention, not the
format's). That every printed claim is asserted is checked for every lecture in tests/lectures/test_lectures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from course_lib.cost import memory as cost_memory
from course_lib.cost.activations import activation_bytes_per_layer
from course_lib.measure.step_memory import KINDS, PHASES, training_step_memory
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.plots import basics as plots

LECTURE = Path(__file__).resolve().parents[2] / "lectures" / "01_foundations.ipynb"


def cells(kind: str) -> list[str]:
    nb = json.loads(LECTURE.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


@pytest.mark.parametrize("batch, seq_len", [(2, 64), (3, 16)])
def test_one_step_holds_what_the_formulas_say(batch, seq_len):
    cfg = configs.get("tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    y = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    rows = training_step_memory(model, opt, x, y)
    assert tuple(rows) == PHASES and all(tuple(r) == KINDS for r in rows.values())
    n = cfg.n_params()
    assert [r["parameters"] for r in rows.values()] == [4 * n] * 5
    assert [r["gradients"] for r in rows.values()] == [0, 0, 4 * n, 4 * n, 0], "grads exist from backward to zero_grad"
    assert [r["optimizer state"] for r in rows.values()] == [0, 0, 0, 8 * n, 8 * n], "AdamW's m, v appear in step 1"
    assert rows["after optimizer step"]["optimizer state"] == cost_memory.state_bytes("adamw", model.parameters())
    d, v, bs = cfg.d_model, cfg.vocab_size, batch * seq_len
    # Layers by the activation model; the head: final norm (input, rsqrt, normalised), output linear's
    # input, log-softmax output (fp32); token ids and targets (int64); nll_loss's scalar total weight.
    head = 4 * (3 * bs * d + bs + bs * v) + 8 * 2 * bs + 4
    expected = cfg.n_layers * activation_bytes_per_layer(cfg, batch, seq_len) + head
    assert rows["after forward"]["activations"] == expected
    assert [r["activations"] for k, r in rows.items() if k != "after forward"] == [0] * 4


def test_memory_timeline_stacks_each_kind():
    phases = {
        "start": {"parameters": 2**20, "activations": 0},
        "after forward": {"parameters": 2**20, "activations": 3 * 2**20},
    }
    ax = plots.memory_timeline(phases)
    tops = [p.get_y() + p.get_height() for p in ax.patches]
    assert sorted(tops) == [1.0, 1.0, 1.0, 4.0], "MiB: each phase stacks parameters then activations"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["parameters", "activations"]
    with pytest.raises(ValueError, match="same kinds"):
        plots.memory_timeline({"a": {"parameters": 1}, "b": {"gradients": 1}})


def test_e4m3_overflow_is_stated_as_a_convention():
    text = "\n".join(cells("markdown"))
    assert "non-saturating" in text and "NaN" in text and "OFP8" in text, (
        "lecture 01 must say that saturation at ±448 is this build's conversion and that OCP's "
        "non-saturating conversion gives NaN"
    )
    code = "\n".join(cells("code"))
    assert "torch.float8_e4m3fn" in code and "448.0, 448.0" in code, "a cell must cast values above 448 and assert it"
    # What that cell asserts, on the torch this suite runs:
    too_big = torch.tensor([500.0, 1e4, -1e4])
    assert too_big.to(torch.float8_e4m3fn).float().tolist() == [448.0, 448.0, -448.0]
