"""course_lib.measure — harnesses that launch ranks and measure what :mod:`course_lib.cost` predicts.

For lectures, tests and benchmarks only: no algorithm imports this package.

* :mod:`~course_lib.measure.zero`            — bytes held and moved by each ZeRO stage
* :mod:`~course_lib.measure.activations`     — bytes autograd saves for one layer's backward
* :mod:`~course_lib.measure.tensor_parallel` — collectives of one TP / TP+SP block
* :mod:`~course_lib.measure.ddp`             — one traced DDP step, for the overlap timeline
* :mod:`~course_lib.measure.allreduce`       — timed ring all-reduces, single and bucketed, against the alpha-beta model
* :mod:`~course_lib.measure.context_parallel` — one traced ring attention, for its overlap timeline
* :mod:`~course_lib.measure.flops`           — counted matmul FLOPs of a step, step time, this machine's matmul peak
* :mod:`~course_lib.measure.step_memory`     — bytes held after each phase of one training step
* :mod:`~course_lib.measure.compression`     — the tiny model trained under each gradient-compression hook: loss and bytes per step
* :mod:`~course_lib.measure.fixed_point`     — least squares with fixed-point weights, nearest vs stochastic rounding
* :mod:`~course_lib.measure.precision`       — the course model trained in fp32, bf16 autocast and FP8 (tensor, block): losses and gaps
* :mod:`~course_lib.measure.qlora`           — QLoRA on the tiny model: NF4 base + adapters, training, bytes held
* :mod:`~course_lib.measure.distill`         — a teacher distilled into a smaller student, against the same student on labels
* :mod:`~course_lib.measure.recompute`       — activation checkpointing: bytes kept and peak under none/selective/full, the compile budget knob, step time
* :mod:`~course_lib.measure.decode`          — decode tokens/s with and without a KV cache as the context grows
* :mod:`~course_lib.measure.quantized_kv`    — the quantized KV cache on the course model: attention error against its bound, logits, CacheGen sizes, transformers' quanto cache side by side
* :mod:`~course_lib.measure.roofline`        — this CPU's roofline (GEMM peak, streaming bandwidth) with the course model's kernels on it
* :mod:`~course_lib.measure.aten_ops`        — every aten operator a training step dispatches (a port's first question)
* :mod:`~course_lib.measure.collectives`     — gloo collectives timed from bytes to tens of MiB, for the alpha-beta fit; node-limited routing
* :mod:`~course_lib.measure.checkpoint`      — training with checkpoints: a rank killed and resumed, resharding, a killed save, sizes
* :mod:`~course_lib.measure.stability`       — a loss spike provoked on the course model and each remedy's curve
* :mod:`~course_lib.measure.reproducibility` — seeds, deterministic mode, reduction-order non-associativity
* :mod:`~course_lib.measure.lineage`         — SeedPrints-style fingerprints: do two models share an initialisation?
* :mod:`~course_lib.measure.frameworks`      — DeepSpeed (accelerate launch), FSDP2 and Lightning Fabric beside course ZeRO and DDP
* :mod:`~course_lib.measure.capstone`        — the course model trained over a DP × TP × PP mesh beside one process, one step traced
"""
