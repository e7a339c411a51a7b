"""Optimizer update rules written out, and the bytes of state each one keeps (lecture 01, Foundations).

g = gradient, θ = parameters, η = learning rate, λ = weight decay, t = step (from 1):

    SGD        θ ← θ − η g
    momentum   b ← μ b + g                  θ ← θ − η b          (heavy ball in torch's form; b₁ = g₁)
    Adam       m ← β₁ m + (1−β₁) g          v ← β₂ v + (1−β₂) g²
               θ ← θ − η m̂ / (√v̂ + ε),     m̂ = m/(1−β₁ᵗ), v̂ = v/(1−β₂ᵗ)   (Kingma & Ba 2015, Alg. 1)
    AdamW      θ ← θ (1 − ηλ), then Adam with no λ in g          (Loshchilov & Hutter 2019, Alg. 2)
    Adagrad    G ← G + g²                   θ ← θ − η g / (√G + ε)       (Duchi et al. 2011, diagonal form)
    RMSprop    v ← α v + (1−α) g²           θ ← θ − η g / (√v + ε)       (Tieleman & Hinton 2012, lecture 6.5)
    Lion       c = β₁ m + (1−β₁) g          θ ← θ (1 − ηλ) − η sign(c)
               m ← β₂ m + (1−β₂) g                                (Chen et al. 2023, Alg. 2)
    Adafactor  second moment of an n×m matrix kept as row and column statistics R, C:
               V̂ = R Cᵀ / (1ᵀR), update = g/√V̂ clipped to RMS ≤ d, step α = max(ε₂, RMS(θ))·ρₜ
                                                                  (Shazeer & Stern 2018, Alg. 4)

The classes are ``torch.optim.Optimizer`` subclasses with one short ``_update`` each. Where torch has
the optimizer, the arithmetic is done in torch's own order (``lerp_`` for the first moment, the same
bias-correction expressions) so that tests can demand bit-equality rather than "close": an
algebraically equal reordering changes the last bit, and after hundreds of steps that is no longer
one bit. State per parameter (:func:`state_bytes`) is what ZeRO (lecture 02) shards and what makes
Adam cost 16 bytes per parameter in mixed precision (:func:`training_bytes_per_param`).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SGD",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Lion",
    "RMSprop",
    "adamw_",
    "build",
    "factored_second_moment",
]


class _Optimizer(torch.optim.Optimizer):
    """Loop over parameters that have a gradient; each subclass says what one update does."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} takes dense gradients; an nn.Embedding "
                        "built with sparse=True needs torch.optim.SparseAdam instead"
                    )
                self._update(p, p.grad, self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError


def _check(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value < high:
        raise ValueError(
            f"{name}={value} is outside [{low}, {high}); "
            + {
                "lr": "a learning rate must be >= 0",
                "momentum": "momentum mu must be in [0, 1): mu = 1 never forgets a gradient",
                "beta": "betas must be in [0, 1): they are the decay of an exponential moving average",
                "eps": "eps must be >= 0: it keeps the denominator away from zero",
                "weight_decay": "weight decay must be >= 0",
            }[name.split("[")[0]]
        )


def check_adam_args(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The hyper-parameters every Adam-family optimizer takes, checked once (Adam, AdamW, GaLore)."""
    _check("lr", lr, 0.0)
    _check("beta[0]", betas[0], 0.0, 1.0)
    _check("beta[1]", betas[1], 0.0, 1.0)
    _check("eps", eps, 0.0)
    _check("weight_decay", weight_decay, 0.0)


class SGD(_Optimizer):
    """SGD, with heavy-ball momentum when ``momentum > 0`` and coupled L2 weight decay (g ← g + λθ).

    Momentum in torch's form b ← μ b + g, θ ← θ − η b (no (1−μ) factor, so η is ~1/(1−μ) times
    larger than the "EMA" form's); the first buffer is g itself. State: b, one element per parameter.
    """

    def __init__(self, params, lr: float = 1e-2, momentum: float = 0.0, weight_decay: float = 0.0):
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        if group["weight_decay"]:
            g = g.add(p, alpha=group["weight_decay"])
        if group["momentum"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = g.clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(g)
            g = state["momentum_buffer"]
        p.add_(g, alpha=-group["lr"])


class Adam(_Optimizer):
    """Adam (Kingma & Ba 2015, Alg. 1); ``weight_decay`` adds λθ to g (L2), AdamW does not.

    State: m and v, two elements per parameter, plus a scalar step count.
    """

    decoupled = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        check_adam_args(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        if wd and self.decoupled:
            p.mul_(1 - lr * wd)  # AdamW: shrink θ directly, so λ is not divided by √v̂ below
        elif wd:
            g = g.add(p, alpha=wd)  # Adam + L2: λθ goes through √v̂ and is weaker where v is large
        m.lerp_(g, 1 - beta1)  # m + (1−β₁)(g − m) = β₁m + (1−β₁)g: torch's form, one rounding
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])  # `** 0.5` as torch has it
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter 2019, Alg. 2): θ ← θ(1 − ηλ), then the Adam step without λ."""

    decoupled = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class Adagrad(_Optimizer):
    """Adagrad (Duchi, Hazan & Singer 2011, the diagonal form): G ← G + g², θ ← θ − η g/(√G + ε).

    Each coordinate's step shrinks with the sum of all its past squared gradients, so rare features
    keep large steps; the sum never forgets, which is why the step decays towards zero on long runs and
    RMSprop and Adam replaced the sum by a moving average. State: G, one element per parameter.
    Arithmetic in torch.optim.Adagrad's order (no learning-rate decay, accumulator from 0).
    """

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10):
        _check("lr", lr, 0.0)
        _check("eps", eps, 0.0)
        super().__init__(params, dict(lr=lr, eps=eps))

    def _update(self, p, g, state, group):
        if not state:
            state["sum"] = torch.zeros_like(p)
        state["sum"].addcmul_(g, g, value=1)
        p.addcdiv_(g, state["sum"].sqrt().add_(group["eps"]), value=-group["lr"])


class RMSprop(_Optimizer):
    """RMSprop (Tieleman & Hinton 2012, Coursera lecture 6.5): v ← α v + (1 − α) g², θ ← θ − η g/(√v + ε).

    Adagrad with the sum replaced by an exponential moving average, so old gradients are forgotten;
    Adam adds a first moment and bias correction on top. State: v, one element per parameter.
    Arithmetic in torch.optim.RMSprop's order (no momentum, not centred).
    """

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8):
        _check("lr", lr, 0.0)
        _check("beta", alpha, 0.0, 1.0)
        _check("eps", eps, 0.0)
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps))

    def _update(self, p, g, state, group):
        if not state:
            state["square_avg"] = torch.zeros_like(p)
        v = state["square_avg"]
        v.mul_(group["alpha"]).addcmul_(g, g, value=1 - group["alpha"])
        p.addcdiv_(g, v.sqrt().add_(group["eps"]), value=-group["lr"])


class Lion(_Optimizer):
    """Lion, "EvoLved Sign Momentum" (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2).

    The step is η·sign(β₁m + (1−β₁)g): every coordinate moves by exactly ±η (or 0), so the update
    has a larger norm than Adam's and the paper uses a 3-10x smaller lr and a 3-10x larger λ.
    It interpolates with β₁ for the step but tracks m with a slower β₂. State: m only, one element
    per parameter, half of Adam's.
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        _check("lr", lr, 0.0)
        _check("beta[0]", betas[0], 0.0, 1.0)
        _check("beta[1]", betas[1], 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
        m = state["exp_avg"]
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(m.lerp(g, 1 - beta1).sign_(), alpha=-lr)
        m.lerp_(g, 1 - beta2)


def factored_second_moment(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """V̂ = R Cᵀ / (1ᵀR) from row means ``row`` [..., n, 1] and column means ``col`` [..., 1, m].

    Shazeer & Stern (2018) write R = V·1 (row sums) and C = 1ᵀV (column sums); with means
    r = R/m, c = C/n the same estimate is r cᵀ / mean(r), which we use because means do not grow
    with the matrix. The estimate is exact when V is rank 1 (V = a bᵀ gives R = a·Σb, C = Σa·bᵀ,
    1ᵀR = Σa·Σb); in general it is the rank-1 matrix closest to V in generalised KL divergence.
    """
    return (row @ col) / row.mean(dim=-2, keepdim=True)


class Adafactor(_Optimizer):
    """Adafactor without momentum (Shazeer & Stern 2018, Alg. 4 for matrices, Alg. 5 for vectors).

    For a parameter with ≥ 2 dims (last two n×m) only the row and column means of the EMA of g²
    are kept: n + m elements instead of n·m, and V̂ = :func:`factored_second_moment`. Vectors keep the
    full EMA. Then, with the increasing decay β̂₂ₜ = 1 − t^decay (decay = −0.8), ρₜ = min(lr, 1/√t)
    and the relative step size α = max(ε₂, RMS(θ))·ρₜ:

        U = g / √V̂,   Û = U / max(1, RMS(U)/d)  (update clipping),   θ ← θ(1 − ηλ) − α Û

    ε₁ (default: the dtype's machine epsilon) keeps V̂ away from 0; we clamp V̂ at ε₁² and 1ᵀR at ε₁
    as torch.optim.Adafactor does, where the paper adds ε₁ to g² (the two differ by ~ε₁, far below
    rounding for real gradients). The other defaults are the paper's: d = 1, ε₂ = 1e-3, lr = 1e-2.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
    ):
        _check("lr", lr, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        if not beta2_decay <= 0:
            raise ValueError(f"beta2_decay={beta2_decay} must be <= 0: β̂₂ₜ = 1 − t^beta2_decay must rise towards 1")
        if d <= 0:
            raise ValueError(f"clipping threshold d={d} must be > 0 (the paper uses d = 1)")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))

    def _update(self, p, g, state, group):
        eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
        eps2, lr = group["eps"][1], group["lr"]
        if not state:
            state["step"] = 0
            if p.dim() >= 2:
                state["row_var"] = p.new_zeros(p.shape[:-1]).unsqueeze(-1)  # [..., n, 1]
                state["col_var"] = p.new_zeros(p.shape[:-2] + p.shape[-1:]).unsqueeze(-2)  # [..., 1, m]
            else:
                state["variance"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"]
        one_minus_beta2 = t ** group["beta2_decay"]  # 1 − β̂₂ₜ; equals 1 at t = 1: V starts as g²
        alpha = max(eps2, p.norm(2).item() / p.numel() ** 0.5) * min(lr, 1 / t**0.5)  # read θ before decay
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        if p.dim() >= 2:
            row, col = state["row_var"], state["col_var"]
            row.lerp_(g.square().mean(dim=-1, keepdim=True), one_minus_beta2)
            col.lerp_(g.square().mean(dim=-2, keepdim=True), one_minus_beta2)
            v_hat = (row @ col).div_(row.mean(dim=-2, keepdim=True).clamp(min=eps1))
        else:
            v_hat = state["variance"].lerp_(g.square(), one_minus_beta2).clone()
        update = v_hat.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
        clip = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * group["d"]))
        p.add_(update, alpha=-alpha / clip)


_CLASSES = {
    "sgd": SGD,
    "momentum": SGD,
    "adagrad": Adagrad,
    "rmsprop": RMSprop,
    "adam": Adam,
    "adamw": AdamW,
    "lion": Lion,
    "adafactor": Adafactor,
}


def build(name: str, params, **kwargs) -> torch.optim.Optimizer:
    """The course optimizer called ``name`` ("sgd", "momentum", "adagrad", "rmsprop", "adam", "adamw", "lion",
    "adafactor").

    "momentum" is SGD with μ = 0.9 unless ``momentum=`` is given.
    """
    if name not in _CLASSES:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(_CLASSES)}")
    if name == "momentum":
        kwargs.setdefault("momentum", 0.9)
    return _CLASSES[name](params, **kwargs)


# --------------------------------------------------------------------------------------------------
# Bytes of state
# --------------------------------------------------------------------------------------------------


def adamw_(
    param, grad, exp_avg, exp_avg_sq, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> None:
    """One AdamW step, in place (Loshchilov & Hutter 2019, Algorithm 2):

        θ ← θ·(1 − lr·λ)                         decoupled weight decay
        m ← β1·m + (1 − β1)·g,   v ← β2·v + (1 − β2)·g²
        θ ← θ − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)

    The operations are torch.optim.AdamW's (``foreach=False``), in its order and with its scalar
    arguments. Every one is elementwise, so applying them to a shard of a flat buffer gives each
    element bit for bit what torch gives it inside its own parameter tensor: that is why ZeRO in
    fp32 can be *equal* to DDP + torch AdamW, not merely close.
    """
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
