"""Relative paths are read from the current directory, and a missing one's error names that directory: data,
model, tokenizer, template, reward function, tool, environment, parser, agent and hook paths at validation, and
the data and media paths the dataset reads."""

from __future__ import annotations

import pytest
from helpers.configs import CPU, problems_of
from helpers.runs import REPO

from vlmrl.data.errors import DataError
from vlmrl.data.media import MediaError, open_image
from vlmrl.data.sources import load_rows

QUICKSTART = f"config={REPO / 'examples' / 'quickstart.yaml'}"
AGENT_QUICKSTART = f"config={REPO / 'examples' / 'agent_quickstart.yaml'}"
JUDGE_QUICKSTART = f"config={REPO / 'examples' / 'judge_quickstart.yaml'}"
AGENT = "worker.rollout.agent=agents/mine.py:solve"
FROM_CWD = " in {cwd} (the current directory, which relative paths are read from)"


@pytest.fixture
def cwd(tmp_path, monkeypatch, quickstart_assets):
    """A current directory other than the repository's: the examples' own relative paths are missing there too."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("config", "overrides", "expected"),
    [
        (QUICKSTART, ["data.train_files=data/train.jsonl"], "data.train_files: data/train.jsonl does not exist"),
        (QUICKSTART, ["data.val_files=data/val.jsonl"], "data.val_files: data/val.jsonl does not exist"),
        (
            QUICKSTART, ["data.format_prompt=prompts/format.jinja"],
            "data.format_prompt: prompts/format.jinja does not exist",
        ),
        (QUICKSTART, ["data.image_dir=images"], "data.image_dir: images does not exist"),
        (
            QUICKSTART, ["worker.actor.model.model_path=models/my/model"],
            "worker.actor.model.model_path: models/my/model does not exist",
        ),
        (
            QUICKSTART, ["worker.actor.model.tokenizer_path=tok"],
            "worker.actor.model.tokenizer_path: tok does not exist",
        ),
        (
            QUICKSTART, ["worker.reward.reward_function=rewards/mine.py:score"],
            "worker.reward.reward_function: file rewards/mine.py does not exist",
        ),
        (
            AGENT_QUICKSTART, ["worker.rollout.multi_turn.tools=[tools/mine.py:search]"],
            "worker.rollout.multi_turn.tools: file tools/mine.py does not exist",
        ),
        (
            AGENT_QUICKSTART, ["worker.rollout.multi_turn.tools=[]", "worker.rollout.multi_turn.env=envs.py:Game"],
            "worker.rollout.multi_turn.env: file envs.py does not exist",
        ),
        (
            AGENT_QUICKSTART, ["worker.rollout.multi_turn.format=parsers.py:parse"],
            "worker.rollout.multi_turn.format: file parsers.py does not exist",
        ),
        (QUICKSTART, [AGENT], "worker.rollout.agent: file agents/mine.py does not exist"),
        (
            QUICKSTART, [AGENT, "worker.rollout.agent_hooks.on_failed=hooks.py:failed"],
            "worker.rollout.agent_hooks.on_failed: file hooks.py does not exist",
        ),
        (
            JUDGE_QUICKSTART, ["worker.reward.reward_model.prompt_template=judge.jinja"],
            "worker.reward.reward_model.prompt_template=judge.jinja: no such file",
        ),
    ],
)  # fmt: skip
def test_a_missing_relative_path_names_the_directory_it_was_resolved_from(cwd, config, overrides, expected):
    problems = problems_of(config, *overrides, cluster=CPU)
    assert [p for p in problems if p.startswith(expected + FROM_CWD.format(cwd=cwd))], problems


def test_a_rollout_data_dir_that_is_a_file_is_refused_naming_where_it_was_resolved(cwd):
    (cwd / "rows").write_text("not a directory")
    problems = problems_of(QUICKSTART, "trainer.rollout_data_dir=rows", cluster=CPU)
    assert [p for p in problems if p.startswith("trainer.rollout_data_dir: rows is a file, not a directory" +
                                                FROM_CWD.format(cwd=cwd))], problems  # fmt: skip
    fine = problems_of(QUICKSTART, "trainer.rollout_data_dir=new/rows", cluster=CPU)  # made when first written
    assert not [p for p in fine if p.startswith("trainer.rollout_data_dir")], fine


def test_the_examples_own_relative_paths_are_read_from_the_current_directory_too(cwd):
    # Run from elsewhere than the repository, the quickstart's own paths are missing and say where they were looked
    # for.
    problems, where = problems_of(QUICKSTART, cluster=CPU), FROM_CWD.format(cwd=cwd)
    assert "data.format_prompt: examples/format_prompt/colour.jinja does not exist" + where in problems
    assert "worker.reward.reward_function: file reward_functions/synthetic_colour.py does not exist" + where in problems


def test_an_absolute_path_is_named_alone(cwd):
    problems = problems_of(QUICKSTART, "data.train_files=/nonexistent/train.jsonl", cluster=CPU)
    assert "data.train_files: /nonexistent/train.jsonl does not exist" in problems, problems


def test_the_dataset_names_the_directory_of_a_missing_data_file_or_image(cwd):
    with pytest.raises(DataError) as info:
        load_rows("data/train.jsonl")
    assert str(info.value) == "data/train.jsonl: no such file or directory" + FROM_CWD.format(cwd=cwd)
    with pytest.raises(MediaError) as info:
        open_image("images/gone.png", None)
    assert str(info.value) == (
        "missing image file 'images/gone.png'" + FROM_CWD.format(cwd=cwd) + "; data.image_dir is not set"
    )
