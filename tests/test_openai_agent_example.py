"""The agent demo (docs/guides/openai-agent.md, examples/openai_agent/) on the real tiny engine and endpoint.

- The agent is written against the ``openai`` package alone (it imports nothing from vlmrl), and its config
  names it, with trajectory aggregation, per-rollout loss averaging and the quickstart's tiny assets.
- Run by an ``AgentRunner`` on 4 rows of the quickstart's validation data, with the quickstart's format-tuned
  model and the lengths the config gives the engine and the endpoint: every rollout ends ok, leaves the reward
  to the reward function (its answer is the last call's reply, which synthetic_colour scores) and makes two
  calls; the row's picture reaches the engine intact in both (expanded to its patch tokens in the recorded
  prompt); call 2's prompt starts with call 1's prompt and response, so trajectory aggregation makes one row
  per rollout with both replies trained, and that row fits data.max_response_length.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf
from transformers import AutoProcessor

from vlmrl.data.media import open_image
from vlmrl.rollout.agents.runner import AgentRunner, AgentStatus, AgentTask, load_agent
from vlmrl.rollout.agents.traces import aggregate
from vlmrl.user_code import load_object

from helpers import agent_endpoint  # noqa: E402  (tests/ is on the path, as for the other agent tests)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai_agent"
AGENT = EXAMPLE / "agent.py"
N_ROWS = 4


@pytest.fixture(scope="module")
def config():
    """The example's YAML as written (the ``${tiny:...}`` paths are not resolved)."""
    return OmegaConf.load(EXAMPLE / "config.yaml")


def test_the_agent_uses_openai_alone_and_the_config_names_it(config):
    tree = ast.parse(AGENT.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "openai" in imported and "vlmrl" not in imported, imported
    assert load_agent(f"{AGENT}:solve").is_async
    assert config.worker.rollout.agent == "examples/openai_agent/agent.py:solve"
    assert config.algorithm.trace_aggregation == "trajectory"
    assert config.worker.actor.loss_avg_mode == "per_rollout_mean"
    quickstart = OmegaConf.load(ROOT / "examples" / "quickstart.yaml")
    for key in ("data.train_files", "data.val_files", "worker.actor.model.model_path", "worker.reward.reward_function"):
        assert OmegaConf.select(config, key) == OmegaConf.select(quickstart, key), key


def test_every_rollout_client_shares_its_event_loops_http_client(monkeypatch):
    """An ``AsyncOpenAI`` made without ``http_client`` builds an HTTP client and an SSL context of its own, about
    30 ms of CPU a rollout on the engine's machine (docs/performance.md): the demo passes one per event loop."""
    agent = load_agent(f"{AGENT}:solve").fn.__globals__
    made = []

    class Recorded(Exception):
        pass

    def record(**kwargs):
        made.append(kwargs["http_client"])
        raise Recorded  # enough: the client solve would use

    monkeypatch.setattr(agent["openai"], "AsyncOpenAI", record)
    task = {"prompt": "<image>What colour?", "images": []}
    llm = type("LLM", (), {"base_url": "http://127.0.0.1:9/v1", "api_key": "k", "model": "m"})

    async def two_rollouts():
        for _ in range(2):
            with pytest.raises(Recorded):
                await agent["solve"](task, llm)

    asyncio.run(two_rollouts())
    asyncio.run(two_rollouts())
    assert made[0] is made[1] and made[2] is made[3], "rollouts in one loop built HTTP clients of their own"
    assert made[0] is not made[2], "a client was shared across event loops (its connections belong to one loop)"


def test_the_agent_makes_two_append_only_calls_with_the_picture_on_the_tiny_engine(config, quickstart_assets):
    processor = AutoProcessor.from_pretrained(quickstart_assets.model_dir)
    tokenizer = processor.tokenizer
    resize = agent_endpoint.resize(processor)  # the dataset's resize, the config's pixel bounds
    assert (config.data.min_pixels, config.data.max_pixels) == (agent_endpoint.MIN_PIXELS, agent_endpoint.MAX_PIXELS)
    rows = pd.read_parquet(quickstart_assets.val_file).head(N_ROWS)
    tasks = [
        AgentTask(
            rollout_id=f"openai-agent-{i}",
            fields={"prompt": row["problem"], "ground_truth": row["answer"], "data_source": row["data_source"]},
            images=[resize(open_image(item, None)) for item in row["images"]],
        )
        for i, row in enumerate(rows.to_dict("records"))
    ]
    # As the trainer sizes them: the engine holds prompt + response; one call samples at most the response budget.
    max_response = config.data.max_response_length
    max_model_len = config.data.max_prompt_length + max_response
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    with agent_endpoint.tiny_engine(quickstart_assets.model_dir, processor, max_model_len) as engine:
        with agent_endpoint.new_endpoint(engine, processor, max_model_len, max_response).start() as endpoint:
            agent = load_agent(f"{AGENT}:solve")
            # One rollout at a time: the seeded engine then samples the same replies on every run. (A reply holding
            # half a UTF-8 character, which the tiny model samples now and then, cannot come back as the same ids
            # through the reply's text: trajectory aggregation starts a new row there, which this test would flag.)
            with AgentRunner(agent, endpoint, max_concurrency=1, timeout=120, decode=decode).start() as runner:
                run = runner.run(tasks)

    assert run.counts()["ok"] == N_ROWS, [r.error for r in run.rollouts]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = processor.image_processor.merge_size
    reward = config.worker.reward
    path, name = reward.reward_function.split(":")
    compute_score = load_object(f"{ROOT / path}:{name}", "worker.reward.reward_function")

    for record in run.rollouts:
        assert record.status is AgentStatus.ok and record.reward is None, record.error
        first, second = record.calls[0], record.calls[1]
        assert len(record.calls) >= 2 and [c.index for c in record.calls[:2]] == [0, 1]
        # The picture reached the engine intact, once per call (the second call sends the conversation again).
        [image] = record.task.images
        assert first.images == second.images == (image,)
        patches = processor.image_processor(images=[image], do_resize=False, return_tensors="pt")["image_grid_thw"]
        assert list(first.prompt_ids).count(pad) == int(patches.prod()) // merge**2 > 0
        assert record.task.fields["prompt"].replace("<image>", "") in tokenizer.decode(first.prompt_ids)
        # Append-only: call 2 goes on from call 1's prompt and response.
        assert list(second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)]) == [
            *first.prompt_ids,
            *first.response_ids,
        ]
        assert all(c.temperature == 1.0 and len(c.log_probs) == len(c.response_ids) > 0 for c in record.calls)
        # The reward function scores the final reply.
        assert record.answer == decode(record.last_call.response_ids)
        truth = record.task.fields["ground_truth"]
        score = compute_score({"response": record.answer, "response_length": 0, "ground_truth": truth},
                              **reward.reward_function_kwargs)  # fmt: skip
        assert score["overall"] == score["accuracy"] in (0.0, 1.0)

    aggregated = aggregate({r.rollout_id: r.calls for r in run.rollouts}, "trajectory", tokenizer.decode)
    assert aggregated.mismatches == [] and len(aggregated.rows) == N_ROWS
    for row, record in zip(aggregated.rows, run.rollouts, strict=True):
        first, last = record.calls[0], record.calls[-1]
        assert row.rollout_id == record.rollout_id and row.calls == [c.index for c in record.calls]
        assert row.token_ids == [*last.prompt_ids, *last.response_ids]
        assert row.prompt_length == len(first.prompt_ids)
        assert row.trained_tokens == sum(len(c.response_ids) for c in record.calls)  # both replies are trained
        assert len(row.token_ids) - row.prompt_length <= max_response  # the merged row fits the config's budget
