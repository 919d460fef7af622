"""multi_turn settings are checked before Ray starts: the switch, the limits, and the user's files, loaded.

A broken tools file, a missing function, two tools with one name, an environment that is not a class with
reset and step, or an unknown call format is one clear problem naming the key, reported with the others.
The tool schemas come from the functions, and reach the prompt.
"""

from __future__ import annotations

import pytest
from helpers.configs import CPU, problems_of
from transformers import AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.turns.tools import load_tools, tool_from_function
from vlmrl.user_code import UserCodeError
from vlmrl.validate import load_config

AGENT = "config=examples/agent_quickstart.yaml"
MT = "worker.rollout.multi_turn"
TOOLS = "tests/helpers/agent_tools.py"


def test_the_agent_quickstart_validates():
    config = load_config([AGENT], CPU)
    assert config.worker.rollout.multi_turn.enable and config.worker.rollout.multi_turn.tools


def test_every_multi_turn_problem_is_reported_at_once(tmp_path):
    bad = tmp_path / "bad_tools.py"
    bad.write_text("raise RuntimeError('import-time failure')\n")
    problems = problems_of(
        AGENT,
        f"{MT}.tools=[{bad}:zoom,{TOOLS}:missing]",
        f"{MT}.max_turns=0",
        f"{MT}.tool_timeout=0",
        f"{MT}.max_tokens_per_turn=1000",
        f"{MT}.format=nope",
        "algorithm.adv_estimator=remax",
    )
    text = "\n".join(problems)
    assert "bad_tools.py failed to load: RuntimeError: import-time failure" in text
    assert f"{MT}.max_turns=0: must be at least 1" in text
    assert f"{MT}.tool_timeout=0" in text
    assert f"{MT}.max_tokens_per_turn=1000" in text and "data.max_response_length=96" in text
    assert f"{MT}.format='nope'" in text
    assert "remax" in text and "ReMax's baseline" in text


def test_a_missing_function_and_duplicate_names_are_refused():
    text = "\n".join(problems_of(AGENT, f"{MT}.tools=[{TOOLS}:missing]"))
    assert f"{MT}.tools: {TOOLS} has no 'missing'" in text
    text = "\n".join(problems_of(AGENT, f"{MT}.tools=[{TOOLS}:submit,{TOOLS}:submit]"))
    assert "are both named 'finish'" in text


def test_the_switch_and_the_environment_are_checked():
    assert any("enable=false" in p for p in problems_of(AGENT, f"{MT}.enable=false"))
    assert any("no worker.rollout.multi_turn.tools and no" in p for p in problems_of(AGENT, f"{MT}.tools=[]"))
    both = problems_of(AGENT, f"{MT}.env={TOOLS}:CountingEnv")
    assert any("both set" in p for p in both)
    not_class = problems_of(AGENT, f"{MT}.tools=[]", f"{MT}.env={TOOLS}:reveal")
    assert any("not a class" in p for p in not_class)
    assert load_config([AGENT, f"{MT}.tools=[]", f"{MT}.env={TOOLS}:CountingEnv"], CPU).worker.rollout.multi_turn.env


def test_a_tools_schema_comes_from_its_signature_and_docstring():
    (calc, submit) = load_tools([f"{TOOLS}:calculator", f"{TOOLS}:submit"])
    assert calc.schema() == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "digits and + - * / ( )."},
                    "precision": {"type": "integer", "description": "decimals of the result."},
                },
                "required": ["expression"],
            },
        },
    }
    assert (submit.name, submit.description) == ("finish", "Give the final answer.")
    (reveal,) = load_tools([f"{TOOLS}:reveal"])
    assert reveal.takes_context and reveal.parameters["properties"] == {}

    def positional(x, /):
        """No."""

    with pytest.raises(UserCodeError, match="positional-only"):
        tool_from_function(positional, "here")


def test_the_schemas_reach_the_prompt(tiny_assets):
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    tools = [t.schema() for t in load_tools([f"{TOOLS}:calculator"])]
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=2048, min_pixels=3136, max_pixels=12544, tools=tools,
    )  # fmt: skip
    text = ds[0].prompt_text
    assert '"name": "calculator"' in text and "<tool_call>" in text
    assert text.count("<|im_start|>system") == 1  # the tools replace the default system turn, not add one
