"""LoRA: fine-tune a frozen model through a low-rank update of some of its matrices (Hu et al. 2021).

A pretrained ``nn.Linear`` computes y = x Wᵀ with W of shape [d_out, d_in]. LoRA (§4.1) freezes W and
learns a rank-r correction beside it:

    y = x Wᵀ + (α/r) · x Aᵀ Bᵀ,      A: [r, d_in],  B: [d_out, r],  r ≪ min(d_in, d_out)

* A starts random (Kaiming-uniform, as Microsoft's ``loralib`` and Hugging Face's ``peft`` draw it;
  the paper says "random Gaussian"), B starts at zero: so B·A = 0 and the adapted model computes
  *exactly* the base model at step 0; training moves it away from there.
* α/r scales the update so that, with Adam, changing r barely changes how far a step moves the
  output; the paper sets α to the first r it tries and does not tune it (§4.1).
* Trainable parameters per adapted matrix: r·(d_in + d_out) instead of d_in·d_out. The paper adapts
  only W_q and W_v (§7.1, Table 5: at a fixed budget, spreading r over W_q, W_v beats a large r on
  one matrix), hence ``targets=("wq", "wv")`` below, the course model's names for them.
* No inference cost (§4.1): :func:`merge_lora` folds W ← W + (α/r)·B·A and gives back plain
  ``nn.Linear`` layers; the merged model computes the same function up to fp32 rounding.

What LoRA saves is optimizer state and gradients (only r·(d_in+d_out) per matrix need Adam's two
moments), not activations: the frozen base still runs forward and backward through x.
:mod:`course_lib.optim.lowrank` keeps every weight trainable and makes the *optimizer state* low-rank
instead (GaLore). The same adapter in ``peft`` is ``LoraConfig(r, lora_alpha, target_modules=
["q_proj", "v_proj"], lora_dropout=0)`` on the model :func:`~course_lib.model.hf_export.export_hf` writes;
tests/model/test_lora.py runs the two side by side.

The base need not be an ``nn.Linear``: any frozen stand-in for one that says so (class attribute
``frozen_linear = True``) and has ``in_features``, ``out_features``, ``bias`` and ``weight`` (the dense
[d_out, d_in] matrix it computes with) can carry an adapter. QLoRA (Dettmers et al. 2023, §3) is exactly
that: the base stored in 4-bit NF4 (:class:`course_lib.precision.nf4.NF4Linear`), the adapter in full
precision, ``apply_lora(quantize_linears(model, targets), targets)`` (tests/precision/test_qlora.py). This file does
not import the quantized layer: the attribute is the whole contract.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LoRALinear", "apply_lora", "is_linear_base", "lora_parameters", "merge_lora"]


def is_linear_base(module: nn.Module) -> bool:
    """``nn.Linear`` itself (not a subclass, whose forward may be anything), or a frozen stand-in that
    declares ``frozen_linear = True`` (e.g. :class:`course_lib.precision.nf4.NF4Linear`)."""
    return type(module) is nn.Linear or getattr(module, "frozen_linear", False) is True


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` (or a stand-in, :func:`is_linear_base`) plus the trainable low-rank path
    (α/r)·B·A (Hu et al. 2021, eq. 3).

    forward(x) = base(x) + (α/r) · B(A(x)), computed in that order (x → A → B → scale), which is
    also ``peft``'s order: the same A and B give the same bits.
    """

    def __init__(self, base: nn.Module, r: int, alpha: float):
        super().__init__()
        if not (isinstance(base, nn.Linear) or is_linear_base(base)):
            raise TypeError(
                f"LoRALinear wraps an nn.Linear or a frozen stand-in declaring frozen_linear = True "
                f"(e.g. precision.nf4.NF4Linear), got {type(base).__name__}"
            )
        if not isinstance(r, int) or not 1 <= r <= min(base.in_features, base.out_features):
            raise ValueError(
                f"rank r={r!r} must be an int in 1..min(d_in, d_out) = 1..{min(base.in_features, base.out_features)}: "
                f"a rank above that is not low-rank (it costs more than training W itself)"
            )
        self.base = base
        self.base.requires_grad_(False)  # W (and a bias, if any) stay as they were: only A and B train
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        weight = base.weight  # read for its dtype and device (a stand-in dequantizes it here, once)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=weight.dtype, device=weight.device))
        # nn.Linear's own default draw, as loralib and peft (init_lora_weights=True) use for A
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base layer with W ← W + (α/r)·B·A folded in (a new ``nn.Linear``; this module is unchanged).

        A quantized base is dequantized first, so the merged layer is dense, in the compute dtype: a sum of a
        4-bit grid and a low-rank update is on no 4-bit grid (re-quantizing it would round the update away).
        """
        weight = self.base.weight
        out = nn.Linear(
            self.base.in_features,
            self.base.out_features,
            bias=self.base.bias is not None,
            dtype=weight.dtype,
            device=weight.device,
        )
        out.weight.copy_(weight + (self.lora_B @ self.lora_A) * self.scaling)  # peft's order too
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        return out

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}"


def _replace(model: nn.Module, wanted, make) -> list[str]:
    """Swap every submodule whose own name is in ``wanted`` and that ``make`` accepts; return full names."""
    swapped = []
    for name, module in list(model.named_modules()):
        parent_name, _, child = name.rpartition(".")
        if child not in wanted:
            continue
        new = make(module)
        if new is not None:
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
            swapped.append(name)
    return swapped


def apply_lora(model: nn.Module, targets=("wq", "wv"), r: int = 8, alpha: float = 16.0) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap each ``nn.Linear`` (or stand-in, :func:`is_linear_base`)
    named in ``targets`` in a :class:`LoRALinear` (in place; returns ``model``). Only the adapters' A and B
    then train.

    ``targets`` are attribute names (``"wq"`` matches ``layers.3.attention.wq``), as ``peft``'s
    ``target_modules`` are. A target that matches nothing is an error, not a silent no-op.
    """
    if isinstance(targets, str):
        targets = (targets,)
    model.requires_grad_(False)
    swapped = _replace(model, set(targets), lambda m: LoRALinear(m, r, alpha) if is_linear_base(m) else None)
    if not swapped:
        linears = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if is_linear_base(m)})
        raise ValueError(f"no nn.Linear named {tuple(targets)} in the model; its linear layers are named {linears}")
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` by its merged ``nn.Linear`` (W + (α/r)·B·A), in place.

    The merged layers keep the base's ``requires_grad`` (False after :func:`apply_lora`).
    """
    wanted = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoRALinear)}

    def make(module):
        if not isinstance(module, LoRALinear):
            return None
        merged = module.merged()
        merged.requires_grad_(any(p.requires_grad for p in module.base.parameters()))
        return merged

    _replace(model, wanted, make)
    return model


def lora_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The adapters' parameters (every A, then B, in module order): what the optimizer gets."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            yield module.lora_A
            yield module.lora_B
