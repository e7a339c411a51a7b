"""The lectures' exercises, both ways: the notebook's placeholder fails its check with a hint, the
reference answer (solutions/lectures/answers.py) passes it.

nbval executes every lecture with COURSE_REFERENCE_ANSWERS=1 (root conftest.py), which proves the
notebooks' check cells pass with the reference; here the exercise cell itself is run as a learner
first sees it, without that flag, and its answer must fail the same check.
"""

import json
from pathlib import Path

import pytest

from course_lib.cost.collective_bytes import ring_comm_bytes
from course_lib.experiments.lecture02.tp_collectives import tp_step_collectives
from course_lib.grading import exercises
from course_lib.model import configs

LECTURES = Path(__file__).resolve().parents[2] / "lectures"
RING = dict(B=2, S=64, HKV=4, D=16, N=4)  # lecture 03's miniature (§2.2)


@pytest.fixture(scope="module")
def tp_counted():
    """What the counter sees in one TP step at t = 2 (lecture 02 measures the same)."""
    return {n: tp_step_collectives(n)[:3] for n in (1, 3)}


def _run_check(name: str, ns: dict, tp_counted) -> str:
    if name == "my_adamw_step":
        return exercises.check_adamw_step(ns[name])
    if name == "model_state_gb":
        return exercises.check_model_state_gb(ns[name], ns["lowest_stage_that_fits_70b"])
    if name == "predict_tp_step":
        return exercises.check_tp_step_prediction(ns[name], tp_counted, configs.get("tiny").d_model)
    if name == "kv_cache_bytes":
        return exercises.check_kv_cache_bytes(ns[name])
    if name == "lora_trainable_params":
        return exercises.check_lora_trainable_params(ns[name])
    if name == "paged_waste_slots":
        return exercises.check_paged_waste_slots(ns[name])
    if name == "compute_bound_tokens":
        return exercises.check_compute_bound_tokens(ns[name])
    if name == "checkpoint_plan":
        return exercises.check_checkpoint_plan(ns[name])
    if name == "best_tp_scheme":
        return exercises.check_best_tp_scheme(ns[name])
    if name == "valid_layouts":
        return exercises.check_valid_layouts(ns[name])
    # ring_comm_bytes equals what the counter measures: tests/parallel/context/test_ring_attention.py and lecture 03 §2.5
    sent = ring_comm_bytes(RING["B"], RING["S"], RING["HKV"], RING["D"], RING["N"])["backward_bytes"]
    return exercises.check_ring_backward_bytes(ns[name], sent, *RING.values())


EXERCISES = [
    ("01_foundations.ipynb", "my_adamw_step"),
    ("02_data_and_tensor_parallelism.ipynb", "model_state_gb"),
    ("02_data_and_tensor_parallelism.ipynb", "predict_tp_step"),
    ("03_pipeline_sequence_expert_parallelism.ipynb", "ring_backward_bytes"),
    ("04_frontier_architectures.ipynb", "kv_cache_bytes"),
    ("05_frontier_training_optimizations.ipynb", "lora_trainable_params"),
    ("06_memory_kv_cache_and_checkpointing.ipynb", "paged_waste_slots"),
    ("07_hardware_landscape_and_domestic_accelerators.ipynb", "compute_bound_tokens"),
    ("08b_failures_checkpoints_reproducibility.ipynb", "checkpoint_plan"),
    ("09_frameworks_and_toolchains.ipynb", "best_tp_scheme"),
    ("10_capstone_and_outlook.ipynb", "valid_layouts"),
]


def _cells(notebook: str) -> list[str]:
    nb = json.loads((LECTURES / notebook).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _exercise_cell(notebook: str, name: str) -> tuple[str, str]:
    """The cell that answers ``name`` and the code cell after it (its check)."""
    cells = _cells(notebook)
    found = [i for i, src in enumerate(cells) if f'answer("{name}"' in src]
    assert len(found) == 1, f"{notebook}: expected one exercise cell with answer({name!r}, ...), found {len(found)}"
    return cells[found[0]], cells[found[0] + 1]


def _answer_of(cell: str, reference: bool, monkeypatch) -> dict:
    if reference:
        monkeypatch.setenv(exercises.ENV, "1")
    else:
        monkeypatch.delenv(exercises.ENV, raising=False)
    namespace: dict = {}
    exec(cell, namespace)  # the exercise cell imports what it uses: it runs on its own
    return namespace


@pytest.mark.parametrize(("notebook", "name"), EXERCISES, ids=[n for _, n in EXERCISES])
def test_the_placeholder_fails_its_check_with_a_hint(notebook, name, monkeypatch, tp_counted):
    cell, check_cell = _exercise_cell(notebook, name)
    assert "exercises.check_" in check_cell, f"{notebook}: the cell after {name}'s must run its shared check"
    ns = _answer_of(cell, reference=False, monkeypatch=monkeypatch)
    with pytest.raises(AssertionError, match="not answered yet"):
        _run_check(name, ns, tp_counted)


@pytest.mark.parametrize(("notebook", "name"), EXERCISES, ids=[n for _, n in EXERCISES])
def test_the_reference_answer_passes_its_check(notebook, name, monkeypatch, tp_counted):
    cell, _ = _exercise_cell(notebook, name)
    ns = _answer_of(cell, reference=True, monkeypatch=monkeypatch)
    assert _run_check(name, ns, tp_counted)


def _plan(interval):
    """A checkpoint_plan that picks its interval by ``interval(C, R, M, M_gpu)`` and evaluates the loss there."""

    def checkpoint_plan(n, gpu_mtbf, c, r):
        tau = interval(c, r, gpu_mtbf / n, gpu_mtbf)
        return tau, c / tau + (r + tau / 2) / (gpu_mtbf / n)

    return checkpoint_plan


def test_a_wrong_answer_fails_with_what_to_look_at(tp_counted):
    def coupled_decay(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay):
        g = g + weight_decay * p  # Adam + L2, not AdamW
        m.mul_(beta1).add_((1 - beta1) * g)
        v.mul_(beta2).add_((1 - beta2) * g * g)
        p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))

    with pytest.raises(AssertionError, match="decoupled"):
        exercises.check_adamw_step(coupled_decay)
    with pytest.raises(AssertionError, match="how many hops"):
        exercises.check_ring_backward_bytes(
            lambda B, S, HKV, D, N, kv: 2 * (N - 1) * B * HKV * (S // N) * D * kv, 114688, *RING.values()
        )  # the gradients' hops left out
    with pytest.raises(AssertionError, match="which precision"):  # dK, dV in the K/V precision, not fp32
        exercises.check_ring_backward_bytes(
            lambda B, S, HKV, D, N, kv: (4 * N - 2) * B * HKV * (S // N) * D * kv, 114688, *RING.values()
        )
    with pytest.raises(AssertionError, match="switched off"):  # the library's formula is not an answer
        exercises.check_ring_backward_bytes(
            lambda B, S, HKV, D, N, kv: ring_comm_bytes(B, S, HKV, D, N, kv)["backward_bytes"], 114688, *RING.values()
        )
    with pytest.raises(AssertionError, match="switched off"):
        exercises.check_model_state_gb(
            lambda psi, n, stage: (
                __import__("course_lib.cost.memory").cost.memory.zero_model_state_bytes(psi, n, stage) / 1e9
            ),
            3,
        )

    def library_adamw(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay):
        from course_lib.optim.optimizers import adamw_

        adamw_(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay)

    with pytest.raises(AssertionError, match="switched off"):
        exercises.check_adamw_step(library_adamw)
    from course_lib.cost.memory import zero_model_state_bytes

    assert zero_model_state_bytes(8, 2, 3) == 64, "the forbidden function works again after the check"
    with pytest.raises(AssertionError, match="the 'sliding' ones only the last"):  # no window: every layer grows
        exercises.check_kv_cache_bytes(lambda cfg, L: 2 * cfg.n_kv_heads * cfg.head_dim * 2 * cfg.n_layers * L)
    with pytest.raises(AssertionError, match="Derive the count"):  # the library's count is not an answer
        exercises.check_kv_cache_bytes(lambda cfg, L: cfg.kv_cache_bytes(L, 2))
    with pytest.raises(AssertionError, match="512-token window"):  # the window typed in as gpt-oss's 128
        exercises.check_kv_cache_bytes(
            lambda cfg, L: (
                4 * cfg.n_kv_heads * cfg.head_dim * sum(L if t == "full" else min(L, 128) for t in cfg.layer_types)
            )
        )
    with pytest.raises(AssertionError, match="wk and wv map d_model"):  # every projection d_model wide
        exercises.check_lora_trainable_params(lambda cfg, t, r: cfg.n_layers * len(t) * 2 * r * cfg.d_model)
    with pytest.raises(AssertionError, match="wk and wv map d_model"):  # one layer only
        exercises.check_lora_trainable_params(
            lambda cfg, t, r: sum(
                r * (cfg.d_model + (cfg.n_heads if n in ("wq", "wo") else cfg.n_kv_heads) * cfg.head_dim) for n in t
            )
        )
    with pytest.raises(AssertionError, match="whole blocks"):  # one block too many per sequence
        exercises.check_paged_waste_slots(lambda lengths, b: sum((n // b + 1) * b - n for n in lengths))
    with pytest.raises(AssertionError, match="grid exists"):  # always the 3D grid, whatever p
        exercises.check_best_tp_scheme(lambda b, h, n, p: "3d")
    with pytest.raises(AssertionError, match="set its derivative to zero"):  # forgot the factor 2
        exercises.check_checkpoint_plan(_plan(lambda c, r, m, gpu: (c * m) ** 0.5))
    with pytest.raises(AssertionError, match="any of the n GPUs"):  # one GPU's MTBF for the cluster's
        exercises.check_checkpoint_plan(_plan(lambda c, r, m, gpu: (2 * c * gpu) ** 0.5))
    with pytest.raises(AssertionError, match="does not move the optimum"):  # the restart counted as a checkpoint
        exercises.check_checkpoint_plan(_plan(lambda c, r, m, gpu: (2 * (c + r) * m) ** 0.5))
    with pytest.raises(AssertionError, match="add R/M"):  # the right interval, the restart left out of the loss
        exercises.check_checkpoint_plan(lambda n, g, c, r: ((2 * c * g / n) ** 0.5, (2 * c * n / g) ** 0.5))
    with pytest.raises(AssertionError, match="find the first m"):  # the m >> k, n limit: 2m/b = ridge
        exercises.check_compute_bound_tokens(lambda k, n, b, peak, bw: int(peak / bw * b / 2))
    with pytest.raises(AssertionError, match="tp must divide the heads, the key/value heads"):  # kv heads forgotten
        exercises.check_valid_layouts(
            lambda cfg, world, batch, m: {
                (dp, tp, world // (dp * tp))
                for dp in range(1, world + 1)
                for tp in range(1, world + 1)
                if world % (dp * tp) == 0 and cfg.n_heads % tp == 0 and world // (dp * tp) <= cfg.n_layers
                if batch % (dp * m) == 0 and not (cfg.tie_embeddings and world // (dp * tp) > 1)
            }
        )
    with pytest.raises(AssertionError, match="Walk the model"):
        exercises.check_tp_step_prediction(lambda n, b, s, d: (0, 0, 0), tp_counted, 64)
