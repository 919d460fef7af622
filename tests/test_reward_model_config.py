"""The reward model's settings, checked before Ray starts; and the pure pieces: the judge's question and its parse.

Validation reads only the model's config.json and renders the template on the training data's first row, so
these tests start no actor and load no model.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from PIL import Image

from vlmrl.config import ConfigError, JudgeParse
from vlmrl.plan import Cluster
from vlmrl.reward.judging import (
    DEFAULT_TEMPLATE,
    compile_template,
    judge_conversation,
    parse_verdict,
    question_of,
    scored_conversation,
    template_text,
)
from vlmrl.testing.judge_assets import ensure_judge_assets
from vlmrl.validate import load_config

CPU = Cluster(gpus=0, cpus=2)
GPU_NODE = Cluster(gpus=8, cpus=64)
P = "worker.reward.reward_model"


@pytest.fixture(scope="module")
def models():
    return ensure_judge_assets()


def _problems(args: list[str], cluster: Cluster = CPU) -> list[str]:
    try:
        load_config(["config=examples/judge_quickstart.yaml", *args], cluster)
    except ConfigError as e:
        return e.problems
    return []


def test_the_judge_quickstart_validates():
    assert _problems([]) == []


def test_an_architecture_that_does_not_fit_the_kind_is_refused(models):
    problems = _problems([f"{P}.model_path={models.score_dir}"])  # a classifier as a judge
    assert any("Qwen2ForSequenceClassification, not a generative model" in p and "kind=score" in p for p in problems)
    problems = _problems([f"{P}.model_path={models.judge_dir}", f"{P}.kind=score", f"{P}.prompt_template="])
    assert any("kind=score needs a ForSequenceClassification" in p for p in problems), problems


def test_a_missing_model_directory_is_named():
    problems = _problems([f"{P}.model_path=/nowhere/judge"])
    assert any(p.startswith(f"{P}.model_path=/nowhere/judge: no such directory") for p in problems), problems


def test_a_template_that_does_not_render_is_refused(tmp_path):
    bad_syntax = tmp_path / "bad.jinja"
    bad_syntax.write_text("Grade {{ response ")
    unknown = tmp_path / "unknown.jinja"
    unknown.write_text("Grade {{ respons }}")
    assert any("line 1" in p for p in _problems([f"{P}.prompt_template={bad_syntax}"]))
    problems = _problems([f"{P}.prompt_template={unknown}"])
    assert any("'respons' is undefined" in p and "may use question, response" in p for p in problems), problems
    assert any("no such file" in p for p in _problems([f"{P}.prompt_template={tmp_path}/none.jinja"]))


def _rows_with_a_shape_column(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text(
        '{"problem": "What colour is the shape?", "answer": "red", "shape": "circle", "data_source": "mine"}\n'
        '{"problem": "What colour is it?", "answer": "blue", "shape": "square", "data_source": "mine"}\n'
    )
    return rows


def test_a_template_over_the_rows_own_columns_renders_on_the_first_training_row(tmp_path):
    template = tmp_path / "judge.jinja"
    template.write_text("Is the {{ shape }} {{ response }}? Reference: {{ ground_truth }} ({{ data_source }})")
    rows = _rows_with_a_shape_column(tmp_path)
    assert _problems([f"data.train_files={rows}", f"{P}.prompt_template={template}"]) == []


def test_a_template_naming_a_column_the_row_lacks_is_refused_naming_the_row_and_the_variable(tmp_path):
    template = tmp_path / "judge.jinja"
    template.write_text("Is the {{ shapes }} {{ response }}?")
    rows = _rows_with_a_shape_column(tmp_path)
    problems = _problems([f"data.train_files={rows}", f"{P}.prompt_template={template}"])
    (mine,) = [p for p in problems if "prompt_template" in p]
    assert f"does not render for the first training row ({rows}, row 0)" in mine
    assert "'shapes' is undefined" in mine and "that row's columns: data_source, shape" in mine


def test_the_first_row_is_read_from_each_kind_of_source(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmrl.validate.first_row import first_row

    records = [{"problem": "p0", "answer": "a0"}, {"problem": "p1", "answer": "a1"}]
    (tmp_path / "rows.jsonl").write_text("\n" + "\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "rows.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "dir").mkdir()
    pq.write_table(pa.Table.from_pylist(records[1:]), tmp_path / "dir" / "b.parquet")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "dir" / "a.parquet")
    for source in ("rows.jsonl", "rows.json", "rows.parquet", "saved", "dir"):
        first = first_row(f"{tmp_path / source}, {tmp_path / 'rows.jsonl'}")
        assert first is not None and first.row == records[0], source
    assert first_row(str(tmp_path / "dir")).where == f"{tmp_path / 'dir' / 'a.parquet'}, row 0"
    assert first_row("owner/dataset@train") is None  # a hub dataset is not read at validation


def test_a_separate_model_must_fit_beside_the_workers_on_gpu():
    args = [f"{P}.model_path=Qwen/Qwen2.5-VL-7B-Instruct", "trainer.n_gpus_per_node=8", "worker.rollout.n=8"]
    problems = _problems(args, GPU_NODE)
    assert any("needs 1 GPU(s) beside the 8 training worker(s)" in p for p in problems), problems
    assert not any("needs 1 GPU" in p for p in _problems([*args, f"{P}.placement=colocated"], GPU_NODE))
    assert not any("needs 1 GPU" in p for p in _problems([*args, "trainer.n_gpus_per_node=4"], GPU_NODE))


def test_the_reward_function_and_the_model_must_go_together(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(textwrap.dedent("""
        def plain(reward_input):
            return {"overall": 0.0}

        def wants_model(reward_input, reward_model):
            return {"overall": 0.0}
    """))
    problems = _problems([f"worker.reward.reward_function={rewards}:plain"])
    assert any("has no 'reward_model' parameter" in p for p in problems), problems
    problems = _problems([f"worker.reward.reward_function={rewards}:wants_model", f"{P}.model_path="])
    assert any("takes a 'reward_model' parameter but no reward model is configured" in p for p in problems)
    # No reward function at all: the model's score is the reward.
    assert _problems(["worker.reward.reward_function="]) == []
    problems = _problems(["worker.reward.reward_function=", f"{P}.model_path="])
    assert any("worker.reward.reward_function is empty" in p and "reward_model.model_path" in p for p in problems)


def test_every_problem_is_reported_at_once():
    problems = _problems([f"{P}.model_path=/nowhere", f"{P}.micro_batch_size=0", f"{P}.timeout=-1",
                          f"{P}.max_score=0", f"{P}.temperature=-0.5"])  # fmt: skip
    for needle in ("no such directory", "micro_batch_size=0", "timeout=-1", "max_score=0", "temperature=-0.5"):
        assert any(needle in p for p in problems), (needle, problems)


def test_a_bad_option_value_names_the_choices():
    problems = _problems([f"{P}.kind=oracle", f"{P}.placement=nearby"])
    assert any("kind='oracle'" in p and "judge, score" in p for p in problems), problems
    assert any("placement='nearby'" in p and "colocated, separate" in p for p in problems), problems


# ----------------------------------------------------------------------------- the pure pieces


@pytest.mark.parametrize(
    ("text", "mode", "expected"),
    [
        ("yes", JudgeParse.yes_no, 1.0),
        ("No.", JudgeParse.yes_no, 0.0),
        ("  YES, the colour matches", JudgeParse.yes_no, 1.0),
        ("The answer is yes", JudgeParse.yes_no, None),  # only the first word counts
        ("", JudgeParse.yes_no, None),
        ("7", JudgeParse.number, 0.7),  # 7 / max_score 10
        ("Score: 10/10", JudgeParse.number, 1.0),  # the first number
        ("11", JudgeParse.number, None),  # over max_score
        ("-1", JudgeParse.number, None),
        ("great", JudgeParse.number, None),
    ],
)
def test_parse_verdict(text, mode, expected):
    assert parse_verdict(text, mode, max_score=10.0) == expected


def test_the_question_is_the_prompts_last_user_turn_without_markup():
    prompt = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "What colour is the shape? Answer with one word.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert question_of(prompt) == "What colour is the shape? Answer with one word."
    assert question_of("plain text question") == "plain text question"


def test_the_judge_gets_the_samples_own_images_then_the_question():
    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")
    x = {"prompt": "<|im_start|>user\nWhich?<|im_end|>\n", "response": "red", "ground_truth": "blue",
         "images": [red, blue], "difficulty": 3}  # fmt: skip
    (message,) = judge_conversation(compile_template("{{ question }}|{{ response }}|{{ difficulty }}"), x, "s")
    assert message["content"][0]["image"] is red and message["content"][1]["image"] is blue  # not copies
    assert message["content"][2] == {"type": "text", "text": "Which?|red|3"}
    default = judge_conversation(compile_template(DEFAULT_TEMPLATE), x, "s")[0]["content"][-1]["text"]
    assert "Reference answer: blue" in default and "Answer to grade: red" in default and "images above" in default
    user, assistant = scored_conversation(x)
    assert user["content"][0]["image"] is red and assistant == {"role": "assistant", "content": "red"}


def test_a_template_is_a_file_or_the_text_itself(tmp_path):
    path = tmp_path / "q.jinja"
    path.write_text("Grade {{ response }}")
    assert template_text(str(path)) == "Grade {{ response }}"
    assert template_text("Grade {{ response }} inline") == "Grade {{ response }} inline"
    assert template_text("") == DEFAULT_TEMPLATE
