"""Fault tolerance (course_lib.checkpoint, lecture 08b) across ranks: every ZeRO stage saved at 4 ranks loads
exactly at 2, a run resharded 4 -> 2 -> 4 continues with the same losses, a save killed before its manifest
leaves the previous checkpoint, and incremental and quantized sizes against the formulas. The ranks are those
of course_lib.experiments.lecture08.checkpoint_runs, the code the lecture runs; the single-process tests are
in tests/checkpoint/test_checkpoint.py.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from course_lib.checkpoint import (
    CorruptCheckpoint,
    full_state,
    load_zero_state,
    sharded,
    zero_state_dict,
)
from course_lib.cost import checkpoint as cost
from course_lib.dist import device, launch
from course_lib.experiments.lecture08 import checkpoint_runs
from course_lib.model import configs
from course_lib.model.transformer import Transformer
from course_lib.parallel.data.zero import Zero

# ------------------------------------------------------------------------------------------ multi-rank


def _odd_model():
    torch.manual_seed(0)  # unit sizes 20, 42, 8 and 2: uneven shards at 4 ranks, and empty ones (2 over 4)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Linear(7, 1), nn.Linear(1, 2))
    return model.to(device())  # Zero keeps its shards on device()


CASES = [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]


def _odd_step(model, zero, seed):
    # host: drawn on the host so every machine gets the same numbers, then moved to the rank's device
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    model(x.to(device(), zero.dtype)).float().pow(2).mean().backward()
    zero.step()
    zero.zero_grad()


def _save_odd(root):
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device().type, (world,))
    out = {"rule": [], "saved": {}}
    for stage, precision in CASES:
        model = _odd_model()
        zero = Zero(model, stage, lr=1e-2, precision=precision)
        for s in range(2):
            _odd_step(model, zero, s)
        sharded.save(f"{root}/{stage}-{precision}", 2, zero_state_dict(zero))
        out["saved"][stage, precision] = (full_state(zero), zero.full_parameters())
        if stage == 1:  # DTensor's own split of each unit against the range Zero's shard holds
            for u in zero.units:
                start = rank * u.shard_numel
                mine = torch.arange(start, start + max(0, min(u.shard_numel, u.numel - start)), device=device())
                theirs = distribute_tensor(torch.arange(u.numel, device=device()), mesh, [Shard(0)]).to_local()
                out["rule"].append((u.name, torch.equal(mine, theirs)))
    return out


def _load_odd(root):
    out = {}
    for stage, precision in CASES:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 7), nn.Linear(7, 1), nn.Linear(1, 2))
        model = model.to(device())  # Zero keeps its shards on device()
        zero = Zero(model, stage, lr=1e-2, precision=precision)  # other weights: the load must replace them all
        state = zero_state_dict(zero)
        sharded.load(f"{root}/{stage}-{precision}/step_00000002", state)
        load_zero_state(zero, state)
        out[stage, precision] = (full_state(zero), zero.full_parameters())
    return out


def test_every_zero_stage_saved_at_4_ranks_loads_exactly_at_2(tmp_path):
    saved = launch(_save_odd, 4, str(tmp_path), timeout=120)
    for rank, result in enumerate(saved):
        bad = [name for name, ok in result["rule"] if not ok]
        assert not bad, (
            f"rank {rank}: distribute_tensor(Shard(0)) gives other ranges than Zero's shards for units {bad}; "
            "the DTensor view of ZeRO would save the wrong elements"
        )
    loaded = launch(_load_odd, 2, str(tmp_path), timeout=120)
    for case in CASES:
        truth, truth_params = saved[0]["saved"][case]
        for rank, result in enumerate(loaded):
            state, params = result[case]
            wrong = [k for k in truth if not checkpoint_runs.same(state[k], truth[k])]
            wrong += [n for n in truth_params if not torch.equal(params[n], truth_params[n])]
            # exact: resharding copies elements, it computes nothing
            assert not wrong, (
                f"ZeRO-{case[0]} {case[1]}: saved by 4 ranks (uneven and empty shards), loaded by 2, rank {rank} "
                f"differs in {wrong[:4]}: check the shard ranges of zero_state and the all-gather of load_zero_state"
            )


def test_reshard_4_to_2_and_back_continues_with_the_same_losses(tmp_path):
    run = checkpoint_runs.reshard(str(tmp_path))
    big, small, back = run["big"], run["small"], run["back"]
    for loaded, saved, what in ((small, big, "4 -> 2"), (back, small, "2 -> 4")):
        step = int(loaded["loaded_from"][-8:])
        wrong = [
            k for k in saved["saved"][step] if not checkpoint_runs.same(loaded["loaded"][k], saved["saved"][step][k])
        ]
        assert not wrong, (
            f"{what}: the state loaded must be the state saved at step {step} bit for bit; differs: {wrong}"
        )
    # Tolerance 1e-5 on losses ≈ 3.5-4.2. The runs differ only in how the gradient sum over the global batch of 8
    # sequences is grouped (4 local means of 2 vs 2 of 4, then gloo's sum over ranks), and the reported loss in the
    # same way. A float32 sum of n terms is off by at most (n-1)·u·Σ|terms| (Higham, Accuracy and Stability of
    # Numerical Algorithms, §4.2; u = 2^-24), so each reduction differs by ≤ 7u relative: ~2e-6 on a loss of 4.
    # Through AdamW (lr 3e-3, ≤ 6 steps) a relative change of the gradient δ moves a parameter by ≤ ~lr·δ per step,
    # which moves the loss by far less. Measured: ≤ 5e-7 (two ulps of 3.5). A shard loaded into the wrong place, or
    # a wrong data position, changes a loss by > 1e-2.
    for run_, what in ((small, "4 -> 2"), (back, "4 -> 2 -> 4")):
        for step, loss in run_["losses"].items():
            assert abs(loss - big["losses"][step]) <= 1e-5, (
                f"{what}: loss at step {step} is {loss:.7f}, the uninterrupted 4-rank run had "
                f"{big['losses'][step]:.7f}; beyond reduction-order rounding (1e-5): check the resharded state and "
                "the data position"
            )


def _refusals(paths):
    """Try to load each damaged checkpoint into a fresh ZeRO; the CorruptCheckpoint message of each, or None."""
    out = []
    for path in paths:
        zero = Zero(Transformer(configs.get("tiny", **checkpoint_runs.MODEL)).to(device()), 2)
        try:
            sharded.load(path, zero_state_dict(zero))
            out.append(None)
        except CorruptCheckpoint as e:
            out.append(str(e))
    return out


@pytest.mark.slow
@pytest.mark.launch_heavy  # fault injection: a save killed
def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint(tmp_path):
    root = tmp_path / "run"
    crash = checkpoint_runs.crash_during_save(str(root), save_every=2, crash_at=6)
    tmp = [e for e in crash["entries"] if e.startswith(".tmp-step_00000006")]
    assert tmp and sorted(set(crash["entries"]) - set(tmp)) == ["step_00000002", "step_00000004"], (
        f"rank 0 died in the save of step 6: only a temp folder for step 6 may exist; found {crash['entries']}"
    )
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(crash["tmp_files"]), (
        f"the crash was to come after DCP wrote every shard; the temp folder holds {crash['tmp_files']}"
    )
    assert crash["latest"] == "step_00000004", f"latest() must fall back to step 4, picked {crash['latest']}"
    copies = checkpoint_runs.corrupt_copies(root / "step_00000004", tmp_path / "copies")
    # resume from what the crash left, saving every 2 steps and keeping 2: the temp folder and step 2 are pruned
    resumed = launch(checkpoint_runs.train, 2, str(root), 8, save_every=2, keep=2, load=str(root), timeout=120)
    assert resumed[0]["loaded_from"] == "step_00000004" and resumed[0]["step"] == 8
    assert sorted(os.listdir(root)) == ["step_00000006", "step_00000008"], (
        f"with keep=2 only the newest two checkpoints remain, and no temp folder; found {sorted(os.listdir(root))}"
    )
    refusals = launch(_refusals, 2, [str(copies["truncated"]), str(copies["altered"])], timeout=120)
    for rank, (truncated, altered) in enumerate(refusals):
        for message, reason in ((truncated, "is truncated"), (altered, "is corrupted")):
            assert message is not None and f"shard __0_0.distcp {reason}" in message, (
                f"rank {rank}: loading a checkpoint whose __0_0.distcp {reason[3:]} must raise CorruptCheckpoint "
                f"naming the file on every rank (the ranks share the checking, then agree); got {message!r}"
            )


def test_incremental_and_quantized_sizes_against_the_formulas(tmp_path):
    sizes = checkpoint_runs.checkpoint_sizes(str(tmp_path))
    for name, row in sizes.items():
        low, high = row["bounds"]
        assert low <= row["files"] <= high, (
            f"{name}: .distcp files hold {row['files']} bytes; the formula's payload {row['payload']} plus "
            f"torch.save's framing for {row['items']} items gives [{low}, {high}]"
        )
    full = sizes["full"]["payload"]
    assert full == cost.full_checkpoint_bytes(22_688, 4, 0, 8), "fp32 params + two moments: 12 bytes per parameter"
    for scenario in ("full training", "frozen"):
        assert sizes[f"incremental ({scenario})"]["exact"], f"incremental ({scenario}): base + delta must be exact"
    frozen = sizes["incremental (frozen)"]
    assert frozen["changed_fraction"] == pytest.approx(0.5, abs=0.01) and frozen["payload"] < 0.55 * full, (
        "with the embedding, the first block and the norm frozen (half the parameters), an increment holds half"
    )
    assert sizes["incremental (full training)"]["changed_fraction"] > 0.9, (
        "under AdamW almost every block changes each step: incremental saves little in full training"
    )
    assert sizes["quantized"]["worst"] <= 1.0, "every dequantized element must be within its error bound"
    assert sizes["quantized"]["payload"] < 0.26 * full, "int8 + one fp32 scale per 256: about a quarter of fp32"
