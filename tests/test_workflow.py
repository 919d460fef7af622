"""User workflows (``vlmrl.rollout.workflow``) on the real in-process vLLM (tiny model, fp32), against the actor.

- A workflow that generates token-in/token-out, with an image it makes mid-episode: the actor's log-probs on its
  trajectories equal the engine's, and its loss mask trains exactly the tokens the model sampled.
- The built-in single_turn and the same thing written as a workflow give the same trajectories on the same seeds.
- Failure: a workflow that raises, hangs or returns the wrong type is an error naming the workflow and the row, or
  with skip a dropped sample that is counted; ``None`` drops a sample.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import MODEL_INPUT_KEYS, RLHFDataset
from vlmrl.data.media import resize_to_grid
from vlmrl.models import family_of
from vlmrl.models.qwen_vision import QwenMediaSizes
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.vllm import VLLMEngine
from vlmrl.rollout.turns.observations import ConversationRenderer
from vlmrl.rollout.turns.tools import ToolRunner, load_tools
from vlmrl.rollout.workflow import OnError, WorkflowError, WorkflowRollouts, check_workflow_class
from vlmrl.train.actor import forward_response
from vlmrl.user_code import load_object
from vlmrl.workflows.single_turn import SingleTurn

MIN_PIXELS, MAX_PIXELS = 3136, 12544
PROMPT, RESPONSE = 1024, 64
FILE = "tests/fixtures/workflows/workflows.py"
SAMPLING = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE, want_log_probs=True)


@pytest.fixture(scope="module")
def parts(tiny_assets):
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    config = AutoConfig.from_pretrained(tiny_assets.model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()
    allowed = sampling_mask(processor.tokenizer, config.get_text_config().vocab_size, QWEN_MARKERS)
    threads = torch.get_num_threads()
    engine = VLLMEngine(
        str(tiny_assets.model_dir), dtype="float32", seed=2, max_model_len=PROMPT + RESPONSE,
        max_num_batched_tokens=PROMPT + RESPONSE, enforce_eager=True, gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=1, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, allowed_tokens=allowed,
    )  # fmt: skip
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=PROMPT, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, model_config=config,
    )  # fmt: skip
    yield processor, config, model, allowed, engine, [ds[0], ds[1]]
    from vllm.distributed import cleanup_dist_env_and_memory

    del engine
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)


def _pad_ids(processor) -> tuple[int, int]:
    vocab = processor.tokenizer.get_vocab()
    return vocab["<|image_pad|>"], vocab["<|video_pad|>"]


def _rollouts(parts, name: str, *, on_error=OnError.error, timeout=30.0, tools=None, **kwargs) -> WorkflowRollouts:
    processor, config, _, _, engine, _ = parts
    ip = processor.image_processor
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[], template_has_tools=False,
        resize=lambda image: resize_to_grid(image.convert("RGB"), QwenMediaSizes.of(ip, MIN_PIXELS, MAX_PIXELS)),
        model_input_keys=MODEL_INPUT_KEYS,
    )  # fmt: skip
    spec = f"{FILE}:{name}"
    return WorkflowRollouts(
        load_object(spec, "test")(**kwargs), spec, engine, renderer, positions=family_of(config).positions(config).positions,
        pad_ids=_pad_ids(processor), max_response_length=RESPONSE, timeout=timeout, on_error=on_error, tools=tools,
    )  # fmt: skip


@pytest.fixture(scope="module")
def look_again(parts):
    """Two prompts x 2 samples of LookAgain: answer, a picture made mid-episode, answer again."""
    trajectories, stats = _rollouts(parts, "LookAgain").rollout(parts[5], [3, 8], SAMPLING)
    return trajectories, stats


def test_the_actor_log_probs_equal_the_engines_after_an_image_made_mid_episode(parts, look_again):
    processor, _, model, allowed, _, prompts = parts
    trajectories, stats = look_again
    assert len(trajectories) == 4 and stats.counts["workflow/errors"] == 0
    # Each trajectory shows its prompt's image and the picture the workflow drew, and both model turns.
    assert all(len(t.images) == 2 and len(t.turn_ends) == 2 for t in trajectories)
    assert [m["role"] for m in trajectories[0].messages] == ["assistant", "user", "assistant"]
    batch = to_batch(trajectories, max_prompt_length=PROMPT, max_response_length=RESPONSE,
                     pad_token_id=processor.tokenizer.pad_token_id)  # fmt: skip
    with torch.no_grad():
        log_probs, _ = forward_response(model, batch, allowed, with_entropy=False)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) > 0
    # fp32 engine and actor agree to ~2e-3 on image prompts (ENVIRONMENT.md); the second turn's tokens come after
    # the drawn picture, so a picture the actor saw otherwise than the engine would move them far past this.
    diff = (log_probs - batch.rollout_log_probs).abs()[mask]
    assert diff.max() < 2e-2, diff.max()


def test_the_loss_mask_trains_exactly_the_sampled_tokens(look_again):
    trajectories, _ = look_again
    generated = load_object(f"{FILE}:GENERATED", "test")
    for t in trajectories:
        first, second = generated[t.sample_id]
        assert [tok for tok, m in zip(t.token_ids, t.loss_mask) if m] == first + second
        # The first turn follows the prompt; the second ends the sequence; between them only context.
        assert t.token_ids[t.prompt_length : t.prompt_length + len(first)] == first
        assert t.token_ids[-len(second) :] == second and t.loss_mask[-len(second) :] == [1] * len(second)
        between = t.loss_mask[t.prompt_length + len(first) : len(t.token_ids) - len(second)]
        assert between and not any(between)  # the user message with its picture's patch tokens
        assert all(v == -1 for v, m in zip(t.versions, t.loss_mask) if not m)


def test_the_builtin_single_turn_equals_the_same_workflow_written_by_hand(parts):
    processor, _, _, _, engine, prompts = parts
    builtin, _ = SingleTurn(engine, _pad_ids(processor)).rollout(prompts, [3, 8], SAMPLING)
    by_hand, stats = _rollouts(parts, "SingleTurnByHand").rollout(prompts, [3, 8], SAMPLING)
    assert len(builtin) == len(by_hand) == 4 and stats.counts["workflow/dropped"] == 0
    for a, b in zip(builtin, by_hand):
        assert (a.sample_id, a.token_ids, a.loss_mask, a.prompt_length) == (b.sample_id, b.token_ids, b.loss_mask, b.prompt_length)
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-6) and a.versions == b.versions
        assert torch.equal(a.position_ids, b.position_ids) and not b.turn_ends  # recorded as a single turn
        assert [m.offset for m in a.media] == [m.offset for m in b.media]
        assert a.mm_inputs.keys() == b.mm_inputs.keys()
        assert all(torch.equal(a.mm_inputs[k], b.mm_inputs[k]) for k in a.mm_inputs)


def test_a_workflow_that_raises_names_the_workflow_and_the_row(parts):
    with pytest.raises(WorkflowError) as e:
        _rollouts(parts, "Raises").rollout(parts[5], [3, 8], SAMPLING)
    text = str(e.value)
    assert f"workflow {FILE}:Raises" in text and f"row {parts[5][0].uid}" in text and "no luck on row" in text
    assert "data.on_bad_sample=skip" in text


def test_with_skip_a_raising_sample_is_dropped_and_counted(parts):
    trajectories, stats = _rollouts(parts, "RaisesOnSecondRow", on_error=OnError.skip).rollout(
        parts[5], [4, 7], SAMPLING
    )
    assert [t.group_id for t in trajectories] == [4, 4] and stats.counts["workflow/errors"] == 2


def test_a_hanging_workflow_is_cut_by_its_timeout(parts):
    import time

    start = time.perf_counter()
    with pytest.raises(WorkflowError, match="workflow_timeout=0.5"):
        _rollouts(parts, "Hangs", timeout=0.5).rollout(parts[5], [3, 8], SAMPLING)
    assert time.perf_counter() - start < 20
    _, stats = _rollouts(parts, "Hangs", timeout=0.5, on_error=OnError.skip).rollout(parts[5], [3, 8], SAMPLING)
    assert stats.counts["workflow/timeouts"] == 4
    assert not parts[4].has_unfinished()  # nothing left running on the engine


def test_a_wrong_return_type_names_the_workflow_and_the_row(parts):
    with pytest.raises(WorkflowError, match=r"ReturnsText, row .* run returned str; it must return an Episode"):
        _rollouts(parts, "ReturnsText").rollout(parts[5], [3, 8], SAMPLING)


def test_none_drops_a_sample_and_an_episode_reward_reaches_the_record(parts):
    trajectories, stats = _rollouts(parts, "DropsOddSamples").rollout(parts[5], [3, 8], SAMPLING)
    assert [t.sample_id for t in trajectories] == ["3:0", "8:0"] and stats.counts["workflow/dropped"] == 2
    assert all(t.agent_reward == 0.0 for t in trajectories)


@pytest.mark.parametrize(
    ("name", "says"),
    [("NotAsync", "run is not async"), ("NoRun", "has no run method"), ("SingleTurnByHand", None)],
)
def test_a_class_without_an_async_run_is_refused(name, says):
    problems = check_workflow_class(load_object(f"{FILE}:{name}", "test"), f"{FILE}:{name}")
    assert (problems == []) if says is None else (says in problems[0] and FILE in problems[0])


def test_a_workflow_calls_a_configured_tool_and_shows_its_picture(parts):
    runner = ToolRunner(load_tools(["tests/helpers/agent_tools.py:reveal"]), 5.0)
    try:
        trajectories, _ = _rollouts(parts, "CallsATool", tools=runner).rollout(parts[5], [3, 8], SAMPLING)
    finally:
        runner.close()
    assert len(trajectories) == 4
    for t in trajectories:
        assert t.stop_reason == "ok"  # the tool ran
        assert t.turn_rewards == [0.25, 0.0]  # the tool's reward on the turn that called it
        assert len(t.images) == 2  # the row's image, then the tool's card
        assert "picture 0" in json.dumps(t.messages)
        # Recorded as the multi-turn loop records its calls: the reward function's tool_calls, the tool metrics.
        assert [(c["name"], c["status"], c["turn"]) for c in t.tool_calls] == [("reveal", "ok", 0)]
        assert t.tool_calls[0]["seconds"] >= 0
