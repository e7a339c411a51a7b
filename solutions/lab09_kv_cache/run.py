"""Lab 09 entry point: serve a request stream from your paged KV cache, one engine replica per rank.

    .venv/bin/accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 2 labs/lab09_kv_cache/run.py

Serving scales out by replicas before it splits a model: every rank builds the same course model
(seeded) and an engine over *your* ``PagedCache``, and serves its share of one request stream
(request i goes to rank i mod N). Each rank checks its tokens against decoding without a cache;
rank 0 gathers the counts and prints tokens per second, the memory waste of your paged cache, the
waste of reserving max_len slots per request on the same stream, and the prefix-cache hit rate of
a second stream whose prompts share a 48-token system prompt.
"""

import random

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.dist import script
from course_lib.inference.engine import Engine, Request
from course_lib.inference.generate import generate
from course_lib.model.configs import get
from course_lib.model.transformer import Transformer

import paged_cache as lab


def requests(n: int, seed: int, shared: list[int]) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(shared + [rng.randrange(60) for _ in range(rng.randint(32, 256))], rng.randint(64, 256))
        for _ in range(n)
    ]


def serve(model, mine: list[Request], blocks: int, reserve: str = "paged"):
    cache = lab.PagedCache(blocks, 16, device=cdist.device())  # beside the model: positions, slots, pool
    engine = Engine(model, max_batch=8, reserve=reserve, cache=cache)
    return engine.run(mine)


def run(args) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    say = script.print_on(0)
    torch.manual_seed(0)
    model = Transformer(get("tiny", max_seq_len=512)).eval().to(cdist.device())  # seeded on the host, then moved
    say(f"{n} ranks, backend {cdist.backend()}; {args.requests} requests, rank r serves requests r, r + {n}, ...")
    stream = requests(args.requests, seed=0, shared=[])
    mine = stream[rank::n]
    try:
        outputs, stats = serve(model, mine, args.blocks)
        contiguous = serve(model, mine, args.blocks * 4, reserve="max_len")[1]
        shared = requests(args.requests, seed=1, shared=list(range(48)))[rank::n]
        hits = serve(model, shared, args.blocks)[1]
    except NotImplementedError as err:
        say(f"not implemented yet ({err})")
        return
    equal = all(
        out
        == generate(model, torch.tensor(r.prompt, device=cdist.device()), r.max_new_tokens)[len(r.prompt) :].tolist()
        for out, r in zip(outputs, mine)
    )
    # sums over the ranks: tokens, seconds, allocated and used slots, equal flags
    totals = torch.tensor(
        [
            stats.generated_tokens,
            stats.wall_seconds,
            sum(stats.allocated_slots),
            sum(stats.used_slots),
            sum(contiguous.allocated_slots),
            sum(contiguous.used_slots),
            float(equal),
            stats.preemptions,
        ],
        dtype=torch.float64,
        device=cdist.device(),  # an all-reduce's tensor: on the rank's device (NCCL takes no CPU tensor)
    )
    dist.all_reduce(totals)
    tokens, seconds, alloc, used, c_alloc, c_used, n_equal, preempted = totals.tolist()
    say(
        f"generated {int(tokens)} tokens, {tokens / (seconds / n):.0f} tokens/s over {n} replicas ({int(preempted)} preemptions)"
    )
    say(f"tokens equal decoding without a cache on every rank: {int(n_equal) == n}")
    say(
        f"paged cache waste: {(alloc - used) / alloc:.2%} of allocated slots; reserving max_len: {(c_alloc - c_used) / c_alloc:.2%}"
    )
    say(f"prefix-cache hit rate on the shared-prompt stream (rank 0): {hits.prefix_hit_rate:.1%}")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=200, help="blocks of 16 tokens in each replica's pool")
    script.main(run, parser)


if __name__ == "__main__":
    main()
