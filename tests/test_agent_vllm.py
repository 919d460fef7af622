"""Multi-turn rollouts on the real in-process vLLM (tiny model, fp32), checked against the actor.

The decisive check: the actor's log-probs on the assembled multi-turn batch equal the log-probs vLLM gave
each sampled token, turn by turn, with tool images between the turns. If the actor were given the tool
images in another order than the engine saw them, its log-probs after those images would differ, and the
check must catch it (swapping two tool images' pixels moves them far past the tolerance).

Also: the same rollout done twice samples the same tokens (each turn is seeded by group, sample and turn),
the trajectories turn into the padded view the passes use, and every request names each of its images by
its content id, so the engine need not hash the images a trajectory sends again at every turn.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from helpers import agent_tools
from vlmrl.data.dataset import MODEL_INPUT_KEYS, RLHFDataset
from vlmrl.data.media import resize_to_grid
from vlmrl.models import family_of
from vlmrl.models.qwen_vision import QwenMediaSizes
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine import Sampling, image_content_id
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.vllm import VLLMEngine
from vlmrl.rollout.turns.loop import AgentLoop, Limits
from vlmrl.rollout.turns.observations import ConversationRenderer
from vlmrl.rollout.turns.tools import ToolRunner, load_tools
from vlmrl.train.actor import forward_response

MIN_PIXELS, MAX_PIXELS = 3136, 12544
PROMPT, RESPONSE = 1024, 160


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
    yield processor, config, model, allowed, engine
    from vllm.distributed import cleanup_dist_env_and_memory

    del engine
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)


class _Recording:
    """The engine, keeping every request it is given."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests):
        self.requests += requests
        return self.engine.generate(requests)


def _rollout(tiny_assets, parts):
    """The trajectories of a two-prompt, n=2 rollout, and the engine requests of its turns."""
    processor, config, _, _, engine = parts
    engine = _Recording(engine)
    tools = load_tools(["tests/helpers/agent_tools.py:reveal"])
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=PROMPT, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        model_config=config, tools=[t.schema() for t in tools],
    )  # fmt: skip
    ip = processor.image_processor
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[t.schema() for t in tools], template_has_tools=False,
        resize=lambda image: resize_to_grid(image, QwenMediaSizes.of(ip, MIN_PIXELS, MAX_PIXELS)),
        model_input_keys=MODEL_INPUT_KEYS,
    )  # fmt: skip
    vocab = processor.tokenizer.get_vocab()
    loop = AgentLoop(
        engine, renderer,
        Limits(max_turns=3, max_response_length=RESPONSE, max_tokens_per_turn=8, max_tool_response_length=32,
               max_images=4, tool_timeout=5.0, max_parallel_calls=2),
        positions=family_of(config).positions(config).positions, pad_ids=(vocab["<|image_pad|>"], vocab["<|video_pad|>"]),
        runner=ToolRunner(tools, 5.0), parser=agent_tools.call_reveal,
    )  # fmt: skip
    sampling = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE, want_log_probs=True)
    trajectories, _ = loop.run([ds[0], ds[1]], [3, 8], sampling)
    return trajectories, engine.requests


@pytest.fixture(scope="module")
def rollout(tiny_assets, parts):
    return _rollout(tiny_assets, parts)


@pytest.fixture(scope="module")
def trajectories(rollout):
    return rollout[0]


def _actor_log_probs(parts, trajectories):
    processor, _, model, allowed, _ = parts
    batch = to_batch(trajectories, max_prompt_length=PROMPT, max_response_length=RESPONSE,
                     pad_token_id=processor.tokenizer.pad_token_id)  # fmt: skip
    with torch.no_grad():
        log_probs, _ = forward_response(model, batch, allowed, with_entropy=False)
    return batch, log_probs


def test_actor_log_probs_equal_vllms_turn_by_turn_with_tool_images(parts, trajectories):
    multi = [t for t in trajectories if len(t.images) > 1]
    assert multi, "no trajectory got a tool image: the check would not test tool images"
    batch, log_probs = _actor_log_probs(parts, trajectories)
    mask = batch.response_mask.bool()
    assert int(mask.sum()) > 0 and torch.isfinite(log_probs[mask]).all()
    # vLLM and the actor agree to ~2e-3 in fp32 on image prompts (ENVIRONMENT.md); the same here on every
    # trained token of every turn, after the tool images.
    diff = (log_probs - batch.rollout_log_probs).abs()[mask]
    assert diff.max() < 2e-2, diff.max()
    for row, t in enumerate(trajectories):
        for turn, end in enumerate(t.turn_ends):
            start = t.turn_ends[turn - 1] + 1 if turn else t.prompt_length
            cols = [i - t.prompt_length for i in range(start, end + 1) if t.loss_mask[i]]
            assert cols and (log_probs[row, cols] - batch.rollout_log_probs[row, cols]).abs().max() < 2e-2, (row, turn)


def test_tool_images_in_the_wrong_order_fail_the_check(parts, trajectories):
    swapped = []
    for t in trajectories:
        grids = t.mm_inputs["image_grid_thw"]
        if len(grids) < 3:
            swapped.append(t)
            continue
        sizes = grids.prod(dim=1).tolist()  # patches per image; the two tool images of turns 0 and 1
        a0 = sizes[0]
        a1, b1 = a0 + sizes[1], a0 + sizes[1] + sizes[2]
        assert sizes[1] == sizes[2]
        pixels = t.mm_inputs["pixel_values"].clone()
        pixels[a0:a1], pixels[a1:b1] = t.mm_inputs["pixel_values"][a1:b1], t.mm_inputs["pixel_values"][a0:a1]
        swapped.append(dataclasses.replace(t, mm_inputs={**t.mm_inputs, "pixel_values": pixels}))
    assert any(s is not t for s, t in zip(swapped, trajectories)), "no trajectory had two tool images"
    batch, log_probs = _actor_log_probs(parts, swapped)
    diff = (log_probs - batch.rollout_log_probs).abs()[batch.response_mask.bool()]
    assert diff.max() > 5e-2, diff.max()


def test_the_same_rollout_twice_samples_the_same_tokens(tiny_assets, parts, trajectories):
    again, _ = _rollout(tiny_assets, parts)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajectories]
    # And the turns of one trajectory are distinct draws, not one seed replayed.
    t = trajectories[0]
    turns = [t.token_ids[(t.turn_ends[i - 1] + 1 if i else t.prompt_length) : e + 1] for i, e in enumerate(t.turn_ends)]
    assert len({tuple(x) for x in turns}) > 1


def test_each_request_names_its_images_by_content_id(rollout):
    # The ids are vLLM's keys for the images' processed inputs: an id on the wrong image would feed the engine
    # another image's features (the decisive check above would then fail too).
    trajectories, requests = rollout
    with_images = [r for r in requests if r.multi_modal_data.get("image")]
    assert len(with_images) == len(requests) and any(len(r.multi_modal_data["image"]) > 1 for r in requests)
    for r in with_images:
        assert r.multi_modal_ids == {"image": [image_content_id(i) for i in r.multi_modal_data["image"]]}
    # A later turn sends the prompt's image again under the same id, and a tool's image under its own.
    later = next(r for r in requests if len(r.multi_modal_data["image"]) > 1)
    first = next(r for r in requests if r.request_id.rsplit(":", 1)[0] == later.request_id.rsplit(":", 1)[0])
    assert later.multi_modal_ids["image"][0] == first.multi_modal_ids["image"][0]
    assert len(set(later.multi_modal_ids["image"])) == len(later.multi_modal_ids["image"])
