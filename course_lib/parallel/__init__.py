"""course_lib.parallel — one folder per parallelism; sibling strategies never import each other.

* :mod:`~course_lib.parallel.data`    — DDP, ZeRO-1/2/3
* :mod:`~course_lib.parallel.tensor`  — Megatron TP (comms → layers → sequence parallel → model), 2D/2.5D/3D
* :mod:`~course_lib.parallel.context` — ring attention, Ulysses
* :mod:`~course_lib.parallel.pipeline` — stages, schedules (1F1B, interleaved, zero-bubble, DualPipeV), the executor
* :mod:`~course_lib.parallel.expert`  — expert parallelism: dispatch and combine by all-to-all
* :mod:`~course_lib.parallel.compose` — DP × TP × PP (× EP) on one mesh, checked against one process
"""
