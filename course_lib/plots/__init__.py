"""course_lib.plots — numbers in, matplotlib Axes out; one file per subject, shared helpers in common.

* :mod:`~course_lib.plots.basics`           loss curves, timelines of spans, number lines, bars
* :mod:`~course_lib.plots.data_parallel`    DDP's overlap timeline, measured against formula bars
* :mod:`~course_lib.plots.context_parallel` causal work grid, work per rank, memory against length
* :mod:`~course_lib.plots.precision`        rounding-error histograms per recipe, bytes against quality
* :mod:`~course_lib.plots.inference`        decode speed against context, KV slots allocated and used over a stream
* :mod:`~course_lib.plots.recompute`        predicted vs measured memory per recomputation policy, saved bytes vs budget
* :mod:`~course_lib.plots.hardware`         the accelerator table as a scatter, rooflines with kernels placed
* :mod:`~course_lib.plots.comm`             measured vs fitted collective times, H800 vs H100 step times
* :mod:`~course_lib.plots.stability`        loss curves of a spike and its remedies
* :mod:`~course_lib.plots.capstone`         one composed DP × TP × PP step: a lane for compute and one per mesh axis
"""
