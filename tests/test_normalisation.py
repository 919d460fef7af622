"""Reward scaling, bias and clipping, and advantage normalisation by group or batch (AReaL's options):
the pure functions with hand-derived numbers, the advantage stage's wiring, and the config rules."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from vlmrl.algos import NormLevel, grpo_advantages, normalise_advantages, shape_rewards, shape_scores
from vlmrl.config import AlgorithmConfig, ConfigError
from vlmrl.config.schema import AdvNormConfig
from vlmrl.driver.advantage import AdvantageStage
from vlmrl.plan import Cluster
from vlmrl.validate import load_config

G, B, N = NormLevel.group, NormLevel.batch, NormLevel.none


# --------------------------------------------------------------------------- reward shaping


def test_shape_scores_biases_then_scales_then_clips():
    # bias 0.5, scaling 2, clip 2:  1 -> 1.5 * 2 = 3 -> 2;  0 -> 0.5 * 2 = 1;  -3 -> -2.5 * 2 = -5 -> -2
    out = shape_scores(torch.tensor([1.0, 0.0, -3.0]), scaling=2.0, bias=0.5, clip=2.0)
    assert out.tolist() == [2.0, 1.0, -2.0]
    # No clip: -3 -> -5 stays.
    assert shape_scores(torch.tensor([-3.0]), scaling=2.0, bias=0.5).tolist() == [-5.0]


def test_shape_rewards_puts_the_change_at_the_last_valid_token():
    scores = torch.tensor([[0.0, 0.0, 1.0, 9.0], [0.2, 0.0, 0.3, 0.0], [0.7, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]])
    out = shape_rewards(scores, mask, scaling=2.0, bias=0.5, clip=2.0)
    # row 0: s = 1 (the 9 sits on padding and does not count) -> (1 + 0.5) * 2 = 3 -> clip 2; +1 at token 2.
    # row 1 (a hole in the mask, as multi-turn): s = 0.2 + 0.3 + 0 = 0.5 -> (0.5 + 0.5) * 2 = 2; +1.5 at token 3,
    #        the other tokens' rewards stay where they are.
    # row 2: no valid token, left as is.
    expected = torch.tensor([[0.0, 0.0, 2.0, 9.0], [0.2, 0.0, 0.3, 1.5], [0.7, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    assert out.dtype == scores.dtype


def test_shape_rewards_with_the_defaults_is_the_identity():
    scores, mask = torch.randn(3, 5), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 0, 0]])
    torch.testing.assert_close(shape_rewards(scores, mask), scores)


# --------------------------------------------------------------------------- advantage normalisation

# Four rows, two groups (ids 7 and 3, interleaved on purpose), one sequence-level advantage per row:
#   row 0: [1, 1] (two tokens, group 7)   row 1: [-2, pad] (group 7)
#   row 2: [ 3, pad]  (group 3)           row 3: [ 1, pad] (group 3)
# Over valid tokens:
#   group 7: 1, 1, -2  -> mean 0,   squared deviations 1 + 1 + 4 = 6, / (3 - 1) -> var 3,   std sqrt(3)
#   group 3: 3, 1      -> mean 2,   squared deviations 1 + 1 = 2,     / (2 - 1) -> var 2,   std sqrt(2)
#   batch:   1, 1, -2, 3, 1 -> mean 4 / 5 = 0.8,
#            squared deviations .04 + .04 + 7.84 + 4.84 + .04 = 12.8, / 4 -> var 3.2, std sqrt(3.2)
ADV = torch.tensor([[1.0, 1.0], [-2.0, 0.0], [3.0, 0.0], [1.0, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
IDS = torch.tensor([7, 7, 3, 3])
S3, S2, SB = math.sqrt(3), math.sqrt(2), math.sqrt(3.2)


@pytest.mark.parametrize(
    ("mean_level", "std_level", "per_row"),
    [
        # (A - group mean) / group std
        (G, G, [1 / S3, -2 / S3, 1 / S2, -1 / S2]),
        # (A - group mean) / batch std (the batch std of A itself, around the batch mean): LitePPO's choice
        (G, B, [1 / SB, -2 / SB, 1 / SB, -1 / SB]),
        # (A - batch mean) / batch std
        (B, B, [0.2 / SB, -2.8 / SB, 2.2 / SB, 0.2 / SB]),
        # A - batch mean, no division
        (B, N, [0.2, -2.8, 2.2, 0.2]),
        # A / group std, nothing subtracted
        (N, G, [1 / S3, -2 / S3, 3 / S2, 1 / S2]),
    ],
)
def test_normalise_advantages_by_level(mean_level, std_level, per_row):
    out = normalise_advantages(ADV, MASK, IDS, mean_level, std_level, eps=0.0)
    expected = torch.tensor(per_row)[:, None] * MASK  # the row's value on its valid tokens, 0 on padding
    torch.testing.assert_close(out, expected.float())


def test_both_levels_none_returns_the_advantages_untouched():
    assert normalise_advantages(ADV, MASK, IDS) is ADV


def test_normalisation_does_not_depend_on_batch_order():
    perm = torch.tensor([2, 0, 3, 1])
    out = normalise_advantages(ADV, MASK, IDS, G, B)
    torch.testing.assert_close(normalise_advantages(ADV[perm], MASK[perm], IDS[perm], G, B), out[perm])


def test_eps_is_added_to_the_std():
    # group 3 alone: (3 - 2) / (sqrt(2) + 0.5)
    out = normalise_advantages(ADV, MASK, IDS, G, G, eps=0.5)
    assert out[2, 0].item() == pytest.approx(1 / (S2 + 0.5))


def test_dr_grpo_then_group_std_is_grpo_with_one_token_per_response():
    # One token per response: token statistics are sequence statistics, so Dr.GRPO's (s - mean) followed by
    # adv_norm.std_level=group is GRPO's (s - mean) / (std + eps).
    scores = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0], [0.5]])
    mask, ids = torch.ones(6, 1), torch.tensor([0, 0, 0, 1, 1, 1])
    dr, _ = grpo_advantages(scores, mask, ids, norm_adv_by_std=False)
    full, _ = grpo_advantages(scores, mask, ids, norm_adv_by_std=True)
    torch.testing.assert_close(normalise_advantages(dr, mask, ids, N, G), full)


# --------------------------------------------------------------------------- the advantage stage


class _Batch:
    """What AdvantageStage reads of a batch (a GRPO step with the KL as a loss): pure tensors."""

    def __init__(self, scores, mask, ids):
        self.token_level_scores, self.response_mask, self.group_ids = scores, mask, ids

    def require(self, *names):
        assert all(getattr(self, n, None) is not None for n in names), names

    def __len__(self):
        return len(self.group_ids)


def _step_batch():
    # Two prompts x two responses; the outcome reward on the last valid token.
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    return _Batch(scores, mask, torch.tensor([0, 0, 1, 1]))


def test_the_stage_with_default_settings_is_the_estimator_alone():
    batch = _step_batch()
    out = AdvantageStage(AlgorithmConfig(), kl_in_reward=False)(batch)
    assert out.token_level_rewards is batch.token_level_scores
    expected, _ = grpo_advantages(batch.token_level_scores, batch.response_mask, batch.group_ids)
    torch.testing.assert_close(out.advantages, expected)


def test_the_stage_shapes_before_the_estimator_and_normalises_after():
    batch = _step_batch()
    algo = replace(
        AlgorithmConfig(), reward_scaling=2.0, reward_bias=-0.5, reward_clip=2.0, norm_adv_by_std_in_grpo=False,
        adv_norm=AdvNormConfig(mean_level=N, std_level=B),
    )  # fmt: skip
    out = AdvantageStage(algo, kl_in_reward=False)(batch)
    # Shaped scores: (1 - .5) * 2 = 1;  (0 - .5) * 2 = -1;  (3 - .5) * 2 = 5 -> clip 2;  (1 - .5) * 2 = 1.
    assert out.token_level_rewards.sum(-1).tolist() == [1.0, -1.0, 2.0, 1.0]
    # Dr.GRPO: group 0 mean 0 -> A = 1, -1;  group 1 mean 1.5 -> A = 0.5, -0.5.
    # Batch std over the 2 + 3 + 1 + 3 = 9 valid tokens: values 1 (x2), -1 (x3), 0.5 (x1), -0.5 (x3);
    #   mean (2 - 3 + 0.5 - 1.5) / 9 = -2 / 9;  sum of squares 2 + 3 + 0.25 + 0.75 = 6;
    #   var = (6 - 9 (2/9)^2) / 8 = (6 - 4/9) / 8 = 50 / 72 = 25 / 36;  std = 5 / 6.
    sd = 5 / 6 + 1e-6
    expected = torch.tensor([1 / sd, -1 / sd, 0.5 / sd, -0.5 / sd])[:, None] * batch.response_mask
    torch.testing.assert_close(out.advantages, expected.float())


# --------------------------------------------------------------------------- config


def _problems(*args):
    with pytest.raises(ConfigError) as e:
        load_config(["config=examples/quickstart.yaml", *args], Cluster(gpus=0, cpus=2))
    return e.value.problems


def test_a_second_std_division_under_grpo_is_refused_naming_both_keys():
    problems = _problems("algorithm.adv_norm.std_level=batch")
    assert any(
        "adv_norm.std_level=batch with algorithm.norm_adv_by_std_in_grpo=true" in p
        and "norm_adv_by_std_in_grpo=false" in p
        for p in problems
    ), problems


def test_the_same_settings_that_agree_are_accepted():
    cluster = Cluster(gpus=0, cpus=2)
    base = ["config=examples/quickstart.yaml"]
    load_config([*base, "algorithm.adv_norm.std_level=batch", "algorithm.norm_adv_by_std_in_grpo=false"], cluster)
    load_config([*base, "algorithm.adv_norm.mean_level=batch"], cluster)
    load_config([*base, "algorithm.adv_estimator=rloo", "algorithm.adv_norm.std_level=group"], cluster)
    config = load_config([*base, "algorithm.reward_scaling=0.5", "algorithm.reward_clip=3"], cluster)
    assert (config.algorithm.reward_scaling, config.algorithm.reward_clip) == (0.5, 3.0)


def test_bad_shaping_values_are_reported_all_at_once():
    problems = _problems(
        "algorithm.reward_scaling=0", "algorithm.reward_clip=-1", "algorithm.adv_norm.mean_level=prompt"
    )
    text = "\n".join(problems)
    assert "algorithm.reward_scaling=0.0: must be a finite number above 0" in text, text
    assert "algorithm.reward_clip=-1.0: must be above 0" in text, text
    assert "algorithm.adv_norm.mean_level='prompt': not a valid option; choose one of: none, group, batch" in text
