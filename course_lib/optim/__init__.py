"""course_lib.optim — optimizers written out: SGD, momentum, Adam, AdamW, Lion, Adafactor, and the
functional ``adamw_`` that ZeRO's sharded update calls (:mod:`~course_lib.optim.optimizers`)."""
