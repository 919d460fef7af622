"""A judge or score model: its path, its architecture against the kind, its placement against the devices, the
judge's template; and the reward function against it. Read from the model's config.json only: no model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from vlmrl.config import Config, RewardModelKind, RewardModelPlacement
from vlmrl.plan import Cluster, device, world_size
from vlmrl.reward.judging import JudgeTemplateError, compile_template, render_question, template_text

P = "worker.reward.reward_model"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_GENERATIVE = ("ForConditionalGeneration", "ForCausalLM", "ForImageTextToText")
_SAMPLE_INPUT = {
    "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the shape?<|im_end|>\n",
    "response": "red",
    "ground_truth": "red",
    "images": [None],
    "data_source": "validation",
    "sample_id": 0,
}
"""What the template is rendered on at validation: the keys every reward input has (a row's own fields
are not known yet, so a template that uses one is checked at the first step)."""


def reward_model_problems(config: Config, cluster: Cluster) -> list[str]:
    rm = config.worker.reward.reward_model
    if not rm.model_path:
        return []
    problems = _architecture_problems(rm.model_path, rm.kind)
    for key, value, low in (("micro_batch_size", rm.micro_batch_size, 1), ("max_length", rm.max_length, 16),
                            ("max_new_tokens", rm.max_new_tokens, 1), ("num_cpus", rm.num_cpus, 1)):  # fmt: skip
        if value < low:
            problems.append(f"{P}.{key}={value}: must be at least {low}")
    if rm.timeout is not None and not rm.timeout > 0:
        problems.append(f"{P}.timeout={rm.timeout}: must be a positive number of seconds, or null for no limit")
    if rm.temperature < 0:
        problems.append(f"{P}.temperature={rm.temperature}: must be at least 0 (0 is greedy)")
    if not rm.max_score > 0:
        problems.append(f"{P}.max_score={rm.max_score}: must be positive")
    if rm.kind is RewardModelKind.judge:
        try:
            render_question(compile_template(template_text(rm.prompt_template)), _SAMPLE_INPUT, "a sample input")
        except JudgeTemplateError as e:
            problems.append(
                f"{e} (a template may use question, response, ground_truth, prompt, num_images and the row's fields)"
            )
    elif rm.prompt_template:
        problems.append(f"{P}.prompt_template is set but {P}.kind=score: a score model reads the conversation; "
                        "unset the template or use kind=judge")  # fmt: skip
    problems.extend(_placement_problems(config, cluster))
    return problems


def _architecture_problems(model_path: str, kind: RewardModelKind) -> list[str]:
    config_file = Path(model_path) / "config.json"
    if not Path(model_path).is_dir():
        if _HUB_ID.fullmatch(model_path):
            return []  # a Hub id: its config is read where the model loads, as the actor's is
        return [f"{P}.model_path={model_path}: no such directory (a local model directory, or a Hub id org/name)"]
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        return [f"{P}.model_path={model_path}: cannot read {config_file}: {e}"]
    names = ", ".join(architectures) or "none listed"
    if kind is RewardModelKind.judge and not any(a.endswith(_GENERATIVE) for a in architectures):
        return [
            f"{P}.model_path={model_path} is {names}, not a generative model, but {P}.kind=judge needs one "
            "(ForConditionalGeneration or ForCausalLM); use kind=score for a classifier"
        ]
    if kind is RewardModelKind.score and not any(a.endswith("ForSequenceClassification") for a in architectures):
        return [
            f"{P}.model_path={model_path} is {names}, but {P}.kind=score needs a ForSequenceClassification "
            "model with one label; use kind=judge for a generative model"
        ]
    return []


def _placement_problems(config: Config, cluster: Cluster) -> list[str]:
    rm = config.worker.reward.reward_model
    on_gpu = device(config, cluster) == "cuda"
    if rm.placement is RewardModelPlacement.colocated:
        return []  # it shares each worker's device, as the reference model does
    if not on_gpu:
        return []  # a CPU actor; the local cluster's logical CPUs are sized for it (vlmrl.main)
    if not 0 < rm.num_gpus:
        return [
            f"{P}.num_gpus={rm.num_gpus}: a separate reward model on GPU needs a positive share of a GPU; "
            f"or set {P}.placement=colocated"
        ]
    if config.trainer.nnodes == 1 and cluster.gpus and world_size(config) + rm.num_gpus > cluster.gpus:
        return [
            f"{P}.placement=separate needs {rm.num_gpus:g} GPU(s) beside the {world_size(config)} training "
            f"worker(s), but this machine has {cluster.gpus}; lower trainer.n_gpus_per_node, or set "
            f"{P}.placement=colocated"
        ]
    return []
