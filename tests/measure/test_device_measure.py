"""course_lib.measure on any device: the activation byte model per device kernel, measurements pinned
to an explicit device, and the measurement harnesses' tensors and timings on the rank's device.

No GPU is needed. What CUDA's SDPA kernels save is checked against PyTorch's own shape functions for
them (``torch/_meta_registrations.py``), run on meta tensors; the device argument of the activation
measurement is checked end to end on the meta device, whose SDPA runs the math kernel even when the
fused one is asked for: a measurement that ignored the argument, or a model that ignored the
device, would disagree with it.
"""

import ast
from pathlib import Path

import pytest
import torch

from course_lib.cost.activations import activation_bytes_per_layer, sdpa_extra_bytes, sdpa_saved_statistics
from course_lib.experiments.lecture03 import layer_activation_bytes
from course_lib.measure import saved_tensors
from course_lib.model import configs

CFG = configs.get("tiny", n_heads=8, n_kv_heads=4)
ROOT = Path(__file__).resolve().parents[2]
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _meta_qkv(batch, heads, seq_len, head_dim, dtype):
    # [b, s, a, d] transposed to [b, a, s, d], as the course model hands q, k, v to SDPA
    return [torch.empty(batch, seq_len, heads, head_dim, device="meta", dtype=dtype).transpose(1, 2) for _ in range(3)]


def _nbytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("seq_len", [1, 16, 31, 32, 33, 100])
def test_cuda_fp32_flash_is_the_memory_efficient_kernel_with_a_padded_log_sum_exp(seq_len):
    b, a = 2, 8
    q, k, v = _meta_qkv(b, a, seq_len, 8, torch.float32)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    expected = sdpa_saved_statistics("cuda", "flash", b, a, seq_len)
    assert sum(expected.values()) == _nbytes([lse, seed, offset]), (
        f"s={seq_len}: the memory-efficient kernel saves a log-sum-exp of shape {tuple(lse.shape)} "
        f"and {seed.dtype} seed/offset; sdpa_saved_statistics says {expected}"
    )
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= seq_len
    # laid out [b, s, a, d] as on CPU: wo's input is a view of the saved output, no extra b·s·q copy
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [16, 33])
def test_cuda_16bit_flash_is_flash_attention_2(dtype, seq_len):
    b, a = 2, 4
    q, k, v = _meta_qkv(b, a, seq_len, 8, dtype)
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    assert sum(sdpa_saved_statistics("cuda", "flash", b, a, seq_len, DTYPE_NAMES[dtype]).values()) == _nbytes(
        [lse, seed, offset]
    )
    assert out.transpose(1, 2).is_contiguous(), "the output keeps q's [b, s, a, d] layout: wo reads a view"


@pytest.mark.parametrize("seq_len", [16, 33])
def test_cpu_flash_saves_the_models_log_sum_exp(seq_len):
    b, a = 2, 8
    q, k, v = (torch.zeros(b, seq_len, a, 8).transpose(1, 2) for _ in range(3))
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    assert sdpa_saved_statistics("cpu", "flash", b, a, seq_len) == {"log-sum-exp": _nbytes([lse])}


def test_kernel_term_is_zero_on_cpu_and_the_padding_on_cuda():
    for s in (16, 32, 33):
        assert sdpa_extra_bytes(CFG, 2, s, "flash", "cpu") == 0
        for device_type in ("cpu", "cuda"):
            assert sdpa_extra_bytes(CFG, 2, s, "math", device_type) == 0
    a, b, s = CFG.n_heads, 2, 33
    assert sdpa_extra_bytes(CFG, b, s, "flash", "cuda") == b * a * (64 - s) * 4 + 16
    assert sdpa_extra_bytes(CFG, b, 32, "flash", "cuda") == 16, "a whole tile: only the RNG state is extra"
    assert sdpa_extra_bytes(CFG, b, s, "flash", "cuda", tp_size=2) == b * (a // 2) * (64 - s) * 4 + 16
    with pytest.raises(ValueError, match="measure it"):
        sdpa_saved_statistics("xpu", "flash", 1, 1, 16)


@pytest.mark.parametrize("attention", ["flash", "math"])
def test_measurement_honours_its_device_and_the_model_follows_the_kernel(attention):
    seq_lens = [16, 33]
    cpu = layer_activation_bytes.measure_layer_bytes(CFG, 2, seq_lens, attention=attention, device="cpu")
    meta = layer_activation_bytes.measure_layer_bytes(
        CFG, 2, seq_lens, attention=attention, device=torch.device("meta")
    )
    for s in seq_lens:
        model = activation_bytes_per_layer(CFG, 2, s, attention=attention)
        assert cpu[(s, False)] == model + sdpa_extra_bytes(CFG, 2, s, attention, "cpu") == model
        assert meta[(s, False)] == model + sdpa_extra_bytes(CFG, 2, s, attention, "meta"), (
            f"s={s}, {attention}: measured on meta {meta[(s, False)]} B; meta's SDPA runs the math kernel"
        )
    if attention == "flash":
        assert meta != cpu, "on meta the flash request falls back to math: the measurement must show it"


def test_measurement_refuses_mixed_devices_and_a_device_for_ranks():
    from course_lib.model.transformer import Transformer

    model = Transformer(CFG)
    x = torch.zeros(1, 8, CFG.d_model, device="meta")
    with pytest.raises(ValueError, match="one device"):
        saved_tensors.measure_block(model.layers[0], x, model.rope_cos[:8], model.rope_sin[:8])
    with pytest.raises(ValueError, match="own device"):
        layer_activation_bytes.measure_layer_bytes(CFG, 1, [8], tp_size=2, device="cpu")


def test_aten_census_runs_on_the_device_it_is_given():
    from course_lib.measure.aten_ops import course_model_ops

    cpu, meta = course_model_ops("tiny"), course_model_ops("tiny", device="meta")
    fused = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert fused in cpu.ops, "the default census is the CPU step's, with the CPU's fused attention kernel"
    # on meta SDPA has no fused kernel: the census shows the math kernel's matmuls and softmax instead
    assert fused not in meta.ops and {"aten.bmm.default", "aten._safe_softmax.default"} <= meta.ops


MEASURE = [  # under course_lib/
    "measure/saved_tensors",
    "measure/live_tensors",
    "measure/collective_timing",
    "measure/aten_ops",
    "measure/flop_counter",
    "experiments/small_run",
    "experiments/lecture02/ddp_trace",
    "experiments/lecture03/layer_activation_bytes",
    "experiments/lecture03/ring_attention_trace",
    "experiments/lecture03/expert_training",
    "experiments/lecture05/gradient_compression_runs",
    "experiments/lecture05/distillation_run",
    "experiments/lecture06/decode_speed",
    "experiments/lecture07/node_routing",
    "experiments/lecture08/checkpoint_runs",
    "experiments/lecture10/capstone_run",
]


@pytest.mark.parametrize("name", MEASURE)
def test_measure_harnesses_time_with_the_synchronising_clock(name):
    """No harness reads the wall clock itself: a GPU queues work, and only dist.timing.clock waits for it."""
    tree = ast.parse((ROOT / "course_lib" / f"{name}.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "time" not in imported, f"{name}.py imports time: use course_lib.dist.timing.clock"
