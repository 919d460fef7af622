"""Start the reward model (a judge or a score model) and describe how the reward managers reach it.

Separate: one Ray actor of its own, started here while the workers start, so that its load is hidden
behind theirs. Colocated: the training workers already hold it (``HybridWorker.reward_model``); the
managers send their requests to every worker, a slice each.
"""

from __future__ import annotations

import ray

from vlmrl.config import Config, RewardModelPlacement
from vlmrl.plan import Plan
from vlmrl.reward.function import RewardFunctionError
from vlmrl.reward.judging import template_text
from vlmrl.reward.model_service import ModelLink


def start_reward_model(config: Config, plan: Plan) -> ray.actor.ActorHandle | None:
    """The separate reward model's actor, building (not waited on); None when there is none to start."""
    rm = config.worker.reward.reward_model
    if not rm.model_path or rm.placement is not RewardModelPlacement.separate:
        return None
    from vlmrl.workers.reward_model import RewardModelServer

    on_gpu = plan.device == "cuda"
    return (
        ray.remote(RewardModelServer)
        .options(
            num_cpus=rm.num_cpus,
            num_gpus=rm.num_gpus if on_gpu else 0,
            runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}},
        )
        .remote(rm, plan.device, min_pixels=config.data.min_pixels, max_pixels=config.data.max_pixels, colocated=False)
    )


def reward_model_link(config: Config, actor: ray.actor.ActorHandle | None, workers: list | None) -> ModelLink | None:
    """How a reward manager reaches the model; waits until a separate actor has loaded it."""
    reward = config.worker.reward
    rm = reward.reward_model
    if not rm.model_path:
        return None
    if rm.placement is RewardModelPlacement.separate:
        timeout = config.trainer.start_timeout_s
        try:
            ray.get(actor.ready.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            free = ray.available_resources()
            raise RewardFunctionError(
                f"worker.reward.reward_model: {rm.model_path} did not load within trainer.start_timeout_s={timeout:g} "
                f"s; its actor asks for {rm.num_cpus} CPU(s) (and {rm.num_gpus:g} GPU(s) on GPU), the cluster has "
                f"{free.get('CPU', 0):g} CPU and {free.get('GPU', 0):g} GPU free; lower the reward model's num_cpus "
                "or num_gpus, set placement=colocated, or raise trainer.start_timeout_s"
            ) from None
        except ray.exceptions.RayError as e:
            raise RewardFunctionError(
                f"worker.reward.reward_model: {rm.kind.value} model {rm.model_path} failed to load in its actor: {e}"
            ) from None
        servers, prefix = [actor], ""
    else:
        servers, prefix = list(workers), "reward_model_"
    return ModelLink(
        servers=servers,
        method_prefix=prefix,
        kind=rm.kind.value,
        template=template_text(rm.prompt_template),
        parse=rm.parse,
        max_score=rm.max_score,
        sampling={"temperature": rm.temperature, "max_new_tokens": rm.max_new_tokens, "seed": rm.seed},
        timeout=rm.timeout,
        on_timeout=reward.on_timeout,
        on_invalid=rm.on_invalid,
    )
