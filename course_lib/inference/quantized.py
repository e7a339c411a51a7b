"""A quantized KV cache (KIVI) and a delta + entropy codec for moving one (CacheGen), lecture 06.

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

**CacheGen** (Liu et al. 2024, "CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
Serving", SIGCOMM, arXiv:2310.07240, §5). To *send* a cache over a network, CacheGen exploits that nearby tokens
have similar K/V: it splits the tokens into groups, keeps each group's first token as an anchor and encodes the
others as deltas from it (deltas from the anchor rather than from the previous token, so every token decodes
independently and errors do not accumulate along the group), quantizes the deltas and entropy-codes the codes
with an arithmetic coder that keeps a probability model per channel and layer. :func:`cachegen_compress` does
the same steps with a standard-library coder standing in for the arithmetic coder: ``lzma`` (LZ77 + an adaptive
binary range coder, itself a form of arithmetic coding) or ``zlib`` (LZ77 + Huffman). Not reproduced: CacheGen's
per-layer choice of bits (more for the shallow layers, which are more sensitive) and its streaming adaptation.
"""

from __future__ import annotations

import lzma
import math
import zlib
from dataclasses import dataclass

import torch

from course_lib.inference.cache import StepCache

__all__ = [
    "BITS",
    "KEY_MODES",
    "CompressedKV",
    "QuantizedCache",
    "QuantizedTensor",
    "cachegen_compress",
    "cachegen_decompress",
    "cachegen_entropy_bytes",
    "cachegen_error_bound",
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


def _affine(x: torch.Tensor, bits: int, group_size: int, dim: int):
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
    codes, scale, zero = _affine(x, bits, group_size, dim)
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


# ---------------------------------------------------------------------------------------------------- CacheGen
CODERS = {
    "lzma": (lambda b: lzma.compress(b, preset=9 | lzma.PRESET_EXTREME), lzma.decompress),
    "zlib": (lambda b: zlib.compress(b, 9), zlib.decompress),
}


@dataclass
class CompressedKV:
    """A K or V tensor as CacheGen would send it: one entropy-coded ``blob`` holding the delta codes (one byte
    a code, channel by channel), the anchors' INT8 codes and every scale and zero point; the rest is the
    few integers a header would carry."""

    blob: bytes
    sections: tuple[int, ...]  # byte lengths of: delta codes, anchor codes, anchor (s, m), delta (s, m)
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    tokens_per_group: int
    coder: str

    def nbytes(self) -> int:
        return len(self.blob)


# CacheGen's codec works on the bytes that go over the network: on the host, where cachegen_compress copies
# the tensor (x.detach().cpu()) and where cachegen_decompress hands it back (the receiver moves it on).
def _anchor_mask(n: int, tokens_per_group: int) -> torch.Tensor:
    return torch.arange(n) % tokens_per_group == 0  # host: CacheGen's codec runs on the host (above)


def cachegen_compress(x: torch.Tensor, bits: int = 4, tokens_per_group: int = 16, coder: str = "lzma") -> CompressedKV:
    """x [..., tokens, channels] (a layer's K or V) -> :class:`CompressedKV` (CacheGen §5, module docstring).

    Every ``tokens_per_group``-th token is an anchor, stored in INT8 per token (one (s, m) over its channels).
    Every other token is stored as its delta from its group's *dequantized* anchor â, so that x̂ = â + Δ̂ carries
    only the delta's error: the deltas are quantized to ``bits`` bits with one (s, m) per channel over all of the
    tensor's tokens, |x − x̂| ≤ s/2, and the codes go through ``coder`` ("lzma" or "zlib")."""
    if coder not in CODERS:
        raise ValueError(f"coder={coder!r}: choose one of {tuple(CODERS)}")
    if bits not in BITS:
        raise ValueError(f"bits={bits}: choose one of {BITS}")
    n = x.shape[-2]
    xs = x.detach().cpu().reshape(-1, n, x.shape[-1])  # [rows, tokens, channels]; the bytes leave the device
    anchors = _anchor_mask(n, tokens_per_group)
    if anchors.all():
        raise ValueError(f"tokens_per_group={tokens_per_group} leaves no token to delta-code; use at least 2")
    a_codes, a_scale, a_zero = _affine(xs[:, anchors], 8, xs.shape[-1], dim=2)
    a_hat = (a_zero.float() + a_scale.float() * a_codes.float()).to(x.dtype)
    group = torch.arange(n)[~anchors] // tokens_per_group  # host: indexes xs, on the host; each token's anchor
    delta = xs[:, ~anchors] - a_hat[:, group]
    d_codes, d_scale, d_zero = _affine(delta, bits, delta.shape[1], dim=1)
    # channel-major: each channel's codes are one run, which is what a per-channel probability model sees
    sections = [
        d_codes.transpose(1, 2).contiguous().numpy().tobytes(),
        a_codes.contiguous().numpy().tobytes(),
        torch.cat([a_scale, a_zero]).contiguous().view(torch.uint8).numpy().tobytes(),
        torch.cat([d_scale, d_zero]).contiguous().view(torch.uint8).numpy().tobytes(),
    ]
    blob = CODERS[coder][0](b"".join(sections))
    return CompressedKV(blob, tuple(map(len, sections)), x.shape, x.dtype, bits, tokens_per_group, coder)


def _parts(c: CompressedKV):
    raw = CODERS[c.coder][1](c.blob)
    n, width = c.shape[-2], c.shape[-1]
    rows = math.prod(c.shape[:-2])
    anchors = _anchor_mask(n, c.tokens_per_group)
    n_a = int(anchors.sum())
    chunks, start = [], 0
    for length in c.sections:
        chunks.append(torch.frombuffer(bytearray(raw[start : start + length]), dtype=torch.uint8))
        start += length
    as_dtype = lambda t, shape: t.view(c.dtype).reshape(shape)
    d_codes = chunks[0].reshape(rows, width, n - n_a).transpose(1, 2)
    a_codes = chunks[1].reshape(rows, n_a, width)
    a_scale, a_zero = as_dtype(chunks[2], (2, rows, n_a, 1))
    d_scale, d_zero = as_dtype(chunks[3], (2, rows, 1, width))
    return anchors, d_codes, a_codes, a_scale, a_zero, d_scale, d_zero


def cachegen_decompress(c: CompressedKV) -> torch.Tensor:
    """x̂ from a :class:`CompressedKV`: anchors â = m + s·code, the others â + m_Δ + s_Δ·code.

    On the host, where the received bytes are decoded: the receiver moves x̂ to its device."""
    anchors, d_codes, a_codes, a_scale, a_zero, d_scale, d_zero = _parts(c)
    a_hat = (a_zero.float() + a_scale.float() * a_codes.float()).to(c.dtype)
    group = torch.arange(c.shape[-2])[~anchors] // c.tokens_per_group  # host: decoded from bytes, on the host
    out = torch.empty(a_codes.shape[0], c.shape[-2], c.shape[-1], dtype=c.dtype)  # host: as the codes
    out[:, anchors] = a_hat
    out[:, ~anchors] = a_hat[:, group] + (d_zero.float() + d_scale.float() * d_codes.float()).to(c.dtype)
    return out.reshape(c.shape)


def cachegen_error_bound(c: CompressedKV) -> torch.Tensor:
    """Per-element bound of :func:`cachegen_decompress` in fp32: half the anchor's step for anchors, half the
    channel's delta step for the others (plus, in 16-bit dtypes, the rounding of â + Δ̂)."""
    anchors, d_codes, _, a_scale, _, d_scale, _ = _parts(c)
    out = torch.empty(d_codes.shape[0], c.shape[-2], c.shape[-1])  # host: beside the decoded codes
    out[:, anchors] = a_scale.float().expand(-1, -1, c.shape[-1]) / 2
    out[:, ~anchors] = d_scale.float().expand(-1, d_codes.shape[1], -1) / 2
    return out.reshape(c.shape)


def cachegen_entropy_bytes(c: CompressedKV) -> int:
    """Bytes of ``c`` if its delta codes took their zeroth-order entropy under one model per channel (what
    CacheGen's arithmetic coder, with a probability table per channel and layer, approaches; tables not counted)
    and the anchors, scales and zero points were sent as they are."""
    _, d_codes, *_ = _parts(c)
    per_channel = d_codes.transpose(1, 2).flatten(0, 1).long()  # [rows·channels, delta tokens]
    # host: counts of the decoded codes, on the host where they were decoded
    counts = torch.zeros(per_channel.shape[0], 2**c.bits).scatter_add_(1, per_channel, torch.ones(per_channel.shape))
    p = counts / per_channel.shape[1]
    bits = -(counts * torch.where(p > 0, p.log2(), 0.0)).sum().item()
    return math.ceil(bits / 8) + sum(c.sections[1:])
