"""A delta + entropy codec for moving a KV cache over a network (CacheGen), lecture 06.

It quantizes with the asymmetric codes of :mod:`course_lib.inference.quantized_cache` (x̂ = m + s·code,
|x − x̂| ≤ s/2). Tested in tests/inference/test_quantized_kv.py.

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

from course_lib.inference.quantized_cache import BITS, affine_codes

__all__ = [
    "CODERS",
    "CompressedKV",
    "cachegen_compress",
    "cachegen_decompress",
    "cachegen_entropy_bytes",
    "cachegen_error_bound",
]

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
    a_codes, a_scale, a_zero = affine_codes(xs[:, anchors], 8, xs.shape[-1], dim=2)
    a_hat = (a_zero.float() + a_scale.float() * a_codes.float()).to(x.dtype)
    group = torch.arange(n)[~anchors] // tokens_per_group  # host: indexes xs, on the host; each token's anchor
    delta = xs[:, ~anchors] - a_hat[:, group]
    d_codes, d_scale, d_zero = affine_codes(delta, bits, delta.shape[1], dim=1)
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
