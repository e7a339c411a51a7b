"""Lab 06 entry point: your ring attention (and Ulysses) against full causal attention, at any N.

    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab06_sequence_parallel/run.py
    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 2 labs/lab06_sequence_parallel/run.py

Every rank draws the same full q, k, v (same seed), keeps its shard, runs your attention forward
and backward, and the shards are all-gathered back into the full sequence and compared with
torch's scaled_dot_product_attention on the whole of it. Then: what each rank sent against the
formulas, the work each rank did under the zigzag layout, and the memory model of lecture 03.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.cost.activations import attention_memory_per_rank
from course_lib.cost.collective_bytes import ring_comm_bytes, ulysses_comm_bytes
from course_lib.dist import counter, script
from course_lib.parallel.context.ring_attention import shard, unshard

import sequence_parallel as sp


def gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def check(name, attend, split, join, full, say) -> None:
    """Run ``attend`` on this rank's shard, forward and backward; compare the gathered results."""
    q, k, v, w = (split(t).contiguous() for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with counter.count() as c:
        out = attend(q, k, v)
        forward = {"calls": c.calls(), "bytes": c.bytes("isend") + c.bytes("all_to_all_single")}
        (out * w).sum().backward()
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in full[:3])
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True)
    (ref * full[3]).sum().backward()
    errors = [
        (join(gather(a.detach())) - b).abs().max().item()
        for a, b in zip((out, q.grad, k.grad, v.grad), (ref.detach(), ref_q.grad, ref_k.grad, ref_v.grad))
    ]
    say(
        f"{name}: max |difference| from full causal attention: out {errors[0]:.1e}, dq {errors[1]:.1e}, "
        f"dk {errors[2]:.1e}, dv {errors[3]:.1e} (fp32; allowed 1e-5)"
    )
    assert max(errors) <= 1e-5, f"{name} differs from full causal attention"
    total = {"calls": c.calls(), "bytes": c.bytes("isend") + c.bytes("all_to_all_single")}
    return forward, total


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    say = script.print_on(0)
    b, s, h, hk, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    say(f"{n} ranks, backend {cdist.backend()}; b={b}, s={s}, h={h}, h_kv={hk}, d={d}")
    g = torch.Generator().manual_seed(0)  # host: the same draw on every machine, moved to dev below
    full = [torch.randn(b, x, s, d, generator=g).to(dev) for x in (h, hk, hk, h)]  # host: drawn with g

    # 1. Ring attention, zigzag layout: equal to full attention; bytes and work per rank.
    work = []
    original = sp.block_attention

    def counting(q, k, v, causal):
        m = q.shape[-2]
        work.append(m * (m + 1) // 2 if causal else m * k.shape[-2])
        return original(q, k, v, causal)

    sp.block_attention = counting
    try:
        fwd, total = check("ring", sp.ring_attention, lambda t: shard(t, rank, n), unshard, full, say)
    except NotImplementedError as e:
        say(f"ring: not implemented yet ({e})")
    else:
        formula = ring_comm_bytes(b, s, hk, d, n)
        say(f"ring forward: rank 0 sent {fwd['bytes']} B; K and V, N-1 hops each: {formula['forward_bytes']} B")
        say(
            f"ring forward+backward: {total['bytes']} B; formula {formula['forward_bytes'] + formula['backward_bytes']} B"
        )
        per_rank = gather(torch.tensor([sum(work)], device=dev))
        say(f"unmasked scores computed per rank (zigzag): {[int(t) for t in per_rank]}")

    # 2. Ulysses (extra credit).
    try:
        fwd, _ = check(
            "ulysses", sp.ulysses_attention, lambda t: t.chunk(n, dim=-2)[rank], lambda xs: torch.cat(xs, -2), full, say
        )
        say(
            f"ulysses forward: rank 0 handed {fwd['bytes']} B to 4 all-to-alls; formula "
            f"{ulysses_comm_bytes(b, s, h, hk, d, n)['payload_per_rank']} B"
        )
    except NotImplementedError as e:
        say(f"ulysses: not implemented ({e}) — Task 4 is extra credit")

    # 3. The memory model at a long context, for the write-up.
    for method in ("none", "ulysses", "ring"):
        m = attention_memory_per_rank(32768, 32, 8, 128, n, method)
        say(
            f"memory per rank, s=32768, h=32, h_kv=8, d=128, N={n}, {method:>7}: saved {m['saved'] / 2**20:.0f} MiB, "
            f"scores {m['scores'] / 2**30:.1f} GiB"
        )


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    script.main(run, parser)


if __name__ == "__main__":
    main()
