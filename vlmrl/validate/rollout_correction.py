"""``algorithm.rollout_correction``: its bounds, the engine log-probs it needs, and its overlap with the decoupled
loss's behaviour weight, which bounds the same ratio."""

from __future__ import annotations

from vlmrl.config import ActorConfig, Config
from vlmrl.plan import decoupled_loss, rollout_correction

__all__ = ["rollout_correction_problems"]

_KEY = "algorithm.rollout_correction"


def rollout_correction_problems(config: Config) -> list[str]:
    rc, actor = config.algorithm.rollout_correction, config.worker.actor
    problems = []
    if not rc.threshold > 1:
        problems.append(
            f"{_KEY}.threshold={rc.threshold}: must be above 1 (a ratio of 1 is a token the engine and the actor "
            "agree on, and truncate or mask would touch it); e.g. 2.0"
        )
    if not rc.icepop_alpha > 1:
        problems.append(
            f"{_KEY}.icepop_alpha={rc.icepop_alpha}: must be above 1 (icepop keeps ratios in [1/icepop_alpha, "
            "icepop_alpha]); e.g. 2.0"
        )
    if rc.veto_threshold is not None and not 0 < rc.veto_threshold < 1:
        problems.append(
            f"{_KEY}.veto_threshold={rc.veto_threshold}: must be in (0, 1) (a sequence with a token ratio below it is "
            "dropped); e.g. 1e-4, or null for no veto"
        )
    applied = rollout_correction(config)
    explicit = rc.mode is not None
    if explicit and config.worker.rollout.calculate_log_probs is False:
        problems.append(
            f"{_KEY}.mode={rc.mode.value} with worker.rollout.calculate_log_probs=false: the correction's ratio is "
            "the actor's log-prob over the engine's; set worker.rollout.calculate_log_probs=true (or leave it unset)"
        )
    if applied is None:
        unused = [
            f"{_KEY}.{name}={value}"
            for name, value, default in (
                ("level", rc.level.value, "token"),
                ("threshold", rc.threshold, 2.0),
                ("icepop_alpha", rc.icepop_alpha, 2.0),
                ("veto_threshold", rc.veto_threshold, None),
            )
            if value != default
        ]
        if unused:
            why = (
                "the decoupled loss's behaviour weight (worker.actor.behaviour_weight_*) is the correction"
                if decoupled_loss(config)
                else "no correction runs (the engine and the actor both run in float32 and the engine's log-probs "
                "are not asked for, or worker.rollout.calculate_log_probs=false)"
            )
            problems.append(
                f"{', '.join(unused)} with {_KEY}.mode unset: {why}, so these would do nothing; set {_KEY}.mode "
                "(truncate, mask, icepop or none)"
            )
    elif explicit and decoupled_loss(config):
        default = ActorConfig()
        changed = [
            f"worker.actor.{name}={getattr(actor, name)}"
            for name in ("behaviour_weight_cap", "behaviour_weight_mode")
            if getattr(actor, name) != getattr(default, name)
        ]
        if changed:
            problems.append(
                f"{_KEY}.mode={rc.mode.value} with {' and '.join(changed)}: both bound the decoupled loss's weight "
                f"proximal / behaviour, and {_KEY} replaces behaviour_weight_*; keep one: unset {_KEY}.mode, or "
                "leave behaviour_weight_cap and behaviour_weight_mode at their defaults"
            )
    return problems
