"""Unit tests of vlmrl.algos.decoupled: the decoupled PPO loss and the log-linear proximal policy.

Hand-made tensors with the expected numbers derived in a comment beside each
assertion. Notation: ``w = pi_prox / pi_behav`` (the behaviour weight, detached),
``rho = pi / pi_prox`` (the clipped ratio), cap ``c``.
"""

import math

import pytest
import torch

from vlmrl.algos.decoupled import (
    BehaviourWeightMode,
    DecoupledParams,
    policy_loss_decoupled,
    proximal_log_probs_loglinear,
)
from vlmrl.algos.losses import (
    POLICY_LOSSES,
    LossAvgMode,
    PolicyLossParams,
    PolicyLossType,
    policy_loss_ppo_clip,
)

LOG = math.log


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


def random_batch(seed=0, bs=4, length=6):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(bs, length, generator=g, dtype=torch.float64) * 3
    prox = behav + 0.8 * torch.randn(bs, length, generator=g, dtype=torch.float64)
    logp = prox + 0.3 * torch.randn(bs, length, generator=g, dtype=torch.float64)
    adv = torch.randn(bs, length, generator=g, dtype=torch.float64)
    lengths = torch.tensor([length, 3, 1, length - 2])[:bs]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return behav, prox, logp, adv, mask


def test_behaviour_weight_mode_values_and_cap_check():
    assert {m.value for m in BehaviourWeightMode} == {"truncate", "mask", "none"}
    for m in BehaviourWeightMode:
        assert BehaviourWeightMode(m.value) is BehaviourWeightMode[m.value]  # YAML value and OmegaConf name agree
    with pytest.raises(ValueError, match="'clip'.*choose one of"):
        BehaviourWeightMode("clip")
    # A cap under 1 would drop on-policy tokens (w = 1) in mask mode.
    with pytest.raises(ValueError, match="behaviour_weight_cap must be >= 1"):
        DecoupledParams(behaviour_weight_cap=0.5)


# --------------------------------------------------------------------------- proximal == behaviour is plain PPO


@pytest.mark.parametrize("mode", list(LossAvgMode))
@pytest.mark.parametrize("weight_mode", list(BehaviourWeightMode))
def test_proximal_equal_to_behaviour_is_exactly_ppo_clip(mode, weight_mode):
    # w = exp(0) = 1 exactly, so the advantages are multiplied by 1.0 and the
    # loss is bit-for-bit policy_loss_ppo_clip(behav, logp, A), for every
    # aggregation mode (1 <= cap, so mask mode keeps every token).
    behav, _, logp, adv, mask = random_batch()
    params = PolicyLossParams(loss_avg_mode=mode, norm_len=8)
    got, got_metrics = policy_loss_decoupled(
        behav, behav.clone(), logp, adv, mask, params, DecoupledParams(behaviour_weight_mode=weight_mode)
    )
    want, want_metrics = policy_loss_ppo_clip(behav, logp, adv, mask, params)
    assert torch.equal(got, want)
    for key, value in want_metrics.items():
        assert torch.equal(got_metrics[key], value), key
    close(got_metrics["behav_weight_mean"], 1.0)
    close(got_metrics["behav_weight_max"], 1.0)
    close(got_metrics["behav_weight_capped_frac"], 0.0)
    close(got_metrics["behav_prox_kl"], 0.0)


@pytest.mark.parametrize("loss_type", list(PolicyLossType))
def test_proximal_equal_to_behaviour_is_the_plain_loss_for_every_loss_type(loss_type):
    behav, _, logp, adv, mask = random_batch(seed=1)
    params = PolicyLossParams(loss_avg_mode=LossAvgMode.seq_mean_token_mean)
    got, _ = policy_loss_decoupled(behav, behav, logp, adv, mask, params, DecoupledParams(loss_type=loss_type))
    want, _ = POLICY_LOSSES[loss_type](behav, logp, adv, mask, params)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- cap and mask, hand numbers


def three_token_case():
    # One row of three valid tokens. behav = log [0.8, 0.2, 0.05], prox = log 0.4 each:
    #   w = 0.4 / [0.8, 0.2, 0.05] = [0.5, 2, 8]
    # The current policy equals the proximal one, so rho = 1 (inside the clip) and
    # with A = 1 the plain PPO per-token loss is -A rho = -1.
    behav = torch.tensor([[LOG(0.8), LOG(0.2), LOG(0.05)]], dtype=torch.float64)
    prox = torch.full((1, 3), LOG(0.4), dtype=torch.float64)
    adv = torch.ones(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3)
    return behav, prox, prox.clone().requires_grad_(), adv, mask


@pytest.mark.parametrize(
    ("weight_mode", "loss", "weight_mean", "capped_frac"),
    [
        # truncate: w = [0.5, 2, min(8, 5)] = [0.5, 2, 5]; l = -w; token mean (-0.5 - 2 - 5) / 3 = -2.5
        (BehaviourWeightMode.truncate, -7.5 / 3, 7.5 / 3, 1 / 3),
        # mask: w = [0.5, 2, 0] (8 > 5 is dropped); token mean (-0.5 - 2 - 0) / 3, still over 3 tokens
        (BehaviourWeightMode.mask, -2.5 / 3, 2.5 / 3, 1 / 3),
        # none: w = [0.5, 2, 8]; (-0.5 - 2 - 8) / 3 = -3.5; nothing counts as capped
        (BehaviourWeightMode.none, -10.5 / 3, 10.5 / 3, 0.0),
    ],
)
def test_cap_and_mask_hand_numbers(weight_mode, loss, weight_mean, capped_frac):
    behav, prox, logp, adv, mask = three_token_case()
    decoupled = DecoupledParams(behaviour_weight_cap=5.0, behaviour_weight_mode=weight_mode)
    got, metrics = policy_loss_decoupled(behav, prox, logp, adv, mask, PolicyLossParams(), decoupled)
    close(got, loss)
    close(metrics["pg_loss"], loss)
    close(metrics["behav_weight_mean"], weight_mean)
    close(metrics["behav_weight_max"], 8.0)  # the raw weight, before the cap
    close(metrics["behav_weight_capped_frac"], capped_frac)
    # k3 = w - 1 - log w per token, on the raw weight:
    #   0.5 - 1 - log 0.5 = 0.193147,  2 - 1 - log 2 = 0.306853,  8 - 1 - log 8 = 4.920558
    #   mean = 5.420558 / 3 = 1.806853
    close(metrics["behav_prox_kl"], (0.5 - 1 - LOG(0.5) + 2 - 1 - LOG(2) + 8 - 1 - LOG(8)) / 3)
    # Gradient: d(-w rho A)/d log pi = -w A rho = -w, over the 3-token mean.
    got.backward()
    applied = {"truncate": [0.5, 2.0, 5.0], "mask": [0.5, 2.0, 0.0], "none": [0.5, 2.0, 8.0]}[weight_mode]
    close(logp.grad, [[-w / 3 for w in applied]])


def test_clip_is_anchored_at_the_proximal_policy():
    # behav = log 0.6, prox = log 0.4, current = log 0.6, A = 1, clip_ratio_high 0.3, cap 5.
    #   w   = 0.4 / 0.6 = 2/3
    #   rho = 0.6 / 0.4 = 1.5 > 1.3  -> clipped: l = -w A 1.3 = -0.866667, and no gradient
    # Anchored at behaviour instead the ratio would be 1 (unclipped, gradient -1).
    behav = torch.tensor([[LOG(0.6)]], dtype=torch.float64)
    prox = torch.tensor([[LOG(0.4)]], dtype=torch.float64)
    logp = behav.clone().requires_grad_()
    adv = torch.ones(1, 1, dtype=torch.float64)
    params = PolicyLossParams(clip_ratio_high=0.3)
    loss, metrics = policy_loss_decoupled(behav, prox, logp, adv, torch.ones(1, 1), params, DecoupledParams())
    close(loss, -(2 / 3) * 1.3)
    close(metrics["pg_clipfrac_higher"], 1.0)
    loss.backward()
    close(logp.grad, [[0.0]])


@pytest.mark.parametrize(
    ("mode", "masked", "dropped_from_mask"),
    [
        # Two rows. Row 0: w = [8 (masked, cap 5), 1], A = [1, 3]; row 1: w = [1, pad], A = [2, -].
        # rho = 1, so the plain per-token loss is -A and the weighted one [[0, -3], [-2, pad]].
        # token_mean: (0 - 3 - 2) / 3 tokens = -5/3.  Shrinking the mask to 2 tokens would give -5/2.
        (LossAvgMode.token_mean, -5 / 3, -5 / 2),
        # seq_mean_token_mean: row 0 (0 - 3) / 2 = -1.5, row 1 -2 -> -1.75.  Shrunk: row 0 -3 / 1 -> -2.5.
        (LossAvgMode.seq_mean_token_mean, -1.75, -2.5),
        # seq_mean_token_sum: row sums -3 and -2 over 2 rows = -2.5 either way (no per-token denominator).
        (LossAvgMode.seq_mean_token_sum, -2.5, -2.5),
        # seq_mean_token_sum_norm (norm_len = L = 2): -5 / (2 rows * 2) = -1.25 either way.
        (LossAvgMode.seq_mean_token_sum_norm, -1.25, -1.25),
    ],
)
def test_masking_keeps_the_denominator(mode, masked, dropped_from_mask):
    behav = torch.tensor([[LOG(0.05), LOG(0.4)], [LOG(0.4), 0.0]], dtype=torch.float64)
    prox = torch.full((2, 2), LOG(0.4), dtype=torch.float64)
    adv = torch.tensor([[1.0, 3.0], [2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    params = PolicyLossParams(loss_avg_mode=mode)
    decoupled = DecoupledParams(behaviour_weight_cap=5.0, behaviour_weight_mode=BehaviourWeightMode.mask)
    loss, metrics = policy_loss_decoupled(behav, prox, prox.clone(), adv, mask, params, decoupled)
    close(loss, masked)
    close(metrics["behav_weight_capped_frac"], 1 / 3)
    # Dropping the token from the mask instead would rescale the others' gradients by
    # N / N_kept (AReaL's ppo_actor_loss_fn counts the mask before masking for this reason).
    shrunk = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    wrong, _ = policy_loss_ppo_clip(prox, prox.clone(), adv, shrunk, params)
    close(wrong, dropped_from_mask)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("loss_type", [PolicyLossType.default, PolicyLossType.cispo, PolicyLossType.sapo])
@pytest.mark.parametrize("weight_mode", list(BehaviourWeightMode))
def test_no_gradient_through_the_weight(loss_type, weight_mode):
    # For a token-level loss, l = sum_t w_t l_t / D with w detached, so
    #   d l / d log pi_t = w_t * d l_plain / d log pi_t    (l_plain: the same loss with w = 1)
    # and behaviour / proximal log-probs, though they require grad, get none.
    behav, prox, logp, adv, mask = random_batch(seed=2)
    behav.requires_grad_()
    prox.requires_grad_()
    logp_a = logp.clone().requires_grad_()
    logp_b = logp.clone().requires_grad_()
    decoupled = DecoupledParams(behaviour_weight_cap=1.5, behaviour_weight_mode=weight_mode, loss_type=loss_type)
    params = PolicyLossParams()
    loss, _ = policy_loss_decoupled(behav, prox, logp_a, adv, mask, params, decoupled)
    loss.backward()
    assert behav.grad is None and prox.grad is None

    plain, _ = POLICY_LOSSES[loss_type](prox.detach(), logp_b, adv, mask, params)
    plain.backward()
    raw = (prox - behav).detach().exp()
    assert (mask.bool() & (raw > 1.5)).any()  # the cap bites on some valid token
    w = {
        BehaviourWeightMode.truncate: raw.clamp(max=1.5),
        BehaviourWeightMode.mask: torch.where(raw > 1.5, 0.0, raw),
        BehaviourWeightMode.none: raw,
    }[weight_mode]
    torch.testing.assert_close(logp_a.grad, (w * logp_b.grad) * mask)


def test_padding_with_infinite_log_probs_stays_finite():
    # vLLM-style padding: -inf log-probs on both sides. exp(-inf - -inf) would be nan;
    # the weight is zeroed on padding before exp, so the loss and its gradient stay finite.
    behav, prox, logp, adv, mask = random_batch(seed=3)
    behav = torch.where(mask.bool(), behav, -math.inf)
    prox = torch.where(mask.bool(), prox, -math.inf)
    logp = torch.where(mask.bool(), logp, 0.0).requires_grad_()
    loss, metrics = policy_loss_decoupled(
        behav, prox, logp, adv, mask, PolicyLossParams(), DecoupledParams(behaviour_weight_mode="none")
    )
    # prox is -inf on padding, so the plain PPO ratio there is exp(0 - -inf): clamped to e^20, times A' = 0.
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(logp.grad).all()


# --------------------------------------------------------------------------- log-linear proximal policy


def test_loglinear_proximal_hand_numbers():
    # proximal version v_p = 4, current v = 5; alpha = clip((v_p - v_b) / (v - v_b), 0, 1):
    #   v_b = 3:  (4 - 3) / (5 - 3) = 1/2   -> -2 + 0.5 (-1 - -2)  = -1.5   (halfway)
    #   v_b = 2:  (4 - 2) / (5 - 2) = 2/3   -> -3 + 2/3 (0 - -3)   = -1.0
    #   v_b = 4:  0 (sampled by the proximal weights) -> behaviour, -0.7
    #   v_b = 5:  v - v_b = 0, no interpolation       -> behaviour, -0.9
    #   v_b = -1: context                              -> behaviour, -0.3
    behav = torch.tensor([[-2.0, -3.0, -0.7, -0.9, -0.3]], dtype=torch.float64)
    current = torch.tensor([[-1.0, 0.0, -5.0, -5.0, -5.0]], dtype=torch.float64, requires_grad=True)
    versions = torch.tensor([[3, 2, 4, 5, -1]])
    prox = proximal_log_probs_loglinear(behav, current, versions, proximal_version=4, current_version=5)
    close(prox, [[-1.5, -1.0, -0.7, -0.9, -0.3]])
    assert not prox.requires_grad  # a fixed anchor: no gradient into the clip's denominator


def test_loglinear_proximal_keeps_infinite_padding_and_checks_versions():
    behav = torch.tensor([[-1.0, -math.inf]])
    current = torch.tensor([[-0.5, -math.inf]])
    versions = torch.tensor([[0, -1]])
    # v_b = 0, v_p = 1, v = 3: alpha = 1/3 -> -1 + (0.5)/3 = -0.833333; padding stays -inf (not nan).
    prox = proximal_log_probs_loglinear(behav, current, versions, proximal_version=1, current_version=3)
    close(prox[0, 0], -1.0 + 0.5 / 3)
    assert prox[0, 1] == -math.inf
    with pytest.raises(ValueError, match="current_version .* must be greater than proximal_version"):
        proximal_log_probs_loglinear(behav, current, versions, proximal_version=3, current_version=3)


def test_loglinear_proximal_at_the_proximal_version_gives_plain_ppo():
    # Every token sampled by the proximal weights: alpha = 0, prox = behav, w = 1, plain PPO.
    behav, _, logp, adv, mask = random_batch(seed=4)
    versions = torch.where(mask.bool(), 7, -1)
    prox = proximal_log_probs_loglinear(behav, logp, versions, proximal_version=7, current_version=8)
    got, _ = policy_loss_decoupled(behav, prox, logp, adv, mask, PolicyLossParams(), DecoupledParams())
    want, _ = policy_loss_ppo_clip(behav, logp, adv, mask, PolicyLossParams())
    assert torch.equal(got, want)
