"""Training-step time of the course model under tensor parallelism: course_lib's Megatron TP vs torch DTensor TP.

    .venv/bin/python benchmarks/bench_tp.py --tp 2 4 --steps 10

Both start from the same dense ``course_lib.model.transformer.Transformer`` (config "small" with 8 query / 4 K/V
heads, so t = 2 and 4 both divide them): course_lib's ``TPTransformer.from_dense`` with the
vocab-parallel cross-entropy, and torch's ``parallelize_module`` with ColwiseParallel /
RowwiseParallel on the same matrices (vocab-parallel embedding and output layer, ``loss_parallel``).
A step is forward + backward + AdamW; both use plain TP (no sequence parallelism), the same layout.
The two are timed alternately in the same ranks, so noise from
the shared machine hits both alike; the first losses are printed to show they train the same model.
"""

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import Mesh, device, launch
from course_lib.dist.timing import clock
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.tensor.model import TPTransformer


def dtensor_model(dense: Transformer, t: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(dense.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel()
    # the mesh on the device the dense model (and this rank) computes on: cpu under gloo, cuda under NCCL
    mesh = init_device_mesh(next(dense.parameters()).device.type, (t,))
    return parallelize_module(copy.deepcopy(dense), mesh, plan)


def _ranks(cfg, steps: int, batch: int, seq_len: int):
    from torch.distributed.tensor.parallel import loss_parallel

    t = dist.get_world_size()
    torch.manual_seed(0)
    dev = device()
    dense = Transformer(cfg).to(dev)
    ours = TPTransformer.from_dense(dense, Mesh(tp=t))
    theirs = dtensor_model(dense, t)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in (("ours", ours), ("theirs", theirs))}

    def step_ours(x, y):
        loss = ours.loss(x, y)
        opts["ours"].zero_grad()
        loss.backward()
        opts["ours"].step()
        return loss.item()

    def step_theirs(x, y):
        with loss_parallel():
            loss = F.cross_entropy(theirs(x).flatten(0, 1), y.flatten())
            opts["theirs"].zero_grad()
            loss.backward()
        opts["theirs"].step()
        return loss.item()

    data = make_dataset(MarkovLanguage(), batch * seq_len * (steps + 3) + 1, seq_len, seed=0)
    times, losses = {"ours": [], "theirs": []}, {"ours": [], "theirs": []}
    for i, (x, y) in enumerate(data.batches(batch, seed=0)):
        x, y = x.to(dev), y.to(dev)  # drawn on the host: the same batches on every rank
        for name, step in (("ours", step_ours), ("theirs", step_theirs)):
            dist.barrier()
            start = clock()
            losses[name].append(step(x, y))
            times[name].append(clock() - start)
        if i >= steps + 2:
            break
    return {name: statistics.median(v[3:]) for name, v in times.items()}, {k: v[:3] for k, v in losses.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation (after 3 warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    cfg = configs.get("small", n_heads=8, n_kv_heads=4)
    print(
        f"config small (d={cfg.d_model}, {cfg.n_layers} layers, 8 heads / 4 KV heads), batch {args.batch} x "
        f"{args.seq_len} tokens, median of {args.steps} steps"
    )
    print(f"{'TP':>3} {'course_lib (ms)':>16} {'DTensor (ms)':>13} {'ratio':>6}  first losses (course_lib / DTensor)")
    for t in args.tp:
        med, losses = launch(_ranks, t, cfg, args.steps, args.batch, args.seq_len, timeout=600)[0]
        first = " ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(losses["ours"], losses["theirs"]))
        print(
            f"{t:>3} {med['ours'] * 1e3:>16.1f} {med['theirs'] * 1e3:>13.1f} {med['ours'] / med['theirs']:>6.2f}  {first}"
        )


if __name__ == "__main__":
    main()
