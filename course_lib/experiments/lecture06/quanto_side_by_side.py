"""transformers' ``QuantizedCache`` (backend quanto) beside course_lib's quantized KV cache (lecture 06).

The course model is exported (:func:`course_lib.model.hf_export.export_hf`) and loaded as
``transformers.LlamaForCausalLM``; both stacks then generate with a quantized cache at the same bits, group
size and window (:func:`hf_side_by_side`), and their bytes and logits are set side by side. The measurement
along the course model's own K/V is :mod:`course_lib.experiments.lecture06.kv_quantization_error` (KIVI: Liu et
al. 2024). Tested in tests/inference/test_quantized_kv.py.

Measured (``small`` after ``train_briefly()``; fp32; one thread), for the lecture:

    transformers' QuantizedCache (quanto INT4, group 32, residual 32), 64-token prompt + 48 generated: it holds
        67,584 bytes, ours with keys per token and no window the same to the byte (logits within 1e-6), ours as
        KIVI 120,832, full fp32 227,328; max |Δlogit| 0.28 (transformers) and 0.07 (ours, KIVI); greedy tokens
        equal to full precision 92 % and 100 %. quanto's extension compiled in 25 s (quiet) to 52 s (busy).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from course_lib.experiments.lecture06.kv_quantization_error import decode_logits
from course_lib.experiments.third_party import EXTENSIONS
from course_lib.inference.cache import ContiguousCache
from course_lib.inference.generate import generate
from course_lib.inference.quantized_cache import QuantizedCache
from course_lib.model.hf_export import export_hf
from course_lib.model.transformer import Transformer

__all__ = ["hf_cache_bytes", "hf_side_by_side", "quanto_extension"]


NOISY = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet(*names: str):
    """Raise these loggers to ERROR for the block: importing optimum.quanto imports torchao, which logs
    "Failed to load ... .so" for its CUDA kernels and makes torch log Enum deprecation warnings — noise in a
    notebook's output, nothing wrong on CPU."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quanto_extension() -> float:
    """Import optimum.quanto quietly and load its C++ extension (INT4 unpacking on CPU), built under
    :data:`EXTENSIONS` instead of quanto's own folder in site-packages. Returns the seconds it took: the first
    time it compiles (~25 s measured on a quiet 2-core machine), later it loads (< 1 s).

    quanto passes its own ``build_directory`` to ``torch.utils.cpp_extension.load``, which then ignores
    TORCH_EXTENSIONS_DIR, so the folder is set on quanto's extension object before its first use."""
    with _quiet(*NOISY):
        import optimum.quanto  # noqa: F401
        from optimum.quanto.library.extensions import get_extension
    ext = get_extension("quanto_cpp")
    if ext._lib is None:
        ext.build_directory = str(EXTENSIONS / "quanto_cpp")
    start = time.perf_counter()  # host: compiling or loading a C++ extension, no device work to wait for
    ext.lib  # noqa: B018 (compiles or loads)
    return time.perf_counter() - start  # host: as above


def _held_bytes(t) -> int:
    """Bytes of a tensor's storage, looking inside tensor subclasses (quanto's packed codes, scales, shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        return sum(_held_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.untyped_storage().nbytes() if t.numel() else 0


def hf_cache_bytes(cache) -> dict[str, int]:
    """What a transformers ``QuantizedCache`` holds: ``quantized`` (codes, scales, zero points of every layer) and
    ``residual`` (its full-precision keys and values)."""
    out = {"quantized": 0, "residual": 0}
    for layer in cache.layers:
        out["quantized"] += _held_bytes(layer._quantized_keys) + _held_bytes(layer._quantized_values)
        out["residual"] += _held_bytes(layer.keys) + _held_bytes(layer.values)
    out["total"] = out["quantized"] + out["residual"]
    return out


def _load_hf(model: Transformer, directory: str | Path):
    """``model`` exported with :func:`export_hf` and loaded as ``transformers.LlamaForCausalLM`` (no progress bar:
    it would land in a notebook's stored output)."""
    with _quiet(*NOISY):
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return LlamaForCausalLM.from_pretrained(export_hf(model, directory)).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()


@torch.no_grad()
def _hf_decode_logits(hf, tokens: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """:func:`decode_logits` for a transformers model and cache."""
    out = [hf(tokens[:, :prompt_len], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt_len, tokens.shape[1]):
        out.append(hf(tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, dim=1)


@torch.no_grad()
def hf_side_by_side(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    directory: str | Path,
    nbits: int = 4,
    group_size: int = 32,
    residual: int = 32,
) -> dict:
    """transformers' ``QuantizedCache`` (backend quanto) beside course_lib's :class:`QuantizedCache` on ``model``
    exported to ``directory``, at the same bits, group size and window. Three quantized caches:

    * ``"hf"``: transformers' — quantizes the whole prompt at once, then keeps up to ``residual`` new tokens in
      full precision and re-quantizes everything when they fill up; keys and values grouped along channels (its
      axis 0, per token);
    * ``"kivi"``: ours — keys per channel, values per token, window of ``residual`` + the unfinished group;
    * ``"as_hf"``: ours with keys per token and ``residual=0``: for a prompt of whole groups it quantizes the same
      tokens the same way as ``"hf"``, so its bytes and logits should match transformers'.

    Returns ``extension_s`` (:func:`quanto_extension`), greedy ``tokens`` per cache (and ``"full"``, ``"hf_full"``
    without quantization), ``bytes`` held after the generation (``stored_bytes``, :func:`hf_cache_bytes`;
    ``"full"``: the full-precision cache), ``logit_error`` per cache against its own stack's full-precision
    logits along the full-precision greedy tokens (teacher forcing: ``max_abs``, ``rms`` and the fraction of
    equal argmaxes), ``hf_vs_as_hf`` and ``hf_full_vs_full`` (max |Δlogit| between the two stacks)."""
    seconds = quanto_extension()
    with _quiet(*NOISY):
        from transformers import DynamicCache
        from transformers import QuantizedCache as HFQuantizedCache
    hf = _load_hf(model, directory)
    b, n = prompt.shape
    total = n + max_new_tokens
    options = dict(nbits=nbits, q_group_size=group_size, residual_length=residual)
    generated = hf.generate(
        prompt,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        cache_implementation="quantized",
        cache_config={"backend": "quanto", **options},
        return_dict_in_generate=True,
    )
    on = next(model.parameters()).device
    full = ContiguousCache(b, total, on)
    ours = {"kivi": dict(residual=residual), "as_hf": dict(residual=0, key_mode="per_token")}
    result = {
        "extension_s": seconds,
        "tokens": {
            "full": generate(model, prompt, max_new_tokens, full),
            "hf_full": hf.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False),
            "hf": generated.sequences,
        },
        "bytes": {"full": full.used_bytes(), "hf": hf_cache_bytes(generated.past_key_values)["total"]},
    }
    for name, kwargs in ours.items():
        cache = QuantizedCache(b, total, nbits, group_size, **kwargs, device=on)
        result["tokens"][name] = generate(model, prompt, max_new_tokens, cache)
        result["bytes"][name] = cache.stored_bytes()

    tokens = result["tokens"]["full"][:, :-1]  # the last token is generated, never fed
    reference = decode_logits(model, tokens, n, ContiguousCache(b, total, on))
    hf_reference = _hf_decode_logits(hf, tokens, n, DynamicCache(config=hf.config))
    logits = {"hf": _hf_decode_logits(hf, tokens, n, HFQuantizedCache(backend="quanto", config=hf.config, **options))}
    for name, kwargs in ours.items():
        logits[name] = decode_logits(model, tokens, n, QuantizedCache(b, total, nbits, group_size, **kwargs, device=on))
    result["logit_error"] = {
        name: _compare(x, hf_reference if name == "hf" else reference) for name, x in logits.items()
    }
    result["hf_vs_as_hf"] = (logits["hf"] - logits["as_hf"]).abs().max().item()
    result["hf_full_vs_full"] = (hf_reference - reference).abs().max().item()
    return result


def _compare(logits: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    return {
        "max_abs": (logits - reference).abs().max().item(),
        "rms": (logits - reference).pow(2).mean().sqrt().item(),
        "agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
    }
