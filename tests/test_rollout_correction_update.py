"""The rollout correction inside the actor's update, on the tiny VLM, and its config: validation and the plan.

The maths has hand-derived tests (tests/test_rollout_correction.py); these check the wiring. Derivation of the
expected gradients: every policy loss is positively homogeneous in A per token, so the corrected update is the
plain update on a batch whose advantages are w * A and whose response mask is the kept tokens (a dropped token
is padding to the loss). Gradient accumulation must then count only the kept tokens in token_mean's denominator,
whichever micro-batch they fall in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_update_equivalence import (  # noqa: F401 (model_and_batch is a fixture)
    RecordingOptimizer,
    assert_same_gradients,
    model_and_batch,
    update_settings,
)

from vlmrl.algos import (
    BehaviourWeightMode,
    CorrectionLevel,
    CorrectionMode,
    CorrectionParams,
    DecoupledParams,
    LossAvgMode,
    PolicyLossType,
    rollout_correction,
)
from vlmrl.config import ConfigError
from vlmrl.plan import Cluster, resolve
from vlmrl.train.actor import UpdateSettings, update_policy
from vlmrl.validate import load_config

CLUSTER = Cluster(gpus=0, cpus=2)


def _copy(batch):
    return batch.select(list(range(len(batch))))


def _grads(model, batch, settings, allowed):
    optimizer = RecordingOptimizer(model)
    metrics = update_policy(model, optimizer, batch, settings, allowed).metrics
    return optimizer.grads, metrics


def _off_policy(batch, scale=0.7, seed=1):
    off = _copy(batch)
    gen = torch.Generator().manual_seed(seed)
    off.rollout_log_probs = batch.old_log_probs + scale * torch.randn(batch.old_log_probs.shape, generator=gen)
    return off


def _as_padding(batch, off, params):
    """The plain update's batch that the corrected update must equal: advantages w * A, dropped tokens padding."""
    c = rollout_correction(off.rollout_log_probs, batch.old_log_probs, batch.response_mask, params)
    want = _copy(batch)
    want.advantages = batch.advantages * c.weight
    want.response_mask = c.keep.to(batch.response_mask.dtype)
    return want, c


def test_with_the_engine_equal_to_the_actor_it_is_the_plain_update(model_and_batch):
    model, batch, allowed = model_and_batch
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    on_policy = _copy(batch)
    on_policy.rollout_log_probs = batch.old_log_probs.clone()  # r = 1 on every token
    want, _ = _grads(model, _copy(batch), settings, allowed)
    params = CorrectionParams(mode=CorrectionMode.mask, veto_threshold=1e-4)
    got, _ = _grads(model, on_policy, dataclasses.replace(settings, correction=params), allowed)
    assert_same_gradients(model, got, want)


@pytest.mark.parametrize("mode", [LossAvgMode.token_mean, LossAvgMode.seq_mean_token_mean])
@pytest.mark.parametrize(
    "params",
    [
        CorrectionParams(mode=CorrectionMode.truncate, threshold=1.5),
        CorrectionParams(mode=CorrectionMode.mask, threshold=1.5),
        CorrectionParams(mode=CorrectionMode.icepop, icepop_alpha=1.8, level=CorrectionLevel.sequence_geometric),
    ],
    ids=["truncate", "mask", "icepop-geometric"],
)
def test_dropped_tokens_are_padding_across_micro_batches(model_and_batch, mode, params):
    # Micro-batches of 2 hold 7, 6 and 8 tokens; the corrected update accumulates them with token_mean's count of
    # the kept tokens only (run_epochs rescales), so it equals the plain update on the padded batch in one pass.
    model, batch, allowed = model_and_batch
    off = _off_policy(batch)
    want_batch, c = _as_padding(batch, off, params)
    if params.mode is not CorrectionMode.truncate:
        kept = int(c.keep.sum())
        assert 0 < kept < int(batch.response_mask.sum())  # some tokens dropped, some kept
    else:
        assert c.truncated.any()
    want, _ = _grads(model, want_batch, update_settings(batch, len(batch), PolicyLossType.default, mode), allowed)
    settings = dataclasses.replace(update_settings(batch, 2, PolicyLossType.default, mode), correction=params)
    got, _ = _grads(model, off, settings, allowed)
    assert_same_gradients(model, got, want)


def test_under_the_decoupled_loss_the_correction_is_the_behaviour_weight(model_and_batch):
    # The proximal (old) log-probs stay the clip anchor; the correction replaces the behaviour weight instead of
    # multiplying it: the gradient is the plain one with w * A (w the correction's, not the decoupled cap's).
    model, batch, allowed = model_and_batch
    off = _off_policy(batch)
    params = CorrectionParams(mode=CorrectionMode.truncate, threshold=1.5)
    want_batch, _ = _as_padding(batch, off, params)
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    want, _ = _grads(model, want_batch, settings, allowed)
    decoupled = DecoupledParams(behaviour_weight_cap=5.0, behaviour_weight_mode=BehaviourWeightMode.mask)
    got, metrics = _grads(model, off, dataclasses.replace(settings, decoupled=decoupled, correction=params), allowed)
    assert_same_gradients(model, got, want)
    assert "actor/behav_weight_mean" not in metrics  # the decoupled loss's own weight did not run


def test_the_update_needs_the_engines_log_probs(model_and_batch):
    model, batch, allowed = model_and_batch
    settings = update_settings(batch, 2, PolicyLossType.default, LossAvgMode.token_mean)
    missing = _copy(batch)
    missing.rollout_log_probs = None
    with pytest.raises(RuntimeError, match="rollout_log_probs"):
        update_policy(model, RecordingOptimizer(model), missing,
                      dataclasses.replace(settings, correction=CorrectionParams()), allowed)  # fmt: skip


# --------------------------------------------------------------------------- config


def _load(*args):
    return load_config(["config=examples/quickstart.yaml", *args], CLUSTER)


def _problems(*args):
    with pytest.raises(ConfigError) as e:
        _load(*args)
    return e.value.problems


def test_bounds_are_checked_at_validation_all_at_once():
    problems = _problems("algorithm.rollout_correction.mode=mask", "algorithm.rollout_correction.threshold=1",
                         "algorithm.rollout_correction.icepop_alpha=0.5",
                         "algorithm.rollout_correction.veto_threshold=1.5")  # fmt: skip
    assert any("rollout_correction.threshold=1.0: must be above 1" in p for p in problems), problems
    assert any("rollout_correction.icepop_alpha=0.5: must be above 1" in p for p in problems), problems
    assert any("rollout_correction.veto_threshold=1.5: must be in (0, 1)" in p for p in problems), problems


def test_a_correction_needs_the_engines_log_probs():
    problems = _problems("algorithm.rollout_correction.mode=truncate", "worker.rollout.calculate_log_probs=false")
    assert any("mode=truncate with worker.rollout.calculate_log_probs=false" in p for p in problems), problems


def test_settings_that_would_do_nothing_are_refused():
    problems = _problems("algorithm.rollout_correction.level=sequence_product")
    assert any("level=sequence_product with algorithm.rollout_correction.mode unset" in p for p in problems), problems


def test_two_bounds_on_the_decoupled_weight_are_refused_naming_both():
    problems = _problems("worker.actor.use_decoupled_loss=true", "algorithm.rollout_correction.mode=icepop",
                         "worker.actor.behaviour_weight_cap=3")  # fmt: skip
    assert any(
        "mode=icepop with worker.actor.behaviour_weight_cap=3.0" in p and "keep one" in p for p in problems
    ), problems
    # Either one alone is fine.
    _load("worker.actor.use_decoupled_loss=true", "algorithm.rollout_correction.mode=icepop")
    _load("worker.actor.use_decoupled_loss=true", "worker.actor.behaviour_weight_cap=3")


@pytest.mark.parametrize(
    ("args", "mode", "log_probs"),
    [
        # The quickstart (engine and actor in float32, no engine log-probs asked for): no correction, and no
        # generation time spent on log-probs.
        ((), None, False),
        # Engine log-probs asked for: TIS at token level (TRL's default), C = 2.
        (("worker.rollout.calculate_log_probs=true",), "truncate", True),
        # A bfloat16 engine or actor, where the two disagree: TIS, and the log-probs it needs.
        (("worker.rollout.dtype=bfloat16",), "truncate", True),
        (("worker.actor.fsdp.torch_dtype=bfloat16",), "truncate", True),
        (("worker.rollout.dtype=bfloat16", "worker.rollout.calculate_log_probs=false"), None, False),
        # A correction set asks for them.
        (("algorithm.rollout_correction.mode=mask",), "mask", True),
        (("algorithm.rollout_correction.mode=none",), "none", False),
        # The decoupled loss: its behaviour weight is the correction unless a mode is set.
        (("worker.actor.use_decoupled_loss=true",), None, True),
        (("worker.actor.use_decoupled_loss=true", "algorithm.rollout_correction.mode=truncate"), "truncate", True),
    ],
)
def test_the_plan_resolves_the_default(args, mode, log_probs):
    config = _load(*args)
    plan = resolve(config, CLUSTER)
    assert (plan.rollout_correction, plan.rollout_log_probs) == (mode, log_probs)
    settings = UpdateSettings.from_config(config, plan)
    assert (settings.correction is None) == (mode is None)
    if mode is not None:
        assert settings.correction == CorrectionParams(mode=CorrectionMode(mode))
