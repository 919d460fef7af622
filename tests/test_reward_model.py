"""Rewards from a model, through the real pieces: a reward-manager actor whose reward processes call a judge
(vLLM) or a score model (transformers) served by another Ray actor.

What only shows end to end: the handle reaches the user's function in its reward process; every response
gets its own verdict, in order, judged on its own image; asks from several processes are batched; a score
model's scores are the ones the model gives when called directly; bad verdicts, timeouts and a missing
``reward_model`` parameter give the errors (or the counted zeros) the settings ask for.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest
import ray
import torch
from helpers.shared_cluster import forked_runtime_env
from PIL import Image

from vlmrl.config import Config, Device, DType, JudgeParse, RewardModelKind, TimeoutPolicy
from vlmrl.driver.reward_model import reward_model_link
from vlmrl.reward.function import RewardFunctionError
from vlmrl.reward.judging import DEFAULT_TEMPLATE, compile_template, judge_conversation
from vlmrl.reward.manager import BatchFunctionRewardManager, SequentialFunctionRewardManager
from vlmrl.testing.judge_assets import ensure_judge_assets, judge_question_input, quickstart_prompt_text

COLOURS = ["red", "green", "blue", "yellow"]

FUNCTIONS = """
    def judge_batch(reward_inputs, reward_model):
        texts = reward_model.generate([[{"role": "user", "content": [
            {"type": "image", "image": x["images"][0]}, {"type": "text", "text": "Describe the picture."}]}]
            for x in reward_inputs])
        scores = reward_model.score(reward_inputs)
        return [{"overall": s, "text_length": float(len(t))} for s, t in zip(scores, texts)]

    def judge_one(reward_input, reward_model):
        return {"overall": reward_model.score([reward_input])[0]}

    def no_parameter(reward_input):
        return {"overall": 0.0}
"""


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=forked_runtime_env())
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def judge_assets():
    return ensure_judge_assets()


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "rewards.py"
    path.write_text(textwrap.dedent(FUNCTIONS))
    return str(path)


def _config(model_path, kind: RewardModelKind, **settings) -> Config:
    config = Config()
    config.trainer.device = Device.cpu
    config.data.min_pixels, config.data.max_pixels = 3136, 12544
    rm = config.worker.reward.reward_model
    rm.model_path, rm.kind, rm.dtype, rm.max_length = str(model_path), kind, DType.float32, 1024
    for key, value in settings.items():
        setattr(rm, key, value)
    return config


def _server(config: Config):
    from vlmrl.workers.reward_model import RewardModelServer

    rm = config.worker.reward.reward_model
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    return ray.remote(RewardModelServer).options(num_cpus=1, runtime_env={"env_vars": env}).remote(
        rm, "cpu", min_pixels=3136, max_pixels=12544, colocated=False
    )


def _inputs(prompt_text: str, responses: list[str], truths: list[str]) -> list[dict]:
    # Each sample its own picture: a flat colour, so that the judge's view of it is easy to tell apart.
    rows = []
    for i, (response, truth) in enumerate(zip(responses, truths)):
        image = Image.new("RGB", (56, 56), truth)
        rows.append({**judge_question_input(prompt_text, response, truth, image), "sample_id": i, "data_source": "c"})
    return rows


@pytest.fixture(scope="module")
def judge(cluster, judge_assets):
    config = _config(judge_assets.judge_dir, RewardModelKind.judge)
    actor = _server(config)
    return config, actor, reward_model_link(config, actor, None)


def _compute(manager, inputs: list[dict] | None):
    """``manager.compute(inputs)`` (``start()`` alone for None), its reward processes stopped afterwards."""
    try:
        return manager.start() if inputs is None else manager.compute(inputs)
    finally:
        manager.close()


def _direct_chat(model_dir, conversations, max_tokens):
    """The judge's texts from a vLLM engine built here, not through vlmrl's server."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=1 << 30, enable_chunked_prefill=False,
              mm_processor_kwargs={"min_pixels": 3136, "max_pixels": 12544})  # fmt: skip
    messages = [
        [{**m, "content": [{"type": "image_pil", "image_pil": p["image"]} if p["type"] == "image" else p
                           for p in m["content"]]} for m in c]
        for c in conversations
    ]  # fmt: skip
    outputs = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    del llm
    return [o.outputs[0].text for o in outputs]


def test_judge_gives_each_response_its_own_verdict_on_its_own_image(judge, judge_assets, rewards_file):
    config, _, link = judge
    from transformers import AutoProcessor

    prompt_text = quickstart_prompt_text(AutoProcessor.from_pretrained(judge_assets.judge_dir))
    # Right, wrong, right, wrong, ... over four pictures: the tuned judge should say yes, no, yes, no.
    truths = COLOURS * 2
    responses = [t if i % 2 == 0 else COLOURS[(COLOURS.index(t) + 1) % 4] for i, t in enumerate(truths)]
    inputs = _inputs(prompt_text, responses, truths)
    result = _compute(BatchFunctionRewardManager(f"{rewards_file}:judge_batch", reward_model=link), inputs)
    # The reference: the same conversations judged by an engine built here. The verdicts come back in
    # the inputs' order (a shuffled order would pair verdicts with the wrong responses).
    template = compile_template(DEFAULT_TEMPLATE)
    conversations = [judge_conversation(template, x, "test") for x in inputs]
    texts = _direct_chat(judge_assets.judge_dir, conversations, config.worker.reward.reward_model.max_new_tokens)
    expected = [{"yes": 1.0, "no": 0.0}[t.strip().split()[0].strip(".").lower()] for t in texts]
    assert result.overall == expected
    # The tuned judge mostly agrees with exact match (the example's reward rests on that).
    agree = sum(s == float(r == t) for s, r, t in zip(result.overall, responses, truths))
    assert agree >= 6, (result.overall, responses, truths)
    # generate(): one raw text per conversation, and the description depends on the picture it was given.
    describe = [[{"role": "user", "content": [{"type": "image", "image": x["images"][0]},
                                              {"type": "text", "text": "Describe the picture."}]}] for x in inputs]  # fmt: skip
    raw = _direct_chat(judge_assets.judge_dir, describe, config.worker.reward.reward_model.max_new_tokens)
    assert result.sub_scores["text_length"] == [float(len(t)) for t in raw]
    assert result.metrics["reward_model/requests"] == 2  # one generate, one score: the batch went as one request
    assert result.metrics["reward_model/items"] == 16
    assert result.metrics["reward_model/tokens_per_s"] > 0
    assert result.metrics["reward_model/score_mean"] == pytest.approx(sum(result.overall) / 8)


def test_judge_sees_the_samples_own_image(judge_assets):
    """Swapping two samples' pictures changes what an image-sensitive model says about them: the check above
    compares texts produced from the images each sample carries, so a judge fed the wrong image fails it."""
    images = [Image.new("RGB", (56, 56), c) for c in COLOURS]
    ask = [[{"role": "user", "content": [{"type": "image", "image": im},
                                         {"type": "text", "text": "Describe the picture."}]}] for im in images]  # fmt: skip
    texts = _direct_chat(judge_assets.judge_dir, ask, 16)
    assert len(set(texts)) > 1, texts


def test_asks_from_several_processes_are_batched(judge, judge_assets, rewards_file):
    _, _, link = judge
    from transformers import AutoProcessor

    prompt_text = quickstart_prompt_text(AutoProcessor.from_pretrained(judge_assets.judge_dir))
    inputs = _inputs(prompt_text, COLOURS * 3, COLOURS * 3)
    result = _compute(SequentialFunctionRewardManager(f"{rewards_file}:judge_one", num_cpus=2, reward_model=link), inputs)
    assert len(result.overall) == 12
    # Two processes, each one call at a time: asks that meet within the coalescing window share a request.
    assert result.metrics["reward_model/items"] == 12
    assert result.metrics["reward_model/requests"] < 12


def test_unparseable_verdicts_fail_naming_the_sample_or_count_as_zero(judge, judge_assets, rewards_file):
    _, actor, _ = judge
    # A question the judge was never tuned on, parsed as a number: its yes/no is no number.
    template = "How many shapes? {{ question }} Answer: {{ response }}"
    inputs = _inputs("q", ["red", "blue"], ["red", "red"])
    strict = reward_model_link(_config(judge_assets.judge_dir, RewardModelKind.judge, prompt_template=template,
                                       parse=JudgeParse.number), actor, None)  # fmt: skip
    with pytest.raises(RewardFunctionError, match=r"does not parse as parse=number on sample 0 .*on_invalid=zero"):
        _compute(BatchFunctionRewardManager(f"{rewards_file}:judge_batch", reward_model=strict), inputs)
    lenient = dataclasses.replace(strict, on_invalid=TimeoutPolicy.zero)
    result = _compute(BatchFunctionRewardManager(f"{rewards_file}:judge_batch", reward_model=lenient), inputs)
    assert result.overall == [0.0, 0.0]
    assert result.metrics["reward_model/invalid"] == 2


def test_a_judge_timeout_is_an_error_or_a_counted_zero(judge, judge_assets, rewards_file):
    _, actor, link = judge
    inputs = _inputs("q", ["red"] * 4, ["red"] * 4)
    slow = dataclasses.replace(link, timeout=1e-4)
    with pytest.raises(RewardFunctionError, match=r"ran past worker.reward.reward_model.timeout"):
        _compute(BatchFunctionRewardManager(f"{rewards_file}:judge_batch", reward_model=slow), inputs)
    zero = dataclasses.replace(slow, on_timeout=TimeoutPolicy.zero)
    result = _compute(SequentialFunctionRewardManager(f"{rewards_file}:judge_one", reward_model=zero), inputs)
    assert result.overall == [0.0] * 4
    assert result.metrics["reward_model/timeouts"] == 4
    ray.get(actor.ready.remote())  # the late answers did not break the actor


def test_a_function_without_the_parameter_is_refused_when_a_model_is_set(judge, rewards_file):
    _, _, link = judge
    with pytest.raises(RewardFunctionError, match="has no 'reward_model' parameter"):
        _compute(SequentialFunctionRewardManager(f"{rewards_file}:no_parameter", reward_model=link), None)


def test_score_model_gives_the_scores_of_the_model_called_directly(cluster, judge_assets, rewards_file):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from vlmrl.reward.judging import scored_conversation

    config = _config(judge_assets.score_dir, RewardModelKind.score, micro_batch_size=2)
    actor = _server(config)
    link = reward_model_link(config, actor, None)
    # Different lengths, so that the micro-batches are padded.
    responses = ["red", "a green square", "blue blue blue blue", "yellow", "the red one on the left"]
    inputs = _inputs("<|im_start|>user\nWhat colour?<|im_end|>\n", responses, ["red"] * 5)
    result = _compute(SequentialFunctionRewardManager(f"{rewards_file}:judge_one", reward_model=link), inputs)
    tokenizer = AutoTokenizer.from_pretrained(judge_assets.score_dir)
    model = AutoModelForSequenceClassification.from_pretrained(judge_assets.score_dir, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for x in inputs:  # one at a time: no padding
            conversation = [
                {"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                 else "".join(p.get("text", "") for p in m["content"] if p["type"] == "text")}
                for m in scored_conversation(x)
            ]  # fmt: skip
            ids = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False), return_tensors="pt",
                            add_special_tokens=False)  # fmt: skip
            expected.append(model(**ids).logits[0, 0].item())
    assert result.overall == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 4) for s in expected}) == 5  # the responses are told apart
    assert result.metrics["reward_model/score_min"] == pytest.approx(min(expected), abs=1e-5)
    assert result.metrics["reward_model/score_max"] == pytest.approx(max(expected), abs=1e-5)
    ray.kill(actor)
