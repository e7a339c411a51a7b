"""Distillation (course_lib.optim.distill) against hand computation; merging (course_lib.model.merge) on the course language."""

import math

import pytest
import torch

from course_lib.experiments import small_run
from course_lib.experiments.lecture05 import merging_runs
from course_lib.model import configs
from course_lib.model.merge import add_task_vectors, average_weights, task_vector
from course_lib.model.transformer import Transformer
from course_lib.optim.distill import distillation_loss, soft_target_loss

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
# Merging: a soup of one task, task arithmetic over two (course_lib.experiments.lecture05.merging_runs)
# ------------------------------------------------------------------------------------------------------


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


def test_the_two_tasks_edit_disjoint_halves_of_the_pretraining_language():
    langs = merging_runs.task_languages()
    p, a, b, ab = (langs[k].transition_probs for k in ("P", "A", "B", "AB"))
    first_half = torch.arange(p.shape[0]) % 8 < 4

    def same(x, y):  # from_transitions renormalises each row in float64: equal up to an ulp or two
        return torch.allclose(x, y, rtol=1e-12, atol=1e-15)

    assert same(a[~first_half], p[~first_half]) and not same(a[first_half], p[first_half])
    assert same(b[first_half], p[first_half]) and not same(b[~first_half], p[~first_half])
    assert same(ab[first_half], a[first_half]) and same(ab[~first_half], b[~first_half])


@pytest.fixture(scope="module")
def merging(one_thread):
    """The lecture's study (~10 s on one thread): the recipe's runs, evaluated on held-out windows."""
    return merging_runs.merging_study()


@pytest.mark.slow
def test_merging_claims_of_lecture_05(merging):
    loss, langs = merging["loss"], merging_runs.task_languages()
    # Measured (1 thread, AVX-512 and ATEN_CPU_CAPABILITY=default alike to 1e-3): base on P 0.918; fine-tunes
    # on their task 0.83-0.85; soup A+A' on A 0.864; two inits averaged on P 1.870; on AB: A 2.47, B 2.36,
    # task arithmetic λ=0.7 1.54, trained on AB 0.85. Margins: half or more of each measured gap.
    assert small_run.final_loss(merging["pretrain"]) < langs["P"].conditional_entropy(1), "the base learned P"
    for task in ("A", "A'", "B"):
        language = langs[task.rstrip("'")]
        assert loss[task][task.rstrip("'")] < language.conditional_entropy(1), (
            f"fine-tune {task} ends at {loss[task][task.rstrip(chr(39))]:.3f} on its own task, not below its bigram "
            f"floor {language.conditional_entropy(1):.3f}: the fine-tunes must learn their task's context"
        )
    soup, tunes = loss["soup A+A'"]["A"], (loss["A"]["A"], loss["A'"]["A"])
    assert soup < min(tunes) + 0.1, (
        f"the soup of two fine-tunes on A scores {soup:.3f} on A against their {tunes[0]:.3f} and {tunes[1]:.3f}: "
        "fine-tunes of one base share a basin, so their average should stay with them (look at average_weights)"
    )
    assert loss["average of two inits"]["P"] > loss["base"]["P"] + 0.5, (
        "averaging two independently initialised models should lose: they share no basin (the negative control)"
    )
    merged = loss["task arithmetic λ=0.7"]["AB"]
    assert merged < min(loss["A"]["AB"], loss["B"]["AB"]) - 0.5, (
        f"task arithmetic scores {merged:.3f} on AB, not clearly better than either fine-tune "
        f"({loss['A']['AB']:.3f}, {loss['B']['AB']:.3f}): look at add_task_vectors and the task vectors' base"
    )
    assert merged > loss["trained on AB"]["AB"] + 0.4, "the merge should fall short of a fine-tune on AB itself"


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
