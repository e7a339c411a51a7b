"""course_lib.experiments — the runs the lectures make, one subpackage per lecture.

A run lives with the lecture that introduces it; the lectures that use it again are named beside it.
Every run trains on :mod:`~course_lib.experiments.small_run` (one data factory, one loop) where its
loop is the plain one, and measures with the instruments of :mod:`course_lib.measure`. For lectures,
tests and benchmarks only: nothing in the library imports this package, and it imports
:mod:`course_lib.measure`, never the other way round.

Shared by every lecture:

* :mod:`~course_lib.experiments.small_run`   — the data factory (windows and batches of the synthetic
  language), the training loop with its hooks, and the recipe of the runs whose point is training
  quality (``RECIPE``, ``quality_language``, ``check_learned``: below the bigram floor or an error)
* :mod:`~course_lib.experiments.third_party` — third-party frameworks on the course's device
  (``framework_devices``), their C++ extensions' folder, ``accelerate launch``

Lecture 02, data and tensor parallelism (:mod:`course_lib.experiments.lecture02`):

* :mod:`~.lecture02.ddp_trace`        — one traced DDP step, for the overlap timeline (also lecture 08a)
* :mod:`~.lecture02.zero_stages`      — bytes held and moved by each ZeRO stage beside the formulas; ZeRO-3's
  allocator timeline
* :mod:`~.lecture02.tp_collectives`   — collectives of one TP and TP+SP block and of a TP step; course_lib's
  column/row-parallel MLP beside Megatron-Core's (also lectures 03 and 09)

Lecture 03, pipeline, sequence and expert parallelism (:mod:`course_lib.experiments.lecture03`):

* :mod:`~.lecture03.pipeline_runs`          — course_lib's pipeline schedules beside torch's, bit for bit; the
  bubble measured; activations in flight (also lecture 09)
* :mod:`~.lecture03.layer_activation_bytes` — one layer's activation bytes per rank, dense, TP and TP+SP, beside
  the model
* :mod:`~.lecture03.ring_attention_trace`   — one traced ring attention, for its overlap timeline
* :mod:`~.lecture03.expert_training`        — the MoE model trained at 1 and N expert-parallel ranks: losses,
  expert loads under each balancing method, all-to-all bytes and bandwidth

Lecture 04, frontier architectures (:mod:`course_lib.experiments.lecture04`):

* :mod:`~.lecture04.mtp_run` — the quality recipe with and without one multi-token-prediction module

Lecture 05, training optimisations (:mod:`course_lib.experiments.lecture05`):

* :mod:`~.lecture05.precision_comparison`      — the course model trained in fp32, bf16 autocast and FP8 (tensor,
  block): losses and gaps to bf16
* :mod:`~.lecture05.fixed_point_regression`    — least squares with fixed-point weights, nearest against
  stochastic rounding
* :mod:`~.lecture05.gradient_compression_runs` — the tiny model trained under each gradient-compression hook:
  loss and bytes per step, against the uncompressed run's seed band
* :mod:`~.lecture05.merging_runs`              — a model soup of one task, task arithmetic over two, and the
  average of two initialisations (the negative control)
* :mod:`~.lecture05.qlora_finetune`            — QLoRA on the tiny model: NF4 base and adapters, training, bytes
  held
* :mod:`~.lecture05.distillation_run`          — a teacher distilled into a smaller student, beside the same
  student trained on labels

Lecture 06, memory, the KV cache and checkpointing (:mod:`course_lib.experiments.lecture06`):

* :mod:`~.lecture06.decode_speed`          — decode tokens/s with and without a KV cache as the context grows
* :mod:`~.lecture06.kv_quantization_error` — the quantized KV cache on the course model: attention error against
  its bound, logits, CacheGen sizes
* :mod:`~.lecture06.quanto_side_by_side`   — transformers' quanto cache beside ours: bytes, logits, greedy tokens
* :mod:`~.lecture06.recompute_memory`      — activation checkpointing: bytes kept and peak under
  none/selective/full, the compile budget knob, step time

Lecture 07, hardware (:mod:`course_lib.experiments.lecture07`):

* :mod:`~.lecture07.node_routing` — distinct nodes a token's experts live on, with and without node-limited
  routing

Lecture 08, systematic challenges, in two parts (:mod:`course_lib.experiments.lecture08`):

* :mod:`~.lecture08.spike_remedies`       — 08a: a loss spike provoked on the course model and each remedy's
  curve; what z-loss does
* :mod:`~.lecture08.checkpoint_runs`      — 08b: training with checkpoints: a rank killed and resumed,
  resharding, a killed save, sizes
* :mod:`~.lecture08.reproducibility`      — 08b: summation orders, seeds, deterministic mode, TF32 (also lab
  11's tests)
* :mod:`~.lecture08.lineage_fingerprints` — 08b: SeedPrints-style fingerprints: do two models share an
  initialisation?

Lecture 09, frameworks (:mod:`course_lib.experiments.lecture09`):

* :mod:`~.lecture09.deepspeed_vs_zero`     — DeepSpeed ZeRO under ``accelerate launch`` beside course_lib's ZeRO
  (also the program it launches)
* :mod:`~.lecture09.fabric_fsdp_vs_course` — Lightning Fabric's DDP and torch's FSDP2 beside course_lib's DDP and
  ZeRO-3

Lecture 10, capstone (:mod:`course_lib.experiments.lecture10`):

* :mod:`~.lecture10.capstone_run`  — the course model trained over a DP × TP × PP mesh beside one process, one
  step traced
* :mod:`~.lecture10.layout_timing` — measured step times of composed layouts, to check the planner with

Lectures 01 and 04 make no run of their own: lecture 01 uses the instruments of :mod:`course_lib.measure`.
"""
