"""QLoRA on the course model, measured (lecture 05, tests/precision/test_qlora.py).

QLoRA (Dettmers et al. 2023) = a frozen base stored in 4-bit NF4 with double quantization (§3) + LoRA adapters
on every linear layer of the blocks (§4), trained in full precision. The two pieces live in their layers —
:func:`course_lib.precision.nf4.quantize_linears` and :func:`course_lib.model.lora.apply_lora` — and meet here,
where a harness may import both:

* :func:`make_qlora` quantizes the base and attaches the adapters; :func:`dequantized_copy` is the reference
  it must equal: the same model with each NF4 layer replaced by an ``nn.Linear`` holding the dequantized weight;
* :func:`train` runs AdamW on the adapters over the course language and returns the losses and the optimizer;
* :func:`qlora_held_bytes` measures what the fine-tune holds (NF4 codes and constants, adapters and their
  gradients, optimizer state), beside :func:`course_lib.cost.memory.qlora_bytes`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from course_lib.data import MarkovLanguage
from course_lib.dist import census
from course_lib.experiments import small_run
from course_lib.model.lora import LoRALinear, apply_lora
from course_lib.optim.optimizers import AdamW
from course_lib.precision.nf4 import BLOCK_SIZE, DQ_BLOCK_SIZE, NF4Linear, nf4_nbytes, quantize_linears

__all__ = ["BLOCK_LINEARS", "dequantized_copy", "make_qlora", "qlora_held_bytes", "train", "val_loss"]

# Every linear layer inside the course model's blocks: attention (wq, wk, wv, wo) and SwiGLU (w1, w3, w2).
# The output head and the embeddings stay in full precision, as in transformers' load_in_4bit.
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def make_qlora(
    model: nn.Module,
    targets=BLOCK_LINEARS,
    r: int = 8,
    alpha: float = 16.0,
    block_size: int = BLOCK_SIZE,
    double_quant: bool = True,
    dq_block_size: int = DQ_BLOCK_SIZE,
) -> nn.Module:
    """QLoRA in place: ``apply_lora(quantize_linears(model, targets), targets, r, alpha)``; returns ``model``.

    Quantize first, then wrap: the adapter sits beside the NF4 layer (LoRALinear.base is the NF4Linear).
    """
    quantize_linears(model, targets, block_size, double_quant, dq_block_size)
    return apply_lora(model, targets, r=r, alpha=alpha)


def dequantized_copy(model: nn.Module) -> nn.Module:
    """A deep copy with every :class:`NF4Linear` replaced by a frozen ``nn.Linear`` whose weight is the
    dequantized one (and the same bias): the full-precision model that QLoRA's forward computes."""
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        if isinstance(module, NF4Linear):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            dense = dense.to(device=module.packed.device, dtype=module.compute_dtype)
            with torch.no_grad():
                dense.weight.copy_(module.weight)
                if module.bias is not None:
                    dense.bias.copy_(module.bias)
            dense.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, dense)
    return out


def train(
    model: nn.Module,
    params,
    steps: int,
    lang: MarkovLanguage | None = None,
    batch: int = 16,
    seq_len: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> tuple[list[float], torch.optim.Optimizer]:
    """``steps`` AdamW steps (no weight decay) on ``params`` over windows of ``lang`` (the default course
    language); returns the training losses and the optimizer (its state is what :func:`qlora_held_bytes` counts)."""
    opt = AdamW(params, lr=lr, weight_decay=0.0)
    return small_run.train(model, opt, small_run.batches(steps, batch, seq_len, seed, lang=lang)), opt


@torch.no_grad()
def val_loss(model: nn.Module, lang: MarkovLanguage | None = None, sequences: int = 64, seq_len: int = 32) -> float:
    """Mean cross-entropy on held-out windows of ``lang`` (seed 10 000, never a training seed here)."""
    data = small_run.windows(lang or MarkovLanguage(), sequences, seq_len, 10_000)
    return model.loss(data.inputs, data.targets).item()


def qlora_held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """What a QLoRA fine-tune holds, measured: ``base`` (every NF4 layer's stored tensors: codes, 8-bit
    constants, their scales and mean, by :func:`~course_lib.precision.nf4.nf4_nbytes`), ``adapters`` (A, B and
    their gradients: :func:`course_lib.dist.census.held_bytes` of the LoRALinear modules, whose NF4 base has
    no parameters), ``optimizer`` (:func:`course_lib.dist.census.optimizer_state_bytes`) and ``total``."""
    nf4 = [m for m in model.modules() if isinstance(m, NF4Linear)]
    loras = [m for m in model.modules() if isinstance(m, LoRALinear)]
    out = {
        "base": sum(nf4_nbytes(m.nf4) for m in nf4),
        "adapters": census.held_bytes(*loras),
        "optimizer": census.optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }
    out["total"] = sum(out.values())
    return out
