"""Imported last by the fork server of :func:`course_lib.dist.launch`: ``gc.freeze()`` its heap.

The server pre-imports torch (with torch._dynamo and sympy: ~280k objects), and every rank is forked
from it. A rank's garbage collections would walk all of those inherited objects: one full
``gc.collect()`` took 0.18-0.23 s in a rank on the course machine, and a rank's shutdown runs two
(course_lib.dist.runtime.shutdown), which made up ~0.4 s of a 0.45 s two-rank launch. Frozen
objects sit in a permanent generation the collector skips, in the server and in every process it
forks; what a rank creates is collected as usual. The Python documentation of ``gc.freeze``
recommends exactly this for a parent that forks without exec.

Never import this module elsewhere: freezing a process's heap keeps its current garbage forever.
"""

import gc

gc.freeze()
