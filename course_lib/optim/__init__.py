"""course_lib.optim — optimizers and training objectives, written out.

* :mod:`~course_lib.optim.optimizers`  — SGD, momentum, Adam, AdamW, Lion, Adafactor, and the functional
  ``adamw_`` that ZeRO's sharded update calls
* :mod:`~course_lib.optim.lowrank`     — GaLore-style AdamW with its moments in a rank-r projected space
* :mod:`~course_lib.optim.compression` — gradient compression as DDP communication hooks (Top-K with error
  feedback, QSGD, 1-bit sign with error feedback), for torch DDP and course DDP alike
* :mod:`~course_lib.optim.powersgd`    — PowerSGD's rank-r hook, warm start and error feedback, as torch's
* :mod:`~course_lib.optim.distill`     — knowledge distillation's soft-target loss
* :mod:`~course_lib.optim.grpo`        — GRPO's group-relative advantage and clipped objective
* :mod:`~course_lib.optim.lr_schedules` — the warm-up + cosine learning-rate factor, for ``LambdaLR``
* :mod:`~course_lib.optim.stability`   — output-logit z-loss, global-norm clipping (sharded too), a loss-spike guard
"""
