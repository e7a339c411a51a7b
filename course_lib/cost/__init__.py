"""course_lib.cost — every formula of the course, pure arithmetic, each citing its source.

* :mod:`~course_lib.cost.memory`      — model states under ZeRO, optimizer state per parameter
* :mod:`~course_lib.cost.activations` — activation bytes per layer (Korthikanti et al. 2022), attention per rank
* :mod:`~course_lib.cost.comm`        — bytes each rank moves: ring collectives, ZeRO, ring attention, Ulysses, 2D/3D TP
* :mod:`~course_lib.cost.alignment`   — padding to a multiple, GEMM tile utilisation
* :mod:`~course_lib.cost.flops`       — FLOPs per token (6N + attention), MFU, arithmetic intensity, roofline
* :mod:`~course_lib.cost.pipeline`    — micro-batches in flight per pipeline stage (GPipe, 1F1B)
* :mod:`~course_lib.cost.overlap`     — when a transfer hides behind compute (ring attention's block size)

Nothing here launches ranks or touches a tensor; :mod:`course_lib.measure` measures what these predict.
"""
