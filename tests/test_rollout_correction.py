"""The rollout correction's maths (``vlmrl.algos.rollout_correction``), with hand-derived numbers.

The batch used throughout: two rows, the anchor's log-probs minus the engine's chosen so the token ratios
r = pi / mu are round numbers::

    row 0:  r = [0.25, 1,   4  ]            product 0.25 * 1 * 4 = 1       geometric 1^(1/3) = 1
    row 1:  r = [1.5,  3,   pad]            product 1.5 * 3 = 4.5          geometric sqrt(4.5) = 2.12132

Each test derives the weights and the kept tokens from these by the formulas of the module docstring.
"""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.algos import (
    POLICY_LOSSES,
    CorrectionLevel,
    CorrectionMode,
    CorrectionParams,
    LossAvgMode,
    PolicyLossParams,
    PolicyLossType,
    aggregate_loss,
    correction_metrics,
    mismatch_kl,
    rollout_correction,
)

RATIOS = torch.tensor([[0.25, 1.0, 4.0], [1.5, 3.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, float("-inf")]], dtype=torch.float64)
# anchor - behaviour = log r on valid tokens; padding holds -inf on both sides (nan difference, never read).
ANCHOR = torch.where(MASK.bool(), BEHAVIOUR + RATIOS.log(), torch.tensor(float("-inf"), dtype=torch.float64))
SQRT45 = math.sqrt(4.5)


def _correct(mode, level=CorrectionLevel.token, threshold=2.0, alpha=2.0, veto=None):
    params = CorrectionParams(mode=mode, level=level, threshold=threshold, icepop_alpha=alpha, veto_threshold=veto)
    return rollout_correction(BEHAVIOUR, ANCHOR, MASK, params)


def _close(tensor, expected):
    torch.testing.assert_close(tensor.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


# (mode, level, threshold, expected weight, expected keep)
CASES = [
    # token, none: weight 1 on every valid token, nothing dropped.
    (CorrectionMode.none, CorrectionLevel.token, 2.0, [[1, 1, 1], [1, 1, 0]], [[1, 1, 1], [1, 1, 0]]),
    # token, truncate C=2: min(r, 2) = [0.25, 1, 2], [1.5, 2].
    (CorrectionMode.truncate, CorrectionLevel.token, 2.0, [[0.25, 1, 2], [1.5, 2, 0]], [[1, 1, 1], [1, 1, 0]]),
    # token, mask C=2: r = 4 and r = 3 exceed 2 and are dropped; the others keep weight r.
    (CorrectionMode.mask, CorrectionLevel.token, 2.0, [[0.25, 1, 0], [1.5, 0, 0]], [[1, 1, 0], [1, 0, 0]]),
    # token, icepop a=2: the band is [0.5, 2]; 0.25, 4 and 3 fall outside.
    (CorrectionMode.icepop, CorrectionLevel.token, 2.0, [[0, 1, 0], [1.5, 0, 0]], [[0, 1, 0], [1, 0, 0]]),
    # sequence_product, truncate C=2: R_0 = 1 -> 1, R_1 = 4.5 -> 2, on each token.
    (CorrectionMode.truncate, CorrectionLevel.sequence_product, 2.0, [[1, 1, 1], [2, 2, 0]], [[1, 1, 1], [1, 1, 0]]),
    # sequence_product, mask C=2.5: R_1 = 4.5 > 2.5, row 1 dropped whole.
    (CorrectionMode.mask, CorrectionLevel.sequence_product, 2.5, [[1, 1, 1], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
    # sequence_product, icepop a=2: R_0 = 1 inside [0.5, 2], R_1 = 4.5 outside.
    (CorrectionMode.icepop, CorrectionLevel.sequence_product, 2.0, [[1, 1, 1], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
    # sequence_geometric, truncate C=2: G_1 = sqrt(4.5) = 2.12 -> 2.
    (CorrectionMode.truncate, CorrectionLevel.sequence_geometric, 2.0, [[1, 1, 1], [2, 2, 0]], [[1, 1, 1], [1, 1, 0]]),
    # sequence_geometric, mask C=2.5: G_1 = 2.12 <= 2.5 is kept with weight 2.12 (the product, 4.5, was dropped).
    (CorrectionMode.mask, CorrectionLevel.sequence_geometric, 2.5, [[1, 1, 1], [SQRT45, SQRT45, 0]],
     [[1, 1, 1], [1, 1, 0]]),
    # sequence_geometric, icepop a=2: G_1 = 2.12 > 2, dropped.
    (CorrectionMode.icepop, CorrectionLevel.sequence_geometric, 2.0, [[1, 1, 1], [0, 0, 0]], [[1, 1, 1], [0, 0, 0]]),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "level", "threshold", "weight", "keep"), CASES)
def test_each_mode_and_level_gives_the_hand_derived_weights(mode, level, threshold, weight, keep):
    c = _correct(mode, level, threshold)
    _close(c.weight, weight)
    assert c.keep.tolist() == [[bool(k) for k in row] for row in keep]
    assert not c.weight.isnan().any()  # the -inf padding never reaches the weight


def test_the_level_ratio_is_on_every_token_of_the_sequence_and_0_on_padding():
    _close(_correct(CorrectionMode.none).ratio, [[0.25, 1, 4], [1.5, 3, 0]])
    _close(_correct(CorrectionMode.none, CorrectionLevel.sequence_product).ratio, [[1, 1, 1], [4.5, 4.5, 0]])
    _close(_correct(CorrectionMode.none, CorrectionLevel.sequence_geometric).ratio, [[1, 1, 1], [SQRT45, SQRT45, 0]])


def test_the_veto_drops_a_sequence_with_a_token_below_the_floor_whatever_the_mode():
    # Row 0 holds r = 0.25 < 0.3: vetoed whole, even at sequence level where its ratio is 1. Row 1 (min 1.5) stays.
    c = _correct(CorrectionMode.truncate, veto=0.3)
    _close(c.weight, [[0, 0, 0], [1.5, 2, 0]])
    assert c.vetoed.tolist() == [[True, True, True], [False, False, False]]
    c = _correct(CorrectionMode.none, CorrectionLevel.sequence_product, veto=0.3)
    _close(c.weight, [[0, 0, 0], [1, 1, 0]])
    # A floor under every ratio vetoes nothing.
    assert not _correct(CorrectionMode.truncate, veto=0.2).vetoed.any()


def test_the_metrics_count_ratios_and_shares_by_hand():
    # Token level, truncate C=2. Valid ratios 0.25, 1, 4, 1.5, 3: mean 9.75 / 5 = 1.95, max 4, min 0.25.
    # Truncated: 4 and 3, 2 of 5 tokens, in both rows. Weights 0.25, 1, 2, 1.5, 2: mean 6.75 / 5 = 1.35.
    m = correction_metrics(_correct(CorrectionMode.truncate), MASK, CorrectionLevel.token)
    assert m["mismatch/ratio_mean"] == pytest.approx(1.95)
    assert (m["mismatch/ratio_max"], m["mismatch/ratio_min"]) == pytest.approx((4.0, 0.25))
    assert m["rollout_corr/weight_mean"] == pytest.approx(1.35)
    assert (m["rollout_corr/truncated_token_frac"], m["rollout_corr/truncated_seq_frac"]) == (0.4, 1.0)
    assert m["rollout_corr/masked_token_frac"] == m["rollout_corr/vetoed_seq_frac"] == 0
    # Token level, mask C=2: the same two tokens dropped; kept weights 0.25, 1, 1.5: mean 2.75 / 3.
    m = correction_metrics(_correct(CorrectionMode.mask), MASK, CorrectionLevel.token)
    assert (m["rollout_corr/masked_token_frac"], m["rollout_corr/masked_seq_frac"]) == (0.4, 1.0)
    assert m["rollout_corr/weight_mean"] == pytest.approx(2.75 / 3)
    assert m["rollout_corr/truncated_token_frac"] == 0
    # Sequence level: the statistics are over sequences (1 and 4.5), not tokens. Icepop a=2 drops row 1:
    # its 2 of 5 tokens, 1 of 2 sequences.
    m = correction_metrics(_correct(CorrectionMode.icepop, CorrectionLevel.sequence_product), MASK,
                           CorrectionLevel.sequence_product)  # fmt: skip
    assert (m["mismatch/ratio_mean"], m["mismatch/ratio_max"], m["mismatch/ratio_min"]) == pytest.approx((2.75, 4.5, 1))
    assert (m["rollout_corr/masked_token_frac"], m["rollout_corr/masked_seq_frac"]) == (0.4, 0.5)
    # The veto (floor 0.3) drops row 0: 3 of 5 tokens, 1 of 2 sequences, counted as vetoed and not as masked.
    m = correction_metrics(_correct(CorrectionMode.mask, veto=0.3), MASK, CorrectionLevel.token)
    assert (m["rollout_corr/vetoed_token_frac"], m["rollout_corr/vetoed_seq_frac"]) == (0.6, 0.5)
    assert m["rollout_corr/masked_token_frac"] == 0.2  # only row 1's r = 3; row 0's r = 4 is vetoed


def test_the_mismatch_kl_by_hand():
    # KL(mu || pi) per token with r = pi / mu: k1 = -log r, k3 = r - 1 - log r.
    # r = 0.25: k1 = log 4 = 1.386294, k3 = 0.25 - 1 + 1.386294 = 0.636294.
    # r = 4:    k1 = -1.386294,        k3 = 4 - 1 - 1.386294 = 1.613706.
    k1, k3 = mismatch_kl(BEHAVIOUR, ANCHOR)
    assert k1[0, 0].item() == pytest.approx(math.log(4))
    assert k3[0, 0].item() == pytest.approx(0.25 - 1 + math.log(4))
    assert k1[0, 2].item() == pytest.approx(-math.log(4))
    assert k3[0, 2].item() == pytest.approx(3 - math.log(4))
    assert k1[0, 1].item() == k3[0, 1].item() == 0  # r = 1: no mismatch


def test_bounds_are_refused():
    for kwargs in ({"threshold": 1.0}, {"icepop_alpha": 0.9}, {"veto_threshold": 1.0}, {"veto_threshold": 0.0}):
        with pytest.raises(ValueError):
            CorrectionParams(**kwargs)


def test_no_gradient_flows_through_the_weights():
    behaviour = BEHAVIOUR.clone().requires_grad_(True)
    anchor = torch.where(MASK.bool(), ANCHOR, 0.0).clone().requires_grad_(True)
    for mode in CorrectionMode:
        c = rollout_correction(behaviour, anchor, MASK, CorrectionParams(mode=mode, veto_threshold=0.3))
        assert not c.weight.requires_grad and c.weight.grad_fn is None
        assert not c.ratio.requires_grad


# --------------------------------------------------------------------------- composed with the losses


def _loss(loss_type, mode, log_prob, advantages, mask, correction=None):
    """The loss as the actor's update composes it: A times the weight, aggregated over the kept tokens."""
    old = torch.full_like(log_prob, -1.0)
    params = PolicyLossParams(loss_avg_mode=mode, norm_len=3)
    if correction is not None:
        advantages, mask = correction.weight * advantages, correction.keep.to(mask.dtype)
    return POLICY_LOSSES[loss_type](old, log_prob, advantages, mask, params)[0]


@pytest.mark.parametrize("loss_type", list(PolicyLossType))
@pytest.mark.parametrize("mode", list(LossAvgMode))
@pytest.mark.parametrize("correction_mode", list(CorrectionMode))
@pytest.mark.parametrize("level", list(CorrectionLevel))
def test_with_every_ratio_1_the_gradient_is_the_plain_losss(loss_type, mode, correction_mode, level):
    # r = 1 everywhere: truncate gives min(1, C) = 1, mask and icepop keep 1 (1 <= C, 1 in [1/a, a]), the veto
    # (floor < 1) drops nothing, at every level (the product and the geometric mean of ones are 1). So w = 1 on the
    # mask, keep = mask, and the composed loss is the plain loss exactly.
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    advantages = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    start = -1.0 + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    behaviour = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    params = CorrectionParams(mode=correction_mode, level=level, veto_threshold=0.5)
    correction = rollout_correction(behaviour, behaviour.clone(), mask, params)
    grads = []
    for c in (None, correction):
        log_prob = start.clone().requires_grad_(True)
        _loss(loss_type, mode, log_prob, advantages, mask, c).backward()
        grads.append(log_prob.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(LossAvgMode))
def test_a_dropped_token_is_padding_to_every_aggregation_mode(mode):
    # With log_prob = old the PPO ratio is 1 and the per-token loss is l = -w A. Take A = 1 on every token and the
    # token-level mask correction of the module's batch: kept weights w = [0.25, 1, -], [1.5, -, -] (4 and 3 are
    # over C = 2). A dropped token must count as padding: out of the token sums and the token counts.
    #   token_mean               -(0.25 + 1 + 1.5) / 3                     = -0.916667   (3 kept tokens)
    #   seq_mean_token_mean      -((0.25 + 1) / 2 + 1.5 / 1) / 2           = -1.0625     (rows' kept counts 2, 1)
    #   seq_mean_token_sum       -((0.25 + 1) + 1.5) / 2                   = -1.375
    #   seq_mean_token_sum_norm  -(0.25 + 1 + 1.5) / (2 * 3)               = -0.458333   (the constant bs * norm_len)
    #   per_rollout_mean         one row per rollout: seq_mean_token_mean  = -1.0625
    expected = {
        LossAvgMode.token_mean: -2.75 / 3,
        LossAvgMode.seq_mean_token_mean: -1.0625,
        LossAvgMode.seq_mean_token_sum: -1.375,
        LossAvgMode.seq_mean_token_sum_norm: -2.75 / 6,
        LossAvgMode.per_rollout_mean: -1.0625,
    }[mode]
    log_prob = torch.full((2, 3), -1.0, dtype=torch.float64)
    correction = _correct(CorrectionMode.mask)
    loss = _loss(PolicyLossType.default, mode, log_prob, torch.ones(2, 3, dtype=torch.float64), MASK, correction)
    assert loss.item() == pytest.approx(expected)
    # The same as the plain loss on the batch with the dropped tokens made padding.
    padded = aggregate_loss(-correction.weight, correction.keep, mode, norm_len=3)
    assert loss.item() == pytest.approx(padded.item())
