"""NF4: QLoRA's 4-bit NormalFloat, blockwise absmax, and double quantization (Dettmers et al. 2023, §3).

Pretrained weights are close to normally distributed, so QLoRA picks the 16 code values q₀ … q₁₅ that split
N(0, 1) into equal-probability bins (quantile quantization), normalised to [−1, 1] and with an exact zero so that
padding and zero weights stay exact (§3, "4-bit NormalFloat Quantization"). The zero forces an asymmetric
split: 8 quantiles for the positive half, 7 for the negative half, and 0:

    positive  Φ⁻¹(pᵢ), pᵢ = 9 points evenly spaced from δ down to 1/2, the last (1/2, i.e. 0) dropped  → 8 values
    negative −Φ⁻¹(pᵢ), pᵢ = 8 points evenly spaced from δ down to 1/2, the last dropped               → 7 values
    qᵢ = sorted(positive ∪ {0} ∪ negative) / max          δ = ½((1 − 1/(2·15)) + (1 − 1/(2·16))) = 0.9677083

δ keeps the outermost quantile finite (Φ⁻¹(1) = ∞); it and the recipe are bitsandbytes' ``create_normal_map``,
whose output QLoRA's Appendix lists as the NF4 table. :func:`nf4_code` computes it the same way (δ written as
0.9677083, probabilities on a float32 grid, Φ⁻¹ in float64, the table in float32) and equals bitsandbytes' table
bit for bit.

Blockwise absmax quantization, block B = 64 (§2, "Block-wise k-bit Quantization"):

    c_b = max_{i∈b} |wᵢ|       codeᵢ = argmin_j |wᵢ/c_b − q_j|       ŵᵢ = q_{codeᵢ} · c_b

Double quantization (§3): the fp32 constants c_b cost 32/64 = 0.5 bits per parameter. QLoRA quantizes them
again: subtract their mean (they are all positive; centring makes a symmetric 8-bit format usable), then blocks
of 256 constants share one fp32 scale c₂ and each constant keeps 8 bits. QLoRA (and bitsandbytes) store those
8 bits in bitsandbytes' "dynamic" 8-bit code; here they are fp8 e4m3 with c₂ = max|c − mean| / 448, the 8-bit
float torch has — same layout and bytes, a slightly different grid, so double-quantized results are compared
with bitsandbytes by error, not bit for bit. Memory per parameter:

    single:  4 + 32/64                  = 4.5 bits
    double:  4 + 8/64 + 32/(64·256)     ≈ 4.127 bits     (+ 32 bits once for the mean)

Two elements per byte, the first in the high nibble (bitsandbytes' order, so packed bytes compare directly).
Those bit counts are formulas, so they live in :mod:`course_lib.cost.memory` (``nf4_bits_per_parameter``,
``nf4_bytes``); :func:`nf4_nbytes` here measures what a quantized tensor really holds.

QLoRA's frozen base (§3, eq. 5): the weight is *stored* in NF4 and *computed with* in a 16- or 32-bit
dtype, dequantized on the fly, Y = X · doubleDequant(c₂, c_b, W_NF4)ᵀ. :class:`NF4Linear` is that layer, a
frozen stand-in for ``nn.Linear`` (no parameters: nothing of it trains); :func:`quantize_linears` swaps it in
for a model's linear layers. With :func:`course_lib.model.lora.apply_lora` on top, only the adapters train:
QLoRA = ``apply_lora(quantize_linears(model, targets), targets)`` (tests/precision/test_qlora.py, against bitsandbytes'
``Linear4bit``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.precision.formats import FORMATS, round_to_format

__all__ = [
    "NF4Linear",
    "NF4Tensor",
    "dequantize_nf4",
    "nf4_code",
    "nf4_nbytes",
    "quantize_linears",
    "quantize_nf4",
]

BLOCK_SIZE = 64
DQ_BLOCK_SIZE = 256
# ½((1 − 1/30) + (1 − 1/32)) = 0.96770833…, written to 7 digits as bitsandbytes' create_normal_map has it: with
# the exact fraction the table moves by up to 3e-7 (the tests compare it with bitsandbytes' table bit for bit).
NF4_DELTA = 0.9677083
E4M3 = FORMATS["fp8_e4m3"]


def nf4_code() -> torch.Tensor:
    """The 16 NF4 values, ascending, float32: q₀ = −1, q₇ = 0, q₁₅ = 1. On the host, computed once as
    bitsandbytes' create_normal_map does; quantize and dequantize move it to the weights' device."""
    # host: a constant table (above), compared with bitsandbytes' bit for bit
    positive = torch.special.ndtri(torch.linspace(NF4_DELTA, 0.5, 9)[:-1].double())
    negative = -torch.special.ndtri(torch.linspace(NF4_DELTA, 0.5, 8)[:-1].double())  # host: the same table
    values = torch.cat([negative, torch.zeros(1, dtype=torch.float64, device=negative.device), positive])
    values = values.float().sort().values
    return values / values.max()


NF4_CODE = nf4_code()


@dataclass
class NF4Tensor:
    """What QLoRA stores for one weight matrix.

    ``packed`` uint8 (two codes a byte). Without double quantization ``absmax`` holds the fp32 c_b. With it,
    ``absmax`` holds the 8-bit quantized constants (float8_e4m3fn), ``absmax_scale`` the fp32 c₂ (one per 256
    constants) and ``absmax_offset`` their fp32 mean.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, ...]
    block_size: int = BLOCK_SIZE
    absmax_scale: torch.Tensor | None = None
    absmax_offset: torch.Tensor | None = None

    @property
    def double_quantized(self) -> bool:
        return self.absmax_scale is not None


def _quantize_constants(c: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: (c − mean) in blocks of ``block_size``, scaled to e4m3's ±448 and rounded to e4m3."""
    offset = c.mean()
    centred = c - offset
    pad = (-centred.numel()) % block_size
    blocks = torch.nn.functional.pad(centred, (0, pad)).reshape(-1, block_size)
    scale = blocks.abs().amax(1) / E4M3.max
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = round_to_format(blocks * inv.unsqueeze(1), E4M3).to(E4M3.dtype)
    return q.reshape(-1)[: c.numel()], scale, offset


def _dequantize_constants(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, block_size: int) -> torch.Tensor:
    pad = (-q.numel()) % block_size
    blocks = torch.nn.functional.pad(q.float(), (0, pad)).reshape(-1, block_size)
    return (blocks * scale.unsqueeze(1)).reshape(-1)[: q.numel()] + offset


def quantize_nf4(
    w: torch.Tensor, block_size: int = BLOCK_SIZE, double_quant: bool = False, dq_block_size: int = DQ_BLOCK_SIZE
) -> NF4Tensor:
    """Blockwise absmax NF4 over the flattened tensor (as bitsandbytes does), optionally double-quantized.

    Like bitsandbytes, wᵢ/c_b is computed as wᵢ · (1/c_b) in float32 and clamped to [−1, 1]; the nearest code
    is found by comparing with the midpoints between neighbouring codes (a tie goes to the lower code, as
    ``argmin`` does).
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_nf4 takes a floating-point tensor, got {w.dtype}")
    if w.numel() % block_size or block_size % 2:
        raise ValueError(
            f"{w.numel()} elements are not a whole number of blocks of {block_size} (an even size): "
            "pad the weight, or choose a block size that divides it"
        )
    blocks = w.detach().float().reshape(-1, block_size)
    absmax = blocks.abs().amax(1)
    inv = torch.where(absmax > 0, 1 / absmax, torch.zeros_like(absmax))  # an all-zero block stays zero
    scaled = (blocks * inv.unsqueeze(1)).clamp(-1, 1).reshape(-1)
    code = NF4_CODE.to(blocks.device)  # the host table, where the weights are
    midpoints = (code[1:] + code[:-1]) / 2
    codes = torch.bucketize(scaled, midpoints).to(torch.uint8)  # right=False: a midpoint goes to the lower code
    packed = (codes[0::2] << 4) | codes[1::2]
    if not double_quant:
        return NF4Tensor(packed, absmax, tuple(w.shape), block_size)
    q, scale, offset = _quantize_constants(absmax, dq_block_size)
    return NF4Tensor(packed, q, tuple(w.shape), block_size, absmax_scale=scale, absmax_offset=offset)


def dequantize_nf4(
    t: NF4Tensor, dtype: torch.dtype = torch.float32, dq_block_size: int = DQ_BLOCK_SIZE
) -> torch.Tensor:
    """ŵᵢ = q_{codeᵢ} · c_b, with c_b itself dequantized first when double quantization was used."""
    codes = torch.stack([t.packed >> 4, t.packed & 0xF], dim=-1).reshape(-1)
    absmax = t.absmax
    if t.double_quantized:
        absmax = _dequantize_constants(t.absmax, t.absmax_scale, t.absmax_offset, dq_block_size)
    values = NF4_CODE.to(codes.device)[codes.long()].reshape(-1, t.block_size) * absmax.unsqueeze(1)
    return values.reshape(t.shape).to(dtype)


def nf4_nbytes(t: NF4Tensor) -> int:
    """Bytes held by every stored tensor of ``t``."""
    held = [t.packed, t.absmax] + ([t.absmax_scale, t.absmax_offset] if t.double_quantized else [])
    return sum(x.numel() * x.element_size() for x in held)


# ----------------------------------------------------------------------------------------------------------------
# QLoRA's frozen base layer
# ----------------------------------------------------------------------------------------------------------------


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored in NF4: y = x·Ŵᵀ + b, Ŵ = :func:`dequantize_nf4` of the
    stored tensor in ``compute_dtype`` (QLoRA §3, eq. 5; bitsandbytes' ``Linear4bit``).

    It holds no parameters: ``packed``, ``absmax`` (and with double quantization ``absmax_scale``,
    ``absmax_offset``) and ``bias`` are buffers, so they move with ``.to(device)`` and are saved in the
    ``state_dict``, but no optimizer can reach them. The gradient still flows through to x, which is what LoRA
    needs. It stands in for ``nn.Linear`` where a LoRA adapter is attached (``frozen_linear = True``, read by
    :func:`course_lib.model.lora.apply_lora`): ``in_features``, ``out_features``, ``bias``, and ``weight``, the
    dequantized [d_out, d_in] matrix (a new tensor at each read; merging an adapter reads it).

    Cast the model *before* quantizing: ``.to(dtype)``/``.half()`` would convert the stored constants too (they
    are floating-point buffers), and :attr:`nf4` refuses them then.
    """

    frozen_linear = True

    def __init__(
        self,
        t: NF4Tensor,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
        dq_block_size: int = DQ_BLOCK_SIZE,
    ):
        super().__init__()
        if len(t.shape) != 2:
            raise ValueError(f"NF4Linear takes a quantized [d_out, d_in] matrix, got shape {t.shape}")
        self.out_features, self.in_features = t.shape
        self.block_size, self.dq_block_size, self.compute_dtype = t.block_size, dq_block_size, compute_dtype
        self.register_buffer("packed", t.packed)
        self.register_buffer("absmax", t.absmax)
        self.register_buffer("absmax_scale", t.absmax_scale)
        self.register_buffer("absmax_offset", t.absmax_offset)
        self.register_buffer("bias", None if bias is None else bias.detach().to(compute_dtype).clone())
        self._absmax_dtype = t.absmax.dtype

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        block_size: int = BLOCK_SIZE,
        double_quant: bool = True,
        dq_block_size: int = DQ_BLOCK_SIZE,
        compute_dtype: torch.dtype | None = None,
    ) -> NF4Linear:
        """Quantize ``linear.weight`` (QLoRA's defaults: B = 64, double quantization with B₂ = 256); the bias
        is kept as it is. ``compute_dtype`` defaults to the weight's own dtype."""
        t = quantize_nf4(linear.weight, block_size, double_quant=double_quant, dq_block_size=dq_block_size)
        return cls(t, linear.bias, compute_dtype or linear.weight.dtype, dq_block_size)

    @property
    def nf4(self) -> NF4Tensor:
        """The stored tensor (views of the buffers, no copy)."""
        if self.packed.dtype != torch.uint8 or self.absmax.dtype != self._absmax_dtype:
            raise TypeError(
                f"NF4Linear's stored tensors were cast (packed {self.packed.dtype}, absmax {self.absmax.dtype}, "
                f"stored as uint8 and {self._absmax_dtype}): cast the model before quantize_linears, not after"
            )
        shape = (self.out_features, self.in_features)
        return NF4Tensor(self.packed, self.absmax, shape, self.block_size, self.absmax_scale, self.absmax_offset)

    @property
    def weight(self) -> torch.Tensor:
        """Ŵ = doubleDequant(c₂, c_b, W_NF4) in ``compute_dtype``: what the forward multiplies with."""
        return dequantize_nf4(self.nf4, self.compute_dtype, self.dq_block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dequantize, then one ordinary GEMM: bitsandbytes' CPU path does the same (F.linear on the dequantized
        # weight), which is why the two agree bit for bit when their stored constants agree (tests/precision/test_qlora.py).
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        dq = f", double_quant (B₂={self.dq_block_size})" if self.absmax_scale is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"block_size={self.block_size}{dq}, compute_dtype={self.compute_dtype}"
        )


def quantize_linears(
    model: nn.Module,
    targets,
    block_size: int = BLOCK_SIZE,
    double_quant: bool = True,
    dq_block_size: int = DQ_BLOCK_SIZE,
) -> nn.Module:
    """Replace every ``nn.Linear`` whose attribute name is in ``targets`` by its :class:`NF4Linear` (in place;
    returns ``model``). ``targets`` are names as in ``apply_lora`` (``"wq"`` matches ``layers.0.attention.wq``);
    QLoRA quantizes every linear layer of the transformer blocks and puts an adapter on each (§4: adapters on all
    of them are what matches full fine-tuning); transformers' ``load_in_4bit`` keeps the output head in 16 bits
    and embeddings are not linear layers. A target that matches nothing is an error.

    Quantize after any ``.to(dtype)``: the layers compute in the dtype their weight had.
    """
    if isinstance(targets, str):
        targets = (targets,)
    wanted = set(targets)
    swapped = []
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        if child in wanted and type(module) is nn.Linear:
            new = NF4Linear.from_linear(module, block_size, double_quant, dq_block_size)
            setattr(model.get_submodule(parent) if parent else model, child, new)
            swapped.append(name)
    if not swapped:
        linears = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"no nn.Linear named {tuple(targets)} in the model; its linear layers are named {linears}")
    return model
