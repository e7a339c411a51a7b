"""course_lib.model — the course model and what describes it.

* :mod:`~course_lib.model.config`           — ``ModelConfig``: a transformer's hyper-parameters and derived sizes
* :mod:`~course_lib.model.configs`          — the named configs: the course's ``tiny``/``small`` and six published ones
* :mod:`~course_lib.model.layers`           — RMSNorm and RoPE, shared by every attention variant
* :mod:`~course_lib.model.transformer`      — the Llama-style decoder (GQA, SwiGLU) and its frontier variants
* :mod:`~course_lib.model.recompute`        — activation checkpointing of its blocks: none, full, selective
* :mod:`~course_lib.model.moe`              — mixture of experts: routers, capacity, balancing, the layer
* :mod:`~course_lib.model.mla`              — multi-head latent attention and its latent cache
* :mod:`~course_lib.model.linear_attention` — Gated DeltaNet, a linear attention with a fixed-size state
* :mod:`~course_lib.model.mtp`              — multi-token prediction modules
* :mod:`~course_lib.model.lora`             — LoRA adapters: apply, train, merge
* :mod:`~course_lib.model.merge`            — weight averaging and task vectors
* :mod:`~course_lib.model.tokenizer`        — the 64-token vocabulary and an offline Hugging Face tokenizer
* :mod:`~course_lib.model.hf_export`        — export to a Hugging Face Llama checkpoint
"""
