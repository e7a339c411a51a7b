"""Activation checkpointing measured (lecture 06): bytes kept, peak, step time and torch.compile's
activation memory budget, beside the model of :mod:`course_lib.cost.activations`
(``recompute_peak_bytes``, ``recompute_flops``; tests/model/test_recompute.py, benchmarks/bench_recompute.py).

    measure_recompute(cfg, batch, seq_len, "selective")   {"saved", "peak", "saved_hooks"} in bytes
    model_vs_measurement(cfg, batch, seq_len)             one row per policy, model and measurement
    measure_memory_budget(cfg, batch, seq_len, (1.0, 0.5, 0.0))   {budget: bytes saved} under torch.compile
    step_time_and_peak(cfg, batch, seq_len, "full")       {"step_s", "allocator_peak"} of one training step

Memory is counted by :class:`~course_lib.measure.live_tensors.LiveTensorMeter` (the bytes of the
tensors that ops create and that are still alive, after every op), which sees all three policies.
:class:`~course_lib.measure.saved_tensors.SavedTensorMeter` (saved-tensor hooks) does not: inside a
non-reentrant checkpoint, torch's own hooks replace it, so it sees only what checkpoint saves
itself (each block's input), and selective checkpointing's cache of matmul outputs is held by a
dispatch mode, not by autograd. ``"saved_hooks"`` reports what the hooks see, to show the gap.

Every function runs on ``device`` (default :func:`course_lib.dist.device`: the CPU on a laptop, cuda:0
in a notebook on a GPU machine). The bytes depend on it through the attention kernel: the model's
terms read the CPU's, and :func:`~course_lib.cost.activations.recompute_kernel_extra` adds what CUDA's
fp32 kernel saves beyond them (a log-sum-exp padded to 32 rows, two RNG scalars), so
:func:`model_vs_measurement` compares like with like on either.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch._functorch.config as functorch_config

from course_lib.cost.activations import RECOMPUTE_POLICIES, recompute_kernel_extra, recompute_peak_bytes
from course_lib.dist import device as rank_device
from course_lib.dist.timing import time_calls
from course_lib.measure.allocations import AllocationTrace
from course_lib.measure.live_tensors import LiveTensorMeter
from course_lib.measure.saved_tensors import SavedTensorMeter, sdpa_kernel
from course_lib.model.config import ModelConfig
from course_lib.model.recompute import set_recompute
from course_lib.model.transformer import Transformer

COMPILE_BACKENDS = ("aot_eager_decomp_partition", "inductor")


def _on(device) -> torch.device:
    return rank_device() if device is None else torch.device(device)


def build(cfg: ModelConfig, policy="none", seed: int = 0, device=None) -> Transformer:
    """The course model on ``device`` (default :func:`course_lib.dist.device`), with ``policy`` set on
    its blocks: one name, or one name per layer."""
    torch.manual_seed(seed)
    model = Transformer(cfg).to(_on(device))
    policies = [policy] * cfg.n_layers if isinstance(policy, str) else list(policy)
    for i, p in enumerate(policies):
        set_recompute(model, p, [i])
    return model


def blocks_forward(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The blocks of ``model`` on hidden states x [batch, seq, d_model], without embedding and head:
    the part that the activation model counts."""
    s = x.shape[1]
    cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    for layer in model.layers:
        x = layer(x, cos, sin)
    return x


def _inputs(cfg: ModelConfig, batch: int, seq_len: int, seed: int, on: torch.device):
    # host: a CPU generator and its draws, so every machine gets the same numbers; moved to `on`
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=gen).to(on).requires_grad_(True)  # host: drawn by gen
    return x, torch.randn(batch, seq_len, cfg.d_model, generator=gen).to(on)  # host: drawn by gen, as above


def measure_recompute(
    cfg: ModelConfig, batch: int, seq_len: int, policy="none", attention: str = "flash", seed: int = 0, device=None
) -> dict:
    """Bytes of activations of the blocks' forward and backward under ``policy`` (a name, or one per layer).

    ``saved``: alive when the forward pass ends (what backward will read: Σ K of the model);
    ``peak``: the most alive at once during forward + backward; both by :class:`LiveTensorMeter`,
    leaving out the parameters' and the input's gradients (model state, not activations);
    ``saved_hooks``: what saved-tensor hooks see (:class:`SavedTensorMeter`), for comparison;
    ``grads``: the gradients (input's first, then the parameters'), for the equality test.
    On ``device`` (default :func:`course_lib.dist.device`).
    """
    on = _on(device)
    model = build(cfg, policy, seed, on)
    x, grad_out = _inputs(cfg, batch, seq_len, seed, on)
    s = seq_len
    hooks = SavedTensorMeter(exclude=model, constants=(model.rope_cos[:s], model.rope_sin[:s]))
    with sdpa_kernel(attention), LiveTensorMeter() as meter:
        with hooks:
            out = blocks_forward(model, x)
        meter.mark("backward")
        out.backward(grad_out)
        del out
    grads = [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    return {
        "saved": meter.bytes_at("backward", exclude=grads),
        "peak": meter.peak(exclude=grads),
        "saved_hooks": hooks.bytes,
        "grads": [x.grad] + [p.grad for p in model.parameters()],
    }


def model_vs_measurement(
    cfg: ModelConfig, batch: int, seq_len: int, policies=RECOMPUTE_POLICIES, attention: str = "flash", device=None
) -> list[dict]:
    """For the lecture: one row per policy, the model's and the measured bytes saved and at the peak, on
    ``device`` (default :func:`course_lib.dist.device`); the model adds the device kernel's own extra
    (:func:`~course_lib.cost.activations.recompute_kernel_extra`: 0 on the CPU)."""
    on = _on(device)
    rows = []
    for policy in policies:
        got = measure_recompute(cfg, batch, seq_len, policy, attention, device=on)
        model = recompute_peak_bytes(cfg, batch, seq_len, policy, attention)
        extra = recompute_kernel_extra(cfg, batch, seq_len, policy, attention, on.type)
        rows.append(
            {
                "policy": policy,
                "model_saved": model["saved"] + extra["saved"],
                "measured_saved": got["saved"],
                "model_peak": model["peak"] + extra["peak"],
                "measured_peak": got["peak"],
                "saved_hooks": got["saved_hooks"],
            }
        )
    return rows


@contextlib.contextmanager
def _fresh_compile():
    """Each budget compiles anew (the knob is read when AOTAutograd partitions the graph); the
    compiled code is dropped after, so nothing compiled here leaks into later calls."""
    import torch._dynamo  # heavy: only where something is compiled

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def measure_memory_budget(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    budgets=(1.0, 0.5, 0.0),
    backend: str = "aot_eager_decomp_partition",
    seed: int = 0,
    device=None,
) -> dict[float, dict]:
    """Bytes the blocks save for backward under ``torch.compile`` at each activation memory budget.

    ``torch._functorch.config.activation_memory_budget`` (PyTorch 2.4+) steers AOTAutograd's min-cut
    partitioner, which decides for the joint forward-backward graph which values the forward saves and
    which the backward recomputes: 1.0 = its default, runtime-first choice; 0.0 = checkpoint the whole
    compiled region (keep only its inputs); b in between = the least recompute (estimated by FLOPs, a
    0-1 knapsack) that keeps the saved bytes within a fraction b of the way from 0.0's to 1.0's, by
    the partitioner's own size estimate (measured at 0.5: 0.54 of the way with this backend on the
    tiny model, 0.50 with inductor in benchmarks/bench_recompute.py).

    ``backend``: ``"aot_eager_decomp_partition"`` runs the same decompositions and partitioner as
    inductor but executes the partitioned graphs op by op (no code generation: a second per budget);
    ``"inductor"`` compiles C++ kernels on a CPU (a C++ compiler needed; tens of seconds). The compile
    cache goes to ``tempfile.gettempdir()`` (under the test suite: build/tmp). Saved bytes are measured
    with :class:`SavedTensorMeter`: the compiled forward hands its saved tensors to autograd, where the
    hooks see them (a dispatch mode, :class:`LiveTensorMeter`, would make dynamo run the code eagerly).

    Returns {budget: {"saved": bytes, "grads": [input's gradient, then the parameters']}}, measured on
    ``device`` (default :func:`course_lib.dist.device`).
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(
            f"backend {backend!r}: use one of {COMPILE_BACKENDS} (the backends whose partitioner reads the budget)"
        )
    on = _on(device)
    model = build(cfg, "none", seed, on)
    x, grad_out = _inputs(cfg, batch, seq_len, seed, on)
    constants = (model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    out = {}
    for budget in budgets:
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"activation memory budget {budget}: a fraction in [0, 1] (1 = the partitioner's default)")
        x.grad = None
        model.zero_grad(set_to_none=True)
        with _fresh_compile(), functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(lambda h: blocks_forward(model, h), backend=backend)
            try:
                with SavedTensorMeter(exclude=model, constants=constants) as hooks:
                    y = compiled(x)
            except Exception as err:  # the compiler's own error, with what to do about it
                hint = (
                    "Inductor on a CPU generates C++ and needs a working compiler (gcc or clang, the one in $CXX); "
                    "backend='aot_eager_decomp_partition' runs the same partitioner without generating code"
                    if backend == "inductor"
                    else "run the blocks eagerly first (measure_recompute) to see whether the model itself fails"
                )
                raise RuntimeError(
                    f"torch.compile(backend={backend!r}) failed on {on}: {type(err).__name__}: {err}. {hint}"
                ) from err
            y.backward(grad_out)
        out[budget] = {"saved": hooks.bytes, "grads": [x.grad] + [p.grad for p in model.parameters()]}
    return out


def step_time_and_peak(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    policy="none",
    compile_budget=None,
    steps: int = 6,
    warmup: int = 2,
    device=None,
) -> dict:
    """One training step of the whole model (loss, forward + backward) under ``policy``, measured:
    {"step_s": median seconds over ``steps`` steps after ``warmup`` (which compile, if anything does),
    "allocator_peak": the most bytes allocated at once during one step}.

    ``compile_budget``: a float compiles the loss with inductor at that activation memory budget
    (``policy`` must then be "none"). The peak comes from torch.profiler's memory events
    (:class:`~course_lib.measure.allocations.AllocationTrace`): everything the step allocates —
    activations, the parameters' gradients, logits, backward's temporaries, a kernel's scratch,
    compiled code's buffers — so it sees compiled code, where :func:`measure_recompute` cannot, but
    it depends on kernels and threads. For a benchmark, not a test: timings vary with load.

    Every call compiles afresh (dynamo is reset: guards do not see the budget, so a second model of
    the same shapes would otherwise reuse the first one's partition). On ``device`` (default
    :func:`course_lib.dist.device`), timed with :func:`course_lib.dist.timing.time_calls`.
    """
    if compile_budget is not None and policy != "none":
        raise ValueError("compile_budget replaces the eager policies: pass policy='none' with it")
    on = _on(device)
    model = build(cfg, policy, device=on)
    # host: drawn from a CPU generator, so every machine gets the same tokens; moved to `on`
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(on)
    loss_fn = model.loss

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(tokens[:, :-1], tokens[:, 1:]).backward()

    with contextlib.ExitStack() as stack:
        if compile_budget is not None:
            stack.enter_context(_fresh_compile())
            stack.enter_context(functorch_config.patch(activation_memory_budget=compile_budget))
            loss_fn = torch.compile(model.loss, backend="inductor")
        for _ in range(max(warmup, 1)):  # one at least: the trace must not see the compilation
            step()
        with AllocationTrace(on) as trace:
            step()
        times = time_calls(step, steps, warmup=0)  # warmed up above
    return {"step_s": statistics.median(times), "allocator_peak": trace.peak()}
