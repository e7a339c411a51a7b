"""vLLM's generation throughput on the course model beside course_lib's engine: tokens/s on the same requests.

    .venv/bin/python benchmarks/bench_vllm.py                          # 16 requests, 32 new tokens, 3 repeats
    .venv/bin/python benchmarks/bench_vllm.py --requests 64 --new-tokens 32 --model small

The model is the course's ``small`` (seeded, float32: vLLM's CPU attention needs head_dim 32, 64, ...),
exported with course_lib.model.hf_export.export_hf and run by vllm.LLM in .venv-vllm/ (made by
./course) through course_lib.inference.vllm: greedy, ``ignore_eos``, so every request makes exactly
``--new-tokens`` tokens. The requests are course_lib.inference.vllm.request_stream's (prompt lengths
uniform in 8..96 tokens), all submitted at once, so vLLM batches them as its scheduler likes
(continuous batching). Each repeat uses a new stream seed: the same prompts again would come from
vLLM's prefix cache and measure the cache, not generation. tokens/s counts generated tokens only,
over the wall time of ``LLM.generate`` (prefill included); the engine's start-up is printed apart.
course_lib's engine (course_lib.inference.engine, continuous and static batching, blocks of 32 like
vLLM's CPU backend, max 8 sequences per step) then serves the same streams in this process; its
tokens are checked against vLLM's, and its tokens/s is timed the same way (generated tokens over the
wall time of the whole stream).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from course_lib.inference.engine import Engine, Request
from course_lib.inference.vllm import ROOT, request_stream, vllm_run
from course_lib.model import configs
from course_lib.model.hf_export import export_hf
from course_lib.model.transformer import Transformer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="a course_lib.model.configs name (head_dim >= 32)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Transformer(configs.get(args.model)).eval()
    streams = [request_stream(seed, args.requests, args.min_len, args.max_len) for seed in range(1, args.repeats + 1)]
    warmup = (request_stream(0, 2, 4, 8), 2)  # the first generate() call pays one-off costs: not timed
    (ROOT / "build" / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "build" / "tmp") as tmp:
        result = vllm_run(export_hf(model, tmp), [warmup] + [(s, args.new_tokens) for s in streams])
    runs = result["batches"][1:]
    prompt_tokens = [sum(map(len, s)) for s in streams]
    print(
        f"vLLM {args.model}: {args.requests} requests x {args.new_tokens} new tokens, prompts "
        f"{args.min_len}-{args.max_len} tokens; engine start-up {result['startup_s']:.1f} s"
    )
    print(f"{'repeat':>6} {'prompt tok':>10} {'new tok':>8} {'seconds':>8} {'new tok/s':>10} {'cache hits':>10}")
    for i, (run, n_prompt) in enumerate(zip(runs, prompt_tokens)):
        n_new = sum(map(len, run["tokens"]))
        print(
            f"{i:>6} {n_prompt:>10} {n_new:>8} {run['seconds']:>8.3f} {run['tokens_per_s']:>10.0f} {run['hit_rate']:>10.2f}"
        )
    vllm_median = statistics.median(r["tokens_per_s"] for r in runs)
    print(f"median: {vllm_median:.0f} generated tokens/s")

    for batching in ("continuous", "static"):
        speeds, same = [], True
        for stream, run in zip(streams, runs):
            requests = [Request(p, args.new_tokens) for p in stream]
            outputs, stats = Engine(model, num_blocks=400, block_size=32, max_batch=8, batching=batching).run(requests)
            speeds.append(stats.tokens_per_second)
            same &= outputs == run["tokens"]
        median = statistics.median(speeds)
        print(
            f"course_lib engine, {batching:>10} batching: median {median:.0f} generated tokens/s "
            f"(vLLM / course_lib = {vllm_median / median:.1f}x); same tokens as vLLM: {same}"
        )


if __name__ == "__main__":
    main()
