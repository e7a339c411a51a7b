"""course_lib.measure — the instruments: meters, counters and timers that several lectures and tests share,
each measuring what a formula of :mod:`course_lib.cost` predicts.

For lectures, tests, benchmarks and :mod:`course_lib.experiments` only: no algorithm imports this package
(a tool an algorithm itself calls, such as the census of held bytes, lives beside ``course_lib.dist``), and
nothing here imports the experiments. The runs each lecture makes with these are in
:mod:`course_lib.experiments`.

Memory:

* :mod:`~course_lib.measure.saved_tensors`     — bytes autograd saves for backward (saved-tensor hooks); one
  block's activation bytes, against ``cost.activations``
* :mod:`~course_lib.measure.live_tensors`      — bytes of the tensors alive after every op, forward, backward
  and recomputation included
* :mod:`~course_lib.measure.allocations`       — the allocator's timeline from torch.profiler's memory events
  (CPU and GPU alike)
* :mod:`~course_lib.measure.step_memory`       — bytes held after each phase of one training step, against
  ``cost.memory``
* :mod:`~course_lib.measure.stage_activations` — activation bytes a pipeline rank holds through one step, per
  micro-batch and stage, against ``cost.pipeline``

Compute and the machine:

* :mod:`~course_lib.measure.flop_counter`      — counted matmul FLOPs of a step, its time, this machine's
  matmul peak, against ``cost.flops``
* :mod:`~course_lib.measure.cpu_roofline`      — this CPU's roofline (GEMM peak, STREAM bandwidth) with the
  course model's kernels on it, against ``cost.roofline``
* :mod:`~course_lib.measure.aten_ops`          — every aten operator a training step dispatches (a port's first
  question); also a program
* :mod:`~course_lib.measure.gpu_check`         — ``./course gpu-check``: what only a GPU can show, as a
  PASS/FAIL table (a program)

Communication:

* :mod:`~course_lib.measure.collective_timing` — all-reduces and bucket sweeps, every collective from bytes to
  tens of MiB, and the alpha-beta fit judged on held-out sizes, against ``cost.alpha_beta``

At real world sizes:

* :mod:`~course_lib.measure.simulated_ranks`           — the composed model at hundreds of simulated ranks (fake process
  group, meta device): each rank's parameters and TP collectives, against ``cost.planner`` and ``cost.step_time``
"""
