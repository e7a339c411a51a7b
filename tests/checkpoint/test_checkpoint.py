"""Fault tolerance (course_lib.checkpoint, lecture 08b) in one process: atomic commit, corruption, keep-last-k,
incremental and quantized checkpoints, the data position and the RNG states; DCP saves and loads without a
process group. With ranks (resharding, a save killed before its manifest, sizes at 2 ranks):
tests/checkpoint/test_checkpoint_multirank.py; the run killed with SIGKILL and resumed bit for bit:
tests/checkpoint/test_checkpoint_resume.py.
"""

import io
import itertools
import math
import os
import random
import shutil

import pytest
import torch

from course_lib.checkpoint import (
    CorruptCheckpoint,
    TrainState,
    commit,
    incremental,
    latest,
    prune,
    quantized,
    read_manifest,
    resume,
    sharded,
    verify,
)
from course_lib.cost import checkpoint as cost
from course_lib.experiments.lecture08 import checkpoint_runs

# ------------------------------------------------------------------------------------------ single process


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1000, generator=g), "b": torch.randn(7, 3, generator=g), "step": 3}


def test_zero_shards_follow_torch_chunk_rule():
    """Zero pads each unit to c·N with c = ceil(numel/N) and gives rank r elements [r·c, (r+1)·c); DTensor's Shard(0)
    follows torch.chunk. Without the padding the two must be the same split, or DCP would reshard the wrong ranges."""
    for numel, n in itertools.product(range(1, 41), range(1, 6)):
        c = -(-numel // n)
        zero_sizes = [max(0, min(c, numel - r * c)) for r in range(n)]
        chunks = [len(t) for t in torch.chunk(torch.arange(numel), n)]
        chunks += [0] * (n - len(chunks))  # torch.chunk returns fewer chunks when the last ones would be empty
        assert zero_sizes == chunks, (
            f"numel={numel}, N={n}: Zero's shards hold {zero_sizes} real elements, torch.chunk splits {chunks}; "
            "zero_state exposes Zero's shards as Shard(0) DTensors, which is only right when these agree"
        )


def test_commit_writes_manifest_then_renames(tmp_path):
    path = sharded.save(tmp_path, 5, _state())
    assert path == tmp_path / "step_00000005" and sorted(os.listdir(tmp_path)) == ["step_00000005"], (
        f"a committed save is exactly one directory step_XXXXXXXX, no temp folder left; found {os.listdir(tmp_path)}"
    )
    manifest = read_manifest(path)
    on_disk = {p.name: p.stat().st_size for p in path.iterdir() if p.name != "MANIFEST.json"}
    assert {k: v["bytes"] for k, v in manifest["files"].items()} == on_disk, (
        "the manifest must list every file DCP wrote with its size"
    )
    assert manifest["step"] == 5 and manifest["kind"] == "full" and manifest["world_size"] == 1
    back = sharded.read_full(path)
    assert torch.equal(back["w"], _state()["w"]) and torch.equal(back["b"], _state()["b"]) and back["step"] == 3, (
        "reading the checkpoint back must give the saved tensors bit for bit and the saved objects"
    )


def _truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_truncate, r"is truncated \(\d+ of \d+ bytes\)"),
        (_flip, "is corrupted: its sha256 differs"),
        (lambda p: p.unlink(), "is missing"),
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), "where the manifest says"),
    ],
    ids=["truncated", "bit flipped", "missing", "appended"],
)
def test_damaged_shard_is_refused_naming_the_file(tmp_path, damage, expected):
    path = sharded.save(tmp_path, 1, _state())
    shard = sorted(path.glob("*.distcp"))[0]
    damage(shard)
    with pytest.raises(CorruptCheckpoint, match=expected) as err:
        verify(path)
    message = str(err.value)
    assert shard.name in message and "latest(root)" in message, (
        f"the error must name the bad file ({shard.name}) and say what to do (load an older one with latest(root)); "
        f"got: {message}"
    )
    with pytest.raises(CorruptCheckpoint, match=shard.name):
        sharded.read_full(path)  # the load path checks too: a damaged checkpoint is never read silently
    assert latest(tmp_path) is None, "latest() must not offer a checkpoint that fails verification"


def test_latest_skips_unfinished_and_corrupt_checkpoints(tmp_path):
    sharded.save(tmp_path, 1, _state(1))
    good = sharded.save(tmp_path, 2, _state(2))
    bad = sharded.save(tmp_path, 3, _state(3))
    _flip(sorted(bad.glob("*.distcp"))[0])
    unfinished = tmp_path / ".tmp-step_00000004-dead"
    shutil.copytree(good, unfinished)
    (unfinished / "MANIFEST.json").unlink()  # a save killed before its manifest
    assert latest(tmp_path) == good, (
        f"latest() should pick step 2: step 3 is corrupt and step 4 never committed; picked {latest(tmp_path)}"
    )
    with pytest.raises(CorruptCheckpoint, match="never committed"):
        verify(unfinished)


def _tiny_write(d):
    (d / "data.bin").write_bytes(b"x" * 10)


def test_prune_keeps_last_k_and_the_bases_they_need(tmp_path):
    for step in range(1, 6):
        commit.commit(tmp_path, step, _tiny_write, keep=2)
        kept = sorted(p.name for p in tmp_path.iterdir())
        expected = [f"step_{s:08d}" for s in range(max(1, step - 1), step + 1)]
        assert kept == expected, f"after saving step {step} with keep=2, expected {expected}, found {kept}"
    # an increment refers to its base: the base survives however many newer checkpoints come
    commit.commit(tmp_path, 6, _tiny_write, kind="incremental", refs=["step_00000004"])
    (tmp_path / ".tmp-step_00000007-dead").mkdir()  # the leftover of a killed save
    removed = prune(tmp_path, 1)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step_00000004", "step_00000006"], (
        f"keep=1 keeps step 6 and the base step 4 it refers to (removing it would make step 6 unloadable); found {kept}"
    )
    assert ".tmp-step_00000007-dead" in removed and "step_00000005" in removed
    with pytest.raises(ValueError, match="keep must be"):
        prune(tmp_path, 0)


def test_resaving_a_step_replaces_it_atomically(tmp_path):
    sharded.save(tmp_path, 1, _state(1))
    path = sharded.save(tmp_path, 1, _state(2))  # a run resumed from an older checkpoint reaches step 1 again
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert torch.equal(sharded.read_full(path)["w"], _state(2)["w"]), "the newer save of a step must replace the older"


def test_incremental_rebuilds_the_exact_state(tmp_path):
    state = _state()
    base_path = sharded.save(tmp_path, 1, state)
    base = incremental.snapshot(state)
    with torch.no_grad():
        state["w"][100:110] += 1  # touches block 0 of 4 (block = 256)
        state["w"][999] = -0.0 if state["w"][999] == 0 else 0.0  # the last, short block
        state["b"][0, 0] = float("nan")
    state["step"] = 4
    path = incremental.save(tmp_path, 2, state, base_path, base, block=256)
    entries = incremental.delta(state, base, 256)
    assert entries["delta.0.w.blocks"].tolist() == [0, 3] and entries["delta.0.b.blocks"].tolist() == [0], (
        "only the blocks holding a changed element are written"
    )
    changed = sum(v.numel() for k, v in entries.items() if k.endswith(".values"))
    assert changed == 256 + (1000 - 768) + 21, "block 0 of w, its short last block (232), and all of b (21)"
    payload = cost.incremental_checkpoint_bytes(changed, 3, 4)
    low, high = cost.dcp_file_bytes(payload, items=4)  # blocks and values of 2 tensors
    step_bytes = io.BytesIO()
    torch.save(4, step_bytes)  # DCP stores an object as its torch.save bytes
    files = sum(p.stat().st_size for p in path.glob("*.distcp")) - len(step_bytes.getvalue())
    assert low <= files <= high, (
        f"incremental files hold {files} bytes besides the step; the formula gives payload {payload} plus "
        f"torch.save's framing per item, in [{low}, {high}]"
    )
    target = {"w": torch.zeros(1000), "b": torch.zeros(7, 3), "step": 0}
    incremental.load(path, target)
    for key in ("w", "b"):
        assert torch.equal(target[key].view(torch.int32), state[key].view(torch.int32)), (
            f"{key}: base + increment must rebuild the state bit for bit (NaN and -0.0 included)"
        )
    assert target["step"] == 4
    sharded.save(tmp_path, 1, _state(5))  # the base is re-written: its deltas no longer apply
    with pytest.raises(CorruptCheckpoint, match="re-written"):
        incremental.load(path, target)


def test_quantized_error_is_within_its_bound_and_the_size_is_the_formula(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g) * torch.logspace(-3, 3, 5000)  # blocks of very different scales
    x[:256] = 0  # an all-zero block
    x[1000] = 1e4  # an outlier costs only its own block
    q, scale = quantized.quantize(x, 256)
    err = (quantized.dequantize(q, scale, 256) - x).abs()
    bound = quantized.error_bound(scale, x.numel(), 256)
    # the bound is s/2 per element plus float32's own rounding of x/s and q·s (quantized.error_bound)
    assert bool((err <= bound).all()), f"|x - x̂| exceeds s·(1/2 + 254u) at {int((err > bound).sum())} elements"
    assert float((err / bound.clamp_min(1e-38)).max()) > 0.9, "the bound should be nearly tight for random data"
    assert q.dtype == torch.int8 and q.nbytes + scale.nbytes == cost.quantized_checkpoint_bytes([5000], 256), (
        "1 byte per element and 4 per block of 256"
    )
    state = {"x": x.clone(), "keep": x.clone(), "step": 2}
    path = quantized.save(tmp_path, 1, state, block=256, skip=("keep",))
    back = {"x": torch.zeros(5000), "keep": torch.zeros(5000), "step": 0}
    quantized.load(path, back)
    assert torch.equal(back["keep"], x) and back["step"] == 2, "skipped keys and objects come back exact"
    assert bool(((back["x"] - x).abs() <= bound).all())


def test_data_position_resumes_the_same_batches_at_any_world_size():
    ds = checkpoint_runs.dataset()
    steps_per_epoch = len(ds) // checkpoint_runs.GLOBAL_BATCH
    whole = list(itertools.islice(TrainState(0, 3, 8).batches(ds, 0, 1), 2 * steps_per_epoch))
    for s in (0, 4, steps_per_epoch + 1):  # the last one starts inside the second epoch
        for world in (1, 2, 4):
            parts = [next(TrainState(s, 3, 8).batches(ds, r, world)) for r in range(world)]
            assert torch.equal(torch.cat([x for x, _ in parts]), whole[s][0]), (
                f"resumed at step {s} on {world} ranks, the ranks' batches together must be step {s}'s global "
                "batch of the uninterrupted single-process run (the order depends only on seed and global batch)"
            )
    assert TrainState(steps_per_epoch + 1, 3, 8).epoch(ds) == 1
    with pytest.raises(ValueError, match="does not split"):
        TrainState(0, 3, 8).batches(ds, 0, 3)


def test_rng_states_are_restored():
    torch.manual_seed(5)
    random.seed(5)
    state = resume.state_dict(TrainState(4, 1, 8))
    expected = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    train = resume.restore(state)
    assert train == TrainState(4, 1, 8)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1], (
        "after restore() the torch and Python generators must continue exactly where the saved run was"
    )


def test_checkpoint_interval_formulas():
    c, m = 60.0, 24 * 3600.0  # a 1-minute checkpoint, a failure a day
    tau = cost.young_interval(c, m)
    assert tau == pytest.approx(math.sqrt(2 * c * m))
    overhead = [cost.checkpoint_overhead(t, c, m) for t in (0.5 * tau, tau, 2 * tau)]
    assert overhead[1] < min(overhead[0], overhead[2]) and overhead[1] == pytest.approx(math.sqrt(2 * c / m)), (
        "Young's interval minimises C/τ + τ/(2M), where the loss is sqrt(2C/M)"
    )
    assert cost.daly_interval(c, m) == pytest.approx(tau, rel=0.03), "Daly's estimate ≈ Young's when C << M"
    assert cost.daly_interval(3 * m, m) == m, "Daly: when a checkpoint takes more than 2M, checkpoint every M"
    assert cost.full_checkpoint_bytes(10, 2, 4, 8) == 140, "bf16 params + fp32 master + two fp32 moments: 14 B/param"
