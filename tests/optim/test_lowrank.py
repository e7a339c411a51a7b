"""GaLore-style low-rank optimizer state (course_lib.optim.lowrank): its bytes, its subspace, and that it trains."""

from fractions import Fraction

import pytest
import torch

from course_lib.cost.memory import galore_state_elements
from course_lib.data import MarkovLanguage, make_dataset
from course_lib.dist import census
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.optim.lowrank import GaLoreAdamW
from course_lib.optim.optimizers import AdamW

# one thread for the whole module: see one_thread in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


def _one_step(opt_class, shape, **kwargs):
    p = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    opt = opt_class([p], **kwargs)
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    opt.step()
    return opt


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)], ids=["wide", "tall"])
def test_state_is_2rn_plus_mr_against_adamw_2mn(shape):
    rank = 8
    galore = census.optimizer_state_bytes(_one_step(GaLoreAdamW, shape, rank=rank))
    adamw = census.optimizer_state_bytes(_one_step(AdamW, shape))
    m, n = min(shape), max(shape)  # GaLore projects the shorter side, so the moments are r x the longer one
    assert adamw == 4 * 2 * m * n
    assert galore == 4 * (2 * rank * n + m * rank) == 4 * galore_state_elements(shape, rank), (
        f"GaLore state for {shape} at r={rank}: measured {galore} B, expected 4·(2·r·n + m·r) = "
        f"{4 * (2 * rank * n + m * rank)} B (two r×n moments and the m×r projector, fp32)"
    )
    ratio = Fraction(galore, adamw)
    assert ratio == Fraction(2 * rank * n + m * rank, 2 * m * n) == Fraction(9, 64), f"ratio {ratio}"


def test_state_of_the_tiny_model_matches_formula():
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny"))
    opt = GaLoreAdamW(model.parameters(), rank=8)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model.loss(x, x).backward()
    opt.step()
    measured = census.optimizer_state_bytes(opt)
    expected = 4 * sum(galore_state_elements(p.shape, 8) for p in model.parameters())
    adamw = 4 * 2 * sum(p.numel() for p in model.parameters())
    assert measured == expected, f"measured {measured} B of optimizer state, formula says {expected} B"
    # measured: 36480 / 213632 elements = 0.171 (norm gains keep full moments; every matrix is projected)
    assert measured < 0.2 * adamw, f"GaLore r=8 on tiny keeps {measured / adamw:.3f} of AdamW's state"


def test_update_stays_in_the_subspace_between_refreshes():
    """Between two SVDs every step is P·N: the matrix moves only inside span(P), rank ≤ r."""
    m, n, rank = 32, 48, 4
    # W starts at 0, so W itself is ΔW: from a W of size ~1, ΔW ~ 0.05 would carry W's rounding (~1e-5 relative)
    p = torch.nn.Parameter(torch.zeros(m, n))
    opt = GaLoreAdamW([p], rank=rank, update_proj_gap=100, lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        p.grad = torch.randn(m, n, generator=generator)
        opt.step()
    delta = p.detach()
    proj = opt.state[p]["projector"]
    singular = torch.linalg.svdvals(delta)
    outside = (delta - proj @ (proj.T @ delta)).norm() / delta.norm()
    assert singular[rank:].max() < 1e-4 * singular[0], f"ΔW has rank > r={rank}: singular values {singular[: rank + 2]}"
    assert outside < 1e-5, f"{outside:.1e} of ΔW lies outside span(P): the update was not projected back with P"


def test_projector_is_refreshed_every_T_steps():
    gap, m, n = 3, 16, 24
    p = torch.nn.Parameter(torch.zeros(m, n))
    opt = GaLoreAdamW([p], rank=2, update_proj_gap=gap)
    generator = torch.Generator().manual_seed(0)
    projectors = []
    for _ in range(7):
        p.grad = torch.randn(m, n, generator=generator)
        opt.step()
        projectors.append(opt.state[p]["projector"].clone())
    changed = [step for step in range(1, 7) if not torch.equal(projectors[step], projectors[step - 1])]
    assert changed == [3, 6], f"projector changed after steps {changed} (0-based); expected every T={gap} steps"


def _train(make_opt, steps=30, batch=8):
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny"))
    opt = make_opt(model.parameters())
    ds = make_dataset(MarkovLanguage(), batch * 64 * steps + 1, 64, seed=1)
    losses = []
    for x, y in ds.batches(batch, shuffle=False):
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_galore_trains_the_tiny_model():
    # GaLore's scale s = 0.25 (the paper's) with a larger lr; AdamW at the course's usual 3e-3.
    galore = _train(lambda p: GaLoreAdamW(p, rank=8, update_proj_gap=10, scale=0.25, lr=3e-2))
    adamw = _train(lambda p: AdamW(p, lr=3e-3, weight_decay=0.0))
    first, last, adamw_last = sum(galore[:3]) / 3, sum(galore[-3:]) / 3, sum(adamw[-3:]) / 3
    # Measured: GaLore 4.1 -> 2.82, AdamW -> 2.78 (the bigram plateau is 2.67; see course_lib.data)
    assert last < first - 1.0, f"GaLore r=8 did not train: loss {first:.3f} -> {last:.3f} over 30 steps"
    assert last < adamw_last + 0.15, f"GaLore r=8 ends at {last:.3f}, AdamW at {adamw_last:.3f}: too far behind"
