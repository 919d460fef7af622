"""The driver's mismatch metrics (vlmrl/driver/mismatch.py): the behaviour-vs-training KL split by turn, by
images per sequence and by response length, on a batch made by hand with hand-derived numbers.

The batch (response width R = 8), with r = pi / mu the anchor's probability of a token over the engine's::

    row 0  multi-turn, no image:  turn 0 = 2 model tokens with r = 2, an observation token, turn 1 = 3 tokens
                                  with r = 1; 5 trained tokens -> length quarter ceil(4 * 5 / 8) = 3
    row 1  one image:             2 tokens with r = 0.5; length quarter ceil(4 * 2 / 8) = 1
    row 2  two images:            4 tokens with r = 1;   length quarter ceil(4 * 4 / 8) = 2

Per token k1 = -log r and k3 = r - 1 - log r: r = 2 gives k1 = -0.693147, k3 = 1 - 0.693147 = 0.306853;
r = 0.5 gives k1 = 0.693147, k3 = -0.5 + 0.693147 = 0.193147; r = 1 gives 0 for both.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.trajectories import multi_turn

from vlmrl.algos import CorrectionMode, CorrectionParams, KLEstimator, LossAvgMode, PolicyLossParams, PolicyLossType
from vlmrl.driver.mismatch import mismatch_metrics
from vlmrl.records import Media, PromptSample, Trajectory
from vlmrl.records.views import to_batch
from vlmrl.train.actor import UpdateSettings

LOG2 = math.log(2)


def _prompt(index: int) -> PromptSample:
    ids = [11, 12, 13]
    return PromptSample(
        index=index, raw_prompt_ids=ids, input_ids=ids, images=[], mm_inputs={}, ground_truth="g",
        data_source="s", prompt_text="p", position_ids=torch.arange(3).expand(3, 3).clone(),
    )  # fmt: skip


def _settings(correction=None) -> UpdateSettings:
    return UpdateSettings(
        samples_per_update=3, micro_batch_size=3, ppo_epochs=1, loss_type=PolicyLossType.default,
        loss_params=PolicyLossParams(loss_avg_mode=LossAvgMode.token_mean), max_grad_norm=1.0, entropy_coeff=0.0,
        use_kl_loss=False, kl_estimator=KLEstimator.low_var_kl, kl_coef=0.0, correction=correction,
    )  # fmt: skip


@pytest.fixture(scope="module")
def batch():
    row0 = multi_turn(_prompt(0), 0, 0, [([21, 22], 1), ([31], 0), ([23, 24, 25], 1)])
    one = Trajectory.single_turn(_prompt(1), 1, 0, [41, 42], "", 1.0, None)
    two = Trajectory.single_turn(_prompt(2), 2, 0, [51, 52, 53, 54], "", 1.0, None)
    one = dataclasses.replace(one, media=[Media("image", 0, None)])
    two = dataclasses.replace(two, media=[Media("image", 0, None), Media("image", 1, None)])
    b = to_batch([row0, one, two], max_prompt_length=3, max_response_length=8, pad_token_id=0)
    b.rollout_log_probs = torch.full((3, 8), -1.0)
    log_r = torch.zeros(3, 8)
    log_r[0, :2] = LOG2  # turn 0's tokens: r = 2
    log_r[1, :2] = -LOG2  # row 1: r = 0.5
    b.old_log_probs = b.rollout_log_probs + log_r
    return b


def test_the_kl_is_split_by_turn_images_and_length(batch):
    assert batch.response_mask.tolist() == [
        [1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]
    ]  # fmt: skip
    m = mismatch_metrics(batch, _settings())
    k3_2, k3_half = 1 - LOG2, LOG2 - 0.5
    # Overall: 11 trained tokens; k1 sums to 2 (-log 2) + 2 (log 2) = 0, k3 to 2 k3(2) + 2 k3(0.5).
    assert m["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch/kl_k3"] == pytest.approx((2 * k3_2 + 2 * k3_half) / 11)
    # By turn: only the multi-turn row has turns; turn 0 is its two r = 2 tokens, turn 1 its three r = 1 tokens
    # (the observation token between them is not trained).
    assert m["mismatch/kl_k1/turn_0"] == pytest.approx(-LOG2)
    assert m["mismatch/kl_k3/turn_0"] == pytest.approx(k3_2)
    assert m["mismatch/kl_k1/turn_1"] == pytest.approx(0.0, abs=1e-7)
    assert not any("turn_2" in k for k in m)
    # By images: row 0 (5 tokens, 2 of them r = 2), row 1 (r = 0.5), row 2 (r = 1).
    assert m["mismatch/kl_k1/images_0"] == pytest.approx(-2 * LOG2 / 5)
    assert m["mismatch/kl_k3/images_1"] == pytest.approx(k3_half)
    assert m["mismatch/kl_k3/images_2plus"] == pytest.approx(0.0, abs=1e-7)
    # By length quarter: row 1 in q1, row 2 in q2, row 0 in q3; nothing in q4.
    assert m["mismatch/kl_k1/length_q1"] == pytest.approx(LOG2)
    assert m["mismatch/kl_k1/length_q2"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch/kl_k3/length_q3"] == pytest.approx(2 * k3_2 / 5)
    assert "mismatch/kl_k1/length_q4" not in m
    # The token ratios: 2, 2, 1, 1, 1 | 0.5, 0.5 | 1 x 4 -> mean 12 / 11, max 2, min 0.5.
    assert (m["mismatch/ratio_mean"], m["mismatch/ratio_max"], m["mismatch/ratio_min"]) == pytest.approx(
        (12 / 11, 2.0, 0.5)
    )
    # No correction stage: measured only, nothing of what a correction did.
    assert not any(k.startswith("rollout_corr/") for k in m)


def test_with_a_correction_its_shares_are_logged(batch):
    # mask at C = 1.5: the two r = 2 tokens are dropped, 2 of 11 tokens, 1 of 3 sequences.
    m = mismatch_metrics(batch, _settings(CorrectionParams(mode=CorrectionMode.mask, threshold=1.5)))
    assert m["rollout_corr/masked_token_frac"] == pytest.approx(2 / 11)
    assert m["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 3)


def test_without_the_engines_log_probs_nothing_is_logged(batch):
    no_engine = dataclasses.replace(batch, rollout_log_probs=None)
    assert mismatch_metrics(no_engine, _settings()) == {}
