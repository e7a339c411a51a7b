"""A quantized KV cache (KIVI), lecture 06: K/V stored as INT8/INT4/INT2 codes, keys per channel, values per token.

The codec that moves such a cache over a network (CacheGen) builds on these codes: :mod:`course_lib.inference.cachegen`.
Tested in tests/inference/test_quantized_kv.py.

**Asymmetric uniform quantization.** A group of values g is stored as b-bit codes, its minimum m (the zero
point, in the values' own units) and a step s (Jacob et al. 2018, "Quantization and Training of Neural
Networks for Efficient Integer-Arithmetic-Only Inference", §2.1, with the zero point taken as the minimum):

    m = min g,   s = (max g − m) / (2^b − 1),   code = round((x − m) / s) ∈ {0 … 2^b − 1},   x̂ = m + s·code

so every element comes back within half a step, |x − x̂| ≤ s/2 = (max − min) / (2·(2^b − 1)). A group is
``group_size`` consecutive elements along one dimension; each group pays two numbers (s, m) in the values'
dtype. INT4 and INT2 codes are packed 2 and 4 to a byte along the last dimension, element 2j (4j) in the low bits
(:func:`pack_codes`).

**KIVI** (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML, arXiv:2402.02750,
§3 and Algorithm 1). Keys have a few outlier *channels*, large for every token; values have no fixed outlier
channel. A group that mixes an outlier channel with ordinary ones gets a step sized by the outlier, and the
ordinary channels lose all their resolution, so KIVI quantizes

* keys **per channel**: one (s, m) per channel for each group of ``group_size`` tokens (grouping along tokens);
* values **per token**: one (s, m) per token for each group of ``group_size`` channels (grouping along channels).

Per-channel grouping needs ``group_size`` tokens before a group can be quantized, so the newest tokens wait in
full precision: :class:`QuantizedCache` keeps the most recent ``residual`` tokens (and the unfinished group
beyond them) unquantized and quantizes the oldest ``group_size`` of the window at once when it is full, for
keys and values alike (KIVI quantizes values token by token as they leave the window; grouping them too keeps
one rule for both). The recent tokens are the ones attention weights most, which is why the window pays for
itself. Bytes per token, the same accounting that :func:`course_lib.cost.memory.quantized_kv_bytes_per_token`
does: b/8 per element for the codes plus 2·(scale bytes)/``group_size`` per element for (s, m).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from course_lib.inference.cache import StepCache

__all__ = [
    "BITS",
    "KEY_MODES",
    "QuantizedCache",
    "QuantizedTensor",
    "affine_codes",
    "dequantize",
    "error_bound",
    "fake_quantize_kv",
    "pack_codes",
    "quantize",
    "unpack_codes",
]

BITS = (2, 4, 8)
KEY_MODES = ("per_channel", "per_token")  # one (s, m) per channel over tokens, or per token over channels


# ---------------------------------------------------------------------------------------------------- codes
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits, [..., n] -> [..., n·bits/8]: 8/bits codes a byte, element j·k + i in bits i·b … i·b+b−1."""
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(
            f"{bits}-bit codes pack {per_byte} to a byte along the last dimension, which has {codes.shape[-1]} "
            f"elements; make it a multiple of {per_byte} (head_dim is even for RoPE, so INT4 always fits)"
        )
    if per_byte == 1:
        return codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.unflatten(-1, (-1, per_byte)) << shifts).sum(-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 [..., m] -> codes [..., m·8/bits]."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


def _stored(value: torch.Tensor, dtype: torch.dtype, toward: float) -> torch.Tensor:
    """fp32 ``value`` in ``dtype``, rounded toward ``toward`` (±inf) when the dtype cannot hold it: a minimum
    rounded down and a step rounded up keep every element inside the grid, so |x − x̂| ≤ s/2 holds for the
    (s, m) actually stored, in bf16 as in fp32."""
    out = value.to(dtype)
    wrong = out.float() > value if toward < 0 else out.float() < value
    return torch.where(wrong, torch.nextafter(out, torch.full_like(out, toward)), out)


def affine_codes(x: torch.Tensor, bits: int, group_size: int, dim: int):
    """Unpacked codes (x's shape, uint8) and the groups' step and minimum (x's shape with ``dim`` cut to
    n/group_size, x's dtype) of asymmetric quantization along ``dim``."""
    if bits not in BITS:
        raise ValueError(f"bits={bits}: choose one of {BITS} (codes pack evenly into bytes)")
    n = x.shape[dim]
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"dimension {dim} has {n} elements, not a whole number of groups of group_size={group_size}; "
            f"choose a group_size that divides it"
        )
    g = x.float().movedim(dim, -1).unflatten(-1, (n // group_size, group_size))
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    zero = _stored(lo, x.dtype, -math.inf)
    scale = _stored((hi - zero.float()) / (2**bits - 1), x.dtype, math.inf)
    step = torch.where(scale > 0, scale.float(), 1.0)  # a constant group: every code 0, x̂ = m exactly
    codes = ((g - zero.float()) / step).round().clamp(0, 2**bits - 1).to(torch.uint8)
    return codes.flatten(-2).movedim(-1, dim), scale[..., 0].movedim(-1, dim), zero[..., 0].movedim(-1, dim)


@dataclass
class QuantizedTensor:
    """What :func:`quantize` stores: packed ``codes`` (uint8, 8/bits per byte along the last dimension) and one
    ``scale`` s and ``zero`` m per group, shaped like the tensor with ``dim`` cut to n/group_size."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    dim: int  # non-negative
    shape: torch.Size

    def nbytes(self) -> int:
        """Bytes held: codes + scales + zero points, measured on the tensors' storage."""
        return sum(t.untyped_storage().nbytes() for t in (self.codes, self.scale, self.zero))


def quantize(x: torch.Tensor, bits: int = 8, group_size: int = 32, dim: int = -1) -> QuantizedTensor:
    """Asymmetric ``bits``-bit quantization of ``x`` in groups of ``group_size`` consecutive elements along ``dim``
    (module docstring): x̂ = m + s·code, |x − x̂| ≤ s/2. ``dim=-1`` groups channels (per token), ``dim=-2``
    groups tokens (per channel) of a [..., tokens, channels] tensor."""
    dim = dim % x.dim()
    codes, scale, zero = affine_codes(x, bits, group_size, dim)
    return QuantizedTensor(pack_codes(codes, bits), scale, zero, bits, group_size, dim, x.shape)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """x̂ = m + s·code, in the dtype of the scales (the dtype that was quantized)."""
    codes = unpack_codes(q.codes, q.bits).float()
    expand = lambda t: t.float().repeat_interleave(q.group_size, dim=q.dim)
    return (expand(q.zero) + expand(q.scale) * codes).to(q.scale.dtype)


def error_bound(q: QuantizedTensor) -> torch.Tensor:
    """The bound s/2 for every element (fp32, the tensor's shape): |x − dequantize(q)| ≤ error_bound(q), exactly in
    fp32; a 16-bit x̂ adds the rounding of its own cast, half a unit in the last place."""
    return q.scale.float().repeat_interleave(q.group_size, dim=q.dim) / 2


def _cat(parts: list[QuantizedTensor], dim: int) -> QuantizedTensor:
    """Quantized tensors side by side along ``dim`` (not the packed last one), each of whole groups."""
    first = parts[0]
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    cat = lambda name: torch.cat([getattr(p, name) for p in parts], dim=dim)
    return QuantizedTensor(
        cat("codes"), cat("scale"), cat("zero"), first.bits, first.group_size, first.dim, torch.Size(shape)
    )


# ---------------------------------------------------------------------------------------------------- KIVI
def _check_mode(name: str, mode: str) -> None:
    if mode not in KEY_MODES:
        raise ValueError(f"{name}={mode!r}: choose 'per_channel' (KIVI's keys) or 'per_token' (KIVI's values)")


def _quantize_kv(x: torch.Tensor, bits: int, group_size: int, mode: str) -> QuantizedTensor:
    """x [b, heads, tokens, width] in whole groups of tokens. per_channel: groups of ``group_size`` tokens
    along dim 2; per_token: groups of ``group_size`` channels along dim 3 (the whole head when it is narrower)."""
    if mode == "per_channel":
        return quantize(x, bits, group_size, dim=2)
    width = x.shape[3]
    if width % min(group_size, width):
        raise ValueError(
            f"per-token groups of group_size={group_size} channels do not tile a head of {width} channels; "
            f"choose a group_size that divides {width} (or is at least {width}: one group per head)"
        )
    return quantize(x, bits, min(group_size, width), dim=3)


def fake_quantize_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    bits: int = 4,
    group_size: int = 32,
    residual: int = 32,
    key_mode: str = "per_channel",
    value_mode: str = "per_token",
):
    """What a :class:`QuantizedCache` holds after n tokens of K/V [b, heads, n, width], dequantized, at once:
    the first G·⌊(n − R)/G⌋ tokens quantized in groups, the rest full precision. Returns (k̂, v̂, δk, δv) with
    δ the per-element bounds s/2 (0 where the tokens are kept exactly)."""
    n = k.shape[2]
    n_q = group_size * max(0, (n - residual) // group_size)
    out = []
    for x, mode in ((k, key_mode), (v, value_mode)):
        _check_mode("mode", mode)
        if n_q == 0:
            out.append((x, torch.zeros_like(x, dtype=torch.float32)))
            continue
        q = _quantize_kv(x[:, :, :n_q], bits, group_size, mode)
        hat = torch.cat([dequantize(q), x[:, :, n_q:]], dim=2)
        bound = torch.cat([error_bound(q), torch.zeros_like(x[:, :, n_q:], dtype=torch.float32)], dim=2)
        out.append((hat, bound))
    (k_hat, dk), (v_hat, dv) = out
    return k_hat, v_hat, dk, dv


class _Layer:
    """One layer's K and V: quantized groups (None until the first flush) and the full-precision window."""

    def __init__(self):
        self.quantized: list[QuantizedTensor | None] = [None, None]
        self.window: list[torch.Tensor | None] = [None, None]


class QuantizedCache(StepCache):
    """KIVI's cache for ``batch`` sequences that decode in step (the protocol of
    :class:`course_lib.inference.cache.ContiguousCache`): K/V older than the newest ``residual`` tokens are stored as
    ``bits``-bit codes in groups of ``group_size`` tokens — keys per channel, values per token by default
    (``key_mode``/``value_mode`` choose either for either, to compare) — and the rest in full precision.

    ``update`` returns every cached token read back from storage (dequantized, as a fused kernel would on the
    fly) followed by the new tokens exactly: the new tokens attend to themselves in full precision, as in KIVI's
    prefill and transformers' ``QuantizedLayer``. Then the window is flushed. Storage grows with the tokens (no
    ``max_len`` slab: ``max_len`` only bounds them), and :meth:`stored_bytes` counts what is held.
    ``device``: the model's, where the positions are made and the K/V come from (the CPU by default).
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        bits: int = 4,
        group_size: int = 32,
        residual: int = 32,
        key_mode: str = "per_channel",
        value_mode: str = "per_token",
        device: torch.device | str = "cpu",
    ):
        super().__init__(batch, max_len, device)
        if bits not in BITS:
            raise ValueError(f"bits={bits}: choose one of {BITS}")
        if group_size < 1 or residual < 0:
            raise ValueError(
                f"group_size={group_size} must be >= 1 and residual={residual} >= 0 (tokens kept in full precision)"
            )
        _check_mode("key_mode", key_mode)
        _check_mode("value_mode", value_mode)
        self.bits, self.group_size, self.residual, self.modes = bits, group_size, residual, (key_mode, value_mode)
        self._layers: dict[int, _Layer] = {}

    def _update(self, i: int, k: torch.Tensor, v: torch.Tensor):
        self._check_update(i, k)
        state = self._layers.setdefault(i, _Layer())
        out = []
        for j, new in enumerate((k, v)):
            stored = self._read(state, j)
            out.append(new if stored is None else torch.cat([stored, new], dim=2))
            window = new if state.window[j] is None else torch.cat([state.window[j], new], dim=2)
            # KIVI: once the window holds a whole group beyond the newest `residual` tokens, quantize that group
            n_flush = self.group_size * max(0, (window.shape[2] - self.residual) // self.group_size)
            if n_flush:
                q = _quantize_kv(window[:, :, :n_flush], self.bits, self.group_size, self.modes[j])
                state.quantized[j] = q if state.quantized[j] is None else _cat([state.quantized[j], q], dim=2)
            state.window[j] = window[:, :, n_flush:].clone()  # a copy: a view would keep the flushed tokens alive
        positions = torch.arange(self.length, self.length + self._new, device=k.device).expand(self.batch, self._new)
        return out[0], out[1], positions

    @staticmethod
    def _read(state: _Layer, j: int) -> torch.Tensor | None:
        parts = [dequantize(state.quantized[j])] if state.quantized[j] is not None else []
        parts += [state.window[j]] if state.window[j] is not None else []
        return torch.cat(parts, dim=2) if parts else None

    # ---------------------------------------------------------------- reading back, accounting
    def dequantized(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s cached K and V as attention reads them: quantized groups dequantized, then the window."""
        state = self._layers[i]
        return self._read(state, 0), self._read(state, 1)

    def bytes_by_part(self) -> dict[str, int]:
        """Bytes held, measured on the tensors' storage: ``codes``, ``scales`` (steps and zero points),
        ``residual`` (the full-precision window) and ``total``."""
        out = {"codes": 0, "scales": 0, "residual": 0}
        for state in self._layers.values():
            for q in state.quantized:
                if q is not None:
                    out["codes"] += q.codes.untyped_storage().nbytes()
                    out["scales"] += q.scale.untyped_storage().nbytes() + q.zero.untyped_storage().nbytes()
            out["residual"] += sum(w.untyped_storage().nbytes() for w in state.window if w is not None)
        out["total"] = sum(out.values())
        return out

    def stored_bytes(self) -> int:
        """Everything the cache holds: packed codes + scales and zero points + the full-precision window."""
        return self.bytes_by_part()["total"]

    def error_bounds(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-element bounds (fp32) of :meth:`dequantized`: s/2 for the quantized tokens, 0 for the window."""
        out = []
        for q, window in zip(self._layers[i].quantized, self._layers[i].window):
            parts = [error_bound(q)] if q is not None else []
            out.append(torch.cat(parts + [torch.zeros_like(window, dtype=torch.float32)], dim=2))
        return out[0], out[1]

    def full_precision_bytes(self) -> int:
        """What a full-precision cache would hold for the same tokens (ContiguousCache's ``used_bytes``)."""
        total = 0
        for state in self._layers.values():
            for j in (0, 1):
                x = state.window[j]
                heads, width, size = x.shape[1], x.shape[3], x.element_size()
                total += self.batch * heads * width * size * self.length
        return total
