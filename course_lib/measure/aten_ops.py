"""Every aten operator one training step of the course model dispatches: step 1 of a port.

A port of a training stack to a new accelerator (Ascend, MLU, DCU, ...) starts with *operator
coverage*: the device's PyTorch plugin must provide a kernel for every operator the step reaches,
or fall back to the CPU (slowly) or fail. The rest of a port follows in order (lecture 07 walks
it): operator coverage → compilation → distributed communication → cluster operations; this module
answers the first question for the course model:

    python -m course_lib.measure.aten_ops                      # the tiny model's step
    python -m course_lib.measure.aten_ops --compare deepseek-v3-mini   # and what an MoE/MLA model adds

**How the operators are caught.** A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees
every call at the bottom of PyTorch's dispatcher, below autograd and after the composite operators
have decomposed themselves (``aten.linear`` arrives as ``aten.t`` + ``aten.mm``). That is the level an
out-of-tree backend registers its kernels at (the ``PrivateUse1`` dispatch key that ``torch_npu`` and
``torch_mlu`` use), so the list is what such a backend must implement. It also sees the backward
pass, which autograd runs below the mode, and the optimizer's in-place updates. ``torch.profiler``
records the same calls but nested under the composites that issued them (``aten::linear`` above
``aten::mm``), so one would have to untangle the tree to find the leaves; ``torch._C._dispatch``
hooks are private. Checked on torch 2.13.

Two properties of each operator help read the list: whether it is a *view* (``aten.t``,
``aten.view``: no arithmetic, a strided backend gets most of them from one generic implementation),
and whether it is in the *Core ATen* operator set (``torch.Tag.core``), the ~190 operators that
``torch.export`` and the compiler stack decompose everything into — what a backend that goes
through ``torch.compile`` must cover instead.

The list depends on the device as well as the model: scaled-dot-product attention picks a kernel per
device (``aten._scaled_dot_product_flash_attention_for_cpu`` here, a CUDA flash or memory-efficient
kernel on a GPU, the math fallback's ``bmm`` + ``_safe_softmax`` when a mask is given), so a port
reruns this on the target to see what its own plugin chose.

Tested in tests/measure/test_aten_ops.py.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.model import configs
from course_lib.model.transformer import Transformer

PHASES = ("forward", "backward", "optimizer")

# Scaled-down published architectures to set beside the course model (the shapes of
# tests/model_minis.py): DeepSeek-V3's MLA and its MoE (sigmoid router, a shared expert, the
# first layer dense), with multi-token prediction, at the course model's size.
MINIS = {
    "deepseek-v3-mini": (
        "deepseek-v3",
        dict(
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=4,
            d_ff=128,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_activated_experts=2,
            moe_d_ff=32,
            first_k_dense=1,
            vocab_size=64,
            max_seq_len=64,
        ),
    ),
}


def config(name: str):
    """A config of :mod:`course_lib.model.configs` by name, or one of :data:`MINIS`."""
    if name in MINIS:
        base, overrides = MINIS[name]
        return configs.get(base, **overrides)
    return configs.get(name)


class _Recorder(TorchDispatchMode):
    """Counts every operator that reaches the dispatcher's bottom, per phase."""

    def __init__(self):
        super().__init__()
        self.phase = PHASES[0]
        self.counts = {phase: collections.Counter() for phase in PHASES}
        self.ops: dict[str, torch._ops.OpOverload] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)  # 'aten.mm.default': namespace, operator, overload
        self.counts[self.phase][name] += 1
        self.ops.setdefault(name, func)
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class OpCensus:
    """Calls per operator (``'aten.mm.default'``) in each phase of one training step."""

    counts: dict[str, collections.Counter]
    views: frozenset[str]
    core: frozenset[str]

    @property
    def ops(self) -> set[str]:
        """Every aten operator the step dispatched (other namespaces, e.g. the profiler's
        record_function markers that torch.optim issues, are left out: no backend implements them)."""
        return {op for counter in self.counts.values() for op in counter if op.startswith("aten.")}

    def calls(self, op: str) -> int:
        """Calls of ``op`` over the whole step."""
        return sum(counter[op] for counter in self.counts.values())

    def rows(self) -> list[dict]:
        """One row per aten operator, most called first: op, calls per phase, view, core."""
        out = [
            dict(
                op=op,
                **{phase: self.counts[phase][op] for phase in PHASES},
                view=op in self.views,
                core=op in self.core,
            )
            for op in self.ops
        ]
        return sorted(out, key=lambda r: (-sum(r[p] for p in PHASES), r["op"]))


def training_step_ops(model: torch.nn.Module, tokens, targets, optimizer: torch.optim.Optimizer) -> OpCensus:
    """Run one training step (``model.loss``, backward, ``optimizer.step``, ``zero_grad``) under a dispatch
    recorder and return the operators of each phase."""
    recorder = _Recorder()
    with recorder:
        loss = model.loss(tokens, targets)
        recorder.phase = "backward"
        loss.backward()
        recorder.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    views = frozenset(name for name, op in recorder.ops.items() if op.is_view)
    core = frozenset(name for name, op in recorder.ops.items() if torch.Tag.core in op.tags)
    return OpCensus(recorder.counts, views, core)


def course_model_ops(
    cfg="tiny", batch: int = 2, seq_len: int = 16, seed: int = 0, device: torch.device | str = "cpu"
) -> OpCensus:
    """The operators of one AdamW training step of the course model built from ``cfg`` (a
    :class:`~course_lib.model.config.ModelConfig` or a name for :func:`config`), on random tokens,
    run on ``device``.

    The census is the CPU step's by default. ``torch.optim.AdamW`` with its CPU default (the
    per-parameter loop, ``foreach=False``): on a GPU it takes the multi-tensor ``_foreach_*``
    operators instead, and SDPA another fused kernel, another list to cover (``device="cuda"``).
    """
    cfg = config(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # host: drawn on the CPU generator (the same tokens on any machine), then moved to the model's device
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len)).to(device)
    # host: as the tokens: drawn on the CPU generator, then moved
    targets = torch.randint(0, cfg.vocab_size, (batch, seq_len)).to(device)
    return training_step_ops(model, tokens, targets, optimizer)


def missing_ops(required: Iterable[str], supported: Iterable[str]) -> list[str]:
    """The operators of ``required`` that ``supported`` lacks, sorted: what a port must still provide."""
    return sorted(set(required) - set(supported))


def table(census: OpCensus) -> str:
    """The census as a printed table: one line per operator, calls per phase, view / core flags."""
    lines = [f"{'aten operator':<68}{'fwd':>5}{'bwd':>5}{'opt':>5}  view core"]
    for r in census.rows():
        flags = f"{'v' if r['view'] else ' ':>5}{'c' if r['core'] else ' ':>5}"
        lines.append(f"{r['op']:<68}{r['forward']:5d}{r['backward']:5d}{r['optimizer']:5d}{flags}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.measure.aten_ops",
        description="List every aten operator one training step of the course model dispatches.",
    )
    parser.add_argument("--config", default="tiny", help=f"a config name or one of {sorted(MINIS)} (default: tiny)")
    parser.add_argument(
        "--compare", default=None, help="a second config: also print the operators it adds (what a port must add)"
    )
    args = parser.parse_args(argv)
    census = course_model_ops(args.config)
    print(f"{args.config}: {len(census.ops)} aten operators in one AdamW training step")
    print(table(census))
    if args.compare:
        other = course_model_ops(args.compare)
        added = missing_ops(other.ops, census.ops)
        print(f"\n{args.compare} adds {len(added)} operators to {args.config}'s:")
        print("\n".join(f"  {op}" for op in added))
        gone = missing_ops(census.ops, other.ops)
        print(f"and does not use {len(gone)} of them: {', '.join(gone) or '-'}")


if __name__ == "__main__":
    main()
