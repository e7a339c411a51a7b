"""course_lib.precision — number formats and mixed precision.

* :mod:`~course_lib.precision.formats` — fp32 … fp4 from their bit layouts, rounding measured
* :mod:`~course_lib.precision.scaling` — dynamic loss scaling
"""
