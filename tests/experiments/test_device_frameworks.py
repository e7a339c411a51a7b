"""The frameworks beside course_lib compute where the course's ranks do (issue 28).

One rule (course_lib/experiments/third_party.py, ``framework_devices``): the course's ``device()`` and
``backend()`` decide, and DeepSpeed (``DS_ACCELERATOR``), accelerate (its process-group backend),
Lightning Fabric (``accelerator=``) and Megatron-Core (CPU initialisation or not) are told the same.
Left alone, DeepSpeed picks CUDA whenever a GPU is visible, even where the course keeps its ranks on
the CPU. These checks run on a CPU with pretend devices: no DeepSpeed is started.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from course_lib.experiments import third_party
from course_lib.experiments.third_party import framework_devices

LAB_SCRIPT = Path(__file__).resolve().parents[2] / "solutions" / "lab03_zero" / "train_deepspeed.py"


def _lab():
    spec = importlib.util.spec_from_file_location("train_deepspeed_under_test", LAB_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_ranks_over_gloo_tell_every_framework_cpu():
    rule = framework_devices("cpu", "gloo")
    assert (rule.device, rule.backend) == (torch.device("cpu"), "gloo")
    assert (rule.deepspeed, rule.fabric, rule.megatron_cpu_init) == ("cpu", "cpu", True)


def test_a_gpu_per_rank_over_nccl_tells_every_framework_cuda():
    rule = framework_devices(torch.device("cuda", 1), "nccl")
    assert rule.device == torch.device("cuda", 1), "the rank's own GPU, as course_lib.dist.device() names it"
    assert (rule.backend, rule.deepspeed, rule.fabric, rule.megatron_cpu_init) == ("nccl", "cuda", "cuda", False)


@pytest.mark.parametrize(("on", "backend"), [("cpu", "nccl"), ("cuda:0", "gloo")])
def test_a_device_and_backend_that_disagree_are_refused(on, backend):
    with pytest.raises(ValueError, match="pairs the CPU with gloo"):
        framework_devices(on, backend)


def test_the_default_is_the_course_choice_on_this_machine(monkeypatch):
    monkeypatch.setattr(third_party, "device", lambda: torch.device("cuda", 3))
    monkeypatch.setattr(third_party, "backend", lambda: "nccl")
    assert framework_devices() == framework_devices(torch.device("cuda", 3), "nccl")
    monkeypatch.undo()
    assert framework_devices().device.type in ("cpu", "cuda")


@pytest.mark.parametrize(("on", "backend"), [("cpu", "gloo"), ("cuda:0", "nccl"), ("cuda:3", "nccl")])
def test_the_lab_script_applies_the_same_rule(on, backend):
    assert _lab().deepspeed_accelerator(torch.device(on)) == framework_devices(on, backend).deepspeed


def test_the_lab_script_sets_ds_accelerator_from_the_course_device(monkeypatch):
    lab = _lab()
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(lab, "device", lambda: torch.device("cpu"))
    assert lab.use_course_device() == torch.device("cpu")
    assert os.environ["DS_ACCELERATOR"] == "cpu"


def test_the_lab_script_refuses_a_ds_accelerator_that_disagrees(monkeypatch):
    lab = _lab()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # DeepSpeed's own guess on a GPU machine
    monkeypatch.setattr(lab, "device", lambda: torch.device("cpu"))  # the course kept its ranks on the CPU
    monkeypatch.setattr(lab, "backend", lambda: "gloo")
    with pytest.raises(RuntimeError, match="unset DS_ACCELERATOR or set it to 'cpu'"):
        lab.use_course_device()


def test_an_engine_on_another_device_is_caught():
    lab = _lab()

    class Engine:
        device = torch.device("cuda", 1)  # DeepSpeed's choice for local rank 1 when left to guess

    with pytest.raises(RuntimeError, match="the course's device is cpu"):
        lab.check_engine_device(Engine(), torch.device("cpu"))
    Engine.device = torch.device("cpu")
    lab.check_engine_device(Engine(), torch.device("cpu"))
