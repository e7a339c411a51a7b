"""course_lib.grading — the grading kit.

* :mod:`~course_lib.grading.grade`   — run a lab's tasks, each in its own process, and print the points
* :mod:`~course_lib.grading.adapter` — role → callable, so one check grades a learner and tests course_lib
* :mod:`~course_lib.grading.starters` — generate labs/ from solutions/
* :mod:`~course_lib.grading.exercises` — the lectures' exercises: placeholder, check with a hint, reference answer
* :mod:`course_lib.grading.labs`     — one grader per lab: its checks, tasks and adapter
"""
