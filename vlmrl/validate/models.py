"""The model's family must have an adapter (``vlmrl.models``), and the run must use it only as its adapter allows:
checked from config.json alone, before Ray starts or any weight loads. Hub ids are left to the workers, which pick
the family from the Hub's config the same way."""

from __future__ import annotations

import json
from pathlib import Path

from vlmrl.config import Config
from vlmrl.config.kinds import workflow_name
from vlmrl.models import Family, UnsupportedFamily, family_of
from vlmrl.plan import Cluster, device, uses_critic


def family_problems(config: Config, cluster: Cluster) -> list[str]:
    """One problem per local model (the actor's, and the critic's when it has its own) whose ``model_type`` no
    family adapter covers, naming the key, the model_type and the supported families; and one per setting the
    actor's family refuses (``Family.no_agent_endpoint``, ``cpu_engine_bfloat16``, ``recurrent_layers``,
    ``routed_experts``), naming the family's reason and the fix."""
    models = [("worker.actor.model.model_path", config.worker.actor.model.model_path)]
    if uses_critic(config) and config.worker.critic.model.model_path:
        models.append(("worker.critic.model.model_path", config.worker.critic.model.model_path))
    problems = []
    for key, path in models:
        config_file = Path(path) / "config.json" if path else None
        if config_file is None or not config_file.is_file():
            continue  # a missing path is path_problems'; a Hub id the workers'
        try:
            model_config = json.loads(config_file.read_text())
        except json.JSONDecodeError:
            continue  # model_problems reports it
        try:
            found = family_of(model_config)
        except UnsupportedFamily as e:
            problems.append(f"{key}={path}: {e}; give a model of a supported family")
            continue
        kind = workflow_name(config.worker.rollout)
        if key == "worker.actor.model.model_path" and found.no_agent_endpoint and kind == "openai_agent":
            problems.append(
                f"{key}={path} ({found.name}) with worker.rollout.workflow={kind}: vlmrl cannot train {found.name} "
                f"on an agent's calls yet ({found.no_agent_endpoint}); use worker.rollout.workflow=multi_turn, a "
                "workflow class or single_turn"
            )
        if key == "worker.actor.model.model_path":
            problems.extend(_actor_family_problems(config, cluster, path, found))
    return problems


def _actor_family_problems(config: Config, cluster: Cluster, path: str, found: Family) -> list[str]:
    """What the actor's family refuses of this run's settings."""
    problems = []
    dtype = config.worker.rollout.dtype.value
    if found.cpu_engine_bfloat16 and device(config, cluster) == "cpu" and dtype != "bfloat16":
        problems.append(
            f"worker.rollout.dtype={dtype} with worker.actor.model.model_path={path} ({found.name}) on CPU: "
            f"{found.cpu_engine_bfloat16}; use worker.rollout.dtype=bfloat16"
        )
    coef = config.worker.actor.router_aux_loss_coef
    if coef > 0 and not found.routed_experts:
        problems.append(
            f"worker.actor.router_aux_loss_coef={coef} with worker.actor.model.model_path={path} ({found.name}): the "
            "model has no router to balance (a mixture-of-experts family has: Qwen3-VL-MoE, Qwen3.5-MoE); use "
            "worker.actor.router_aux_loss_coef=0"
        )
    if coef > 0 and config.worker.actor.share_prompts:
        problems.append(
            f"worker.actor.router_aux_loss_coef={coef} with worker.actor.share_prompts=true: the shared-prompt "
            "forward does not collect the router's logits; use worker.actor.share_prompts=false"
        )
    if found.recurrent_layers and config.worker.actor.share_prompts:
        problems.append(
            f"worker.actor.share_prompts=true with worker.actor.model.model_path={path} ({found.name}): the shared-"
            "prompt forward hands each row its prompt's cached keys and values, and this family's linear-attention "
            "layers cache a recurrent state instead; use worker.actor.share_prompts=false"
        )
    return problems
