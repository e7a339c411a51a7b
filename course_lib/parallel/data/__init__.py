"""Data parallelism: :mod:`~course_lib.parallel.data.ddp` (bucketed, overlapped all-reduce) and
:mod:`~course_lib.parallel.data.zero` (ZeRO stages 1–3)."""
