"""Lab 03 — ZeRO: shard the optimizer state, then the gradients, then the parameters.

ZeRO (Rajbhandari et al., SC 2020, arXiv:1910.02054, §5) removes the redundancy of data
parallelism one model state at a time. With N ranks, rank r owns the r-th 1/N of every buffer:

    stage 1  AdamW state sharded. After backward, reduce-scatter the gradients (rank r receives the
             average of its 1/N), update its 1/N of the parameters, all-gather the parameters.
    stage 2  + gradients sharded. Reduce-scatter each unit's gradients *during* backward, as soon as
             they are complete, and keep only this rank's shard.
    stage 3  + parameters sharded. Keep only the shard; all-gather a unit's parameters just before
             its forward and its backward, free them right after.

(Stage 0, plain DDP, is given for comparison.) Put the model on the rank's device
(``course_lib.dist.device()``) before wrapping it: every buffer is made on its parameters' device. A *unit* is a child module of the model, each
ModuleList entry on its own. Each unit's parameters are copied into one flat fp32 buffer whose
length is padded up to a multiple of N, so it splits into N equal shards; the parameters become
views of that buffer. Everything here is fp32 (course_lib.parallel.data.zero adds bf16 and CPU offload).

Communicate with ``dist.reduce_scatter_single(output, input, group=...)`` and
``dist.all_gather_single(output, input, group=...)``, called through ``torch.distributed as dist``.
All-gathering in place is allowed: the input may be this rank's slice of the output.
"""

# Your code goes in the fenced "Task N — your code" regions of this file:
#   line 55: Task 1: pad so that N divides the buffer; returns the smallest multiple of n >= numel (an int)
#   line 62: Task 1: returns slice index of n equal slices of flat, as a view (no copy)
#   line 132: Task 4: re-allocate u.full's storage, all-gather every rank's u.shard into it; returns None
#   line 139: Task 4: release u.full's storage (resize it to 0 bytes), keep the tensor; returns None
#   line 159: Task 3: last grad in: reduce-scatter flat grad ×1/N, add to u.grad_shard, p.grad = None; returns None
#   line 184: Task 2: ZeRO-1: scale u.grad_full by 1/N, reduce-scatter it; sets grad (this rank's slice)
#   line 190: Task 2: adamw_ on params with grad; stages 1-2 then all-gather params into u.full

import torch
import torch.distributed as dist
import torch.nn as nn


def adamw_(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in place, torch.optim.AdamW's operations in torch's order (given).

        θ ← θ·(1 − lr·λ);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
        θ ← θ − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)

    Elementwise: on a shard of a flat buffer each element gets exactly torch's result.
    """
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))


def padded_size(numel: int, n: int) -> int:
    """The smallest multiple of ``n`` that is >= ``numel``: every shard gets the same length."""
    # ━━ Task 1 — your code: pad so that N divides the buffer; returns the smallest multiple of n >= numel (an int) ━━
    raise NotImplementedError('Task 1: pad so that N divides the buffer; returns the smallest multiple of n >= numel (an int)')
    # ━━ end of Task 1 ━━


def shard_of(flat: torch.Tensor, index: int, n: int) -> torch.Tensor:
    """The ``index``-th of ``n`` equal slices of ``flat`` (a view, not a copy)."""
    # ━━ Task 1 — your code: returns slice index of n equal slices of flat, as a view (no copy) ━━
    raise NotImplementedError('Task 1: returns slice index of n equal slices of flat, as a view (no copy)')
    # ━━ end of Task 1 ━━


class Unit:
    """One unit: its parameters, its flat buffer, and (stages 0-1) its flat gradient buffer."""

    def __init__(self, module: nn.Module, n: int):
        self.module = module
        self.params = list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.padded = padded_size(self.numel, n)
        self.device = self.params[0].device  # every buffer lives where the caller put the model
        self.full = torch.zeros(self.padded, device=self.device)
        self.grad_full = None
        self.shard = None  # stage 3: this rank's slice of the parameters (its own tensor)
        self.grad_shard = None  # stages 2-3: this rank's slice of the averaged gradient
        self.pending = len(self.params)

    def views(self, flat):
        out, at = [], 0
        for p in self.params:
            out.append((p, flat[at : at + p.numel()].view_as(p)))
            at += p.numel()
        return out


class ZeroAdamW:
    """ZeRO stage 0-3 data parallelism with AdamW, fp32."""

    def __init__(self, model, stage, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, group=None):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {stage!r} does not exist: choose 0, 1, 2 or 3")
        self.model, self.stage, self.group = model, stage, group
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.parts = 1 if stage == 0 else self.n  # stage 0 keeps everything: one part
        self.mine = 0 if stage == 0 else self.rank
        self.step_count = 0
        self.units = []
        for _, child in model.named_children():
            children = child.children() if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]
            self.units += [Unit(m, self.parts) for m in children if any(True for _ in m.parameters())]
        for u in self.units:
            for p, view in u.views(u.full):
                view.copy_(p.detach())
            dist.broadcast(u.full, dist.get_global_rank(group, 0) if group else 0, group=group)
            for p, view in u.views(u.full):
                p.data = view
            # Adam moments: only this rank's slice (stage 0: all of it).
            u.exp_avg = torch.zeros(u.padded // self.parts, device=u.device)
            u.exp_avg_sq = torch.zeros(u.padded // self.parts, device=u.device)
            if stage <= 1:  # full gradients, accumulated in place by autograd
                u.grad_full = torch.zeros(u.padded, device=u.device)
                for p, view in u.views(u.grad_full):
                    p.grad = view
            else:
                u.grad_shard = torch.zeros(u.padded // self.n, device=u.device)
                for p in u.params:
                    p.register_post_accumulate_grad_hook(lambda _p, u=u: self._grad_ready(u))
            if stage == 3:
                u.shard = shard_of(u.full, self.rank, self.n).clone()
                self._free(u)
                u.module.register_forward_pre_hook(lambda *_, u=u: self._gather(u))
                u.module.register_forward_hook(lambda _m, _i, out, u=u: self._after_forward(u, out))

    # -------------------------------------------------------------------------------- stage 3
    def _gather(self, u: Unit) -> None:
        """Re-allocate ``u.full`` and all-gather every rank's shard into it (nothing if gathered)."""
        # ━━ Task 4 — your code: re-allocate u.full's storage, all-gather every rank's u.shard into it; returns None ━━
        raise NotImplementedError("Task 4: re-allocate u.full's storage, all-gather every rank's u.shard into it; returns None")
        # ━━ end of Task 4 ━━

    def _free(self, u: Unit) -> None:
        """Release ``u.full``'s memory but keep the tensor, so the parameters (its views) and the
        tensors autograd saved stay valid: ``u.full.untyped_storage().resize_(0)``."""
        # ━━ Task 4 — your code: release u.full's storage (resize it to 0 bytes), keep the tensor; returns None ━━
        raise NotImplementedError("Task 4: release u.full's storage (resize it to 0 bytes), keep the tensor; returns None")
        # ━━ end of Task 4 ━━

    def _after_forward(self, u: Unit, output) -> None:
        """Free after forward; gather again when the output's gradient arrives, just before the unit's backward."""
        self._free(u)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: self._gather(u))

    # -------------------------------------------------------------------------------- stages 2-3
    def _grad_ready(self, u: Unit) -> None:
        """Called by autograd each time one of the unit's parameters has its gradient.

        When all have arrived (count ``u.pending`` down): copy them into a zero-padded flat buffer,
        multiply by 1/N (DDP averages; it multiplies before summing), reduce-scatter it into a
        shard, add that to ``u.grad_shard`` (add: with gradient accumulation several backward passes run
        before one step), drop every ``p.grad`` (set it to None) and reset
        ``u.pending``. Stage 3: the unit's backward is over, free its parameters.
        """
        # ━━ Task 3 — your code: last grad in: reduce-scatter flat grad ×1/N, add to u.grad_shard, p.grad = None; returns None ━━
        raise NotImplementedError('Task 3: last grad in: reduce-scatter flat grad ×1/N, add to u.grad_shard, p.grad = None; returns None')
        # ━━ end of Task 3 ━━

    # -------------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        for u in self.units:
            if self.stage == 0:  # DDP (given): average the whole gradient, update everything
                u.grad_full.mul_(1 / self.n)
                dist.all_reduce(u.grad_full, group=self.group)
                adamw_(
                    u.full,
                    u.grad_full,
                    u.exp_avg,
                    u.exp_avg_sq,
                    self.step_count,
                    self.lr,
                    *self.betas,
                    self.eps,
                    self.weight_decay,
                )
                continue
            if self.stage == 1:
                # ━━ Task 2 — your code: ZeRO-1: scale u.grad_full by 1/N, reduce-scatter it; sets grad (this rank's slice) ━━
                raise NotImplementedError("Task 2: ZeRO-1: scale u.grad_full by 1/N, reduce-scatter it; sets grad (this rank's slice)")
                # ━━ end of Task 2 ━━
            else:
                grad = u.grad_shard
            params = u.shard if self.stage == 3 else shard_of(u.full, self.rank, self.n)
            # ━━ Task 2 — your code: adamw_ on params with grad; stages 1-2 then all-gather params into u.full ━━
            raise NotImplementedError('Task 2: adamw_ on params with grad; stages 1-2 then all-gather params into u.full')
            # ━━ end of Task 2 ━━

    def zero_grad(self) -> None:
        for u in self.units:
            if u.grad_full is not None:
                u.grad_full.zero_()
            if u.grad_shard is not None:
                u.grad_shard.zero_()
