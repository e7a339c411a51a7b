"""Lab 04 entry point: a small tensor-parallel language model from your layers, trained next to its dense twin.

    accelerate launch --config_file labs/accelerate/cpu.yaml labs/lab04_tensor_parallel/run.py
    accelerate launch --config_file labs/accelerate/cpu.yaml --num_processes 2 labs/lab04_tensor_parallel/run.py

Model: token embedding -> x + MLP(x) -> output layer -> cross-entropy, i.e. a bigram-style model without
attention (attention heads split the same way as the MLP: see course_lib.parallel.tensor.model.TPAttention).
All ranks form one tensor-parallel group and read the same batches; the dense twin is built from the
same seed and trained on every rank, so the two loss curves can be compared line by line.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import counter, script
from course_lib.model.tokenizer import VOCAB_SIZE

from tensor_parallel import (
    ColumnParallelLinear,
    DenseMLP,
    ParallelMLP,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


class DenseLM(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB_SIZE, d)
        self.mlp = DenseMLP(d, 4 * d)
        self.out = nn.Linear(d, VOCAB_SIZE, bias=False)

    def loss(self, x, y):
        h = self.emb(x)
        return nn.functional.cross_entropy(self.out(h + self.mlp(h)).flatten(0, 1), y.flatten())


class ParallelLM(nn.Module):
    def __init__(self, dense: DenseLM, group):
        super().__init__()
        self.group = group
        self.emb = VocabParallelEmbedding.from_dense(dense.emb, group)
        self.mlp = ParallelMLP(dense.mlp, group)
        self.out = ColumnParallelLinear.from_dense(dense.out, group)  # logits split by vocabulary

    def loss(self, x, y):
        h = self.emb(x)
        return vocab_parallel_cross_entropy(self.out(h + self.mlp(h)), y, self.group)


def run(args) -> None:
    """Everything after init, on every rank (main records it with ``--trace``)."""
    t, dev = dist.get_world_size(), cdist.device()
    group = dist.group.WORLD
    say = script.print_on(0)
    say(f"tensor parallel over {t} ranks, backend {cdist.backend()}, device {dev}")

    torch.manual_seed(0)
    dense = DenseLM(args.d_model).to(dev)
    model = ParallelLM(dense, group).to(dev)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (dense, model)]
    data = make_dataset(MarkovLanguage(), 16 * 32 * args.steps + 1, 32, seed=0)

    say(f"{'step':>5} {'dense loss':>11} {'TP loss':>9} {'|diff|':>9}")
    worst = 0.0
    for step, (x, y) in enumerate(data.batches(16, seed=0)):
        x, y = x.to(dev), y.to(dev)
        losses = []
        for m, opt in zip((dense, model), opts):
            with counter.count() as fwd:
                loss = m.loss(x, y)
            opt.zero_grad()
            with counter.count() as bwd:
                loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        if step % 10 == 0 or step == args.steps - 1:
            say(f"{step:>5} {losses[0]:>11.4f} {losses[1]:>9.4f} {abs(losses[0] - losses[1]):>9.1e}")
    say(
        f"collectives per step on rank 0: {fwd.calls('all_reduce')} all-reduces forward "
        f"(embedding 1, MLP 1, cross-entropy 3), {bwd.calls('all_reduce')} backward (MLP 1, output layer 1)"
    )
    say(f"largest loss difference TP vs dense over {args.steps} steps: {worst:.1e}")
    assert worst < 1e-4, "the TP model should follow the dense loss curve: run ./course grade lab04 for details"
    say("TP training follows the dense loss curve")


def main() -> None:
    parser = script.parser(__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--d-model", type=int, default=64)
    script.main(run, parser)


if __name__ == "__main__":
    main()
