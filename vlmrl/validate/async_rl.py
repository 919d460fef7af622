"""Asynchronous training (``worker.rollout.async_rl``): the bound, the placement, and what it cannot run with."""

from __future__ import annotations

from vlmrl.config import AsyncPlacement, Config
from vlmrl.config.options import WeightTransfer

P = "worker.rollout.async_rl"


def async_problems(config: Config) -> list[str]:
    a = config.worker.rollout.async_rl
    problems: list[str] = []
    if a.weight_transfer is not WeightTransfer.auto and not (a.enable and a.placement is AsyncPlacement.disaggregated):
        problems.append(
            f"{P}.weight_transfer={a.weight_transfer.value} without {P}.enable=true and {P}.placement=disaggregated: "
            "only rollout servers are sent the weights (a colocated engine loads them in its own process); set "
            f"{P}.weight_transfer=auto, or {P}.enable=true {P}.placement=disaggregated"
        )
    if not a.enable:
        return problems
    eta, groups = a.max_head_offpolicyness, config.data.rollout_batch_size
    if eta < 0:
        problems.append(f"{P}.max_head_offpolicyness={eta}: must be 0 (the synchronous schedule) or more")
    if a.max_concurrent_rollouts is not None and a.max_concurrent_rollouts < groups:
        problems.append(
            f"{P}.max_concurrent_rollouts={a.max_concurrent_rollouts}: below data.rollout_batch_size={groups}, a step "
            "could never gather its groups; raise it, or null for (max_head_offpolicyness + 1) x rollout_batch_size"
        )
    if a.placement is AsyncPlacement.disaggregated:
        problems.extend(_disaggregated_problems(config))
    if a.placement is AsyncPlacement.colocated and a.weight_sync_interval != 1:
        problems.append(
            f"{P}.weight_sync_interval={a.weight_sync_interval}: colocated, the engine gets the weights after every "
            "update (its workers hold both); set 1"
        )
    if eta > 0 and config.worker.actor.use_decoupled_loss is False:
        # Unset, the decoupled loss follows from eta > 0 (vlmrl.plan.decoupled_loss); only an explicit false is refused.
        problems.append(
            f"{P}.max_head_offpolicyness={eta} with worker.actor.use_decoupled_loss=false: tokens up to {eta} "
            "version(s) old need the loss corrected for the policy that sampled them; set "
            "worker.actor.use_decoupled_loss=true or leave it unset (it is then on, with vLLM's log-probs), "
            f"or {P}.max_head_offpolicyness=0"
        )
    return problems


def _disaggregated_problems(config: Config) -> list[str]:
    """What the rollout servers (``vlmrl.workers.rollout_server``) cannot do yet, each with the fix."""
    a, rollout = config.worker.rollout.async_rl, config.worker.rollout
    problems: list[str] = []
    where = f"with {P}.placement=disaggregated"
    if a.rollout_workers < 1:
        problems.append(f"{P}.rollout_workers={a.rollout_workers}: disaggregated needs at least 1 rollout server")
    k, eta = a.weight_sync_interval, a.max_head_offpolicyness
    if k < 1:
        problems.append(f"{P}.weight_sync_interval={k}: must be 1 (a push after every update) or more")
    elif k - 1 > eta:
        problems.append(
            f"{P}.weight_sync_interval={k} {where} and max_head_offpolicyness={eta}: between pushes the servers "
            f"sample with weights up to {k - 1} version(s) behind the trainer, so every such group would be stale; "
            f"raise {P}.max_head_offpolicyness to {k - 1} or more, or lower the interval to {eta + 1}"
        )
    return problems
