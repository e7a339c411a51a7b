"""Tests for course_lib.data's windows and batches: data-parallel batches shard exactly.

The data-parallel batch property is checked as the identity it promises (concatenated rank batches ==
global batch). The language the windows are cut from: tests/data/test_data.py.
"""

import pytest
import torch

from course_lib.data import MarkovLanguage, TokenDataset, make_dataset

# ------------------------------------------------------------------------------------------
# datasets, shards, data-parallel batches
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return make_dataset(MarkovLanguage(), n_tokens=24 * 16 + 1, seq_len=16, seed=0)  # 24 sequences


def test_make_dataset_windows_are_the_stream_shifted_by_one():
    lang = MarkovLanguage()
    ds = make_dataset(lang, n_tokens=1000, seq_len=32, seed=3)
    stream = lang.sample(1000, seed=3)
    assert ds.inputs.shape == (999 // 32, 32) and ds.seq_len == 32
    assert torch.equal(ds.inputs.flatten(), stream[: ds.inputs.numel()]), "inputs tile the stream"
    assert torch.equal(ds.targets.flatten(), stream[1 : ds.inputs.numel() + 1]), (
        "targets[i, t] must be the token after inputs[i, t]"
    )
    x, y = ds[0]
    assert torch.equal(x[1:], y[:-1])
    with pytest.raises(ValueError, match="at least seq_len \\+ 1"):
        make_dataset(lang, n_tokens=32, seq_len=32, seed=0)


def test_shards_are_disjoint_and_complete(dataset):
    for world in (1, 2, 3, 4, 6):
        shards = [dataset.shard(r, world) for r in range(world)]
        assert all(len(s) == len(dataset) // world for s in shards), "equal shards, or ranks hang"
        assert torch.equal(torch.cat([s.inputs for s in shards]), dataset.inputs), (
            f"at world_size={world} the shards in rank order must be the dataset, each row once"
        )
        assert torch.equal(torch.cat([s.targets for s in shards]), dataset.targets)


def test_shard_refuses_an_uneven_split_unless_asked(dataset):
    uneven = "24 sequences cannot be split evenly over world_size=5"
    with pytest.raises(ValueError, match=uneven) as e:
        dataset.shard(0, 5)
    assert "drop_last=True" in str(e.value), "the error must name the way out"
    shards = [dataset.shard(r, 5, drop_last=True) for r in range(5)]
    assert torch.equal(torch.cat([s.inputs for s in shards]), dataset.inputs[:20]), (
        "drop_last drops the last n_seq mod world_size sequences, nothing else"
    )
    with pytest.raises(ValueError, match="rank must be an int in 0..world_size-1"):
        dataset.shard(2, 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_batches_concatenate_to_the_single_process_batch(dataset, world_size):
    batch_size = 2  # global batch 2 * world_size; 24 sequences -> 12, 6, 4, 3 steps per epoch
    global_batches = list(dataset.batches(batch_size * world_size, seed=11, epochs=2))
    per_rank = [list(dataset.batches(batch_size, r, world_size, seed=11, epochs=2)) for r in range(world_size)]
    assert all(len(b) == len(global_batches) for b in per_rank), "every rank runs the same steps"
    for step, (gx, gy) in enumerate(global_batches):
        x = torch.cat([per_rank[r][step][0] for r in range(world_size)])
        y = torch.cat([per_rank[r][step][1] for r in range(world_size)])
        assert torch.equal(x, gx) and torch.equal(y, gy), (
            f"step {step}: the {world_size} rank batches, concatenated in rank order, must equal "
            f"the single-process batch of {batch_size * world_size}; DDP is checked against "
            "single-process training on exactly this identity"
        )


def test_an_epoch_visits_each_sequence_at_most_once(dataset):
    rows = {tuple(r) for r in dataset.inputs.tolist()}
    assert len(rows) == len(dataset), "fixture sequences should be distinct for this test"
    for epoch_batches in (list(dataset.batches(5, seed=0)), list(dataset.batches(8, seed=0))):
        seen = [tuple(r) for x, _ in epoch_batches for r in x.tolist()]
        assert len(seen) == len(set(seen)), "within an epoch no sequence may repeat"
        assert set(seen) <= rows
    assert len(list(dataset.batches(5))) == 24 // 5, "the last incomplete global batch is dropped"
    two_epochs = list(dataset.batches(8, seed=0, epochs=2))  # 3 steps each
    e1, e2 = two_epochs[:3], two_epochs[3:]
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(e1, e2)), "each epoch reshuffles"


def test_batches_are_deterministic_and_seeded(dataset):
    def first(seed, **kw):
        return next(iter(dataset.batches(4, seed=seed, **kw)))[0]

    assert torch.equal(first(1), first(1)), "same seed, same batches"
    assert not torch.equal(first(1), first(2)), "different seeds must shuffle differently"
    assert torch.equal(first(1, shuffle=False), dataset.inputs[:4]), "shuffle=False keeps order"
    forever = dataset.batches(12, epochs=None)
    assert len([next(forever) for _ in range(7)]) == 7, "epochs=None never stops"


def test_batch_errors_name_the_constraint(dataset):
    with pytest.raises(ValueError, match="global batch batch_size \\* world_size = 8 \\* 4 = 32"):
        next(iter(dataset.batches(8, rank=0, world_size=4)))
    with pytest.raises(ValueError, match="rank must be an int in 0..world_size-1 = 0..1"):
        next(iter(dataset.batches(2, rank=2, world_size=2)))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        next(iter(dataset.batches(0)))
