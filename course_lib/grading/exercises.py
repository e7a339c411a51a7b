"""The lectures' exercises: a placeholder in the notebook, a check that fails with a hint until the
answer is right, and the reference answer in ``solutions/lectures/answers.py``.

An exercise cell defines the learner's answer and passes it through :func:`answer`::

    def model_state_gb(psi, n, stage):
        todo("model_state_gb")          # your code replaces this line

    model_state_gb = answer("model_state_gb", model_state_gb)

For a learner :func:`answer` returns their own object, and the check in the next cell raises an
``AssertionError`` that says what to look at until it is right. When ``COURSE_REFERENCE_ANSWERS=1``
(set for every pytest run by the root ``conftest.py``, so nbval executes the lectures with it, and by
``./course lectures --execute``) it returns the reference answer instead: the stored outputs come
from the reference, and the suite proves both directions — placeholder fails, reference passes
(``tests/grading/test_exercises.py``).

The checks live here, not in the notebooks, so that the test suite can call them too. A check takes
the learner's answer and, where the answer is compared with a measurement, that measurement.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from course_lib.cost import hardware, roofline
from course_lib.cost.checkpoint import checkpoint_overhead, young_interval
from course_lib.cost.collective_bytes import ring_comm_bytes, tp_received_elements
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.dist import device
from course_lib.grading.adapter import load
from course_lib.inference.paged import PagedCache
from course_lib.model import configs
from course_lib.model.lora import apply_lora, lora_parameters
from course_lib.model.transformer import Transformer
from course_lib.optim import optimizers
from course_lib.parallel.compose import Layout as ComposedLayout
from course_lib.parallel.compose import check_layout

ROOT = Path(__file__).resolve().parents[2]
ANSWERS = ROOT / "solutions" / "lectures" / "answers.py"
ENV = "COURSE_REFERENCE_ANSWERS"


class NotAnswered(NotImplementedError):
    """Raised by a placeholder: the exercise has not been answered yet."""


def todo(exercise: str):
    """The placeholder of an exercise's function body."""
    raise NotAnswered(f"exercise {exercise!r}: not answered yet — replace the todo(...) line with your code")


def answer(name: str, mine):
    """``mine``, or the reference answer ``name`` of solutions/lectures/answers.py when $COURSE_REFERENCE_ANSWERS=1."""
    if os.environ.get(ENV) == "1":
        return getattr(load(ANSWERS), name)
    return mine


def _call(exercise: str, fn, *args):
    """Call the learner's function; a placeholder (or no answer at all) becomes a failed check with a hint."""
    if fn is None:
        raise AssertionError(f"exercise {exercise!r}: not answered yet — assign your answer in the cell above")
    try:
        return fn(*args)
    except NotAnswered as e:
        raise AssertionError(str(e)) from None


def _refuse(*args, **kwargs):
    raise AssertionError(
        "this course_lib function answers the exercise, so it is switched off while the check runs: derive the "
        "answer from the lecture's formula instead"
    )


@contextlib.contextmanager
def _forbidden(*functions):
    """While the block runs, every function in ``functions`` raises :func:`_refuse`'s AssertionError.

    The function's code object is swapped, not its name in one module, so the learner's own import of it
    (``from course_lib.cost.memory import zero_model_state_bytes``, under any name) refuses too. The
    check computes what it needs from the library *before* entering the block."""
    saved = [(f, f.__code__) for f in functions]
    try:
        for f, _ in saved:
            f.__code__ = _refuse.__code__
        yield
    finally:
        for f, code in saved:
            f.__code__ = code


# -------------------------------------------------------------------------- lecture 01: AdamW


def check_adamw_step(my_adamw_step) -> str:
    """20 steps of the learner's in-place AdamW against ``torch.optim.AdamW``.

    Tolerance 1e-6 relative (1e-7 absolute): a correct formula written in another order than torch's
    (``beta1 * m + (1 - beta1) * g`` instead of ``m.lerp_(g, 1 - beta1)``) differs by a few fp32 ulps
    per step (eps = 1.2e-7), 20 steps by ~20 ulps at worst; a wrong formula (coupled decay, a missing
    bias correction, eps inside the square root) is off by 1e-3 or more.
    """
    dev = device()  # the learner's step runs where the lecture computes; the numbers are drawn on the host
    gen = torch.Generator().manual_seed(0)  # host: the same draw on every machine
    p_mine = torch.randn(32, 16, generator=gen).to(dev)  # host: drawn with gen
    p_torch = torch.nn.Parameter(p_mine.clone())
    ref = torch.optim.AdamW([p_torch], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    m, v = torch.zeros_like(p_mine), torch.zeros_like(p_mine)
    for t in range(1, 21):
        # gradients over five orders of magnitude: a misplaced eps or bias correction shows somewhere
        # host: drawn with gen on the host (the same numbers on every machine), then moved to dev
        grad = (torch.randn(32, 16, generator=gen) * 10 ** torch.randint(-3, 2, (32, 16), generator=gen)).to(dev)
        with _forbidden(optimizers.adamw_):  # the library's step is the answer, not a way to it
            _call("my_adamw_step", my_adamw_step, p_mine, grad, m, v, t, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        p_torch.grad = grad.clone()
        ref.step()
    torch.testing.assert_close(
        p_mine,
        p_torch.detach(),
        rtol=1e-6,
        atol=1e-7,
        msg=lambda s: (
            "your AdamW step disagrees with torch.optim.AdamW. Is the decay decoupled (θ·(1 − ηλ) "
            "before the update)? Are both moments bias-corrected with step t? Is eps added after the square root? " + s
        ),
    )
    return "AdamW exercise: your update matches torch.optim.AdamW over 20 steps within 1e-6"


# ------------------------------------------------------------------ lecture 02: ZeRO and TP


ZERO_PAPER_FIGURE_1 = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB per rank, Ψ = 7.5B, N_d = 64 (Rajbhandari et al. 2020)


def check_model_state_gb(model_state_gb, lowest_stage_that_fits_70b) -> str:
    """The learner's per-rank model-state gigabytes against the ZeRO paper's Figure 1 and the library's formula."""
    cases = [(psi, n) for psi, n in ((106_816, 4), (70_000_000_000, 64), (1_000, 3))]
    wants = {(psi, n, st): zero_model_state_bytes(psi, n, st) / 1e9 for psi, n in cases for st in range(4)}
    with _forbidden(zero_model_state_bytes):  # the library's formula is the answer, not a way to it
        for stage, gb in ZERO_PAPER_FIGURE_1.items():
            mine = _call("model_state_gb", model_state_gb, 7_500_000_000, 64, stage)
            assert round(mine, 1) == gb, (
                f"stage {stage}: you get {mine:.2f} GB for 7.5B parameters on 64 ranks, the paper {gb} GB. "
                "Which of parameters (2 B), gradients (2 B), optimizer state (12 B) does each stage split?"
            )
            for psi, n in cases:
                want = wants[psi, n, stage]
                # the same sum of three terms: equal up to the last bit of a float64 division
                assert math.isclose(model_state_gb(psi, n, stage), want), (
                    f"stage {stage}, Ψ={psi}, N={n}: expected {want} GB"
                )
        fits = [s for s in range(4) if model_state_gb(70_000_000_000, 64, s) <= 80]
    if lowest_stage_that_fits_70b is None:
        raise AssertionError("model_state_gb is right; now set lowest_stage_that_fits_70b")
    assert lowest_stage_that_fits_70b == min(fits), (
        f"stage {lowest_stage_that_fits_70b} needs {model_state_gb(70e9, 64, lowest_stage_that_fits_70b):.0f} GB "
        "per rank for 70B parameters on 64 ranks: which is the first stage under 80 GB?"
    )
    return "ZeRO exercise: your model-state sizes match the paper's Figure 1 and the library's formula"


def check_tp_step_prediction(predict_tp_step, measured: dict[int, tuple[int, int, int]], d_model: int) -> str:
    """The learner's (forward all-reduces, backward all-reduces, bytes) against the counter's, per n_layers.

    ``measured[n_layers]`` comes from a real TPTransformer step at t = 2, b = 2, s = 16 (the counter
    counts calls and bytes exactly, so the comparison is exact).
    """
    for n_layers, counted in measured.items():
        predicted = tuple(_call("predict_tp_step", predict_tp_step, n_layers, 2, 16, d_model))
        assert predicted == tuple(counted), (
            f"with {n_layers} blocks the counter saw {counted[0]} all-reduces forward, {counted[1]} backward and "
            f"{counted[2]} bytes; you predicted {predicted}. Walk the model: embedding (g), each block (attention: "
            "f then g; MLP: f then g), final norm, output layer (f), cross-entropy (3 all-reduces of one float per token)."
        )
    return f"TP exercise: your prediction equals the counted all-reduces for n_layers in {sorted(measured)}"


# ------------------------------------------------------------- lecture 03: ring attention


def check_ring_backward_bytes(ring_backward_bytes, measured: int, B: int, S: int, HKV: int, D: int, N: int) -> str:
    """The learner's bytes rank 0 sends in ring attention's *backward*, with K and V in ``kv_bytes`` bytes per
    element and the dK, dV accumulators in fp32: against the counter (fp32, the lecture's run) and against
    :func:`~course_lib.cost.collective_bytes.ring_comm_bytes` in bf16 at other sizes, which the check switches off
    while the learner's function runs (§2.5 shows it)."""
    cases = [(B, S, HKV, D, N, 4), (B, S, HKV, D, N, 2), (1, 131_072, 8, 128, 16, 2), (2, 4096, 4, 64, 8, 2)]
    wants = [ring_comm_bytes(b, s, h, d, n, kv)["backward_bytes"] for b, s, h, d, n, kv in cases]
    assert wants[0] == measured, f"the lecture's run measured {measured} B, the formula {wants[0]}: rerun §2.5"
    with _forbidden(ring_comm_bytes):
        for (b, s, h, d, n, kv), want in zip(cases, wants):
            got = _call("ring_backward_bytes", ring_backward_bytes, b, s, h, d, n, kv)
            assert got == want, (
                f"B={b}, S={s}, HKV={h}, D={d}, N={n}, K/V in {kv}-byte elements: you give {got} B, rank 0 sends "
                f"{want} B. In the backward K and V make the forward's N - 1 hops again, and the gradients dK and dV "
                "travel too: how many hops bring them home, and in which precision are they accumulated?"
            )
    return f"ring exercise: your backward bytes match the counter's {measured} B and the formula at three other sizes"


# -------------------------------------------------------------------------- lecture 04: KV cache with a window


KV_FIELDS = ("n_layers", "layer_types", "n_kv_heads", "head_dim", "sliding_window")


def check_kv_cache_bytes(kv_cache_bytes) -> str:
    """The learner's bytes of bf16 KV cache one sequence holds in gpt-oss, against ModelConfig.kv_cache_bytes.

    The learner's function is handed the config's fields only (:data:`KV_FIELDS`), not the ModelConfig:
    the exercise is to derive the count, and ``cfg.kv_cache_bytes`` (shown in §6) would answer it in one
    call. A third config, gpt-oss-20b with a 512-token window, catches a window typed in as 128.
    """
    cases = [(name, configs.get(name)) for name in ("gpt-oss-120b", "gpt-oss-20b")]
    cases.append(("gpt-oss-20b with a 512-token window", configs.get("gpt-oss-20b", sliding_window=512)))
    for name, cfg in cases:
        fields = SimpleNamespace(**{f: getattr(cfg, f) for f in KV_FIELDS})
        for context in (1, 100, 128, 129, 513, 4096, 131_072):
            want = cfg.kv_cache_bytes(context, 2)
            try:
                got = _call("kv_cache_bytes", kv_cache_bytes, fields, context)
            except AttributeError as e:
                raise AssertionError(
                    f"your function used something the check does not hand it ({e}): it gets the fields "
                    f"{', '.join(KV_FIELDS)} only. Derive the count from them: ModelConfig's own kv_cache_bytes "
                    "is the answer, not a way to it"
                ) from None
            assert got == want, (
                f"{name} at {context} tokens: you give {got:,} B, the cache holds {want:,} B. Per layer and token a "
                f"GQA layer keeps a K and a V of n_kv_heads x head_dim bf16 elements; the 'full' layers of "
                f"cfg.layer_types keep every token, the 'sliding' ones only the last cfg.sliding_window"
            )
    return "KV exercise: every context, both gpt-oss models and a wider window, as ModelConfig.kv_cache_bytes counts"


# ------------------------------------------------------------------ lecture 05: LoRA


def check_lora_trainable_params(lora_trainable_params) -> str:
    """The learner's count of LoRA parameters against the adapters apply_lora actually creates.

    Three small configurations (MHA, GQA with 2 and 1 K/V heads, head_dim ≠ d_model / n_heads) and four
    target sets: a count that uses d_model for every projection, forgets the layers or counts one of A
    and B is wrong on at least one of them. Counting is exact, so the comparison is too.
    """
    shapes = {
        "tiny": {},
        "tiny, GQA 4:2": dict(n_heads=4, n_kv_heads=2),
        "tiny, MQA, head_dim 24": dict(n_heads=4, n_kv_heads=1, head_dim=24, n_layers=3),
    }
    for label, overrides in shapes.items():
        cfg = configs.get("tiny", **overrides)
        for targets in (("wq", "wv"), ("wk",), ("wo",), ("wq", "wk", "wv", "wo")):
            for r in (1, 4):
                torch.manual_seed(0)
                model = apply_lora(Transformer(cfg), targets, r=r)
                want = sum(p.numel() for p in lora_parameters(model))
                got = _call("lora_trainable_params", lora_trainable_params, cfg, targets, r)
                assert got == want, (
                    f"{label} (d_model={cfg.d_model}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
                    f"head_dim={cfg.head_dim}, n_layers={cfg.n_layers}), targets {targets}, r={r}: you count "
                    f"{got:,}, apply_lora creates {want:,}. Each target W [d_out, d_in] gets A [r, d_in] and "
                    "B [d_out, r]; wk and wv map d_model to n_kv_heads x head_dim; every layer has its own"
                )
    return "LoRA exercise: your count equals the adapters apply_lora creates, for every config, target set and rank"


# ------------------------------------------------------------------ lecture 06: paged waste


def check_paged_waste_slots(paged_waste_slots) -> str:
    """The learner's count of empty slots in the blocks a paged cache allocates, against PagedCache.

    Lengths that are multiples of the block size (no waste), one token past (B − 1 wasted), single
    tokens and a random mix, at block sizes 1, 8 and 16. Counting is exact, so the comparison is too.
    """
    rng = random.Random(0)
    cases = [[16, 32, 48], [17, 33], [1, 1, 1], [rng.randint(1, 300) for _ in range(20)]]
    for lengths in cases:
        for block_size in (1, 8, 16):
            cache = PagedCache(sum(-(-n // block_size) for n in lengths), block_size, prefix_caching=False)
            for n in lengths:
                cache.reserve(cache.add_sequence([0] * n), n)
            want = cache.allocated_slots() - sum(lengths)
            got = _call("paged_waste_slots", paged_waste_slots, lengths, block_size)
            assert got == want, (
                f"lengths {lengths[:6]}{' ...' if len(lengths) > 6 else ''}, block_size {block_size}: you count "
                f"{got} empty slots, the pool has {want}. Each sequence takes ceil(length / block_size) whole blocks"
            )
    return "paged-waste exercise: your count equals the empty slots of PagedCache's blocks for every case"


# ------------------------------------------------------------------ lecture 07: the roofline


def check_compute_bound_tokens(compute_bound_tokens) -> str:
    """The learner's smallest number of tokens m at which a [m, k]·[k, n] matmul is compute-bound on a
    device, against the roofline of :mod:`course_lib.cost.roofline` read from the hardware table.

    Cases: the course's weight shapes at 8192 wide in bf16 on several devices, fp8 on the H100, and a
    matrix too small ever to reach the ridge (the answer is then None). Intensities are compared as
    the roofline module computes them, so the answer must satisfy I(m) ≥ ridge > I(m − 1) exactly.
    """
    cases = [
        (8192, 8192, 2, "H100", "bf16"),
        (8192, 8192, 2, "H800", "bf16"),
        (8192, 28672, 2, "A100", "bf16"),
        (8192, 8192, 2, "B200", "bf16"),
        (8192, 8192, 1, "H100", "fp8"),
        (7168, 2048, 2, "Ascend 910B", "bf16"),
        (256, 256, 2, "H100", "bf16"),
    ]
    for k, n, b, name, precision in cases:
        roof = roofline.of(hardware.get(name), precision)

        def compute_bound(m, k=k, n=n, b=b, roof=roof):
            return roofline.gemm("w", m, n, k, b).intensity >= roof.ridge_point

        got = _call(
            "compute_bound_tokens", compute_bound_tokens, k, n, b, roof.peak_flops_per_second, roof.bytes_per_second
        )
        never = not compute_bound(10**12)
        if never:
            assert got is None, (
                f"a {k} x {n} weight in {b}-byte elements on the {name} ({precision}): even infinitely many tokens "
                f"stay below the ridge point ({roof.ridge_point:.0f} FLOP/byte), so the answer is None; you say {got!r}"
            )
            continue
        ok = isinstance(got, int) and got >= 1 and compute_bound(got) and (got == 1 or not compute_bound(got - 1))
        assert ok, (
            f"a {k} x {n} weight in {b}-byte elements on the {name} ({precision}, ridge point "
            f"{roof.ridge_point:.0f} FLOP/byte): you say {got!r} tokens. Intensity = 2mnk / (bytes·(mk + kn + mn)) "
            "grows with m; find the first m where it reaches peak / bandwidth"
        )
    return "roofline exercise: your token counts are the first compute-bound ones for every device and shape"


# ------------------------------------------------------------------ lecture 08b: checkpointing a cluster


def check_checkpoint_plan(checkpoint_plan) -> str:
    """The learner's (interval, lost fraction) for a cluster, against Young's first-order model (1974) with
    the cluster's mean time between failures and a restart cost.

    n GPUs failing independently, each every M_gpu seconds on average, stop the run every M = M_gpu / n
    (exponential failures: the rates add). Each failure costs the restart R and, on average, half an
    interval of redone work; each checkpoint stalls training for C. Lost time per second of work is
    C/τ + (R + τ/2)/M, smallest at τ* = sqrt(2CM) (R does not depend on τ), where it is sqrt(2C/M) + R/M.
    Cases from 8 to 16,384 GPUs, checkpoints of 5 s to 10 min, restarts of 0 and 10 min. Relative
    tolerance 1e-9: each figure is a few float64 operations, so only a different formula misses it.
    """
    year = 365 * 86400.0
    cases = [
        (n, gpu_mtbf, c, r)
        for n in (8, 2048, 16384)
        for gpu_mtbf in (5 * year, 50 * year)
        for c in (5.0, 60.0, 600.0)
        for r in (0.0, 600.0)
    ]
    for n, gpu_mtbf, c, r in cases:
        got = _call("checkpoint_plan", checkpoint_plan, n, gpu_mtbf, c, r)
        assert isinstance(got, tuple) and len(got) == 2, f"return a pair (interval_s, lost_fraction), not {got!r}"
        tau, lost = got
        m = gpu_mtbf / n
        want_tau = young_interval(c, m)
        want_lost = checkpoint_overhead(want_tau, c, m) + r / m
        case = f"{n} GPUs each failing every {gpu_mtbf / year:g} years, C = {c:g} s, R = {r:g} s"
        if not (isinstance(tau, (int, float)) and math.isclose(tau, want_tau, rel_tol=1e-9)):
            if isinstance(tau, (int, float)) and math.isclose(tau, young_interval(c, gpu_mtbf), rel_tol=1e-6):
                hint = (
                    "that is one GPU's MTBF: the run stops when any of the n GPUs fails, and independent failures "
                    "add their rates, so the cluster fails every M = M_gpu / n"
                )
            elif r and isinstance(tau, (int, float)) and math.isclose(tau, young_interval(c + r, m), rel_tol=1e-6):
                hint = (
                    "the restart R is paid once per failure, whatever the interval: it adds R/M to the lost time, "
                    "but its derivative in τ is zero, so it does not move the optimum"
                )
            else:
                hint = (
                    "lost time per second of work is C/τ (writing) + (R + τ/2)/M (per failure: the restart and half "
                    "an interval redone, on average): set its derivative to zero"
                )
            raise AssertionError(f"{case}: you say every {tau!r} s, the optimum is {want_tau:.1f} s; {hint}")
        if not (isinstance(lost, (int, float)) and math.isclose(lost, want_lost, rel_tol=1e-9)):
            no_restart = isinstance(lost, (int, float)) and math.isclose(lost, want_lost - r / m, rel_tol=1e-6)
            hint = (
                "each failure also costs the restart R, however often you checkpoint: add R/M"
                if r and no_restart
                else "evaluate C/τ + (R + τ/2)/M at the optimal τ"
            )
            raise AssertionError(f"{case}: you say {lost!r} of the run is lost, the model {want_lost:.4f}; {hint}")
    return "checkpoint-plan exercise: your interval and lost fraction are Young's model of the cluster in every case"


# ------------------------------------------------------------------ lecture 09: choosing a TP scheme


def check_best_tp_scheme(best_tp_scheme) -> str:
    """The learner's cheapest tensor-parallel scheme for X[b, h]·W[h, n] on p devices, against a search over
    the schemes whose grid exists ("1d" always, "2d" for a square p, "3d" for a cube) ranked by
    :func:`course_lib.cost.collective_bytes.tp_received_elements`, ties going to the simpler scheme. Exact: the
    answer is a name, and the volumes compared are the same formula's.
    """
    cases = [
        (4096, 8192, 28672, 64),  # many tokens, many devices: a grid wins
        (4096, 8192, 28672, 8),
        (16, 8192, 28672, 8),  # a decode step: the 1D all-reduce of a small output
        (16, 8192, 28672, 64),
        (4096, 8192, 8192, 4),  # square, not a cube
        (8192, 4096, 4096, 27),  # cube, not a square
        (2048, 4096, 4096, 6),  # neither: only 1D exists
        (512, 1024, 1024, 1),  # one device: every scheme receives nothing, the simplest wins
    ]
    for b, h, n, p in cases:
        grids = ["1d"] + (["2d"] if round(p**0.5) ** 2 == p else []) + (["3d"] if round(p ** (1 / 3)) ** 3 == p else [])
        volumes = {s: tp_received_elements(s, b, h, n, p) for s in grids}
        want = min(grids, key=lambda s: (volumes[s], grids.index(s)))
        got = _call("best_tp_scheme", best_tp_scheme, b, h, n, p)
        assert got == want, (
            f"X [{b}, {h}] · W [{h}, {n}] on p = {p}: you say {got!r}, the cheapest is {want!r} (elements received "
            f"per device: {', '.join(f'{s} {v:,.0f}' for s, v in volumes.items())}). Consider only the schemes whose "
            "grid exists for p (2d: p a perfect square, 3d: a perfect cube) and compare tp_received_elements"
        )
    return "TP-scheme exercise: your choice is the cheapest existing scheme for every layer shape and device count"


# ------------------------------------------------------- lecture 10: the layouts a mesh can take


def check_valid_layouts(valid_layouts) -> str:
    """The learner's set of (dp, tp, pp) with dp·tp·pp = world that the composed step accepts, against
    :func:`course_lib.parallel.compose.check_layout` tried on every split of the world. Exact: sets of
    integer triples."""
    cases = [  # (config, overrides, world, global batch, micro-batches per replica)
        ("tiny", dict(n_layers=4), 8, 8, 2),
        ("tiny", dict(n_layers=2), 8, 8, 1),
        ("tiny", dict(n_layers=4), 8, 4, 2),
        ("tiny", dict(n_layers=4, tie_embeddings=True), 8, 8, 1),
        ("small", {}, 16, 16, 2),
        ("small", dict(n_layers=8), 12, 24, 3),
    ]
    for name, overrides, world, batch, m in cases:
        cfg = configs.get(name, **overrides)
        want = set()
        for dp in range(1, world + 1):
            for tp in range(1, world + 1):
                if world % (dp * tp):
                    continue
                try:
                    check_layout(ComposedLayout(dp, tp, world // (dp * tp), m), cfg, batch)
                    want.add((dp, tp, world // (dp * tp)))
                except ValueError:
                    pass
        got = _call("valid_layouts", valid_layouts, cfg, world, batch, m)
        got = {tuple(int(x) for x in t) for t in got}
        assert got == want, (
            f"{name} ({cfg.n_layers} blocks, {cfg.n_heads} heads, {cfg.n_kv_heads} key/value heads, tied embeddings "
            f"{cfg.tie_embeddings}) on {world} ranks, batch {batch}, m = {m}: you listed {sorted(got)}, the composed "
            f"step accepts {sorted(want)}. tp must divide the heads, the key/value heads, the vocabulary and d_ff; "
            "pp needs a block per stage (and tied embeddings allow no pp > 1); dp·m must divide the global batch"
        )
    return "layouts exercise: your sets equal the splits the composed step accepts, in every case"
