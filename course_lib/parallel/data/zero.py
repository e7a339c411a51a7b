"""ZeRO, the Zero Redundancy Optimizer: stages 1, 2 and 3 with AdamW (lecture 02, lab 03).

Rajbhandari, Rasley, Ruwase, He. "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020 (arXiv:1910.02054): §5.1 P_os, §5.2 P_os+g, §5.3 P_os+g+p, §7 communication.

Plain data parallelism (DDP) keeps world_size identical copies of the parameters, the gradients
and the optimizer state. Each ZeRO stage stops replicating one more of them and shards it over
the ranks instead: rank r owns shard r of every unit's flat buffer (:mod:`.zero_units`: a unit is
one child module, its buffer padded so that world_size divides it):

    stage 0  DDP: all-reduce the gradients, every rank runs AdamW on every parameter
    stage 1  P_os, optimizer state sharded (§5.1): reduce-scatter the gradients, rank r updates its
             shard of the parameters, then all-gather the updated parameters (2Ψ moved, as DDP)
    stage 2  P_os+g, + gradients sharded (§5.2): each unit's gradients are reduce-scattered during
             the backward pass as soon as they are complete, and only the shard is kept
    stage 3  P_os+g+p, + parameters sharded (§5.3): a unit's parameters are all-gathered just
             before its forward and its backward and freed right after (module hooks): 3Ψ moved

Mixed precision as in the paper (§3.1): ``precision="bf16"`` computes with bf16 parameters and
gradients and keeps fp32 master weights and Adam moments (12 bytes per parameter, sharded); fp32
has no master copy. ``offload=True`` keeps master weights and moments on the CPU and runs AdamW
there (ZeRO-Offload, Ren et al. 2021): a no-op on a CPU-only machine, the same code path.

``prefetch=k`` (stage 3) gathers the k units that compute next (in the order the first forward
recorded; backward walks it in reverse) ahead of time, as DeepSpeed's ``stage3_prefetch_bucket_size``
and FSDP's prefetch do: on a GPU the early all-gather hides behind the current unit's compute, for
up to k + 1 units gathered at once (:func:`course_lib.cost.memory.zero3_gathered_peak_bytes`).

    model = model.to(course_lib.dist.device())  # the caller places the model (and its batches)
    zero = Zero(model, stage=2, lr=1e-3, weight_decay=0.1, precision="bf16")
    loss = model.loss(x, y)    # stage 3: hooks gather each unit's parameters
    loss.backward()            # stages 2-3: hooks reduce-scatter each unit's gradients
    zero.step()                # AdamW on this rank's shard; stages 1-2 all-gather parameters
    zero.zero_grad()

Collectives are called as ``dist.reduce_scatter_single`` / ``dist.all_gather_single`` so that
:mod:`course_lib.dist.counter` counts them. Tested in tests/parallel/data/test_zero.py and by lab 03's grader
checks (tests/grading/test_lab_checks.py).
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
from course_lib.parallel.data.zero_units import Unit, model_units

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _check_arguments(stage, precision, lr, betas, eps, prefetch) -> None:
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
            "Zero needs torch.distributed initialised: run under course_lib.dist.launch, accelerate launch or torchrun"
        )


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
        _check_arguments(stage, precision, lr, betas, eps, prefetch)
        require_on_device(model, "Zero")  # Zero shards the parameters where they are and moves nothing
        self.model, self.stage, self.group = model, stage, group
        self.lr, (self.beta1, self.beta2), self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dtype, self.device = PRECISIONS[precision], compute_device()
        self.optimizer_device = torch.device("cpu") if offload else self.device
        # §5: N_d equal partitions, rank i owns partition i. Stage 0 does not partition: one shard, all ranks own it.
        num_shards, self.shard_index = (1, 0) if stage == 0 else (self.world_size, self.rank)
        self.units, offset = [], 0
        for name, module in model_units(model):
            self.units.append(Unit(name, module, num_shards, offset))
            offset += self.units[-1].shard_numel
        self.step_count = 0
        self.prefetch, self.order, self.order_known = prefetch, [], False  # execution order, stage 3
        # Rank-local shard tensors (the whole model's, stage 0): Adam moments always; an fp32 master
        # copy only when the parameters are not fp32 already or live on another device (offload).
        state = dict(dtype=torch.float32, device=self.optimizer_device)
        self.exp_avg, self.exp_avg_sq = torch.zeros(offset, **state), torch.zeros(offset, **state)
        needs_master = self.dtype != torch.float32 or self.optimizer_device != self.device
        self.master = torch.zeros(offset, **state) if needs_master else None
        self.grad_shard = torch.zeros(offset, dtype=self.dtype, device=self.device) if stage >= 2 else None
        self.param_shard = torch.zeros(offset, dtype=self.dtype, device=self.device) if stage == 3 else None
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for u in self.units:
            self._flatten(u, src)

    def _flatten(self, u: Unit, src: int) -> None:
        """Make the unit's parameters views of one flat buffer, rank 0's values; install the stage's hooks."""
        flat_params = torch.zeros(u.padded, dtype=torch.float32, device=self.device)
        for p, view in u.views(flat_params):
            view.copy_(p.detach())
        dist.broadcast(flat_params, src, group=self.group)  # like DDP: every rank starts from rank 0's weights
        if self.master is not None:  # exact fp32 values, taken before any rounding to bf16
            u.in_local(self.master).copy_(u.shard(flat_params, self.shard_index))
        u.full = flat_params if self.dtype == torch.float32 else flat_params.to(self.dtype)
        for p, view in u.views(u.full):
            p.data = view  # the module now computes with (a view of) the flat buffer
        if self.stage <= 1:  # the whole gradient, accumulated in place by autograd, as DDP's bucket views
            u.flat_grads = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
            for p, view in u.views(u.flat_grads):
                p.grad = view
        else:
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))
        if self.stage == 3:
            u.in_local(self.param_shard).copy_(u.shard(u.full, self.shard_index))
            self._free(u)
            u.module.register_forward_pre_hook(lambda *_, u=u: self._before_forward(u))
            u.module.register_forward_hook(lambda _m, _in, out, u=u: self._after_forward(u, out))

    def param_shard_of(self, u: Unit) -> torch.Tensor:
        """This rank's shard of the unit's compute-precision parameters (the whole unit at stage 0)."""
        if self.stage == 3:
            return u.in_local(self.param_shard)
        return u.shard(u.full, self.shard_index)

    # ------------------------------------------------------------------ §5.1 P_os: the optimizer step
    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients, AdamW on this rank's shard, and bring the parameters up to date."""
        grad_shards = self._averaged_gradient_shards()
        self.step_count += 1
        self.order_known = True  # a whole forward pass has run
        for u in self.units:
            # §5.1: rank i keeps only partition i of the optimizer state, so it updates only
            # partition i of the parameters (of the fp32 master copy when there is one).
            param_shard = self.param_shard_of(u)
            target = u.in_local(self.master) if self.master is not None else param_shard
            grad = grad_shards[u.name].to(self.optimizer_device, torch.float32)  # fp32 path: no copy
            moments = u.in_local(self.exp_avg), u.in_local(self.exp_avg_sq)
            adamw_(
                target, grad, *moments, self.step_count, self.lr, self.beta1, self.beta2, self.eps, self.weight_decay
            )
            if self.master is not None:
                param_shard.copy_(target)  # round to bf16 / move back from the offload device
            if self.stage in (1, 2):
                # §5.1: an all-gather at the end of the step hands every rank the updated parameters
                # of all partitions. In place: this rank's shard of u.full is the input.
                dist.all_gather_single(u.full, param_shard, group=self.group)

    def _averaged_gradient_shards(self) -> dict[str, torch.Tensor]:
        """{unit: the averaged gradient of this rank's shard}: all-reduced (0), reduce-scattered (1),
        already reduce-scattered during backward (2-3)."""
        if self.stage >= 2:
            return {u.name: self._reduced_during_backward(u) for u in self.units}
        grad_shards = {}
        for u in self.units:
            if any(p.grad is None or p.grad.data_ptr() != v.data_ptr() for p, v in u.views(u.flat_grads)):
                raise RuntimeError(
                    f"the gradients of unit {u.name!r} are no longer views of ZeRO's gradient "
                    "buffer: call zero.zero_grad(), not model.zero_grad() or optimizer.zero_grad()"
                )
            u.flat_grads.mul_(1 / self.world_size)  # average, like DDP, which multiplies by 1/N before summing
            if self.stage == 0:
                dist.all_reduce(u.flat_grads, group=self.group)
                grad_shards[u.name] = u.flat_grads
            else:  # §5.1: rank i needs only the reduced gradients of partition i: a reduce-scatter
                grad_shards[u.name] = torch.empty(u.shard_numel, dtype=self.dtype, device=self.device)
                dist.reduce_scatter_single(grad_shards[u.name], u.flat_grads, group=self.group)
        return grad_shards

    # ------------------------------------------------------------ §5.2 P_os+g: gradients sharded
    def _grad_ready(self, u: Unit) -> None:
        """Autograd has finished one of the unit's gradients; when all are in, reduce-scatter them.

        §5.2: as the gradients of each layer become available during backward, reduce them only onto
        the rank that updates those parameters, then release them. Per unit, that is one
        reduce-scatter of the unit's flat gradients (the paper's bucket is our unit).
        """
        u.pending -= 1
        if u.pending > 0:
            return
        u.pending = len(u.params)
        flat_grads = torch.zeros(u.padded, dtype=self.dtype, device=self.device)
        for p, view in u.views(flat_grads):
            view.copy_(p.grad)
            p.grad = None  # the full gradient is not kept: that is the memory stage 2 saves
        flat_grads.mul_(1 / self.world_size)  # average, like DDP, which multiplies by 1/N before summing
        grad_shard = torch.empty(u.shard_numel, dtype=self.dtype, device=self.device)
        dist.reduce_scatter_single(grad_shard, flat_grads, group=self.group)
        u.in_local(self.grad_shard).add_(grad_shard)  # add: several backwards accumulate
        u.reduced = True
        if self.stage == 3:
            self._free(u)

    def _reduced_during_backward(self, u: Unit) -> torch.Tensor:
        """The unit's gradient shard that backward reduce-scattered; refused if some gradient never came."""
        if u.pending != len(u.params) or not u.reduced:
            got = len(u.params) - u.pending if u.pending != len(u.params) else 0
            raise RuntimeError(
                f"unit {u.name!r} received gradients for {got} of its {len(u.params)} parameters: "
                "ZeRO-2/3 reduce-scatter a unit when all its gradients are in, so every "
                "parameter must be used in the forward pass"
            )
        u.reduced = False
        return u.in_local(self.grad_shard)

    # ---------------------------------------------------------- §5.3 P_os+g+p: parameters sharded
    # §5.3: each rank stores only its partition of the parameters; the others are fetched when the
    # forward or the backward pass needs them, and dropped after. §7.2.2: an all-gather before the
    # forward, one before the backward, and stage 2's reduce-scatter: 3Ψ moved instead of 2Ψ.
    def _before_forward(self, u: Unit) -> None:
        if not self.order_known and u not in self.order:  # the first forward records the order
            self.order.append(u)
        self._gather(u, direction=+1)

    def _gather(self, u: Unit, direction: int = 0) -> None:
        """All-gather the unit's parameters into its flat buffer (re-allocated), before compute; then
        the ``self.prefetch`` units that compute next (``direction``: +1 forward, -1 backward, 0 none)."""
        storage = u.full.untyped_storage()
        if storage.nbytes() == 0:  # else already gathered: prefetched, or an output of several tensors
            # the label marks the all-gather (and its allocation) in a torch.profiler trace
            with record_function(f"ZeRO-3 all-gather {u.name}"):
                storage.resize_(u.padded * u.full.element_size())
                dist.all_gather_single(u.full, u.in_local(self.param_shard), group=self.group)
        if direction and self.order_known:
            at = self.order.index(u)
            for i in range(at + direction, at + direction * (self.prefetch + 1), direction):
                if 0 <= i < len(self.order):
                    self._gather(self.order[i])

    def _after_forward(self, u: Unit, output) -> None:
        """Free the unit's parameters, and have them gathered again when the gradient of its output
        arrives: that moment comes just before autograd runs the unit's backward."""
        self._free(u)
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _grad, u=u: self._gather(u, direction=-1))

    def _free(self, u: Unit) -> None:
        """Give the gathered buffer's memory back. The parameters stay views of it, and autograd's
        saved tensors too: the next gather refills the same storage, so backward sees the values."""
        if u.full.untyped_storage().nbytes() > 0:
            with record_function(f"ZeRO-3 free {u.name}"):
                u.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------------------ housekeeping
    def zero_grad(self) -> None:
        for u in self.units:
            if u.flat_grads is not None:
                u.flat_grads.zero_()
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    @torch.no_grad()
    def full_parameters(self, master: bool = False) -> dict[str, torch.Tensor]:
        """{name: full parameter} on every rank (collective): the compute-precision parameters, or
        with ``master=True`` the fp32 master weights (the same tensors when there is no master copy)."""
        out, names = {}, {id(p): n for n, p in self.model.named_parameters()}
        for u in self.units:
            if master and self.master is not None:
                master_shard = u.in_local(self.master).to(self.device)
                flat_params = master_shard.clone()
                if self.stage > 0:  # stage 0 holds every master weight already
                    flat_params = torch.empty(u.padded, dtype=torch.float32, device=self.device)
                    dist.all_gather_single(flat_params, master_shard, group=self.group)
            elif self.stage == 3:
                self._gather(u)
                flat_params = u.full.clone()
                self._free(u)
            else:
                flat_params = u.full.clone()
            out.update({names[id(p)]: view.clone() for p, view in u.views(flat_params)})
        return out

    def model_state_bytes(self) -> dict[str, int]:
        """A census of the model states this rank holds, by storage (see memory.held_bytes).

        ``params``: the compute-precision parameters (stage 3: the shard; freed gathers count 0);
        ``grads``: gradient buffers and any ``.grad``; ``optimizer``: master weights and moments;
        ``total``: everything reachable from this object, each storage once.
        """
        params = [p.data for p in self.model.parameters()] + [self.param_shard]
        grads = [p.grad for p in self.model.parameters()] + [u.flat_grads for u in self.units] + [self.grad_shard]
        optim = [self.master, self.exp_avg, self.exp_avg_sq]
        return {
            "params": held_bytes(params),
            "grads": held_bytes(grads),
            "optimizer": held_bytes(optim),
            "total": held_bytes(self),
        }
