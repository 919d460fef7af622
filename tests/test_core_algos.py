"""Unit tests of vlmrl.algos.

Hand-made tensors with the expected numbers derived in a comment beside each
assertion, plus property tests (batch-order invariance, padding, degenerate
groups, gradients at the clip boundaries).
"""

import math

import pytest
import torch

import vlmrl.algos.logits as logits_module
from vlmrl.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    KLControllerType,
    KLEstimator,
    LossAvgMode,
    PolicyLossParams,
    PolicyLossType,
    adaptive_kl_coef,
    aggregate_loss,
    aggregation_weight,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    kl_in_reward,
    kl_penalty,
    logprobs_and_entropy,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_sum,
    masked_whiten,
    online_filter_keep,
    policy_loss_cispo,
    policy_loss_gspo,
    policy_loss_gspo_token,
    policy_loss_ppo_clip,
    policy_loss_sapo,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    value_loss_clipped,
    zero_advantage_groups,
)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# --------------------------------------------------------------------------- enums and registries


@pytest.mark.parametrize(
    ("enum", "values"),
    [
        (
            AdvantageEstimator,
            {"grpo", "rloo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"},
        ),
        (PolicyLossType, {"default", "gspo", "gspo_token", "cispo", "sapo"}),
        (KLControllerType, {"fixed", "adaptive"}),
        (
            LossAvgMode,
            {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "per_rollout_mean"},
        ),
        (KLEstimator, {"kl", "abs", "mse", "low_var_kl", "full"}),
    ],
)
def test_enum_values_are_strings_and_names(enum, values):
    assert {m.value for m in enum} == values
    for v in values:
        assert enum(v) is enum[v]  # value lookup (plain YAML) and name lookup (OmegaConf) agree
        assert enum(v) == v  # str Enum: compares equal to its string


def test_unknown_enum_value_lists_valid_ones():
    with pytest.raises(ValueError, match="'ppo'.*choose one of: 'grpo', 'rloo'"):
        AdvantageEstimator("ppo")
    with pytest.raises(ValueError, match="'k3'.*'low_var_kl'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k3")


def test_registries_cover_every_enum_member():
    assert set(ADVANTAGE_ESTIMATORS) == set(AdvantageEstimator)
    assert set(KL_ESTIMATORS) == set(KLEstimator)
    assert set(POLICY_LOSSES) == set(PolicyLossType)
    assert set(KL_CONTROLLERS) == set(KLControllerType)


def test_estimator_specs_say_what_each_estimator_needs():
    needs = {e: (s.needs_groups, s.needs_critic, s.needs_greedy_baseline) for e, s in ADVANTAGE_ESTIMATORS.items()}
    assert needs[AdvantageEstimator.gae] == (False, True, False)
    assert needs[AdvantageEstimator.remax] == (False, False, True)
    assert needs[AdvantageEstimator.reinforce_plus_plus] == (False, False, False)
    for grouped in ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline"):
        assert needs[AdvantageEstimator(grouped)] == (True, False, False)
    # Every knob names a real keyword of its function.
    import inspect

    for spec in ADVANTAGE_ESTIMATORS.values():
        assert set(spec.knobs) <= set(inspect.signature(spec.fn).parameters)


def test_omegaconf_maps_yaml_strings_onto_enums():
    omegaconf = pytest.importorskip("omegaconf")
    from dataclasses import dataclass

    @dataclass
    class Algo:
        adv_estimator: AdvantageEstimator = AdvantageEstimator.grpo
        kl_penalty: KLEstimator = KLEstimator.kl
        loss_avg_mode: LossAvgMode = LossAvgMode.token_mean

    cfg = omegaconf.OmegaConf.merge(
        omegaconf.OmegaConf.structured(Algo),
        omegaconf.OmegaConf.create(
            "adv_estimator: rloo\nkl_penalty: low_var_kl\nloss_avg_mode: seq_mean_token_sum_norm\n"
        ),
    )
    assert cfg.adv_estimator is AdvantageEstimator.rloo
    assert cfg.kl_penalty is KLEstimator.low_var_kl
    assert cfg.loss_avg_mode is LossAvgMode.seq_mean_token_sum_norm


# --------------------------------------------------------------------------- masks


def test_masked_mean_and_sum_hand_numbers_and_ignore_padding_values():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(x, mask), 7.0)  # 1 + 2 + 4
    close(masked_mean(x, mask), 7.0 / 3)  # (1 + 2 + 4) / 3 tokens
    close(masked_mean(x, mask, dim=-1), [1.5, 4.0])  # row 0: (1+2)/2, row 1: 4/1
    close(masked_sum(x, mask.bool(), dim=0), [5.0, 2.0, 0.0])  # cols: 1+4, 2, nothing
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty selection is 0, not nan


# --------------------------------------------------------------------------- advantages

# Six responses in three groups, interleaved so that batch position and group disagree.
# Each response's reward sits at its last valid token; padding holds a stray 100
# that must be ignored.
#   idx   group  valid len  score
#    0     11       3        1
#    1     22       2        2
#    2     11       1        0
#    3     33       4        5      (singleton group)
#    4     22       3        4
#    5     11       2        0
GROUP_IDS = torch.tensor([11, 22, 11, 33, 22, 11])
LENGTHS = torch.tensor([3, 2, 1, 4, 3, 2])
SCORES = torch.tensor([1.0, 2.0, 0.0, 5.0, 4.0, 0.0])


def make_batch(scores=SCORES, lengths=LENGTHS, width=4):
    bs = len(scores)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # (bs, width)
    rewards = torch.zeros(bs, width)
    rewards[torch.arange(bs), lengths - 1] = scores
    rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, 100.0))  # junk in padding
    return rewards, mask


def per_seq(adv, mask):
    """The single value an advantage row carries on its valid tokens."""
    return masked_sum(adv, mask, dim=-1) / mask.sum(-1)


def test_grpo_hand_numbers():
    rewards, mask = make_batch()
    adv, ret = grpo_advantages(rewards, mask, GROUP_IDS)
    # group 11: scores [1, 0, 0]; mean 1/3; deviations [2/3, -1/3, -1/3];
    #   unbiased var = (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3; std = 0.577350
    #   A = [ (2/3)/0.577350, (-1/3)/0.577350, (-1/3)/0.577350 ] = [1.154701, -0.577350, -0.577350]
    # group 22: scores [2, 4]; mean 3; var = (1 + 1) / 1 = 2; std = 1.414214
    #   A = [-1/1.414214, 1/1.414214] = [-0.707107, 0.707107]
    # group 33: singleton -> mean 0, std 1: A = 5 / (1 + 1e-6) = 4.999995
    expected = [1.154701, -0.707107, -0.577350, 4.999995, 0.707107, -0.577350]
    close(per_seq(adv, mask), expected)
    assert torch.equal(adv, ret)


def test_dr_grpo_is_score_minus_group_mean():
    rewards, mask = make_batch()
    adv, _ = grpo_advantages(rewards, mask, GROUP_IDS, norm_adv_by_std=False)
    # group 11 mean 1/3: [1 - 1/3, 0 - 1/3, 0 - 1/3]; group 22 mean 3: [2 - 3, 4 - 3]; group 33 singleton: 5 - 0
    expected = [2 / 3, -1.0, -1 / 3, 5.0, 1.0, -1 / 3]
    close(per_seq(adv, mask), expected)


def test_rloo_hand_numbers():
    rewards, mask = make_batch()
    adv, _ = rloo_advantages(rewards, mask, GROUP_IDS)
    # group 11, scores [1, 0, 0]: baselines = mean of the other two = [(0+0)/2, (1+0)/2, (1+0)/2] = [0, .5, .5]
    #   A = [1 - 0, 0 - .5, 0 - .5] = [1, -.5, -.5]   (= 3/2 * (s - 1/3))
    # group 22, scores [2, 4]: baselines [4, 2] -> A = [-2, 2]
    # group 33 singleton: baseline 0 -> A = 5
    expected = [1.0, -2.0, -0.5, 5.0, 2.0, -0.5]
    close(per_seq(adv, mask), expected)


def test_grpo_passk_hand_numbers():
    rewards, mask = make_batch()
    adv, _ = grpo_passk_advantages(rewards, mask, GROUP_IDS)
    # group 11, scores [1, 0, 0] (idx 0, 2, 5): best idx 0, runner-up 0 -> margin 1;
    #   std = 0.577350 (as in the GRPO test) -> A_0 = 1 / (0.577350 + 1e-6) = 1.732048; idx 2, 5 -> 0
    # group 22, scores [2, 4] (idx 1, 4): best idx 4, margin 4 - 2 = 2; std 1.414214 -> A_4 = 1.414213; idx 1 -> 0
    # group 33, singleton: no runner-up -> 0
    close(per_seq(adv, mask), [1.732048, 0.0, 0.0, 0.0, 1.414213, 0.0])
    adv, _ = grpo_passk_advantages(rewards, mask, GROUP_IDS, norm_adv_by_std=False)
    close(per_seq(adv, mask), [1.0, 0.0, 0.0, 0.0, 2.0, 0.0])  # the raw margins


def test_grpo_passk_tied_best_gets_zero():
    # group [3, 3, 1]: margin of the best over the runner-up is 3 - 3 = 0 for either tied sample
    rewards, mask = make_batch(torch.tensor([3.0, 3.0, 1.0]), torch.tensor([1, 2, 3]))
    adv, _ = grpo_passk_advantages(rewards, mask, torch.tensor([0, 0, 0]))
    assert torch.all(adv == 0)


# Two rows for the token-level estimators: row 0 has 3 valid tokens, row 1 has 2.
# Padding holds junk that must be ignored.
TOK_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
TOK_REWARDS = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 50.0]])


def test_reinforce_plus_plus_hand_numbers():
    adv, ret = reinforce_plus_plus_advantages(TOK_REWARDS, TOK_MASK, torch.tensor([0, 1]), gamma=0.5)
    # Returns G_t = r_t + 0.5 G_{t+1}:
    #   row 0: G_2 = 1, G_1 = 0 + 0.5 * 1 = 0.5, G_0 = 0 + 0.5 * 0.5 = 0.25
    #   row 1: G_1 = 2 (the 50 in padding is ignored), G_0 = 0 + 0.5 * 2 = 1
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # Whitening over the 5 valid returns [0.25, 0.5, 1, 1, 2]: mean 4.75 / 5 = 0.95;
    #   deviations [-0.7, -0.45, 0.05, 0.05, 1.05], squares sum to 1.8, unbiased var 1.8 / 4 = 0.45,
    #   std sqrt(0.45) = 0.670820: A = [-1.043498, -0.670820, 0.074536, 0.074536, 1.565248]
    close(adv, [[-1.043498, -0.670820, 0.074536], [0.074536, 1.565248, 0.0]])


def test_reinforce_plus_plus_baseline_hand_numbers():
    # group 1: scores [1, 0], group 2: scores [3, 1]; lengths [1, 2, 1, 1]
    rewards, mask = make_batch(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([1, 2, 1, 1]), width=2)
    adv, ret = reinforce_plus_plus_baseline_advantages(rewards, mask, torch.tensor([1, 1, 2, 2]))
    # Centred by group mean: group 1 mean 0.5 -> [0.5, -0.5]; group 2 mean 2 -> [1, -1].
    # Per valid token: [0.5 | -0.5, -0.5 | 1 | -1]; mean -0.5 / 5 = -0.1;
    #   deviations [0.6, -0.4, -0.4, 1.1, -0.9], squares sum 2.7, var 2.7 / 4 = 0.675, std 0.821584
    #   A = [0.730297, -0.486864, -0.486864, 1.338877, -1.095445]
    close(adv, [[0.730297, 0.0], [-0.486864, -0.486864], [1.338877, 0.0], [-1.095445, 0.0]])
    assert torch.equal(adv, ret)


def test_remax_hand_numbers():
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.5, 1.0, 50.0]])
    adv, ret = remax_advantages(rewards, TOK_MASK, torch.tensor([0, 1]), baseline_scores=torch.tensor([1.5, 2.0]))
    # scores: row 0 = 2, row 1 = 0.5 + 1 = 1.5 (padding ignored); A = score - greedy baseline:
    #   row 0: 2 - 1.5 = 0.5 on 3 tokens; row 1: 1.5 - 2 = -0.5 on 2 tokens
    close(adv, [[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]])
    # returns-to-go: row 0 [2, 2, 2]; row 1 [1.5, 1, 0 (padding)]
    close(ret, [[2.0, 2.0, 2.0], [1.5, 1.0, 0.0]])


def test_gae_hand_numbers():
    values = torch.tensor([[0.5, 0.2, 0.4], [0.3, 0.6, float("nan")]])  # nan in padding must not leak
    adv, ret = gae_advantages(TOK_REWARDS, TOK_MASK, torch.tensor([0, 1]), values=values, gamma=0.9, lam=0.8)
    # gamma * lam = 0.72; V past the last valid token is 0.
    # row 0: t=2: delta = 1 + 0 - 0.4 = 0.6;               Ahat_2 = 0.6
    #        t=1: delta = 0 + 0.9 * 0.4 - 0.2 = 0.16;       Ahat_1 = 0.16 + 0.72 * 0.6 = 0.592
    #        t=0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32;      Ahat_0 = -0.32 + 0.72 * 0.592 = 0.10624
    # row 1: t=1: delta = 2 + 0 - 0.6 = 1.4;                Ahat_1 = 1.4
    #        t=0: delta = 0 + 0.9 * 0.6 - 0.3 = 0.24;       Ahat_0 = 0.24 + 0.72 * 1.4 = 1.248
    # returns = Ahat + V: row 0 [0.60624, 0.792, 1.0], row 1 [1.548, 2.0, 0 (padding)]
    close(ret, [[0.60624, 0.792, 1.0], [1.548, 2.0, 0.0]])
    # whitened Ahat: mean of [0.10624, 0.592, 0.6, 1.248, 1.4] = 0.789248; unbiased var 0.281173, std 0.530258
    #   A = [-1.288068, -0.371985, -0.356898 | 0.865149, 1.151802]
    close(adv, [[-1.288068, -0.371985, -0.356898], [0.865149, 1.151802, 0.0]])


def test_gae_with_gamma_lam_one_is_return_to_go_minus_value():
    gen = torch.Generator().manual_seed(4)
    rewards, mask = make_batch(torch.randn(5, generator=gen), torch.tensor([1, 4, 2, 3, 4]))
    rewards = rewards + torch.randn(rewards.shape, generator=gen) * mask  # rewards on every token
    values = torch.randn(rewards.shape, generator=gen)
    _, ret = gae_advantages(rewards, mask, torch.arange(5), values=values, gamma=1.0, lam=1.0)
    # lam = gamma = 1: Ahat_t = sum_{t' >= t} r_t' - V_t, so returns = Ahat + V = reward-to-go
    to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, to_go, atol=1e-5, rtol=0)


def test_masked_whiten_hand_numbers():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]; padding 0
    close(masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_grpo_advantages_are_zero_mean_in_every_group(norm_adv_by_std):
    gen = torch.Generator().manual_seed(5)
    group_ids = torch.randint(0, 6, (48,), generator=gen)
    group_ids[:6] = torch.arange(6)  # no singleton accident: each id appears...
    group_ids[6:12] = torch.arange(6)  # ...at least twice
    rewards, mask = make_batch(torch.rand(48, generator=gen), torch.randint(1, 6, (48,), generator=gen), width=5)
    adv, _ = grpo_advantages(rewards, mask, group_ids, norm_adv_by_std=norm_adv_by_std)
    seq = per_seq(adv, mask)
    for g in group_ids.unique():
        close(seq[group_ids == g].mean(), 0.0)


def test_rloo_baseline_leaves_the_sample_out():
    # Changing sample i's own reward moves A_i one for one (its baseline excludes it)
    # and moves the others' baselines by 1 / (n - 1).
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    group_ids = torch.tensor([0, 0, 0, 0])
    lengths = torch.tensor([1, 2, 3, 1])
    before = per_seq(rloo_advantages(*make_batch(scores, lengths), group_ids)[0], make_batch(scores, lengths)[1])
    bumped = scores.clone()
    bumped[2] += 3.0
    after = per_seq(rloo_advantages(*make_batch(bumped, lengths), group_ids)[0], make_batch(bumped, lengths)[1])
    close(after[2] - before[2], 3.0)  # baseline of sample 2 unchanged
    close(after[[0, 1, 3]] - before[[0, 1, 3]], [-1.0, -1.0, -1.0])  # their baselines rose by 3 / (4 - 1)


def extra_inputs(estimator, rewards):
    """What an estimator's spec says it needs, made up for a test batch."""
    spec = ADVANTAGE_ESTIMATORS[estimator]
    kwargs = {}
    if spec.needs_critic:
        kwargs["values"] = torch.linspace(-0.5, 0.5, rewards.numel()).reshape(rewards.shape)
    if spec.needs_greedy_baseline:
        kwargs["baseline_scores"] = torch.full(rewards.shape[:1], 0.25)
    return kwargs


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_every_estimator_is_zero_on_padding_and_finite(estimator):
    rewards, mask = make_batch()
    adv, ret = ADVANTAGE_ESTIMATORS[estimator].fn(rewards, mask, GROUP_IDS, **extra_inputs(estimator, rewards))
    assert adv.shape == ret.shape == mask.shape
    assert adv.dtype == rewards.dtype
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "remax"])
def test_outcome_advantages_are_constant_on_valid_tokens(estimator):
    rewards, mask = make_batch()
    estimator = AdvantageEstimator(estimator)
    adv, _ = ADVANTAGE_ESTIMATORS[estimator].fn(rewards, mask, GROUP_IDS, **extra_inputs(estimator, rewards))
    assert adv.shape == mask.shape
    assert torch.all(adv[mask == 0] == 0)
    seq = per_seq(adv, mask)  # (bs,)
    assert torch.all(torch.where(mask.bool(), adv, seq[:, None]) == seq[:, None])
    assert seq.abs().min() > 0  # none of these hand cases is 0, so a zeroed row would fail


@pytest.mark.parametrize(
    ("estimator", "kwargs"),
    [
        (AdvantageEstimator.grpo, {"norm_adv_by_std": True}),
        (AdvantageEstimator.grpo, {"norm_adv_by_std": False}),
        (AdvantageEstimator.rloo, {}),
        (AdvantageEstimator.grpo_passk, {"norm_adv_by_std": True}),
        (AdvantageEstimator.reinforce_plus_plus_baseline, {}),
    ],
)
def test_advantages_depend_on_group_id_not_batch_position(estimator, kwargs):
    gen = torch.Generator().manual_seed(0)
    bs, width = 40, 7
    group_ids = torch.randint(0, 9, (bs,), generator=gen) * 1000 + 3  # sparse, unsorted ids
    lengths = torch.randint(1, width + 1, (bs,), generator=gen)
    scores = torch.randn(bs, generator=gen)
    rewards, mask = make_batch(scores, lengths, width)
    fn = ADVANTAGE_ESTIMATORS[estimator].fn
    adv, _ = fn(rewards, mask, group_ids, **kwargs)

    perm = torch.randperm(bs, generator=gen)
    adv_perm, _ = fn(rewards[perm], mask[perm], group_ids[perm], **kwargs)
    torch.testing.assert_close(adv_perm, adv[perm], atol=1e-6, rtol=0)

    # Relabelling the groups changes nothing either.
    _, relabelled = torch.unique(group_ids, return_inverse=True)
    adv_relabelled, _ = fn(rewards, mask, 77 - relabelled, **kwargs)
    torch.testing.assert_close(adv_relabelled, adv, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("estimator", "kwargs"),
    [
        (AdvantageEstimator.grpo, {"norm_adv_by_std": True}),
        (AdvantageEstimator.grpo, {"norm_adv_by_std": False}),
        (AdvantageEstimator.rloo, {}),
        (AdvantageEstimator.grpo_passk, {"norm_adv_by_std": False}),
    ],
)
def test_group_with_equal_rewards_gets_zero_advantage(estimator, kwargs):
    # group 1: all 0.7; group 2: [0, 1] (non-zero, guards against an all-zero output)
    scores = torch.tensor([0.7, 0.0, 0.7, 1.0, 0.7])
    group_ids = torch.tensor([1, 2, 1, 2, 1])
    rewards, mask = make_batch(scores, torch.tensor([2, 3, 1, 4, 3]))
    adv, _ = ADVANTAGE_ESTIMATORS[estimator].fn(rewards, mask, group_ids, **kwargs)
    seq = per_seq(adv, mask)
    assert torch.all(seq[group_ids == 1] == 0)
    assert torch.any(seq[group_ids == 2] != 0)


def test_advantage_input_shapes_are_checked():
    rewards, mask = make_batch()
    with pytest.raises(ValueError, match="group_ids must be"):
        grpo_advantages(rewards, mask, GROUP_IDS[:-1])
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(rewards, mask, GROUP_IDS.float())


# --------------------------------------------------------------------------- KL


LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


def test_kl_k1_abs_k2_hand_numbers():
    # logp - ref = [-1 - (-1.5), -2 - (-1)] = [0.5, -1.0]
    close(kl_penalty(LOGP, REF, KLEstimator.kl), [[0.5, -1.0]])
    close(kl_penalty(LOGP, REF, "abs"), [[0.5, 1.0]])
    close(kl_penalty(LOGP, REF, KLEstimator.mse), [[0.125, 0.5]])  # 0.5 * [0.25, 1.0]


def test_kl_k3_hand_numbers_and_clamps():
    # r = ref - logp = [-0.5, 1.0]; k3 = exp(r) - r - 1
    #   exp(-0.5) + 0.5 - 1 = 0.606531 - 0.5 = 0.106531
    #   exp(1) - 1 - 1     = 2.718282 - 2   = 0.718282
    close(kl_penalty(LOGP, REF, KLEstimator.low_var_kl), [[0.106531, 0.718282]])
    # r = -30 -> clamped to -20: exp(-20) + 20 - 1 = 19.0000 -> result clamped to 10
    # r = +30 -> clamped to  20: exp(20) - 21 = 4.85e8     -> result clamped to 10
    # r = -8 (inside both clamps): exp(-8) + 8 - 1 = 7.000335
    k3 = kl_penalty(torch.tensor([[0.0, -30.0, 0.0]]), torch.tensor([[-30.0, 0.0, -8.0]]), "low_var_kl")
    close(k3, [[10.0, 10.0, 7.000335]])


def test_kl_k3_is_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(8, 16, generator=gen) * 3, torch.randn(8, 16, generator=gen) * 3
    assert torch.all(kl_penalty(logp, ref, "low_var_kl") >= 0)
    assert torch.all(kl_penalty(logp, logp, "low_var_kl") == 0)


def test_kl_full_hand_numbers():
    # p = [0.5, 0.5], q = [0.9, 0.1]: KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)
    #   = 0.5 * (-0.587787) + 0.5 * 1.609438 = 0.510826
    # Second token: p = [1, 0] (log 0 = -inf), q = [0.25, 0.75]: KL = 1 * ln(1/0.25) + 0 = 1.386294
    logp = torch.log(torch.tensor([[[0.5, 0.5], [1.0, 0.0]]]))  # (1, 2, V=2)
    ref = torch.log(torch.tensor([[[0.9, 0.1], [0.25, 0.75]]]))
    kl = kl_penalty(logp, ref, KLEstimator.full)
    assert kl.shape == (1, 2)
    close(kl, [[0.510826, 1.386294]])
    with pytest.raises(ValueError, match=r"\(bs, L, V\)"):
        kl_penalty(LOGP, REF, KLEstimator.full)


# --------------------------------------------------------------------------- loss aggregation

# Row 0 has 4 valid tokens, row 1 has 2; padding holds 99 which must never count.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0]])
RAGGED = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "norm_len", "expected"),
    [
        # (1+2+3+4 + 10+20) / 6 tokens = 40/6
        (LossAvgMode.token_mean, None, 40 / 6),
        # mean(10/4, 30/2) = mean(2.5, 15) = 8.75
        (LossAvgMode.seq_mean_token_mean, None, 8.75),
        # mean(10, 30) = 20
        (LossAvgMode.seq_mean_token_sum, None, 20.0),
        # 40 / (bs=2 * L=4) = 5
        (LossAvgMode.seq_mean_token_sum_norm, None, 5.0),
        # 40 / (2 * 8) = 2.5
        (LossAvgMode.seq_mean_token_sum_norm, 8, 2.5),
        # string values work too: same as token_mean
        ("token_mean", None, 40 / 6),
    ],
)
def test_aggregate_loss_on_ragged_mask(mode, norm_len, expected):
    close(aggregate_loss(LOSS, RAGGED, mode, norm_len), expected)


def test_aggregate_loss_empty_row_counts_as_zero_sequence():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    # row 0 token mean 10/4 = 2.5; row 1 empty -> 0; mean over 2 rows = 1.25
    close(aggregate_loss(LOSS, mask, "seq_mean_token_mean"), 1.25)
    # nothing valid at all -> 0, not nan
    close(aggregate_loss(LOSS, torch.zeros_like(mask), "token_mean"), 0.0)


def test_aggregation_modes_agree_when_all_lengths_are_equal():
    gen = torch.Generator().manual_seed(8)
    loss, mask = torch.randn(3, 5, generator=gen), torch.ones(3, 5)
    token_mean = aggregate_loss(loss, mask, "token_mean")
    close(aggregate_loss(loss, mask, "seq_mean_token_mean"), token_mean)
    close(aggregate_loss(loss, mask, "seq_mean_token_sum"), 5 * token_mean)  # a sum of 5 equal-length means
    close(aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=5), token_mean)


@pytest.mark.parametrize("mode", list(LossAvgMode))
def test_micro_batch_losses_weighted_by_aggregation_weight_sum_to_the_full_batch_loss(mode):
    # What the actor relies on for exact gradient accumulation: sum_k agg(mb_k) * w(mb_k) / w(all) = agg(all).
    gen = torch.Generator().manual_seed(9)
    loss = torch.randn(6, 4, generator=gen)
    mask = (torch.arange(4)[None] < torch.tensor([[4], [1], [3], [2], [4], [1]])).float()
    total = aggregation_weight(mask, mode)
    pieces = sum(
        aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, 4) * aggregation_weight(mask[i : i + 2], mode) / total
        for i in range(0, 6, 2)
    )
    close(pieces, aggregate_loss(loss, mask, mode, 4))


# --------------------------------------------------------------------------- PPO clip loss

# One row of 5 tokens, old log-prob 0, so ratio = exp(log_prob). Bounds with
# clip_ratio_low=0.2, clip_ratio_high=0.28 (DAPO): [0.8, 1.28]; dual clip c=3.
#   tok  ratio  A    -A*rho  -A*clip(rho)  max     dual cap -A*c   final
#    a   1.5   +1    -1.5    -1.28         -1.28   -              -1.28  (clipped high)
#    b   0.5   -1     0.5     0.8           0.8    3               0.8   (clipped low)
#    c   1.0   +2    -2.0    -2.0          -2.0    -              -2.0   (unclipped)
#    d   4.0   -1     4.0     1.28          4.0    3               3.0   (dual-capped)
#    e   padding (ratio 7, A 5) -- must not count
RATIOS = torch.tensor([[1.5, 0.5, 1.0, 4.0, 7.0]])
ADV = torch.tensor([[1.0, -1.0, 2.0, -1.0, 5.0]])
PPO_MASK = torch.tensor([[1, 1, 1, 1, 0]])


def ppo(clip_ratio_dual=3.0, mode=LossAvgMode.token_mean):
    log_prob = RATIOS.log().clone().requires_grad_(True)
    params = PolicyLossParams(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=clip_ratio_dual, loss_avg_mode=mode
    )
    loss, metrics = policy_loss_ppo_clip(torch.zeros_like(RATIOS), log_prob, ADV, PPO_MASK, params)
    loss.backward()
    return loss, metrics, log_prob.grad


def test_ppo_clip_hand_numbers_and_metrics():
    loss, metrics, _ = ppo()
    # token_mean over 4 valid tokens: (-1.28 + 0.8 - 2.0 + 3.0) / 4 = 0.52 / 4 = 0.13
    close(loss, 0.13)
    close(metrics["pg_loss"], 0.13)
    close(metrics["pg_clipfrac_higher"], 0.25)  # token a only
    close(metrics["pg_clipfrac_lower"], 0.25)  # token b only
    close(metrics["pg_clipfrac_dual"], 0.25)  # token d only
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1 + ln 4) / 4 = -ln 3 / 4 = -0.274653
    close(metrics["ppo_kl"], -math.log(3) / 4)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_ppo_clip_gradients():
    _, _, grad = ppo()
    # d(-A rho)/d(log_prob) = -A rho, divided by 4 tokens (token_mean):
    #   a clipped high (A>0, rho>1.28): 0;  b clipped low (A<0, rho<0.8): 0
    #   c unclipped: -2 * 1 / 4 = -0.5;     d dual-capped: 0;   e padding: 0
    close(grad, [[0.0, 0.0, -0.5, 0.0, 0.0]])


def test_ppo_without_dual_clip_keeps_pessimistic_large_ratio_term():
    loss, metrics, grad = ppo(clip_ratio_dual=None)
    # token d now costs -A*rho = 4: (-1.28 + 0.8 - 2.0 + 4.0) / 4 = 1.52 / 4 = 0.38
    close(loss, 0.38)
    close(metrics["pg_clipfrac_dual"], 0.0)
    # d keeps its gradient: -A rho / 4 = 1 * 4 / 4 = 1
    close(grad, [[0.0, 0.0, -0.5, 1.0, 0.0]])


def test_ppo_passes_loss_avg_mode_through():
    loss, _, _ = ppo(mode=LossAvgMode.seq_mean_token_sum_norm)
    # sum of valid token losses 0.52 / (bs=1 * L=5) = 0.104
    close(loss, 0.104)


def test_ppo_rejects_dual_clip_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_dual must be > 1"):
        ppo(clip_ratio_dual=0.9)


def run_loss(fn, log_prob, advantages, mask, old_log_prob=None, **params):
    """(loss, metrics, d loss / d log_prob) of a registered policy loss."""
    log_prob = log_prob.clone().requires_grad_(True)
    old = torch.zeros_like(log_prob) if old_log_prob is None else old_log_prob
    loss, metrics = fn(old, log_prob, advantages, mask, PolicyLossParams(**params))
    loss.backward()
    return loss, metrics, log_prob.grad


# GSPO: two rows, old log-prob 0 so the token log-ratios are the log-probs.
#   row 0: log-ratios [0.3, -0.1, 0.1], mean 0.1  -> s_0 = e^0.1  = 1.105171, A = +1
#   row 1: log-ratios [-0.4, 0.0, pad], mean -0.2 -> s_1 = e^-0.2 = 0.818731, A = -2
# Bounds [0.8, 1.28]: both s inside, so no clipping; dual cap -A*3 = 6 is not reached.
GSPO_LOGP = torch.tensor([[0.3, -0.1, 0.1], [-0.4, 0.0, 5.0]])
GSPO_ADV = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
GSPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}


@pytest.mark.parametrize("fn", [policy_loss_gspo, policy_loss_gspo_token])
def test_gspo_hand_numbers(fn):
    loss, _, grad = run_loss(fn, GSPO_LOGP, GSPO_ADV, GSPO_MASK, loss_avg_mode="seq_mean_token_mean", **CLIP)
    # per-token loss -A s: row 0 -1.105171, row 1 2 * 0.818731 = 1.637462
    # seq_mean_token_mean: (-1.105171 + 1.637462) / 2 = 0.266145
    close(loss, 0.266145)
    # d(-A_i s_i)/d logp_t = -A_i s_i / |y_i| (s_i depends on the mean), then / 2 sequences:
    #   row 0: -1.105171 / 3 / 2 = -0.184195;  row 1: 2 * 0.818731 / 2 / 2 = 0.409365; padding 0
    close(grad, [[-0.184195, -0.184195, -0.184195], [0.409365, 0.409365, 0.0]])
    loss, _, _ = run_loss(fn, GSPO_LOGP, GSPO_ADV, GSPO_MASK, loss_avg_mode="token_mean", **CLIP)
    # token_mean: (3 * -1.105171 + 2 * 1.637462) / 5 = -0.040589 / 5 = -0.008118
    close(loss, -0.008118)


def test_gspo_clips_the_sequence_ratio():
    # row 1 now has log-ratios [-0.4, -0.2]: s_1 = e^-0.3 = 0.740818 < 0.8 with A < 0, so the
    # pessimistic term is the clipped one, -A * 0.8 = 1.6, and row 1 gets no gradient.
    logp = torch.tensor([[0.3, -0.1, 0.1], [-0.4, -0.2, 0.0]])
    loss, metrics, grad = run_loss(
        policy_loss_gspo, logp, GSPO_ADV, GSPO_MASK, loss_avg_mode="seq_mean_token_mean", **CLIP
    )
    close(loss, (-1.105171 + 1.6) / 2)
    close(grad[1], [0.0, 0.0, 0.0])
    close(metrics["pg_clipfrac_lower"], 2 / 5)  # both valid tokens of row 1, out of 5


@pytest.mark.parametrize("mode", list(LossAvgMode))
def test_gspo_token_equals_gspo_when_advantages_are_per_sequence(mode):
    gen = torch.Generator().manual_seed(6)
    logp = torch.randn(4, 6, generator=gen) * 0.1
    old = torch.randn(4, 6, generator=gen) * 0.1
    mask = (torch.arange(6)[None] < torch.tensor([[6], [3], [1], [5]])).float()
    adv = torch.randn(4, 1, generator=gen).expand(4, 6)
    kw = {"loss_avg_mode": mode, **CLIP}
    seq_loss, _, seq_grad = run_loss(policy_loss_gspo, logp, adv, mask, old, **kw)
    tok_loss, _, tok_grad = run_loss(policy_loss_gspo_token, logp, adv, mask, old, **kw)
    torch.testing.assert_close(tok_loss, seq_loss)
    torch.testing.assert_close(tok_grad, seq_grad)
    # With advantages that vary along a sequence they part: the token form weights each token's gradient.
    varying = torch.randn(4, 6, generator=gen)
    _, _, seq_grad = run_loss(policy_loss_gspo, logp, varying, mask, old, **kw)
    _, _, tok_grad = run_loss(policy_loss_gspo_token, logp, varying, mask, old, **kw)
    assert not torch.allclose(tok_grad, seq_grad)


@pytest.mark.parametrize("fn", [policy_loss_gspo, policy_loss_gspo_token])
def test_gspo_equals_token_ppo_when_ratios_are_constant_along_each_sequence(fn):
    # log-ratio c_i on every token of row i: the sequence ratio e^{c_i} is every token's ratio.
    c = torch.tensor([[0.5], [-0.3], [0.05]])
    logp = c.expand(3, 4).clone()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = torch.tensor([[1.0], [-1.0], [2.0]]).expand(3, 4)
    kw = {"loss_avg_mode": "token_mean", "clip_ratio_dual": None, **CLIP}
    g_loss, g_metrics, _ = run_loss(fn, logp, adv, mask, **kw)
    p_loss, p_metrics, _ = run_loss(policy_loss_ppo_clip, logp, adv, mask, **kw)
    close(g_loss, p_loss)
    for key in ("pg_clipfrac_higher", "pg_clipfrac_lower", "ppo_kl"):
        close(g_metrics[key], p_metrics[key])


def test_cispo_hand_numbers():
    # old log-prob 0, ratios [1.5, 0.5, 1.0], A [1, -1, 2], bounds [0.8, 1.28]:
    #   weights sg[clip(rho)] = [1.28, 0.8, 1.0]; log pi = [ln 1.5, ln 0.5, 0] = [0.405465, -0.693147, 0]
    #   l = -A w log pi = [-1.28 * 0.405465, -0.8 * 0.693147, 0] = [-0.518995, -0.554518, 0]
    #   token_mean = -1.073513 / 3 = -0.357838
    logp = torch.tensor([[1.5, 0.5, 1.0, 9.0]]).log()
    adv = torch.tensor([[1.0, -1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics, grad = run_loss(policy_loss_cispo, logp, adv, mask, **CLIP)
    close(loss, -0.357838)
    # d l / d log pi = -A w / 3: [-1.28 / 3, 0.8 / 3, -2 / 3, pad 0] -- clipped tokens keep a gradient
    close(grad, [[-0.426667, 0.266667, -0.666667, 0.0]])
    close(metrics["pg_clipfrac_higher"], 1 / 3)  # ratio 1.5 > 1.28
    close(metrics["pg_clipfrac_lower"], 1 / 3)  # ratio 0.5 < 0.8


def test_sapo_hand_numbers():
    # tau_positive 1, tau_negative 2; ratios [1.0, 1.5], A [1, -1]
    #   token 0 (A >= 0, tau 1): gate 4/1 * sigmoid(0) = 2;                  l = -1 * 2 = -2
    #   token 1 (A < 0, tau 2): gate 4/2 * sigmoid(2 * 0.5) = 2 * 0.731059 = 1.462117; l = +1.462117
    #   token_mean: (-2 + 1.462117) / 2 = -0.268941
    logp = torch.tensor([[1.0, 1.5]]).log()
    adv = torch.tensor([[1.0, -1.0]])
    loss, _, grad = run_loss(policy_loss_sapo, logp, adv, torch.ones(1, 2), tau_positive=1.0, tau_negative=2.0)
    close(loss, -0.268941)
    # d gate / d log pi = 4 sigmoid(x)(1 - sigmoid(x)) rho:
    #   token 0: 4 * 0.25 * 1 = 1 -> d l = -1 * 1 / 2 = -0.5   (the unclipped PPO gradient at rho = 1)
    #   token 1: 4 * 0.731059 * 0.268941 * 1.5 = 1.179672 -> d l = +1.179672 / 2 = 0.589836
    close(grad, [[-0.5, 0.589836]])


@pytest.mark.parametrize("loss_type", list(PolicyLossType))
def test_every_policy_loss_ignores_padding_and_reports_pg_loss_and_ppo_kl(loss_type):
    gen = torch.Generator().manual_seed(7)
    logp, old = torch.randn(3, 5, generator=gen) * 0.2 - 1, torch.randn(3, 5, generator=gen) * 0.2 - 1
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    loss, metrics, grad = run_loss(POLICY_LOSSES[loss_type], logp, adv, mask, old, **CLIP)
    junk = torch.where(mask.bool(), logp, torch.full_like(logp, 30.0))  # huge log-probs in padding
    junk_loss, _, _ = run_loss(POLICY_LOSSES[loss_type], junk, adv, mask, old, **CLIP)
    close(junk_loss, loss)
    assert torch.all(grad[mask == 0] == 0)
    assert {"pg_loss", "ppo_kl"} <= set(metrics)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_numbers():
    # cliprange 0.5; padding (last column) holds junk.
    #   tok  vpred  R    old   v_clip = old + clip(vpred - old, +-0.5)   (v-R)^2  (vclip-R)^2  max
    #    a   1.2   1.5   0.8   0.8 + 0.4 = 1.2                            0.09     0.09         0.09
    #    b   2.0   1.5   1.0   1.0 + 0.5 = 1.5                            0.25     0.0          0.25  (unclipped term)
    #    d   1.4   1.5   0.5   0.5 + 0.5 = 1.0                            0.01     0.25         0.25  (clipped: no grad)
    # 0.5 * token_mean = 0.5 * 0.59 / 3 = 0.098333
    vpred = torch.tensor([[1.2, 2.0, 1.4, 7.0]], requires_grad=True)
    returns = torch.tensor([[1.5, 1.5, 1.5, -7.0]])
    old = torch.tensor([[0.8, 1.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = value_loss_clipped(vpred, returns, old, mask, cliprange_value=0.5, loss_avg_mode="token_mean")
    close(loss, 0.098333)
    close(metrics["vf_clipfrac"], 1 / 3)  # token d
    close(metrics["vpred_mean"], (1.2 + 2.0 + 1.4) / 3)
    loss.backward()
    # d/dv 0.5 (v - R)^2 / 3 = (v - R) / 3: a -0.3 / 3 = -0.1, b 0.5 / 3 = 0.166667, d clipped 0, pad 0
    close(vpred.grad, [[-0.1, 0.166667, 0.0, 0.0]])


# --------------------------------------------------------------------------- KL in the reward and controllers


def test_kl_in_reward_hand_numbers():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, current_kl = kl_in_reward(scores, old, ref, mask, kl_coef=0.1, estimator="kl")
    # k1 = old - ref = [[0.5, -1, 0], [1, 0, (padding: 9 -> not counted)]]
    # r = score - 0.1 * k1 = [[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]]
    close(rewards, [[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]])
    # mean over rows of each row's mean KL: ((0.5 - 1 + 0) / 3 + (1 + 0) / 2) / 2 = (-0.166667 + 0.5) / 2
    close(current_kl, 0.166667)


def test_adaptive_kl_controller_hand_numbers():
    # KL above target: e = clip(0.15 / 0.1 - 1, +-0.2) = clip(0.5) = 0.2; coef = 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    close(adaptive_kl_coef(0.1, current_kl=0.15, n_steps=10, target=0.1, horizon=100), 0.102)
    # KL below target: e = 0.09 / 0.1 - 1 = -0.1; coef = 0.1 * (1 - 0.1 * 10 / 100) = 0.099
    close(adaptive_kl_coef(0.1, current_kl=0.09, n_steps=10, target=0.1, horizon=100), 0.099)
    ctl = make_kl_controller("adaptive", 0.1, kl_target=0.1, kl_horizon=100)
    ctl.update(0.15, 10)
    close(ctl.coef, 0.102)
    fixed = make_kl_controller(KLControllerType.fixed, 0.1, kl_target=0.1, kl_horizon=100)
    fixed.update(5.0, 1000)
    assert fixed.coef == 0.1
    with pytest.raises(ValueError, match="kl_horizon > 0"):
        make_kl_controller("adaptive", 0.1, kl_target=0.1, kl_horizon=0)


# --------------------------------------------------------------------------- groups


def test_online_filter_keeps_groups_strictly_inside_the_interval():
    # group 7: [1, 1, 1] mean 1 (not < 0.99) -> drop; group 8: [0, 0] mean 0 (not > 0.01) -> drop;
    # group 9: [0.5] -> keep; group 10: [1, 0] mean 0.5 -> keep
    values = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 0.0])
    group_ids = torch.tensor([7, 8, 7, 9, 7, 8, 10, 10])
    keep = online_filter_keep(values, group_ids, low=0.01, high=0.99)
    assert keep.tolist() == [False, False, False, True, False, False, True, True]
    # the bounds are open: a group mean equal to a bound is dropped
    assert not online_filter_keep(torch.tensor([0.5, 0.5]), torch.tensor([0, 0]), low=0.5, high=1.0).any()


def test_zero_advantage_groups_counts_groups_without_signal():
    adv = torch.tensor([[0.0, 0.0], [0.0, 9.0], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    # group 0: rows 0, 1 -> all valid tokens 0 (row 1's 9 is padding) -> counts
    # group 1: rows 2, 3 -> row 2 is non-zero -> does not count; group 2: row 4 -> counts
    assert zero_advantage_groups(adv, mask, torch.tensor([0, 0, 1, 1, 2])) == 2


# --------------------------------------------------------------------------- logits


def test_entropy_uniform_is_log_vocab_even_for_huge_logits():
    logits = torch.full((2, 3, 7), 1e4)  # a naive exp would overflow
    close(entropy_from_logits(logits), torch.full((2, 3), math.log(7)))


def test_entropy_hand_numbers_and_masked_vocab():
    # logits [0, ln 3] -> p = [1/4, 3/4]; H = 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # logits [0, -inf] -> p = [1, 0]; H = 0 (not nan)
    logits = torch.tensor([[0.0, math.log(3)], [0.0, float("-inf")]])
    close(entropy_from_logits(logits), [0.562335, 0.0])


def test_logprobs_equal_log_softmax_gather():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)


def test_logprobs_hand_numbers():
    # logits [0, ln 3]: p = [1/4, 3/4]; log p(label=1) = ln 0.75 = -0.287682, log p(label=0) = ln 0.25 = -1.386294
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    close(logprobs_from_logits(logits, torch.tensor([[1, 0]])), [[-0.287682, -1.386294]])
    # Large logits [1e5, 1e5 + 2] (both exact in float32) are softmax([0, 2]):
    #   log p = [0, 2] - ln(1 + e^2) = [0, 2] - ln 8.389056 = [-2.126928, -0.126928]
    # (float32 spacing at 1e5 is 1/128, so computing z_y - logsumexp(z) unshifted
    # would round 100002.126928 to 100002.125 and miss by ~2e-3.)
    big = torch.tensor([[[1e5, 1e5 + 2], [1e5, 1e5 + 2]]])
    close(logprobs_from_logits(big, torch.tensor([[0, 1]])), [[-2.126928, -0.126928]])


def test_low_precision_logits_are_upcast_in_chunks(monkeypatch):
    monkeypatch.setattr(logits_module, "_FP32_CHUNK_TOKENS", 4)  # 15 tokens -> 4 chunks, last one ragged
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    ref = logits.detach().float()
    expected_lp = torch.log_softmax(ref, -1).gather(-1, labels[..., None]).squeeze(-1)
    expected_h = -(torch.softmax(ref, -1) * torch.log_softmax(ref, -1)).sum(-1)

    lp = logprobs_from_logits(logits, labels)
    assert lp.dtype == torch.float32 and lp.shape == (3, 5)
    torch.testing.assert_close(lp, expected_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits.detach()), expected_h, atol=1e-5, rtol=1e-5)
    lp.sum().backward()  # gradient flows back through the chunks
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_from_one_softmax_equal_the_two_functions(monkeypatch, dtype):
    # Both come from the same log_softmax, so the values are the separate functions' to the bit; bf16 takes
    # the chunked upcast (15 tokens, chunks of 4). A masked (-inf) entry gives an entropy term of 0, not nan.
    monkeypatch.setattr(logits_module, "_FP32_CHUNK_TOKENS", 4)
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 5, 11, generator=gen) * 4).to(dtype)
    logits[0, 0, 3] = float("-inf")
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    labels[0, 0] = 4
    lp, h = logprobs_and_entropy(logits, labels)
    assert torch.equal(lp, logprobs_from_logits(logits, labels))
    assert torch.equal(h, entropy_from_logits(logits))
    assert torch.isfinite(h).all()


def test_logprobs_and_entropy_gives_the_log_probs_gradient_and_a_detached_entropy():
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(2, 4, 9, generator=gen) * 3
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    weights = torch.randn(2, 4, generator=gen)
    joint = base.clone().requires_grad_(True)
    lp, h = logprobs_and_entropy(joint, labels)
    assert lp.requires_grad and not h.requires_grad  # the entropy is a metric: no backward through it
    (lp * weights).sum().backward()
    apart = base.clone().requires_grad_(True)
    (logprobs_from_logits(apart, labels) * weights).sum().backward()
    assert torch.equal(joint.grad, apart.grad)  # the same graph for the log-probs, so the same bits