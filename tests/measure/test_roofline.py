"""course_lib.cost.roofline against hand-computed formulas and the FLOP formulas of cost.flops, and
course_lib.measure.cpu_roofline's measured CPU roofline against the roofline model itself."""

from __future__ import annotations

import pytest
import torch

from course_lib.cost import flops, hardware, roofline
from course_lib.measure import cpu_roofline
from course_lib.model import configs

MOE_TINY = dict(n_routed_experts=8, n_activated_experts=2, n_shared_experts=1, moe_d_ff=32, first_k_dense=1)
MLA_TINY = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_kv_heads=4)


def test_gemm_kernel_is_2mnk_over_the_three_matrices():
    kern = roofline.gemm("w", m=4, n=3, k=2, bytes_per_element=2)
    assert kern.flops == 2 * 4 * 3 * 2 == 48
    assert kern.bytes_moved == 2 * (4 * 2 + 2 * 3 + 4 * 3) == 52
    assert kern.intensity == 48 / 52
    assert kern.intensity == flops.arithmetic_intensity(4, 3, 2, 2)


def test_attention_kernel_flash_and_naive_bytes_by_hand():
    """tiny: H = 4 query heads, 2 K/V heads, head_dim 16; one sequence of T = 8 tokens, bf16."""
    cfg = configs.get("tiny")
    flash = roofline.attention_kernel(cfg, batch=1, seq_len=8, bytes_per_element=2, flash=True)
    naive = roofline.attention_kernel(cfg, batch=1, seq_len=8, bytes_per_element=2, flash=False)
    assert flash.flops == naive.flops == 2 * 8 * 8 * 4 * (16 + 16)  # scores and weighted sum
    # flash: Q and O of 4 heads, K and V of 2 heads, 8 tokens each
    assert flash.bytes_moved == 2 * (8 * 4 * 32 + 8 * 2 * 32)
    # naive, per query head: Q, K (8 x 16 each); S written, read, P written, read (4 x 8 x 8); V, O
    assert naive.bytes_moved == 2 * 4 * (8 * 16 + 8 * 16 + 4 * 8 * 8 + 8 * 16 + 8 * 16)


def test_naive_attention_is_memory_bound_and_flash_is_not():
    """Llama 3.1 405B, head_dim 128, 8k tokens, bf16: the naive kernel's intensity is about
    head_dim/bytes = 64 FLOP/byte whatever T, under the H100's ridge of 295; FlashAttention's
    compulsory traffic leaves it far to the right (Dao et al. 2022's point)."""
    cfg, h100 = configs.get("llama-3.1-405b"), roofline.of(hardware.H100)
    naive = roofline.attention_kernel(cfg, 1, 8192, flash=False)
    flash = roofline.attention_kernel(cfg, 1, 8192, flash=True)
    assert naive.intensity == pytest.approx(64, rel=0.02)
    assert h100.bound(naive.intensity) == "memory" and h100.bound(flash.intensity) == "compute"


@pytest.mark.parametrize(
    "name, overrides",
    [("tiny", {}), ("tiny", MOE_TINY), ("llama-3.1-405b", {}), ("gpt-oss-20b", {}), ("qwen2.5-72b", {})],
)
def test_training_kernels_sum_to_the_flops_formula(name, overrides):
    """Tolerance 0: three times the forward kernels' FLOPs (forward, dX, dW) is 6N + 12·L·H·Q·T per
    token, the formula tests/cost/test_flops.py checks against FlopCounterMode."""
    cfg = configs.get(name, **overrides)
    batch, seq_len = 2, 64
    kernels = roofline.training_kernels(cfg, batch, seq_len)
    counted = 3 * sum(k.count * k.flops for k in kernels)
    assert counted == pytest.approx(flops.train_flops_per_token(cfg, seq_len) * batch * seq_len, rel=1e-12)


def test_mla_training_kernels_leave_out_only_the_latent_norms():
    """MLA's two latent RMSNorm gains (rq + rkv per layer) are parameters but not matmuls."""
    cfg = configs.get("tiny", **MLA_TINY)
    kernels = roofline.training_kernels(cfg, 1, 32)
    counted = 3 * sum(k.count * k.flops for k in kernels)
    norms = 6 * cfg.n_layers * (cfg.q_lora_rank + cfg.kv_lora_rank) * 32
    assert counted == flops.train_flops_per_token(cfg, 32) * 32 - norms


@pytest.mark.parametrize("name", ["llama-3.1-405b", "gpt-oss-20b", "deepseek-v3"])
def test_decode_kv_reads_are_the_kv_cache(name):
    """The KV-read kernels of one decoding step read each sequence's whole cache once:
    cfg.kv_cache_bytes(context) (sliding layers only their window), plus each layer's query and output."""
    cfg, batch, context = configs.get(name), 3, 4096
    reads = [k for k in roofline.decode_kernels(cfg, batch, context) if k.kind == "kv-read"]
    if cfg.is_mla:
        q_and_o = cfg.n_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # absorbed query, latent output
    else:
        q_and_o = 2 * cfg.n_heads * cfg.head_dim
    cache = sum(k.count * k.bytes_moved for k in reads) - 2 * batch * cfg.n_layers * q_and_o
    assert cache == batch * cfg.kv_cache_bytes(context)


def test_decode_gemvs_are_memory_bound_on_every_accelerator():
    """Zhao et al., Insights into DeepSeek-V3 (ISCA 2025) §2.1.2: decoding turns GEMMs into GEMVs, limited by
    memory bandwidth. One token, bf16:
    every weight GEMV is near 1 FLOP/byte, left of every ridge point of the table; a training GEMM on
    8k tokens is right of every one."""
    cfg = configs.get("llama-3.1-405b")
    have, _ = roofline.rooflines(hardware.ACCELERATORS.values(), "bf16")
    gemvs = [k for k in roofline.decode_kernels(cfg, 1, 8192) if k.kind == "gemv"]
    gemms = [k for k in roofline.training_kernels(cfg, 1, 8192) if k.kind == "gemm"]
    # m = 1: nk/(nk + n + k) = 1 - 1/n - 1/k to first order; the narrowest matrix (wk, k = 16384,
    # n = 1024) is 1.0e-3 below 1
    assert all(k.intensity == pytest.approx(1.0, rel=2e-3) for k in gemvs)
    for roof in have.values():
        assert all(roof.bound(k.intensity) == "memory" for k in gemvs), roof.name
        assert all(roof.bound(k.intensity) == "compute" for k in gemms), roof.name


def test_batching_lifts_weight_gemvs_not_kv_reads():
    """b sequences share each weight read (intensity ≈ b FLOP/byte in bf16), but each reads its own cache."""
    cfg = configs.get("llama-3.1-405b")
    one, sixteen = ({k.name: k for k in roofline.decode_kernels(cfg, b, 4096)} for b in (1, 16))
    assert sixteen["w1"].intensity == pytest.approx(16 * one["w1"].intensity, rel=0.01)
    assert sixteen["kv-read (4096 tokens)"].intensity == one["kv-read (4096 tokens)"].intensity
    # GQA: 2·(H/Hkv)/bytes = 2·16/2 = 16 FLOP/byte, up to the query and output vectors
    assert one["kv-read (4096 tokens)"].intensity == pytest.approx(16, rel=0.01)


def test_moe_decode_touches_top_k_experts_per_token():
    assert roofline.experts_touched(256, 8, 1) == pytest.approx(8)
    assert roofline.experts_touched(256, 8, 4096) == pytest.approx(256)
    cfg = configs.get("deepseek-v3")
    routed = {k.name: k for k in roofline.decode_kernels(cfg, 1, 1024)}["routed w1"]
    assert routed.count == pytest.approx(8 * (cfg.n_layers - cfg.first_k_dense))
    assert routed.shape[0] == pytest.approx(1.0), "one token per touched expert"


def test_place_gives_the_least_time():
    roof = roofline.Roofline("toy", peak_flops_per_second=100.0, bytes_per_second=10.0)
    memory_bound = roofline.Kernel("a", "gemv", flops=50.0, bytes_moved=100.0, count=2)
    compute_bound = roofline.Kernel("b", "gemm", flops=1000.0, bytes_moved=1.0)
    p_mem, p_comp = roofline.place([memory_bound, compute_bound], roof)
    assert (p_mem.bound, p_mem.seconds, p_mem.fraction_of_peak) == ("memory", 2 * 100.0 / 10.0, 0.05)
    assert (p_comp.bound, p_comp.seconds, p_comp.fraction_of_peak) == ("compute", 1000.0 / 100.0, 1.0)
    with pytest.raises(ValueError, match="intensity"):
        roof.attainable(0.0)


def test_linear_attention_layers_are_refused_with_a_reason():
    with pytest.raises(NotImplementedError, match="Gated DeltaNet"):
        roofline.training_kernels(configs.get("qwen3-next-80b-a3b"), 1, 64)


# ---------------------------------------------------------------------- this CPU, measured


@pytest.fixture(scope="module")
def cpu():
    """One measurement for the module, on one thread. With two threads on a 2-core machine that other
    jobs kept busy (load average 5), the measured "peak" and a kernel timed a moment later disagreed
    by up to 4x: a descheduled OpenMP thread stalls one matmul and not the next. One thread keeps the
    comparison between roof and kernels fair (and is the portability matrix's setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cpu_roofline.measure_cpu_roofline()
    finally:
        torch.set_num_threads(threads)


def test_measured_gemm_flops_are_2mnk(cpu):
    """Tolerance 0: the FLOPs each measured GEMM/GEMV is credited with (from cost.roofline) equal what
    FlopCounterMode counts in the call that was timed, 2·m·n·k."""
    matmuls = [m for m in cpu.kernels if m.kernel.kind in ("gemm", "gemv")]
    assert len(matmuls) >= 4
    for measured in matmuls:
        m, n, k = measured.kernel.shape
        assert measured.counted_flops == measured.kernel.flops == 2 * m * n * k, measured.kernel.name


@pytest.mark.serial
def test_measured_kernels_stay_under_the_measured_roof(cpu):
    """No kernel beats min(peak, I·bandwidth) by more than 1.5x. The margin: STREAM's copy counts the
    bytes of 2 arrays while a cache with write-allocate moves 3 (it reads the destination line before
    writing it), so a kernel that mostly reads (a GEMV) can stream up to 3/2 of the copy figure; the
    roof takes the better of copy and triad (4/3) to narrow that. Compute-bound kernels are under
    the peak up to timing noise, which best-of rounds keep to a few percent. A kernel far above the
    roof means its FLOPs or bytes are miscounted, or the roof was measured while the machine was busy."""
    roof = cpu.roofline
    for measured in cpu.kernels:
        attainable = roof.attainable(measured.kernel.intensity)
        assert measured.flops_per_second <= 1.5 * attainable, (
            f"{measured.kernel.name}: {measured.flops_per_second:.3g} FLOP/s at {measured.kernel.intensity:.3g} "
            f"FLOP/byte, above 1.5 x the roof's {attainable:.3g} (peak {roof.peak_flops_per_second:.3g}, "
            f"{roof.bytes_per_second:.3g} B/s); check the kernel's FLOPs and bytes in cost.roofline"
        )


@pytest.mark.serial
def test_a_training_gemm_gets_a_far_larger_share_of_peak_than_a_decode_gemv(cpu):
    """The roofline's verdict, measured. Intensity: the training GEMM sits ~200x right of the GEMV
    (arithmetic, exact). Measured: the GEMM reaches at least a quarter of the peak (BLAS blocks a
    large GEMM as well as the square one that defined the peak; measured 0.5-0.97 on the course
    machine, busy or not), and more than twice the GEMV's share: the GEMV is held to ≤ 1.5·I·bandwidth
    with I = 0.5 FLOP/byte in fp32, 0.05-0.12 of peak on the course machine with either kernel set."""
    gemm, gemv = cpu.kernel("train w1"), cpu.kernel("decode w1, batch 1")
    assert gemm.kernel.intensity > 200 * gemv.kernel.intensity
    peak = cpu.peak_flops_per_second
    gemm_share, gemv_share = gemm.flops_per_second / peak, gemv.flops_per_second / peak
    assert gemm_share >= 0.25, f"a large fp32 GEMM reached only {gemm_share:.0%} of the measured peak"
    assert gemm_share > 2 * gemv_share, (
        f"GEMM {gemm_share:.0%} of peak, GEMV {gemv_share:.0%}: a memory-bound GEMV should get far less"
    )
