"""Lecture 09's side-by-sides, asserted: each framework beside course_lib on the same model, data and seed.

DeepSpeed ZeRO-2 under `accelerate launch`, torch's FSDP2 and Lightning Fabric's DDP run for real on 2
gloo ranks (course_lib.experiments.lecture09); the configuration search's claims come from course_lib.cost (the
TP scheme per layer of lecture 09; the planner's search over layouts, which lecture 10 shows).
vLLM, torch.distributed.pipelining and Megatron-Core are checked in test_vllm.py, test_pipeline.py and
test_tensor_parallel.py.
"""

import pytest

from course_lib.cost.collective_bytes import tp_received_elements
from course_lib.cost.memory import zero_model_state_bytes
from course_lib.cost.planner import Cluster, Layout, plan, predict, reasons
from course_lib.experiments.lecture09.deepspeed_vs_zero import deepspeed_versus_zero
from course_lib.experiments.lecture09.fabric_fsdp_vs_course import fabric_versus_ddp, fsdp2_versus_zero3
from course_lib.model import configs

pytestmark = pytest.mark.slow  # DeepSpeed, FSDP2 and Fabric launched beside the course's code


@pytest.mark.launch_heavy  # a framework launched
def test_deepspeed_zero2_under_accelerate_launch_equals_course_zero2_in_loss_and_bytes():
    """Bit-equal losses (both: one 2-term gradient sum, torch's AdamW on the same shards). Bytes per rank in
    fp32: the ZeRO formula 4Ψ + (4 + 8)Ψ/N for course_lib exactly; DeepSpeed holds the same total made of
    other pieces (an fp32 master partition 4Ψ/N instead of a kept gradient shard) plus two 4-byte scalars."""
    ds = deepspeed_versus_zero(stage=2, steps=4)
    assert ds["ranks"] == 2 and ds["distributed_type"] == "DistributedType.DEEPSPEED", ds["stdout"][-2000:]
    assert ds["deepspeed"]["losses"] == ds["course"]["losses"], (
        f"DeepSpeed ZeRO-2 and course ZeRO-2 should agree bit for bit:\n{ds['deepspeed']['losses']}\n"
        f"{ds['course']['losses']}"
    )
    psi, n = ds["n_params"], ds["ranks"]
    formula = zero_model_state_bytes(psi, n, 2, k=8, param_bytes=4, grad_bytes=4)
    for theirs, ours in zip(ds["deepspeed"]["state_bytes"], ds["course"]["state_bytes"], strict=True):
        assert ours == formula, f"course ZeRO-2 holds {ours:,} bytes, the formula says {formula:,.0f}"
        assert theirs["module"] == 4 * psi and theirs["fp32 master partition"] == 4 * psi // n, theirs
        assert theirs["total"] - formula == 8, f"DeepSpeed's census {theirs} vs formula {formula:,.0f}"


@pytest.mark.launch_heavy  # a framework launched
def test_fsdp2_equals_course_zero3():
    result = fsdp2_versus_zero3(steps=3)
    losses = result[0]["losses"]
    assert losses["torch FSDP2"] == losses["course_lib ZeRO-3"], losses
    assert all(r["parameters_bit_equal"] for r in result), "FSDP2 and course ZeRO-3 parameters differ after 3 steps"


@pytest.mark.launch_heavy  # a framework launched
def test_fabric_ddp_equals_course_ddp_and_fabric_refuses_sharded_strategies_on_a_cpu():
    """Fabric's ddp wraps torch's DDP, which course DDP reproduces bucket for bucket: bit-equal. Its fsdp and
    deepspeed strategies refuse accelerator="cpu" (the libraries themselves run on gloo, see above)."""
    result = fabric_versus_ddp(steps=3)
    for r in result:
        assert r["strategy"] == "DDPStrategy" and r["wrapper"] == "DistributedDataParallel" and r["world_size"] == 2
        assert r["losses"]["Fabric ddp"] == r["losses"]["course_lib DDP"], r["losses"]
        assert r["parameters_bit_equal"], "Fabric DDP and course DDP should end with bit-equal parameters"
        assert "only available on GPU" in r["refusals"]["fsdp"], r["refusals"]
        assert "only supported on CUDA GPUs" in r["refusals"]["deepspeed"], r["refusals"]
    assert result[0]["losses"]["Fabric ddp"][-1] < result[0]["losses"]["Fabric ddp"][0], "it should be training"


def test_the_cheapest_tensor_parallel_scheme_depends_on_the_layer_and_the_phase():
    """Lecture 09 §6: for thousands of tokens the 3D grid receives least, at 8 and at 64 devices; for a
    16-token decode step, 1D's all-reduce of the small output wins."""
    mlp = dict(h=8192, n=28672)
    for p, q in ((8, 2), (64, 4)):
        assert q**3 == p
        prefill = {s: tp_received_elements(s, 4096, mlp["h"], mlp["n"], p) for s in ("1d", "3d")}
        decode = {s: tp_received_elements(s, 16, mlp["h"], mlp["n"], p) for s in ("1d", "3d")}
        assert prefill["3d"] < prefill["1d"] / 3, prefill
        assert decode["1d"] < decode["3d"] / 10, decode


def test_the_planner_search_for_llama3_405b_keeps_tp_in_a_node_and_explains_its_refusals():
    llama, h100s, g, s = configs.get("llama-3.1-405b"), Cluster("H100", 16384), 2048, 8192
    fitting = [p for p in plan(llama, h100s, g, s) if p.fits]
    published = predict(llama, h100s, Layout(dp=128, tp=8, pp=16, micro_batch=1, recompute="full"), g, s)
    assert published.fits and fitting[0].step_seconds <= published.step_seconds
    assert any(p.layout == published.layout for p in fitting), "the published layout should be among those that fit"
    assert all(p.layout.tp <= h100s.devices_per_node for p in fitting[:3])
    assert not predict(llama, h100s, Layout(dp=2048, tp=8), g, s).fits
    assert "does not divide" in reasons(llama, h100s, Layout(dp=1024, tp=16), g, s)[0]
    assert "blocks" in reasons(llama, h100s, Layout(dp=8, tp=8, pp=256), g, s)[0]
