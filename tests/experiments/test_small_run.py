"""The experiments' data factory and training loop (course_lib.experiments.small_run): the batches a run
sees, a rank's share of them, and the loop's order of calls."""

import pytest
import torch

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.experiments import small_run
from course_lib.model import configs
from course_lib.model.transformer import Transformer


def test_windows_cut_one_stream_into_sequences():
    ds = small_run.windows(MarkovLanguage(), 6, 8, seed=3)
    ref = make_dataset(MarkovLanguage(), 6 * 8 + 1, 8, seed=3)
    assert len(ds) == 6 and torch.equal(ds.inputs, ref.inputs) and torch.equal(ds.targets, ref.targets)
    assert torch.equal(ds.inputs[:, 1:], ds.targets[:, :-1]), "targets are the inputs shifted by one"


def test_batches_see_every_window_once_then_cycle():
    batches = small_run.batches(4, 2, 8, seed=1)
    assert len(batches) == 4 and all(x.shape == (2, 8) and y.shape == (2, 8) for x, y in batches)
    seen = torch.cat([x for x, _ in batches])
    assert torch.equal(seen.sort(0).values, small_run.windows(MarkovLanguage(), 8, 8, 1).inputs.sort(0).values)
    longer = small_run.batches(6, 2, 8, seed=1, stream_batches=4)  # 4 batches of windows, then a new order
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, longer[:4]))


def test_the_ranks_shares_make_the_global_batch():
    whole = small_run.batches(3, 4, 8, seed=2)
    shares = [small_run.batches(3, 4, 8, seed=2, rank=r, world_size=2) for r in range(2)]
    for step, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([s[step][0] for s in shares]), x)
        assert torch.equal(torch.cat([s[step][1] for s in shares]), y)
    with pytest.raises(ValueError, match="does not split"):
        small_run.batches(3, 3, 8, seed=2, world_size=2)


def test_train_is_the_plain_loop_and_calls_its_hooks_in_order():
    data = small_run.batches(3, 2, 8, seed=0)
    torch.manual_seed(0)
    model = Transformer(configs.get("tiny", max_seq_len=8))
    reference = Transformer(configs.get("tiny", max_seq_len=8))
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    calls = []
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (calls.append(("scheduler", s)), 1.0)[1])
    calls.clear()  # LambdaLR calls the factor once when it is made

    def objective(m, x, y):
        calls.append(("objective",))
        return m.loss(x, y)

    losses = small_run.train(
        model,
        opt,
        data,
        objective=objective,
        after_backward=lambda step: calls.append(("after_backward", step, model.output.weight.grad is not None)),
        scheduler=sched,
        after_step=lambda step, loss: calls.append(("after_step", step)),
    )
    expected = []
    for x, y in data:  # the same steps written out
        loss = reference.loss(x, y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        expected.append(loss.item())
    assert losses == expected, "the loop is forward, zero_grad, backward, step: bit for bit"
    assert calls[:4] == [("objective",), ("after_backward", 0, True), ("scheduler", 1), ("after_step", 0)]
    assert len(calls) == 12


def test_an_objective_that_raises_stops_the_run():
    class Stop(Exception):
        pass

    model = Transformer(configs.get("tiny", max_seq_len=8))
    seen = []

    def objective(m, x, y):
        if len(seen) == 2:
            raise Stop
        seen.append(1)
        return m.loss(x, y)

    with pytest.raises(Stop):
        small_run.train(
            model, torch.optim.SGD(model.parameters(), lr=0.1), small_run.batches(4, 2, 8, 0), objective=objective
        )
    assert len(seen) == 2


def test_check_learned_names_the_run_and_the_floor():
    lang = small_run.quality_language()
    with pytest.raises(AssertionError, match="my run: final loss 2.000 .* bigram floor 1.682"):
        small_run.check_learned([2.0] * 10, lang, "my run")
    assert small_run.check_learned([3.0] * 5 + [1.0] * 10, lang, "ok") == 1.0  # the mean of the last ten
    with pytest.raises(ValueError, match="at least 10 losses"):
        small_run.final_loss([1.0] * 3)
