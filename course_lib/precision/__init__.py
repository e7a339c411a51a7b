"""course_lib.precision — number formats and mixed precision.

* :mod:`~course_lib.precision.formats` — fp32 … fp4 from their bit layouts, rounding measured
* :mod:`~course_lib.precision.scaling` — dynamic loss scaling
* :mod:`~course_lib.precision.fp8_scaling` — FP8 formats and scales per tensor / delayed / row / 1x128 tile /
  128x128 block; quantize and dequantize
* :mod:`~course_lib.precision.fp8_gemm` — the FP8 GEMM (torch._scaled_mm or emulated, DeepSeek's promotion)
* :mod:`~course_lib.precision.fp8_linear` — FP8Linear and convert_to_fp8_training
* :mod:`~course_lib.precision.mxfp4`   — MXFP4: E2M1 elements, one E8M0 power-of-two scale per 32 (OCP MX v1.0)
* :mod:`~course_lib.precision.nf4`     — QLoRA's NF4: normal-quantile codes, blockwise absmax, double quantization;
  ``NF4Linear``, the frozen 4-bit base layer LoRA wraps, and ``quantize_linears``
* :mod:`~course_lib.precision.logfmt`  — DeepSeek's LogFMT-nBit: per-1x128-tile log-magnitude codes
* :mod:`~course_lib.precision.fixed_point` — fixed-point integers, nearest vs stochastic rounding, exact int8 GEMMs
"""
