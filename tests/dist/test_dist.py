"""The distributed runtime: launch, failure handling, device mesh, communication counter, timeline."""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.dist import LaunchTimeout, Mesh, RankError, counter, device, launch, runtime, trace


def _rank_sum(scale, offset=0.0):
    t = torch.tensor([float(dist.get_rank() + 1)], device=device())
    dist.all_reduce(t)
    return (t * scale + offset, dist.get_rank(), dist.get_world_size(), runtime.backend())


@pytest.mark.parametrize("world", [2, 4])
def test_launch_returns_every_rank_result_in_order(world):
    results = launch(_rank_sum, world, 2.0, offset=1.0, timeout=60)
    expected = world * (world + 1) / 2 * 2.0 + 1.0
    assert [r[1] for r in results] == list(range(world)), "results[r] must be rank r's return value"
    assert all(r[2] == world for r in results)
    assert all(torch.equal(r[0], torch.tensor([expected])) for r in results), "all_reduce(sum) of 1..N on every rank"


def test_backend_is_chosen_in_one_place():
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    results = launch(_rank_sum, 2, 1.0, timeout=60)
    # A 1-GPU machine cannot give two ranks a GPU each, so it falls back to gloo as well.
    if torch.cuda.device_count() < 2:
        expected = "gloo"
    assert {r[3] for r in results} == {expected}


def test_backend_override_is_validated(monkeypatch):
    monkeypatch.setenv("COURSE_BACKEND", "mpi")
    with pytest.raises(ValueError, match="use 'gloo' or 'nccl'"):
        runtime.backend()


def test_backend_follows_torch_accelerator(monkeypatch):
    """Device-agnostic: another accelerator (here a pretend Intel XPU with 8 devices) gets its own
    default backend and device from the same rule, with no change to the runtime (lecture 07)."""
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    assert runtime.backend() == "xccl", "XPU's default collective backend (torch.distributed's map) is XCCL"
    assert runtime.device() == torch.device("xpu", 3), "rank with LOCAL_RANK=3 computes on xpu:3"
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert runtime.backend() == "gloo", "4 local ranks on 2 devices cannot have one each: fall back to gloo+cpu"
    assert runtime.device() == torch.device("cpu")


def test_closures_and_lambdas_travel_by_value():
    factor = 3
    results = launch(lambda: dist.get_rank() * factor, 2, timeout=60)
    assert results == [0, 3]


def test_function_defined_in_main_works_like_a_notebook_cell(tmp_path):
    """A notebook defines functions in __main__; they cannot be imported by the ranks, only sent."""
    script = tmp_path / "cell.py"
    script.write_text(
        textwrap.dedent("""
        import torch.distributed as dist
        from course_lib.dist import launch
        def defined_in_a_cell(x):
            return x + dist.get_rank()
        if __name__ == "__main__":  # ranks import the script again; the guard keeps them from launching
            print(launch(defined_in_a_cell, 2, 10, timeout=60))
    """)
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[10, 11]" in out.stdout


def _printer():
    print(f"I am rank {dist.get_rank()}")
    return None


def test_rank_output_is_shown_in_rank_order(capsys):
    launch(_printer, 3, timeout=60)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rank")]
    assert lines == [f"[rank {r}] I am rank {r}" for r in range(3)], (
        "each rank's prints are replayed in rank order so notebook output is deterministic"
    )


def _spawn_orphan_then(what, pid_dir):
    """Leave a grandchild (sleep) behind, record pids, then fail or hang as asked."""
    orphan = subprocess.Popen(["sleep", "600"])
    (pid_dir / f"{dist.get_rank()}.pids").write_text(f"{os.getpid()} {orphan.pid}")
    if dist.get_rank() == 1:
        if what == "raise":
            raise ValueError("rank 1 failed on purpose")
        while True:  # hang on purpose
            time.sleep(0.05)
    t = torch.zeros(1, device=device())
    dist.recv(t, src=1)  # rank 0 waits for a message rank 1 never sends


def _assert_nothing_left(pid_dir, world):
    time.sleep(0.2)
    for r in range(world):
        for pid in map(int, (pid_dir / f"{r}.pids").read_text().split()):
            alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            assert not alive, f"process {pid} of rank {r} outlived the launch"


def test_a_rank_that_raises_reaches_the_caller_and_nothing_is_left(tmp_path):
    with pytest.raises(RankError) as info:
        launch(_spawn_orphan_then, 2, "raise", tmp_path, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed on purpose" in str(err) and "_spawn_orphan_then" in err.rank_traceback
    assert "ranks [0] had not finished" in str(err), "the message says who was still waiting"
    assert "dist.recv(t, src=1)" in str(err), "and on which line"
    _assert_nothing_left(tmp_path, 2)


@pytest.mark.launch_heavy  # fault injection: a rank hangs or raises
def test_a_rank_that_hangs_times_out_naming_it_and_nothing_is_left(tmp_path):
    start = time.monotonic()
    with pytest.raises((LaunchTimeout, RankError)) as info:
        launch(_spawn_orphan_then, 2, "hang", tmp_path, timeout=4)
    assert time.monotonic() - start < 15, "the timeout must end the launch promptly"
    msg = str(info.value)
    if isinstance(info.value, LaunchTimeout):
        assert info.value.ranks == [0, 1] or info.value.ranks == [1]
    assert "rank 1" in msg and "time.sleep(0.05)" in msg, f"the message must show where rank 1 hung:\n{msg}"
    _assert_nothing_left(tmp_path, 2)


@pytest.mark.parametrize("outcome", ["return", "raise", "hang"])
@pytest.mark.launch_heavy  # fault injection: a rank hangs or raises
def test_launch_leaves_nothing_in_the_temp_folder(outcome, tmp_path, monkeypatch):
    """The stack-dump folder a launch makes (to say where a hung rank waits) goes when the launch ends."""
    launch(_rank_sum, 1, 1.0)  # multiprocessing's fork server (and its socket folder) lives for the session
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    work = tmp_path / "work"
    work.mkdir()
    try:
        launch(_spawn_orphan_then, 2, outcome, work, timeout=4) if outcome != "return" else launch(_rank_sum, 2, 1.0)
    except (RankError, LaunchTimeout):
        assert outcome != "return"
    left = sorted(p.name for p in scratch.iterdir())
    assert not left, f"launch ({outcome}) left {left} in the temp folder: remove what it creates in its finally block"


def test_bad_world_size():
    with pytest.raises(ValueError, match="positive int"):
        launch(_printer, 0)


# ---------------------------------------------------------------------------------------- mesh


def test_mesh_validates_sizes():
    with pytest.raises(ValueError, match=r"2\*1\*1\*3 = 6 does not equal the world size 4"):
        Mesh(dp=2, tp=3, world_size=4)
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        Mesh(dp=4, ep=3, world_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        Mesh(dp=0, world_size=4)


def _mesh_groups():
    mesh = Mesh(dp=2, tp=2, ep=2)
    t = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(t, group=mesh.group("tp"))
    return {a: mesh.ranks(a) for a in ("dp", "tp", "pp", "cp", "ep")}, mesh.coords, t.item()


def test_mesh_groups_follow_the_grid():
    out = launch(_mesh_groups, 4, timeout=60)
    # grid = arange(4).view(dp=2, pp=1, cp=1, tp=2): TP neighbours are consecutive ranks.
    assert [o[0]["tp"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[0]["dp"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[0]["ep"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[0]["pp"] for o in out] == [[0], [1], [2], [3]]
    assert [o[1]["tp"] for o in out] == [0, 1, 0, 1] and [o[1]["dp"] for o in out] == [0, 0, 1, 1]
    assert [o[2] for o in out] == [1.0, 1.0, 5.0, 5.0], "the tp all-reduce must sum only within the tp group"


# ------------------------------------------------------------------------------ counter and trace


def _counted():
    mesh = Mesh(dp=2)
    dev = device()
    x = torch.ones(1000, device=dev)  # 4000 bytes
    with counter.count() as c, trace.record() as tl:
        dist.all_reduce(x, group=mesh.group("dp"))
        with trace.span("matmul"):
            torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
        work = dist.all_reduce(x, async_op=True)
        time.sleep(0.05)
        work.wait()
        peer = 1 - dist.get_rank()
        ops = [
            dist.P2POp(dist.isend, torch.ones(10, device=dev), peer),
            dist.P2POp(dist.irecv, torch.empty(10, device=dev), peer),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out = torch.empty(2000, device=dev)
        dist.all_gather_single(out, x)
        dist.all_gather_into_tensor(out, x)  # deprecated, implemented with all_gather_single: counted once
    spans = [(s.name, s.kind, s.duration, s.meta.get("group")) for s in tl.spans]
    return c.as_dict(), spans


def test_counter_counts_calls_and_payload_bytes_per_group():
    counts, spans = launch(_counted, 2, timeout=60)[0]
    assert counts["all_reduce@dp"] == {"calls": 1, "bytes": 4000}
    assert counts["all_reduce@world"] == {"calls": 1, "bytes": 4000}
    assert counts["isend@world"] == {"calls": 1, "bytes": 40} and counts["irecv@world"] == {"calls": 1, "bytes": 40}
    assert counts["all_gather_single@world"] == {"calls": 1, "bytes": 4000}, "all-gather counts this rank's shard"
    assert counts["all_gather_into_tensor@world"] == {"calls": 1, "bytes": 4000}, (
        "a call counts once, however torch implements it"
    )
    names = [s[0] for s in spans]
    assert names == [
        "all_reduce",
        "matmul",
        "all_reduce",
        "isend",
        "irecv",
        "all_gather_single",
        "all_gather_into_tensor",
    ]
    async_span = spans[2]
    assert async_span[1] == "comm" and async_span[2] >= 0.04, "an async op's span ends when wait() returns"


def test_counter_restores_torch_distributed():
    original = dist.all_reduce
    with counter.count():
        assert dist.all_reduce is not original
    assert dist.all_reduce is original, "after the count, torch.distributed must be untouched"


def test_init_without_launcher_environment_explains(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RuntimeError, match="accelerate launch"):
        runtime.init()


def _unpickled_after(seconds: float) -> float:
    time.sleep(seconds)  # in each rank, while it unpickles fn's arguments: part of starting, not of fn
    return seconds


class _SlowToUnpickle:
    """An argument whose unpickling takes ``seconds``, as importing a heavy module of fn's would."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return _unpickled_after, (self.seconds,)


def _returns(x):
    return x


def test_the_timeout_counts_from_when_the_ranks_have_started():
    """Starting the ranks (the group, unpickling fn and its arguments) is not charged to ``timeout``: under
    load it took longer than a test's 4 s, and a hanging rank was reported as ranks stuck in imports."""
    assert launch(_returns, 2, _SlowToUnpickle(3.0), timeout=2) == [3.0, 3.0]


def _only_rank_1_waits():
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1, device=device()), src=0)  # rank 0 returns without ever sending
    return dist.get_rank()


def test_a_rank_that_returns_early_keeps_its_peers_waiting_visibly():
    """Rank 0 must not disconnect when it returns: rank 1's hang must stay a hang, shown on its line,
    not turn into a 'connection reset by peer' error from inside gloo."""
    with pytest.raises(LaunchTimeout) as info:
        launch(_only_rank_1_waits, 2, timeout=3)
    assert info.value.ranks == [1]
    assert "dist.recv(torch.zeros(1, device=device()), src=0)" in str(info.value)
