"""Unit tests of vlmrl.trainer.core_algos.

Hand-made tensors with the expected numbers derived in a comment beside each
assertion, plus property tests (batch-order invariance, padding, degenerate
groups, gradients at the clip boundaries).
"""

import math

import pytest
import torch

from vlmrl.trainer.core_algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    AdvantageEstimator,
    KLEstimator,
    LossAvgMode,
    aggregate_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss_ppo_clip,
    rloo_advantages,
)
import vlmrl.trainer.core_algos as core_algos


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
        (AdvantageEstimator, {"grpo", "rloo"}),
        (LossAvgMode, {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"}),
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
        omegaconf.OmegaConf.create("adv_estimator: rloo\nkl_penalty: low_var_kl\nloss_avg_mode: seq_mean_token_sum_norm\n"),
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


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_advantages_are_constant_on_valid_tokens_and_zero_on_padding(estimator):
    rewards, mask = make_batch()
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](rewards, mask, GROUP_IDS)
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
    ],
)
def test_advantages_depend_on_group_id_not_batch_position(estimator, kwargs):
    gen = torch.Generator().manual_seed(0)
    bs, width = 40, 7
    group_ids = torch.randint(0, 9, (bs,), generator=gen) * 1000 + 3  # sparse, unsorted ids
    lengths = torch.randint(1, width + 1, (bs,), generator=gen)
    scores = torch.randn(bs, generator=gen)
    rewards, mask = make_batch(scores, lengths, width)
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](rewards, mask, group_ids, **kwargs)

    perm = torch.randperm(bs, generator=gen)
    adv_perm, _ = ADVANTAGE_ESTIMATORS[estimator](rewards[perm], mask[perm], group_ids[perm], **kwargs)
    torch.testing.assert_close(adv_perm, adv[perm], atol=1e-6, rtol=0)

    # Relabelling the groups changes nothing either.
    _, relabelled = torch.unique(group_ids, return_inverse=True)
    adv_relabelled, _ = ADVANTAGE_ESTIMATORS[estimator](rewards, mask, 77 - relabelled, **kwargs)
    torch.testing.assert_close(adv_relabelled, adv, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("estimator", "kwargs"),
    [
        (AdvantageEstimator.grpo, {"norm_adv_by_std": True}),
        (AdvantageEstimator.grpo, {"norm_adv_by_std": False}),
        (AdvantageEstimator.rloo, {}),
    ],
)
def test_group_with_equal_rewards_gets_zero_advantage(estimator, kwargs):
    # group 1: all 0.7; group 2: [0, 1] (non-zero, guards against an all-zero output)
    scores = torch.tensor([0.7, 0.0, 0.7, 1.0, 0.7])
    group_ids = torch.tensor([1, 2, 1, 2, 1])
    rewards, mask = make_batch(scores, torch.tensor([2, 3, 1, 4, 3]))
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](rewards, mask, group_ids, **kwargs)
    seq = per_seq(adv, mask)
    assert torch.all(seq[group_ids == 1] == 0)
    assert torch.all(seq[group_ids == 2] != 0)


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
    loss, metrics = policy_loss_ppo_clip(
        old_log_prob=torch.zeros_like(RATIOS),
        log_prob=log_prob,
        advantages=ADV,
        response_mask=PPO_MASK,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_dual=clip_ratio_dual,
        loss_avg_mode=mode,
    )
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
    monkeypatch.setattr(core_algos, "_FP32_CHUNK_TOKENS", 4)  # 15 tokens -> 4 chunks, last one ragged
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
