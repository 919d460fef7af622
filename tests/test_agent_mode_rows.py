"""An external agent's calls become rows on a worker (``vlmrl.workflows.openai_agent.OpenAIAgent``), on the real
tiny engine and endpoint, in this process.

* An append-only chat template: the demo agent's two calls with the picture make one row per rollout,
  whose tokens are the recorded calls' and whose recorded log-probs are the actor's (fp32).
* A template that rewrites earlier assistant turns (as Qwen3's drops earlier reasoning): call 2's prompt
  does not continue call 1's row, so each rollout splits into two rows and the mismatch is counted.
* A failing agent: its rollouts are counted and left out (``on_failure=drop``), or fail the call
  (``on_failure=fail``) naming the rollout; the agent's own rewards travel on the rows.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers import agent_endpoint
from helpers.configs import CPU
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.plan import resolve
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.train.actor import forward_response
from vlmrl.validate import load_config
from vlmrl.workflows.openai_agent import AgentRolloutError, OpenAIAgent
from vlmrl.user_code import load_object
from vlmrl.workflows.rendering import family_positions


DEMO = "config=examples/openai_agent/config.yaml"
HOOK = "worker.rollout.agent_hooks.on_succeeded=tests/fixtures/agents/recording_hooks.py:on_succeeded"
GREEDY = Sampling(n=2, temperature=0.0, max_tokens=8)

# The tiny model's template, except that an assistant turn before the last message is rewritten.
REWRITING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and not loop.last %}(an earlier reply)"
    "{% elif message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% elif 'text' in item %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def parts(quickstart_assets):
    model_dir = quickstart_assets.model_dir
    processor = AutoProcessor.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    config = load_config([DEMO, HOOK], CPU)
    plan = resolve(config, CPU)
    data = RLHFDataset(
        str(quickstart_assets.val_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=config.data.max_prompt_length, min_pixels=config.data.min_pixels,
        max_pixels=config.data.max_pixels, model_config=hf_config,
    )  # fmt: skip
    with agent_endpoint.tiny_engine(model_dir, processor, plan.rollout_max_model_len) as engine:
        yield SimpleNamespace(
            model_dir=model_dir, processor=processor, hf_config=hf_config, config=config, data=data, engine=engine,
            positions=family_positions(str(model_dir)),
        )  # fmt: skip


def _run(parts, *overrides, sampling=GREEDY, rows=(0, 1), template=None):
    processor, data, engine, positions = parts.processor, parts.data, parts.engine, parts.positions
    config = load_config([DEMO, HOOK, *overrides], CPU)
    if template is not None:  # data.override_chat_template, as a YAML file would give it
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, override_chat_template=template))
    records = load_object("tests/fixtures/agents/recording_hooks.py:RECORDS", "test")  # the hook's own list
    records.clear()
    agents = OpenAIAgent(config, resolve(config, CPU), engine, processor, positions)
    try:
        trajectories, stats = agents.rollout([data[i] for i in rows], [10 + i for i in rows], sampling)
        metrics = stats.counts
    finally:
        agents.close()
    return trajectories, metrics, {r.rollout_id: r for r in records}


def test_an_append_only_template_gives_one_row_per_rollout_made_of_the_recorded_calls(parts):
    processor = parts.processor
    trajectories, metrics, records = _run(parts)
    assert metrics["agent/rollouts/ok"] == 4 and metrics["agent/calls"] == 8
    assert metrics["trace/rows"] == 4 and metrics["trace/mismatches"] == 0
    assert sorted(t.rollout_id for t in trajectories) == sorted(records)
    for t in trajectories:
        first, second = records[t.rollout_id].calls
        context = [*first.prompt_ids, *first.response_ids]
        observation = list(second.prompt_ids[len(context) :])
        assert list(second.prompt_ids[: len(context)]) == context
        assert t.token_ids == [*context, *observation, *second.response_ids]
        assert t.prompt_length == len(first.prompt_ids)
        assert t.loss_mask == [0] * len(first.prompt_ids) + [1] * len(first.response_ids) + [0] * len(
            observation
        ) + [1] * len(second.response_ids)
        assert t.group_id == int(t.rollout_id.split(":")[0]) and t.agent_reward is None  # "<group>:<i>#<call>"
        # The row's picture is the agent's (sent as a data URL), with its patch tokens where the calls had them.
        assert len(t.images) == 1 and t.mm_inputs["image_grid_thw"].shape == (1, 3)
        assert t.response_text == processor.tokenizer.decode(list(second.response_ids), skip_special_tokens=True)
    # The actor's log-probs of the merged rows are the endpoint's recorded ones (fp32 engine and model).
    model = AutoModelForImageTextToText.from_pretrained(parts.model_dir, dtype=torch.float32).eval()
    data = parts.config.data
    batch = to_batch(
        trajectories, max_prompt_length=data.max_prompt_length, max_response_length=data.max_response_length,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    allowed = sampling_mask(processor.tokenizer, parts.hf_config.get_text_config().vocab_size, QWEN_MARKERS)
    with torch.no_grad():
        log_probs, _ = forward_response(model, batch, allowed, with_entropy=False)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) >= 8
    assert (log_probs - batch.rollout_log_probs).abs()[mask].max() < 1e-3


def test_a_template_that_rewrites_earlier_turns_splits_each_rollout_and_counts_it(parts):
    trajectories, metrics, records = _run(parts, template=REWRITING_TEMPLATE)
    assert metrics["agent/rollouts/ok"] == 4
    assert metrics["trace/mismatches"] == 4 and metrics["trace/rows"] == 8
    by_rollout: dict[str, list] = {}
    for t in trajectories:
        by_rollout.setdefault(t.rollout_id, []).append(t)
    for rollout_id, rows in by_rollout.items():
        first, second = records[rollout_id].calls
        assert [r.token_ids for r in rows] == [
            [*first.prompt_ids, *first.response_ids],
            [*second.prompt_ids, *second.response_ids],
        ]
        assert "(an earlier reply)" in parts.processor.tokenizer.decode(list(second.prompt_ids))
        assert len({r.sample_id for r in rows}) == 2 and all(r.group_id == rows[0].group_id for r in rows)


def test_failed_rollouts_are_left_out_or_fail_the_call(parts):
    agent = "worker.rollout.agent=tests/fixtures/agents/flaky.py:solve"
    trajectories, metrics, _ = _run(parts, agent, rows=(0, 1))
    assert metrics["agent/rollouts/ok"] == 2 and metrics["agent/rollouts/raised"] == 2
    assert {t.row_index for t in trajectories} == {0}  # row 1's agents raised: left out, counted
    assert all(t.agent_reward == 1.0 for t in trajectories)  # row 0: the agent's own reward
    with pytest.raises(AgentRolloutError, match=r"2 of 4 agent rollouts failed; the first: rollout 11:0#0: raised"):
        _run(parts, agent, "worker.rollout.agent_options.on_failure=fail", rows=(0, 1))
