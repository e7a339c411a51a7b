"""Lab 10's checks can fail: each catches a planted bug in a copy of the reference solution.

tests/labs/test_labs.py proves that the solution scores full marks and the starter only the setup point. Here
each case copies solutions/lab10_capstone/capstone.py, plants one mistake a learner makes when composing
DP × TP × PP or predicting its cost, and requires the check of that task to fail — and a check that
does not depend on that code to pass. Every graded check appears in some case's "must fail" set
(test_every_check_catches_a_planted_bug). Last, the lab's run.py under ``accelerate launch`` at 8 ranks.

Two classes the graders used to miss: refusals whose cases broke several rules at once (so a missing
rule went unseen: now each case breaks exactly one, proven below by rules written here independently,
and a planted bug drops each rule), and averages over the world instead of the data-parallel group.
"""

from pathlib import Path

import pytest
from planted_bugs import grade_planted_bug

from course_lib.grading.labs import lab10_capstone as lab10

pytestmark = pytest.mark.slow  # planted bugs: each mistake graded in a copy of the reference solution

SOLUTION = Path(__file__).resolve().parents[2] / "solutions" / "lab10_capstone" / "capstone.py"

BUGS = {  # name: ([(what the solution says, what the bug says)], checks that must fail, checks that must pass)
    "dp_innermost_instead_of_tp": (  # a consistent mesh, so training still equals one process: the layout is wrong
        [
            (
                "    t = rank % layout.tp\n    s = rank // layout.tp % layout.pp\n    d = rank // (layout.tp * layout.pp)\n",
                "    d = rank % layout.dp\n    s = rank // layout.dp % layout.pp\n    t = rank // (layout.dp * layout.pp)\n",
            )
        ],
        {lab10.check_coordinates},
        {lab10.check_build, lab10.check_refusals},
    ),
    "batch_check_forgets_the_micro_batches": (
        [("    if global_batch % (layout.dp * layout.m):", "    if global_batch % layout.dp:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "output_layer_left_dense": (  # full-vocabulary logits handed to the vocab-parallel loss
        [("        stage.output = ColumnParallelLinear.from_dense(stage.output, tp)\n", "        pass\n")],
        {lab10.check_build},
        {lab10.check_coordinates},
    ),
    "heads_check_forgets_the_kv_heads": (  # tp=4 divides the 4 attention heads, not the 2 K/V heads
        [("    if cfg.n_heads % layout.tp or cfg.n_kv_heads % layout.tp or ", "    if cfg.n_heads % layout.tp or ")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "heads_check_forgets_the_vocabulary": (
        [(" or cfg.vocab_size % layout.tp or cfg.d_ff % layout.tp:", " or cfg.d_ff % layout.tp:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "heads_check_forgets_d_ff": (
        [(" or cfg.vocab_size % layout.tp or cfg.d_ff % layout.tp:", " or cfg.vocab_size % layout.tp:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "blocks_check_counts_instead_of_dividing": (  # pp=3 for 4 blocks passes "at least one block a stage"
        [("    if cfg.n_layers % layout.pp:", "    if layout.pp > cfg.n_layers:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "batch_check_divides_by_dp_and_m_separately": (  # dp=4, m=4 each divide 8; dp·m = 16 does not
        [
            (
                "    if global_batch % (layout.dp * layout.m):",
                "    if global_batch % layout.dp or global_batch % layout.m:",
            )
        ],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "tied_embeddings_refused_on_one_stage_too": (
        [("    if cfg.tie_embeddings and layout.pp > 1:", "    if cfg.tie_embeddings:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "tied_embeddings_rule_forgotten": (
        [("    if cfg.tie_embeddings and layout.pp > 1:", "    if False:")],
        {lab10.check_refusals},
        {lab10.check_coordinates},
    ),
    "loss_averaged_by_the_world_size": (  # the dp all-reduce is right; the mean divides by all 8 ranks
        [("        loss /= ly.dp\n", "        loss /= dist.get_world_size()\n")],
        {lab10.check_training},
        {lab10.check_refusals},
    ),
    "every_replica_takes_the_first_rows": (
        [
            (
                "    x, y = tokens[d * rows : (d + 1) * rows], targets[d * rows : (d + 1) * rows]",
                "    x, y = tokens[:rows], targets[:rows]",
            )
        ],
        {lab10.check_training},
        {lab10.check_coordinates},
    ),
    "dp_gradients_summed_not_averaged": (
        [("        flat /= ly.dp\n", "")],
        {lab10.check_training},
        {lab10.check_refusals},
    ),
    "loss_summed_over_micro_batches": (
        [
            (
                "    loss = torch.tensor(sum(result.losses.values()) / ly.m, device=device)",
                "    loss = torch.tensor(sum(result.losses.values()), device=device)",
            )
        ],
        {lab10.check_training},
        {lab10.check_coordinates},
    ),
    "traffic_gives_the_last_stage_a_forward_send": (
        [("    p2p = ly.m * ((not last) + (not first))", "    p2p = ly.m * (1 + (not first))")],
        {lab10.check_traffic},
        {lab10.check_refusals},
    ),
    "cost_model_without_the_bubble": (
        [("        seconds = (ly.m + ly.pp - 1) / ly.m * flops", "        seconds = flops")],
        {lab10.check_pick},
        {lab10.check_coordinates},
    ),
    "pick_takes_a_layout_that_cannot_run": (
        [("            check_layout(layout, cfg, global_batch)\n", "            pass\n")],
        {lab10.check_pick},
        {lab10.check_refusals},
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_costs_its_task(bug, tmp_path):
    grade_planted_bug(bug, BUGS, SOLUTION, lab10, tmp_path)


def test_every_check_catches_a_planted_bug():
    caught = set().union(*(must_fail for _, must_fail, _ in BUGS.values()))
    graded = {task.check for task in lab10.TASKS if not task.setup}
    missing = sorted(c.__name__ for c in graded - caught)
    assert not missing, f"no planted bug shows that these checks can fail: {missing}"


# check_layout's rules, written here from the README (not from the solution), to prove the grader's cases
RULES = {
    "heads": lambda ly, c: any(n % ly.tp for n in (c.n_heads, c.n_kv_heads, c.vocab_size, c.d_ff)),
    "blocks": lambda ly, c: c.n_layers % ly.pp != 0,
    "batch": lambda ly, c: lab10.G % (ly.dp * ly.m) != 0,
    "tied": lambda ly, c: c.tie_embeddings and ly.pp > 1,
}
HEADS = {"kv heads": lambda ly, c: c.n_kv_heads % ly.tp, "vocabulary": lambda ly, c: c.vocab_size % ly.tp}
HEADS["d_ff"] = lambda ly, c: c.d_ff % ly.tp


def test_each_refusal_breaks_exactly_one_rule():
    """A case that breaks two rules is refused by either: the one a learner forgot goes unseen."""
    for layout, cfg, words, what in lab10._refusals():
        broken = [name for name, rule in RULES.items() if rule(layout, cfg)]
        assert len(broken) == 1, f"{what}: breaks {broken}, should break exactly one rule"
        assert broken[0] in words, f"{what}: breaks the {broken[0]} rule; the grader wants {words}"
        if broken == ["heads"]:  # within the tp rule, one divisibility alone (n_heads: K/V heads divide it)
            parts = [name for name, rule in HEADS.items() if rule(layout, cfg)]
            assert len(parts) == 1, f"{what}: tp fails to divide {parts}, should fail one"
    for layout, tied in lab10.ACCEPTED:
        cfg = lab10._cfg_with(tie_embeddings=tied)
        assert not any(rule(layout, cfg) for rule in RULES.values()), f"{layout} breaks a rule"


def test_run_py_trains_like_one_process_under_accelerate_launch(accelerate_launch):
    """The lab's entry point, as its README runs it, at a layout the grader does not train (1×2×4, m=4)."""
    out = accelerate_launch(
        "solutions/lab10_capstone/run.py", "--dp", 1, "--tp", 2, "--pp", 4, "--m", 4, num_processes=8, timeout=300
    ).stdout
    assert "dp=1 tp=2 pp=4 m=4 on 8 ranks, backend gloo" in out, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith("equal within 1e-05: True") for line in steps), steps
    assert "final parameters equal one process's within 1e-06 on every rank: True" in out, out
    assert "every rank's traffic equals traffic(): True" in out, out
    assert "pick on 2-core CPU, gloo: dp=8 tp=1 pp=1 m=1" in out, out
    assert "pick on 2 nodes × 4 GPUs, 1 Gb/s: dp=2 tp=1 pp=4 m=4" in out, out
