"""The device rule made visible: which backend and devices a launch uses, and why; a forced backend
that cannot work is refused with the fix named. Pretend accelerators stand in for GPUs on CPU."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from course_lib.dist import launch, runtime


def pretend(monkeypatch, kind: str, count: int) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(kind))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)


def test_one_device_per_rank_takes_the_native_backend():
    c = runtime.decide("cuda", 8, 8, None)
    assert (c.backend, c.device_type, c.fell_back) == ("nccl", "cuda", False)


def test_too_few_devices_fall_back_and_say_how_to_use_them():
    c = runtime.decide("cuda", 1, 4, None)
    assert (c.backend, c.device_type, c.fell_back) == ("gloo", "cpu", True)
    assert "4 local ranks but 1 cuda device" in c.why
    assert "--num_processes 1" in c.why, "the fall-back must name the fix: one rank per GPU"


def test_a_cpu_machine_runs_gloo_without_fuss():
    c = runtime.decide(None, 0, 4, None)
    assert (c.backend, c.device_type, c.fell_back) == ("gloo", "cpu", False)


def test_forcing_nccl_with_too_few_gpus_is_refused_with_the_fix():
    with pytest.raises(
        RuntimeError, match=r"COURSE_BACKEND=nccl needs one cuda device per local rank.*--num_processes 2"
    ):
        runtime.decide("cuda", 2, 4, "nccl")
    with pytest.raises(RuntimeError, match="no accelerator for 2 local ranks"):
        runtime.decide(None, 0, 2, "nccl")
    assert runtime.decide("cuda", 4, 4, "nccl").backend == "nccl"
    forced_cpu = runtime.decide("cuda", 8, 4, "gloo")
    assert (forced_cpu.backend, forced_cpu.device_type, forced_cpu.fell_back) == ("gloo", "cpu", False)


def test_describe_names_backend_device_and_reason(monkeypatch):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    pretend(monkeypatch, "cuda", 8)
    line = runtime.describe(8, 8)
    assert line.startswith("course_lib.dist: 8 ranks: backend nccl, device cuda:<local rank>"), line
    assert "one device per rank over nccl" in line


def _backend_seen_by_rank():
    return runtime.backend(), str(runtime.device()), dist.get_world_size()


def test_launch_says_when_a_present_gpu_goes_unused(monkeypatch, capfd):
    """The parent applies the rule before starting ranks: on a pretend 1-GPU machine, 2 ranks fall
    back to the CPU and stderr says so (once per world size). The ranks themselves, started fresh,
    see the real (CPU-only) machine."""
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    launch.__globals__["_ANNOUNCED"].discard(2)  # another test of this process may have announced it
    pretend(monkeypatch, "cuda", 1)
    assert launch(_backend_seen_by_rank, 2, timeout=60) == [("gloo", "cpu", 2)] * 2
    err = capfd.readouterr().err
    assert "2 local ranks but 1 cuda device" in err and "--num_processes 1" in err, err
    launch(_backend_seen_by_rank, 2, timeout=60)
    assert "cuda device" not in capfd.readouterr().err, "said once per world size, not at every launch"


def test_the_fall_back_notice_can_be_silenced_for_nbval(monkeypatch, capfd):
    """gpu-check's nbval row on a 1-GPU machine sets COURSE_FALLBACK_NOTICE=0: the stored outputs were
    made without a GPU and have no such line. The ranks still fall back."""
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.setenv("COURSE_FALLBACK_NOTICE", "0")
    launch.__globals__["_ANNOUNCED"].discard(2)
    pretend(monkeypatch, "cuda", 1)
    assert launch(_backend_seen_by_rank, 2, timeout=60) == [("gloo", "cpu", 2)] * 2
    assert "cuda device" not in capfd.readouterr().err


def test_launch_refuses_a_forced_backend_before_starting_ranks(monkeypatch):
    pretend(monkeypatch, "cuda", 1)
    monkeypatch.setenv("COURSE_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match="COURSE_BACKEND=nccl needs one cuda device per local rank"):
        launch(_backend_seen_by_rank, 4, timeout=60)


def test_a_cpu_only_launch_prints_nothing(monkeypatch, capfd):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    launch(_backend_seen_by_rank, 2, timeout=60)
    assert capfd.readouterr().err == "", "lectures' stored outputs must not show the device choice on a CPU machine"


def test_an_older_torch_is_refused_at_import_naming_the_pin():
    """torch before 2.13 lacks the flat collectives' new names: importing course_lib.dist says so (a rank's
    AttributeError, deep inside ZeRO, would not)."""
    code = "import torch.distributed as d; del d.reduce_scatter_single; import course_lib.dist"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "course_lib needs torch 2.13" in out.stderr, out.stderr[-2000:]
