"""On-policy distillation (``algorithm.distillation``): the maths with hand-derived numbers, the advantage stage
that applies it, the refusals before Ray starts, and two asynchronous steps of a run with a teacher.

The batch used for the maths: two rows, the second one token shorter, log-probs in binary fractions so every sum
is exact::

    student  row 0: [-1.0,  -2.0, -0.5]        row 1: [-0.25, -3.0, pad]
    teacher  row 0: [-0.5,  -2.5, -0.5]        row 1: [-1.25, -1.0, pad]
    signal = teacher - student (reverse_kl):
             row 0: [ 0.5,  -0.5,  0.0]        row 1: [-1.0,   2.0,  0  ]
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import ray
import torch
from helpers.configs import CPU, QUICKSTART, problems_of

from vlmrl.algos import (
    DistillEstimator,
    DistillMode,
    distillation_metrics,
    distillation_signal,
    distilled_advantages,
    grpo_advantages,
)
from vlmrl.config import AlgorithmConfig, DistillationConfig
from vlmrl.driver.advantage import AdvantageStage
from vlmrl.validate.distillation import tokenizer_difference

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
PAD = float("-inf")  # padding holds -inf on both sides: inf - inf is nan there, and must never be read
STUDENT = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, PAD]], dtype=torch.float64)
TEACHER = torch.tensor([[-0.5, -2.5, -0.5], [-1.25, -1.0, PAD]], dtype=torch.float64)
SIGNAL = [[0.5, -0.5, 0.0], [-1.0, 2.0, 0.0]]
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)


def _close(tensor, expected):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=0)


# --------------------------------------------------------------------------- the maths


def test_the_reverse_kl_signal_is_the_teacher_less_the_student_on_trained_tokens():
    _close(distillation_signal(STUDENT, TEACHER, MASK, DistillEstimator.reverse_kl), SIGNAL)


def test_add_and_replace_give_the_hand_derived_advantages():
    signal = distillation_signal(STUDENT, TEACHER, MASK)
    # add, coef 0.5: A + 0.5 s = [1 + .25, 1 - .25, 1 + 0], [-1 - .5, -1 + 1, (pad) 0].
    _close(distilled_advantages(ADVANTAGES, signal, MASK, 0.5, DistillMode.add), [[1.25, 0.75, 1.0], [-1.5, 0.0, 0.0]])
    # replace, coef 0.5: 0.5 s, whatever A was.
    _close(
        distilled_advantages(ADVANTAGES, signal, MASK, 0.5, DistillMode.replace),
        [[0.25, -0.25, 0.0], [-0.5, 1.0, 0.0]],
    )


def test_the_metrics_average_over_the_trained_tokens():
    signal = distillation_signal(STUDENT, TEACHER, MASK)
    m = distillation_metrics(STUDENT, TEACHER, signal, MASK, coef=0.5)
    # student - teacher on the 5 trained tokens: -0.5, 0.5, 0, 1, -2; sum -1, mean -0.2 (the pad's nan is out).
    assert m["distill/reverse_kl"] == pytest.approx(-0.2, abs=1e-12)
    # coef x signal: 0.5 x (0.5 - 0.5 + 0 - 1 + 2) / 5 = 0.5 x 0.2 = 0.1.
    assert m["distill/signal_mean"] == pytest.approx(0.1, abs=1e-12)


def test_a_student_equal_to_the_teacher_gets_no_signal():
    signal = distillation_signal(TEACHER, TEACHER.clone(), MASK)
    _close(signal, [[0.0] * 3, [0.0] * 3])
    _close(distilled_advantages(ADVANTAGES, signal, MASK, 1.0, DistillMode.add), ADVANTAGES.tolist())
    _close(distilled_advantages(ADVANTAGES, signal, MASK, 1.0, DistillMode.replace), [[0.0] * 3, [0.0] * 3])
    m = distillation_metrics(TEACHER, TEACHER.clone(), signal, MASK, coef=1.0)
    assert m == {"distill/reverse_kl": 0.0, "distill/signal_mean": 0.0}


def test_tokens_outside_the_loss_mask_get_no_signal():
    # A multi-turn row: model turn, tool output (mask 0), model turn. The tool's tokens hold log-probs the
    # teacher and the student disagree on wildly (and a nan); none of it may reach the advantage.
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    student = torch.tensor([[-1.0, -1.0, -9.0, float("nan"), -2.0]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -1.5, -0.1, -0.1, -1.0]], dtype=torch.float64)
    signal = distillation_signal(student, teacher, mask)
    _close(signal, [[0.5, -0.5, 0.0, 0.0, 1.0]])
    advantages = torch.full((1, 5), 3.0, dtype=torch.float64)
    _close(distilled_advantages(advantages, signal, mask, 1.0, DistillMode.add), [[3.5, 2.5, 0.0, 0.0, 4.0]])
    # Off the mask the metric ignores the tool's tokens: (-0.5 + 0.5 - 1) / 3.
    m = distillation_metrics(student, teacher, signal, mask, coef=1.0)
    assert m["distill/reverse_kl"] == pytest.approx(-1 / 3, abs=1e-12)


def test_no_gradient_flows_through_the_teacher_or_the_student_log_probs():
    teacher = TEACHER.clone().requires_grad_(True)
    student = STUDENT.clone().requires_grad_(True)
    signal = distillation_signal(student, teacher, MASK)
    assert not signal.requires_grad
    # A policy-gradient surrogate: -A x log pi over the trained tokens, with A from the teacher's signal.
    policy = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    advantages = distilled_advantages(ADVANTAGES, signal, MASK, 1.0, DistillMode.add)
    (-(advantages * policy)[MASK.bool()].sum()).backward()
    assert teacher.grad is None and student.grad is None
    # The policy's gradient is exactly -A on the trained tokens: the signal is a reward, not a path.
    _close(policy.grad, (-advantages * MASK).tolist())


# --------------------------------------------------------------------------- the advantage stage


class _Batch:
    """What AdvantageStage reads of a batch: scores, mask, groups, and the two log-probs."""

    def __init__(self, teacher):
        # Two prompts x two responses, the outcome reward on the last valid token.
        self.token_level_scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
        self.response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
        self.group_ids = torch.tensor([0, 0, 1, 1])
        self.old_log_probs = torch.full((4, 3), -1.0)
        self.teacher_log_probs = teacher

    def require(self, *names):
        missing = [n for n in names if getattr(self, n, None) is None]
        if missing:
            raise RuntimeError(f"Batch fields {missing} are needed here")

    def __len__(self):
        return 4


def _stage(mode, coef=1.0):
    algo = replace(AlgorithmConfig(), distillation=DistillationConfig(teacher_path="t", coef=coef, mode=mode))
    return AdvantageStage(algo, kl_in_reward=False, distills=True)


def test_the_stage_replaces_the_reward_advantage_with_the_teacher_signal():
    # The teacher gives -0.5 on every token: signal = -0.5 - (-1) = 0.5 where the mask is 1.
    batch = _Batch(torch.full((4, 3), -0.5))
    out = _stage(DistillMode.replace, coef=2.0)(batch)
    torch.testing.assert_close(out.advantages, 1.0 * batch.response_mask)  # 2 x 0.5, the reward's A gone
    assert out.metrics["distill/reverse_kl"] == pytest.approx(-0.5)
    assert out.metrics["distill/signal_mean"] == pytest.approx(1.0)
    # add: GRPO's advantage plus the same 1.0 per trained token.
    grpo, _ = grpo_advantages(batch.token_level_scores, batch.response_mask, batch.group_ids)
    torch.testing.assert_close(_stage(DistillMode.add, coef=2.0)(batch).advantages, grpo + batch.response_mask)


def test_with_coef_0_every_advantage_is_exactly_0_so_nothing_trains_the_example(quickstart_assets):
    """The baseline the end-to-end learning check is measured against, argued instead of run: with
    algorithm.distillation.coef=0 and mode=replace every advantage is exactly 0, whatever the teacher says; and the
    example has nothing else that moves the weights (no KL term, no entropy bonus, no weight decay, no critic),
    so each step's gradient is 0, AdamW's step is 0, and the student's greedy validation stays its step-0 value."""
    from vlmrl.validate import load_config

    wild = torch.tensor([[-9.0, -0.1, -30.0], [-0.01, -5.0, -2.0], [-1.0, -1.0, -1.0], [-7.0, -3.0, -3.0]])
    out = _stage(DistillMode.replace, coef=0.0)(_Batch(wild))
    assert torch.equal(out.advantages.abs(), torch.zeros(4, 3, dtype=out.advantages.dtype)), out.advantages
    assert out.metrics["distill/reverse_kl"] != 0 and out.metrics["distill/signal_mean"] == 0
    config = load_config(["config=examples/distillation.yaml", "algorithm.distillation.coef=0"], CPU)
    assert config.algorithm.distillation.mode is DistillMode.replace and config.algorithm.distillation.coef == 0
    actor = config.worker.actor
    assert config.algorithm.disable_kl and actor.entropy_coeff == 0 and actor.optim.weight_decay == 0
    assert config.algorithm.adv_estimator.value != "gae"  # no critic


def test_the_stage_without_distillation_neither_needs_nor_reads_a_teacher():
    batch = _Batch(None)
    plain = AdvantageStage(AlgorithmConfig(), kl_in_reward=False)(batch)
    assert not any(k.startswith("distill/") for k in plain.metrics)
    with pytest.raises(RuntimeError, match="teacher_log_probs"):  # on, it names the missing pass
        _stage(DistillMode.add)(batch)


# --------------------------------------------------------------------------- refused before Ray starts

KEY = "algorithm.distillation.teacher_path"


def _swap_two_ids(model_dir):
    """The model dir's tokenizer.json with the ids of two tokens exchanged: the same size, another mapping."""
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = "red", "blue"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))


def test_a_missing_teacher_is_refused_naming_the_key(quickstart_assets):
    problems = problems_of(QUICKSTART, f"{KEY}=/no/such/teacher")
    assert any(p.startswith(f"{KEY}=/no/such/teacher: no such directory") for p in problems), problems
    assert not ray.is_initialized()


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_paths(quickstart_assets, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(quickstart_assets.model_dir, teacher)
    assert tokenizer_difference(quickstart_assets.model_dir, teacher) == ""  # a copy shares the tokenizer
    _swap_two_ids(teacher)
    problems = problems_of(QUICKSTART, f"{KEY}={teacher}")
    [problem] = [p for p in problems if "tokenizer" in p]
    assert problem.startswith(f"{KEY}={teacher}: its tokenizer differs from the student's")
    assert f"worker.actor.model.model_path={quickstart_assets.model_dir}" in problem
    assert "2 of" in problem and "'blue'" in problem and "'red'" in problem, problem
    assert not ray.is_initialized()


def test_a_text_teacher_for_a_vision_language_student_is_refused(quickstart_assets):
    from vlmrl.testing.assets import ensure_text_assets

    teacher = ensure_text_assets().model_dir  # the tiny text LM: the same tokenizer, no vision tower
    problems = problems_of(QUICKSTART, f"{KEY}={teacher}")
    assert [p for p in problems if p.startswith(f"{KEY}={teacher}")] == [
        f"{KEY}={teacher} is a text model but the student ({quickstart_assets.model_dir}) is a vision_language "
        "model: the teacher must read the same inputs (images included); give it a vision_language teacher"
    ]


def test_other_merges_with_the_same_tokens_are_a_mismatch(quickstart_assets, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(quickstart_assets.model_dir, teacher)
    data = json.loads((teacher / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]
    (teacher / "tokenizer.json").write_text(json.dumps(data))
    assert "other BPE merges" in tokenizer_difference(quickstart_assets.model_dir, teacher)


def test_distillation_settings_without_a_teacher_are_refused():
    problems = problems_of(QUICKSTART, "algorithm.distillation.mode=replace", "algorithm.distillation.coef=0.5")
    assert any(
        p.startswith("algorithm.distillation.coef=0.5, algorithm.distillation.mode=replace with "
                     f"{KEY} empty") for p in problems
    ), problems  # fmt: skip


def test_a_workflow_whose_advantages_come_before_the_passes_is_refused(quickstart_assets):
    workflow = "tests/fixtures/workflows/workflows.py:LookAgain"
    problems = problems_of(
        QUICKSTART, f"{KEY}={quickstart_assets.model_dir}", f"worker.rollout.workflow={workflow}"
    )
    assert any(p.startswith(f"{KEY} with worker.rollout.workflow={workflow}") for p in problems), problems


# --------------------------------------------------------------------------- two asynchronous steps with a teacher

@pytest.mark.e2e
def test_two_async_steps_with_a_teacher_train_on_its_signal(tmp_path):
    """examples/distillation.yaml run asynchronously (worker.rollout.async_rl, eta=1, colocated), cut to 2 steps of
    2 prompts x 4 samples: step 2 trains tokens one policy version old, the old-log-prob pass gives the proximal
    student, the teacher's pass runs, its signal is the advantage (mode=replace), and the update trains on it.

    The synchronous schedule is the same loop with the other sampler: its teacher pass and advantage stage are this
    run's code, and the stage tests above cover it with a batch in hand; one run in the suite covers both."""
    from vlmrl.api import train

    small = {
        "trainer.max_steps": 2, "data.rollout_batch_size": 2, "worker.actor.global_batch_size": 2,
        "worker.actor.micro_batch_size_per_device_for_update": 8, "worker.rollout.n": 4, "data.val_files": "",
        "trainer.val_before_train": False, "trainer.logger": ["file"], "trainer.save_freq": -1,
        "trainer.save_hf_weights": False, "trainer.output_dir": str(tmp_path),
        "worker.rollout.async_rl.enable": True, "worker.rollout.async_rl.max_head_offpolicyness": 1,
    }  # fmt: skip
    result = train("examples/distillation.yaml", small)
    assert result.steps == 2
    metrics = [json.loads(line) for line in (result.experiment_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "distill/reverse_kl" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # The student (random colours) is far from the teacher (the true colour) on its own samples.
        assert m["distill/reverse_kl"] > 0.05 and m["distill/signal_mean"] != 0, m
        assert m["timing_s/teacher"] > 0 and m["timing_s/old"] > 0 and m["actor/grad_norm"] > 0, m
        # replace: the advantages are the signal, which no GRPO advantage (zero-mean per group) would match.
        assert m["critic/advantages/mean"] == pytest.approx(m["distill/signal_mean"], abs=1e-4), m
    # The async path ran: step 1 trains the first version's tokens; step 2's were sampled before update 1, so
    # the proximal student (the old pass) differs from the one that sampled them, and the teacher scored them.
    first, second = steps
    assert first["async/lag/max"] == 0 and second["async/lag/mean"] == 1 and second["async/lag/max"] == 1, second
    assert second["rollout/log_prob_diff_mean"] > 1e-3, second


# --------------------------------------------------------------------------- the example learns


@pytest.mark.e2e
def test_the_example_student_learns_the_colours_from_the_teacher_alone(tmp_path):
    """examples/distillation.yaml as shipped (16 prompts x 8 samples a step, mode=replace, no KL), cut to 16
    steps: greedy validation accuracy on its 128 prompts must pass 0.5 at step 16.

    Why 0.5: the student starts at 0.258 (it names a colour at random: chance is 0.25), and the same run with the
    teacher's signal turned off (coef=0) stays at 0.258 at every step, since every advantage is then exactly 0
    and no weight moves (test_with_coef_0_every_advantage_is_exactly_0_so_nothing_trains_the_example). Measured
    with the signal on, seeds 1/2/3: 0.914/0.727/0.977 at step 16 (docs/reference/algorithms.md). The reward is
    logged but not trained on, so the rise is the teacher's."""
    from vlmrl.api import train

    run = {
        "trainer.max_steps": 16, "trainer.val_freq": 16, "trainer.val_before_train": False,
        "trainer.logger": ["file"], "trainer.save_freq": -1, "trainer.save_hf_weights": False,
        "trainer.val_generations_to_log": 0, "trainer.output_dir": str(tmp_path),
    }  # fmt: skip
    result = train("examples/distillation.yaml", run)
    metrics = [json.loads(line) for line in (result.experiment_dir / "metrics.jsonl").read_text().splitlines()]
    accuracy = [m["val/reward/accuracy"] for m in metrics if "val/reward/accuracy" in m]
    assert len(accuracy) == 1 and accuracy[0] > 0.5, accuracy
