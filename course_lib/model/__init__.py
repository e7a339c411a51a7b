"""course_lib.model — the course model and what describes it.

* :mod:`~course_lib.model.config`      — ``ModelConfig`` and the registry of course and published configs
* :mod:`~course_lib.model.transformer` — the Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU)
* :mod:`~course_lib.model.tokenizer`   — the 64-token vocabulary and an offline Hugging Face tokenizer
* :mod:`~course_lib.model.hf_export`   — export to a Hugging Face Llama checkpoint
"""
