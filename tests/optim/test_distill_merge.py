"""Distillation (course_lib.optim.distill) against hand computation; merging (course_lib.model.merge) on the course language."""

import copy
import math

import pytest
import torch

from course_lib.data import MarkovLanguage, make_dataset
from course_lib.model import configs
from course_lib.model.merge import add_task_vectors, average_weights, task_vector
from course_lib.model.transformer import Transformer
from course_lib.optim.distill import distillation_loss, soft_target_loss
from course_lib.optim.optimizers import AdamW

# one thread for the whole module: see one_thread in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------------
# Knowledge distillation
# ------------------------------------------------------------------------------------------------------

STUDENT = [[1.0, -0.5, 0.25], [0.0, 2.0, -1.0]]
TEACHER = [[2.0, 0.0, -1.0], [0.5, 0.5, 1.5]]
LABELS = [0, 2]


def _softmax(row, t):
    exps = [math.exp(z / t) for z in row]
    return [e / sum(exps) for e in exps]


def test_kd_loss_equals_hand_computation():
    t, w = 2.0, 0.3
    kl = 0.0
    for zs, zt in zip(STUDENT, TEACHER):
        ps, pt = _softmax(zs, t), _softmax(zt, t)
        kl += sum(q * math.log(q / p) for q, p in zip(pt, ps))
    kl /= len(STUDENT)
    ce = -sum(math.log(_softmax(zs, 1.0)[y]) for zs, y in zip(STUDENT, LABELS)) / len(STUDENT)
    expected = w * t * t * kl + (1 - w) * ce
    got = distillation_loss(
        torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(LABELS), temperature=t, soft_weight=w
    )
    assert math.isclose(got.item(), expected, rel_tol=1e-6), (
        f"distillation_loss = {got.item():.7f}, hand computation w·T²·KL(p_t‖p_s) + (1−w)·CE = {expected:.7f}: "
        "check the direction of the KL (teacher first), the T², and the mean over positions"
    )
    assert math.isclose(
        soft_target_loss(torch.tensor(STUDENT), torch.tensor(TEACHER), t).item(), t * t * kl, rel_tol=1e-6
    )


def test_kd_gradient_is_temperature_times_prob_difference():
    """∂(T²·KL)/∂z_s = T·(p_s − p_t) / N  (Hinton et al. 2015, §2.1, times the T² of the loss)."""
    t = 4.0
    student = torch.tensor(STUDENT, requires_grad=True)
    soft_target_loss(student, torch.tensor(TEACHER), t).backward()
    expected = torch.tensor(
        [[t * (ps - pt) / 2 for ps, pt in zip(_softmax(zs, t), _softmax(zt, t))] for zs, zt in zip(STUDENT, TEACHER)]
    )
    torch.testing.assert_close(student.grad, expected, rtol=1e-5, atol=1e-7)


def test_kd_gradient_vanishes_when_student_equals_teacher():
    teacher = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))
    for student_logits in (teacher.clone(), teacher + 3.0):  # a constant per row does not change softmax
        student = student_logits.requires_grad_()
        loss = soft_target_loss(student, teacher, temperature=2.0)
        loss.backward()
        # fp32: the softmaxes sum to 1 only within ~1e-7, so the gradient is ~1e-9, not exactly 0
        assert loss.abs().item() < 1e-6 and student.grad.abs().max().item() < 1e-7, (
            f"student = teacher (+ const): loss {loss.item():.2e}, max |grad| {student.grad.abs().max().item():.2e}; "
            "both must vanish: the soft targets are matched"
        )
    different = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    soft_target_loss(different, teacher).backward()
    assert different.grad.abs().max().item() > 1e-4, "a different student must get a gradient: the check could fail"


# ------------------------------------------------------------------------------------------------------
# Merging two fine-tunes of one base
# ------------------------------------------------------------------------------------------------------

LANG = MarkovLanguage()
SEQ, BATCH = 64, 16


def _train(model, data_seed, steps, lr):
    ds = make_dataset(LANG, BATCH * SEQ * steps + 1, SEQ, seed=data_seed)
    opt = AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for x, y in ds.batches(BATCH, shuffle=False):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    return model


@torch.no_grad()
def _val_loss(model):
    ds = make_dataset(LANG, 32 * SEQ + 1, SEQ, seed=99)
    return model.loss(ds.inputs, ds.targets).item()


def _with(state_dict):
    model = Transformer(configs.get("tiny"))
    model.load_state_dict(state_dict)
    return model


def test_average_is_the_elementwise_mean_and_task_vectors_add_back():
    torch.manual_seed(0)
    a, b = Transformer(configs.get("tiny")).state_dict(), Transformer(configs.get("tiny")).state_dict()
    avg = average_weights([a, b])
    for name in a:
        # 0.5·a + 0.5·b rounds once, exactly like (a + b)/2 (halving is exact in binary): bit-equal
        assert torch.equal(avg[name], (a[name] + b[name]) / 2), f"{name}: the uniform average is not the mean"
    tau = task_vector(b, a)
    back = add_task_vectors(a, [tau])
    for name in a:  # a + (b − a) = b up to one rounding of each operation
        torch.testing.assert_close(back[name], b[name], rtol=0, atol=1e-6)


def test_averaging_two_finetunes_of_one_base_keeps_their_loss():
    torch.manual_seed(0)
    base = _train(Transformer(configs.get("tiny")), data_seed=1, steps=60, lr=3e-3)
    ft_a = _train(copy.deepcopy(base), data_seed=2, steps=25, lr=2e-3)
    ft_b = _train(copy.deepcopy(base), data_seed=3, steps=25, lr=2e-3)
    soup = _with(average_weights([ft_a.state_dict(), ft_b.state_dict()]))
    arithmetic = _with(
        add_task_vectors(
            base.state_dict(), [task_vector(m.state_dict(), base.state_dict()) for m in (ft_a, ft_b)], scale=0.5
        )
    )
    losses = {name: _val_loss(m) for name, m in [("base", base), ("a", ft_a), ("b", ft_b), ("soup", soup)]}
    assert abs(_val_loss(arithmetic) - losses["soup"]) < 1e-4, "θ_base + ½(τ_a + τ_b) is the uniform soup"
    # Measured (tiny, fp32, 1 thread): base 2.744, fine-tunes 2.708 and 2.712, soup 2.707 (below both);
    # margins ~10x any kernel-rounding effect (~1e-4) yet far below what a broken merge does (> 0.05).
    margin = 0.02
    assert losses["soup"] < min(losses["a"], losses["b"]) + margin, (
        f"validation losses {losses}: the average of two fine-tunes of one base should stay within {margin} nats "
        "of each (they lie in one basin of the loss)"
    )
    assert losses["soup"] < losses["base"] - margin, (
        f"validation losses {losses}: the soup should keep the fine-tunes' gain over the base"
    )


# ------------------------------------------------------------------------------------------------------
# Distilling the course's tiny model into a smaller one (course_lib.experiments.lecture05.distillation_run)
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distilled(one_thread):
    """Teacher: tiny (107k parameters), 800 steps; students: d_model 32, one layer (26k), 400 steps each
    from the same initial weights on the same batches. ~10 s on one thread, ~20 s under ATEN_CPU_CAPABILITY=default
    (measured on the shared 2-core machine)."""
    from course_lib.experiments.lecture05.distillation_run import distill

    return distill()


@pytest.mark.slow
def test_distilled_student_is_closer_to_its_teacher_than_the_ce_student(distilled):
    r = distilled
    kd, ce = r["kd"]["kl_to_teacher"], r["ce"]["kl_to_teacher"]
    # Measured KL(p_t‖p_s), KD vs CE student: 0.061 vs 0.412 (AVX2 kernels), 0.043 vs 0.410 (scalar kernels);
    # with seed=1, 0.283 vs 0.465 and 0.157 vs 0.456. The run-to-run spread is *when* the small student leaves
    # the bigram plateau (~2.67), which kernel rounding shifts by tens of steps. The KD student minimises this
    # KL directly, the CE student only through one-sample labels; 0.75 holds in all four runs (worst 0.61),
    # while a KD loss that ignored the teacher (a CE student in disguise) would give a ratio ≈ 1.
    assert kd < 0.75 * ce, (
        f"KL to the teacher: KD student {kd:.3f}, CE student {ce:.3f}; the soft targets should pull the KD "
        "student clearly closer (check the direction of the KL and that the teacher's logits are used)"
    )


@pytest.mark.slow
def test_losses_against_the_entropy_rate(distilled):
    r = distilled
    floor, uniform = r["loss_floor"], r["uniform"]
    assert r["entropy_rate"] < floor < uniform
    for name in ("teacher", "kd", "ce"):
        ce, se = r[name]["val_ce"], r[name]["val_ce_se"]
        # No model beats the source's floor in expectation; 4 standard errors of the validation mean
        # (se ≈ 0.02 for 2048 tokens, measured) allow for the sample, and nothing more.
        assert ce > floor - 4 * se, f"{name}: validation loss {ce:.3f} below the floor {floor:.3f}: a leak?"
        assert ce < uniform, f"{name}: validation loss {ce:.3f} no better than uniform over 16 symbols"
    teacher, kd, plain = r["teacher"]["val_ce"], r["kd"]["val_ce"], r["ce"]["val_ce"]
    # Measured (teacher, KD, CE): 2.050, 2.100, 2.355 (AVX2) and 2.079, 2.096, 2.384 (scalar), floor 1.897; with
    # seed=1 the gap was 0.095 and 0.234. The KD student also predicts the *language* better: the margin 0.05 is
    # ~2.5 standard errors of one validation mean (se ≈ 0.02; both students are scored on the same windows, so
    # their difference is less noisy still) and half the smallest gap measured.
    assert kd < plain - 0.05, f"validation loss: KD student {kd:.3f}, CE student {plain:.3f} (teacher {teacher:.3f})"
    assert r["params"]["student"] < r["params"]["teacher"] / 3, "the student must be much smaller than the teacher"
