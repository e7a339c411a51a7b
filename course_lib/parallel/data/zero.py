"""ZeRO, the Zero Redundancy Optimizer: stages 1, 2 and 3 with AdamW (lecture 02, lab 03).

Rajbhandari, Rasley, Ruwase, He. "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020 (arXiv:1910.02054), §5 (the three stages), §7 (communication).

Plain data parallelism (DDP) keeps N identical copies of everything: parameters, gradients and
the optimizer state. Each ZeRO stage stops replicating one more of them, and shards it over the
N ranks instead; rank r owns the r-th 1/N of every buffer:

    stage 0  DDP: all-reduce the gradients, every rank runs AdamW on every parameter
    stage 1  AdamW state sharded: reduce-scatter the gradients, rank r updates its 1/N of the
             parameters, then all-gather the updated parameters (2Ψ moved: as much as DDP)
    stage 2  + gradients sharded: each unit's gradients are reduce-scattered during the backward
             pass as soon as they are complete, and only the shard is kept
    stage 3  + parameters sharded: a unit's parameters are all-gathered just before its forward
             and its backward, and freed right after (module hooks): 3Ψ moved

A *unit* is one child module of the model (each entry of a ModuleList counts as one): for the
course Transformer the embedding, each Block, the final norm and the output layer. Each unit's
parameters live in one flat buffer, **padded to a multiple of N** so it splits into N equal
shards: reduce-scatter and all-gather exchange equal-sized pieces (NCCL and gloo require it),
and a shard boundary may fall inside a parameter — the optimizer is elementwise, so it does not
care. The padding (< N elements per unit) is zero and stays zero: its gradient is zero.

Mixed precision as in the paper (§3.1): ``precision="bf16"`` computes with bf16 parameters and
gradients and keeps fp32 master weights and fp32 Adam moments (12 bytes per parameter, sharded);
``precision="fp32"`` has no master copy (the parameters are fp32 already). ``offload=True`` puts
the master weights and moments on the CPU and runs AdamW there (ZeRO-Offload, Ren et al. 2021);
on a CPU-only machine that move is a no-op, but the code path is the same.

``prefetch=k`` (stage 3) gathers the next k units ahead of the one about to compute — in the
forward pass the units after it, in the backward pass the ones before it, in the execution order
recorded during the first forward pass — as DeepSpeed's ``stage3_prefetch_bucket_size`` and FSDP's
forward/backward prefetch do. On a GPU the early all-gather runs on another stream, hidden behind
the current unit's compute; the price is memory: up to k + 1 units gathered at once instead of one
(:func:`course_lib.cost.memory.zero3_gathered_peak_bytes`, measured in lecture 02).

    model = model.to(course_lib.dist.device())  # the caller places the model (and its batches)
    zero = Zero(model, stage=2, lr=1e-3, weight_decay=0.1, precision="bf16")
    loss = model.loss(x, y)    # stage 3: hooks gather each unit's parameters
    loss.backward()            # stages 2-3: hooks reduce-scatter each unit's gradients
    zero.step()                # AdamW on this rank's shard; stages 1-2 all-gather parameters
    zero.zero_grad()

Collectives are called as ``dist.reduce_scatter_single`` and ``dist.all_gather_single`` (torch
2.13 renamed ``reduce_scatter_tensor`` to the former) so that :mod:`course_lib.dist.counter` counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from course_lib.cost.memory import STAGES
from course_lib.dist import device as compute_device
from course_lib.dist.census import held_bytes
from course_lib.dist.runtime import require_on_device
from course_lib.optim.optimizers import adamw_

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units: its children, with ModuleList/Sequential entries as units of their own."""
    direct = [n for n, _ in model.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f"parameters {direct} are registered on the root module; ZeRO shards per child "
            "module (unit): move them into a submodule"
        )
    found = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            found += [(f"{name}.{i}", c) for i, c in child.named_children()]
        else:
            found.append((name, child))
    found = [(n, m) for n, m in found if any(True for _ in m.parameters())]
    owner: dict[int, str] = {}
    for name, module in found:
        for p in module.parameters():
            if id(p) in owner:
                raise ValueError(
                    f"a parameter is shared by units {owner[id(p)]!r} and {name!r} (tied weights); "
                    "ZeRO shards each unit on its own: untie them or group both modules in one unit"
                )
            owner[id(p)] = name
    if not found:
        raise ValueError("the model has no parameters to shard")
    return found


class _Unit:
    """One unit's flat buffers and where its shard sits in this rank's shard tensors."""

    def __init__(self, name, module, parts, offset):
        self.name, self.module = name, module
        self.params = list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // parts) * parts  # round up: N must divide the buffer
        self.shard = self.padded // parts
        self.offset = offset  # of this unit's shard inside the rank-local shard tensors
        self.full = None  # flat parameters (stage 3: allocated only while gathered)
        self.grad_full = None  # flat gradients, stages 0-1
        self.pending = len(self.params)  # gradients still to arrive in this backward, stages 2-3
        self.reduced = False  # reduce-scattered since the last step, stages 2-3

    def views(self, flat):
        """(parameter, its slice of ``flat`` shaped like it) for each parameter of the unit."""
        out, at = [], 0
        for p in self.params:
            out.append((p, flat[at : at + p.numel()].view_as(p)))
            at += p.numel()
        return out


class Zero:
    """ZeRO stage 0-3 data parallelism with AdamW for ``model`` over the ranks of ``group``."""

    def __init__(
        self,
        model: nn.Module,
        stage: int,
        *,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precision: str = "fp32",
        offload: bool = False,
        prefetch: int = 0,
        group=None,
    ):
        if not isinstance(stage, int) or stage not in STAGES:
            raise ValueError(
                f"ZeRO stage {stage!r} does not exist: choose 0 (plain data parallel), 1 (shard the "
                "optimizer state), 2 (also the gradients) or 3 (also the parameters)"
            )
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision {precision!r} is not supported: choose 'fp32', or 'bf16' for bf16 "
                "parameters and gradients with fp32 master weights and moments"
            )
        if not lr >= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0:
            raise ValueError(f"AdamW needs lr >= 0, 0 <= betas < 1 and eps > 0; got lr={lr}, betas={betas}, eps={eps}")
        if not isinstance(prefetch, int) or prefetch < 0 or (prefetch and stage != 3):
            raise ValueError(
                f"prefetch={prefetch!r}: prefetch is the number of units (an int >= 0) that stage 3 "
                "gathers ahead of the one computing; stages 0-2 keep every parameter, so use prefetch=0"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "Zero needs torch.distributed initialised: run under course_lib.dist.launch, "
                "accelerate launch or torchrun"
            )
        require_on_device(model, "Zero")  # Zero shards the parameters where they are and moves nothing
        self.model, self.stage, self.group = model, stage, group
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dtype, self.device = PRECISIONS[precision], compute_device()
        self.optimizer_device = torch.device("cpu") if offload else self.device
        # Stage 0 does not shard: one "part", which every rank owns.
        parts, self.me = (1, 0) if stage == 0 else (self.n, self.rank)
        self.units, offset = [], 0
        for name, module in units(model):
            self.units.append(_Unit(name, module, parts, offset))
            offset += self.units[-1].shard
        self.step_count = 0
        self.prefetch, self.order, self.order_known = prefetch, [], False  # execution order, stage 3
        # Rank-local shard tensors (the whole model's, stage 0): Adam moments always; a separate fp32
        # master copy only when the parameters are not fp32 already or live on another device.
        state = dict(dtype=torch.float32, device=self.optimizer_device)
        self.exp_avg, self.exp_avg_sq = torch.zeros(offset, **state), torch.zeros(offset, **state)
        separate = self.dtype != torch.float32 or self.optimizer_device != self.device
        self.master = torch.zeros(offset, **state) if separate else None
        self.grad_shard = torch.zeros(offset, dtype=self.dtype, device=self.device) if stage >= 2 else None
        self.param_shard = torch.zeros(offset, dtype=self.dtype, device=self.device) if stage == 3 else None
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for u in self.units:
            self._build(u, src)

    # ------------------------------------------------------------------------------ set-up
    def _build(self, u: _Unit, src: int) -> None:
        fp32 = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
        for p, view in u.views(fp32):
            view.copy_(p.detach())
        dist.broadcast(fp32, src, group=self.group)  # like DDP: every rank starts from rank 0's weights
        mine = slice(self.me * u.shard, (self.me + 1) * u.shard)
        if self.master is not None:  # exact fp32 values, taken before any rounding to bf16
            self._slice(self.master, u).copy_(fp32[mine])
        u.full = fp32 if self.dtype == torch.float32 else fp32.to(self.dtype)
        for p, view in u.views(u.full):
            p.data = view  # the module now computes with (a view of) the flat buffer
        if self.stage <= 1:  # the whole gradient, accumulated in place by autograd, as DDP's bucket views
            u.grad_full = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
            for p, view in u.views(u.grad_full):
                p.grad = view
        else:
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))
        if self.stage == 3:
            self._slice(self.param_shard, u).copy_(u.full[mine])
            self._free(u)
            u.module.register_forward_pre_hook(lambda *_, u=u: self._before_forward(u))
            u.module.register_forward_hook(lambda _m, _in, out, u=u: self._after_forward(u, out))

    @staticmethod
    def _slice(shard_tensor: torch.Tensor, u: _Unit) -> torch.Tensor:
        return shard_tensor[u.offset : u.offset + u.shard]

    def _my_params(self, u: _Unit) -> torch.Tensor:
        """This rank's slice of the unit's compute-precision parameters."""
        if self.stage == 3:
            return self._slice(self.param_shard, u)
        return u.full[self.me * u.shard : (self.me + 1) * u.shard]

    # ------------------------------------------------------------------------------ stage 3
    def _before_forward(self, u: _Unit) -> None:
        if not self.order_known and u not in self.order:  # the first forward records the order
            self.order.append(u)
        self._gather(u, direction=+1)

    def _gather(self, u: _Unit, direction: int = 0) -> None:
        """All-gather the unit's parameters into its flat buffer (re-allocated), before compute; then
        the ``self.prefetch`` units that compute next (``direction``: +1 forward, -1 backward, 0 none)."""
        storage = u.full.untyped_storage()
        if storage.nbytes() == 0:  # else already gathered: prefetched, or an output of several tensors
            # the label marks the all-gather (and its allocation) in a torch.profiler trace
            with record_function(f"ZeRO-3 all-gather {u.name}"):
                storage.resize_(u.padded * u.full.element_size())
                dist.all_gather_single(u.full, self._slice(self.param_shard, u), group=self.group)
        if direction and self.order_known:
            at = self.order.index(u)
            for i in range(at + direction, at + direction * (self.prefetch + 1), direction):
                if 0 <= i < len(self.order):
                    self._gather(self.order[i])

    def _after_forward(self, u: _Unit, output) -> None:
        """Free the unit's parameters, and have them gathered again when the gradient of its output
        arrives: that moment comes just before autograd runs the unit's backward."""
        self._free(u)
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _grad, u=u: self._gather(u, direction=-1))

    def _free(self, u: _Unit) -> None:
        """Give the gathered buffer's memory back. The parameters stay views of it, and autograd's
        saved tensors too: the next gather refills the same storage, so backward sees the values."""
        if u.full.untyped_storage().nbytes() > 0:
            with record_function(f"ZeRO-3 free {u.name}"):
                u.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------------------ stages 2-3
    def _grad_ready(self, u: _Unit) -> None:
        """Autograd has finished one of the unit's gradients; when all are in, reduce-scatter them."""
        u.pending -= 1
        if u.pending > 0:
            return
        u.pending = len(u.params)
        flat = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        for p, view in u.views(flat):
            view.copy_(p.grad)
            p.grad = None  # the full gradient is not kept: that is the memory stage 2 saves
        flat.mul_(1 / self.n)  # average, like DDP, which multiplies by 1/N before summing
        shard = torch.empty(u.shard, dtype=self.dtype, device=self.device)
        dist.reduce_scatter_single(shard, flat, group=self.group)
        self._slice(self.grad_shard, u).add_(shard)  # add: several backwards accumulate
        u.reduced = True
        if self.stage == 3:
            self._free(u)

    # ------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients, AdamW on this rank's shard, and bring the parameters up to date."""
        grads = self._averaged_gradients()
        self.step_count += 1
        self.order_known = True  # a whole forward pass has run
        for u in self.units:
            mine = self._my_params(u)
            target = self._slice(self.master, u) if self.master is not None else mine
            grad = grads[u.name].to(self.optimizer_device, torch.float32)  # fp32 path: no copy
            adamw_(
                target,
                grad,
                self._slice(self.exp_avg, u),
                self._slice(self.exp_avg_sq, u),
                self.step_count,
                self.lr,
                self.beta1,
                self.beta2,
                self.eps,
                self.weight_decay,
            )
            if self.master is not None:
                mine.copy_(target)  # round to bf16 / move back from the offload device
            if self.stage in (1, 2):  # in place: this rank's slice of u.full is the input
                dist.all_gather_single(u.full, mine, group=self.group)

    def _averaged_gradients(self) -> dict[str, torch.Tensor]:
        """{unit: the averaged gradient of this rank's part}: all-reduce (0), reduce-scatter (1), kept (2-3)."""
        grads = {}
        for u in self.units:
            if self.stage >= 2:
                if u.pending != len(u.params) or not u.reduced:
                    got = len(u.params) - u.pending if u.pending != len(u.params) else 0
                    raise RuntimeError(
                        f"unit {u.name!r} received gradients for {got} of its {len(u.params)} parameters: "
                        "ZeRO-2/3 reduce-scatter a unit when all its gradients are in, so every "
                        "parameter must be used in the forward pass"
                    )
                u.reduced = False
                grads[u.name] = self._slice(self.grad_shard, u)
                continue
            if any(p.grad is None or p.grad.data_ptr() != v.data_ptr() for p, v in u.views(u.grad_full)):
                raise RuntimeError(
                    f"the gradients of unit {u.name!r} are no longer views of ZeRO's gradient "
                    "buffer: call zero.zero_grad(), not model.zero_grad() or optimizer.zero_grad()"
                )
            u.grad_full.mul_(1 / self.n)
            if self.stage == 0:
                dist.all_reduce(u.grad_full, group=self.group)
                grads[u.name] = u.grad_full
            else:
                grads[u.name] = torch.empty(u.shard, dtype=self.dtype, device=self.device)
                dist.reduce_scatter_single(grads[u.name], u.grad_full, group=self.group)
        return grads

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_full is not None:
                u.grad_full.zero_()
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    # ------------------------------------------------------------------------------ inspection
    @torch.no_grad()
    def full_parameters(self, master: bool = False) -> dict[str, torch.Tensor]:
        """{name: full parameter} on every rank (collective): the compute-precision parameters, or
        with ``master=True`` the fp32 master weights (the same tensors when there is no master copy)."""
        out, names = {}, {id(p): n for n, p in self.model.named_parameters()}
        for u in self.units:
            if master and self.master is not None:
                mine = self._slice(self.master, u).to(self.device)
                flat = mine.clone()
                if self.stage > 0:  # stage 0 holds every master weight already
                    flat = torch.empty(u.padded, dtype=torch.float32, device=self.device)
                    dist.all_gather_single(flat, mine, group=self.group)
            elif self.stage == 3:
                self._gather(u)
                flat = u.full.clone()
                self._free(u)
            else:
                flat = u.full.clone()
            out.update({names[id(p)]: view.clone() for p, view in u.views(flat)})
        return out

    def model_state_bytes(self) -> dict[str, int]:
        """A census of the model states this rank holds, by storage (see memory.held_bytes).

        ``params``: the compute-precision parameters (stage 3: the shard; freed gathers count 0);
        ``grads``: gradient buffers and any ``.grad``; ``optimizer``: master weights and moments;
        ``total``: everything reachable from this object, each storage once.
        """
        params = [p.data for p in self.model.parameters()] + [self.param_shard]
        grads = [p.grad for p in self.model.parameters()] + [u.grad_full for u in self.units] + [self.grad_shard]
        optim = [self.master, self.exp_avg, self.exp_avg_sq]
        return {
            "params": held_bytes(params),
            "grads": held_bytes(grads),
            "optimizer": held_bytes(optim),
            "total": held_bytes(self),
        }
