"""The per-layer activation-memory model (course_lib.cost.activations) against what autograd saves.

The brief asks for agreement within 10%; the model lists every tensor the course block saves, so
the measured bytes come out equal, and 10% is the bound asserted (a change to model.py that saves
one more [b, s, h] tensor moves the total by ~5% and shows up in the message).
"""

import pytest

from course_lib.cost.activations import activation_bytes_per_layer, korthikanti_bytes_per_layer, sdpa_extra_bytes
from course_lib.dist import runtime
from course_lib.experiments.lecture03.layer_activation_bytes import measure_layer_bytes
from course_lib.model import configs

CFG = configs.get("tiny", n_heads=8, n_kv_heads=4)
TOLERANCE = 0.10


def _here() -> str:
    """The device type an in-process measurement runs on (cuda on a GPU machine, see measure_layer_bytes)."""
    return runtime.device().type


def _check(measured: dict, tp: int, attention: str, batch: int, device_type: str):
    for (s, sp), got in measured.items():
        # the model counts the CPU kernels; another device's SDPA kernel saves other statistics
        model = activation_bytes_per_layer(CFG, batch, s, tp, sp, attention)
        model += sdpa_extra_bytes(CFG, batch, s, attention, device_type, tp)
        assert abs(got - model) <= TOLERANCE * model, (
            f"{'TP+SP' if sp else 'TP' if tp > 1 else 'dense'} t={tp}, s={s}, {attention} attention: measured "
            f"{got} B saved for backward, the model predicts {model:.0f} B ({(got - model) / model:+.1%}); "
            "compare activation_terms() with what each operation of the block saves"
        )


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_dense_layer_measurement_matches_model(attention):
    _check(measure_layer_bytes(CFG, 2, [16, 32, 64], attention=attention), 1, attention, 2, _here())


def test_math_attention_adds_the_quadratic_term():
    flash = measure_layer_bytes(CFG, 1, [16, 64], attention="flash")
    math = measure_layer_bytes(CFG, 1, [16, 64], attention="math")
    extra = {s: math[(s, False)] - flash[(s, False)] for s in (16, 64)}
    # the s×s probabilities per head replace one log-sum-exp per head and row: a·s·(s - 1) floats
    for s, e in extra.items():
        # on CUDA the flash kernel's statistics differ from the CPU's by sdpa_extra_bytes (0 on CPU)
        assert e == 4 * CFG.n_heads * s * (s - 1) - sdpa_extra_bytes(CFG, 1, s, "flash", _here()), (
            f"at s={s} the math kernel should keep a·s² softmax probabilities instead of a·s log-sum-exps "
            f"({4 * CFG.n_heads * s * (s - 1)} B more), measured {e} B more"
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_and_sp_measurements_match_model(tp):
    measured = measure_layer_bytes(CFG, 2, [16, 32], tp, settings=(False, True))
    ranks_on = runtime.choice(tp).device_type  # the ranks' device: cpu under gloo, cuda with a GPU each
    _check(measured, tp, "flash", 2, ranks_on)
    dense = measure_layer_bytes(CFG, 2, [16, 32])
    for s in (16, 32):
        # without the device kernel's extra statistics (0 on CPU): the RNG state is per rank, not split
        split = measured[(s, True)] - sdpa_extra_bytes(CFG, 2, s, "flash", ranks_on, tp)
        whole = dense[(s, False)] - sdpa_extra_bytes(CFG, 2, s, "flash", _here())
        assert split * tp == whole, (
            f"TP+SP keeps every activation split t ways (Korthikanti eq. 3): measured {measured[(s, True)]} B per "
            f"rank at t={tp} should be the dense {dense[(s, False)]} B / {tp}"
        )
        assert measured[(s, True)] < measured[(s, False)] < dense[(s, False)], "dense > TP > TP+SP per rank"


def test_korthikanti_equations_are_consistent():
    s, b, h, a = 2048, 1, 12288, 96  # a GPT-3 175B layer (Brown et al. 2020)
    none = korthikanti_bytes_per_layer(s, b, h, a)
    assert none == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_bytes_per_layer(s, b, h, a, tp_size=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_bytes_per_layer(s, b, h, a, tp_size=8, sequence_parallel=True) == pytest.approx(none / 8)
    # eq. 2 at t = 1 is eq. 1: nothing is split, nothing is replicated
    assert korthikanti_bytes_per_layer(s, b, h, a, tp_size=1, sequence_parallel=True) == pytest.approx(none)
