"""Dataset samples go through the vLLM rollout and the actor: one engine for the module (it is slow to start).

A batch mixing a multi-image row, a video row, a text-only row and a row with
both goes to the vLLM engine; vLLM must expand each placeholder into
exactly the actor's tokens, and the actor's log-probs of the sampled tokens,
computed from the dataset's positions, must match vLLM's (wrong positions move
them by ~0.1).
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.media import png, write_parquet, write_video
from transformers import AutoModelForImageTextToText, AutoProcessor

from helpers.trajectories import Response, batch_of
from vlmrl.data.dataset import RLHFDataset
from vlmrl.train.actor import forward_response
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.rollout.engine.vllm import VLLMEngine

MIN_PIXELS, MAX_PIXELS = 3136, 12544
RESPONSE = 4


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_assets):
    return AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollout(tiny_assets, hf_model, processor):
    threads = torch.get_num_threads()
    engine = VLLMEngine(
        str(tiny_assets.model_dir),
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_batched_tokens=512,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        cpu_kvcache_space_gb=1,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        allowed_tokens=sampling_mask(processor.tokenizer, hf_model.config.get_text_config().vocab_size, QWEN_MARKERS),
    )
    yield engine
    from vllm.distributed import cleanup_dist_env_and_memory

    del engine
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)  # vLLM lowers it to 1 for serving


@pytest.fixture(scope="module")
def samples(tmp_path_factory, processor):
    tmp = tmp_path_factory.mktemp("vllm-data")
    rows = [
        {
            "problem": "<image> or <image>?",
            "answer": "a",
            "images": [png(56, 56), png(84, 56, (0, 90, 200))],
            "videos": None,
        },
        {"problem": "What moves in <video>?", "answer": "b", "images": None, "videos": [write_video(tmp / "v.mp4")]},
        {"problem": "Only words here.", "answer": "c", "images": None, "videos": None},
        {"problem": "Both.", "answer": "d", "images": [png(112, 56)], "videos": [write_video(tmp / "w.mp4", frames=4)]},
    ]
    ds = RLHFDataset(
        write_parquet(tmp / "d.parquet", rows),
        processor,
        prompt_key="problem",
        answer_key="answer",
        image_key="images",
        image_dir=None,
        max_prompt_length=256,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    return [ds[i] for i in range(len(ds))]


def test_vllm_expands_every_placeholder_into_the_actors_tokens(rollout, samples):
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": s.raw_prompt_ids, "multi_modal_data": s.multi_modal_data} for s in samples]
    requests[2] = {"prompt_token_ids": samples[2].raw_prompt_ids}  # text only: no multimodal data at all
    outputs = rollout.llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for sample, output in zip(samples, outputs):
        assert list(output.prompt_token_ids) == sample.input_ids, sample.prompt_text


def test_rollout_then_actor_on_a_mixed_batch_agree_on_log_probs(rollout, samples, hf_model, processor):
    sampling = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE, want_log_probs=True, ignore_eos=True)
    outputs = rollout.generate(seeded_requests(samples, [0, 1, 2, 3], sampling, rollout.seed))
    generations = [
        Response(prompt, group_id, s.token_ids, s.text, s.log_probs)
        for prompt, group_id, output in zip(samples, [0, 1, 2, 3], outputs)
        for s in output.samples
    ]
    assert [g.prompt.ground_truth for g in generations] == ["a", "a", "b", "b", "c", "c", "d", "d"]
    batch = batch_of(
        generations,
        max_prompt_length=256,
        max_response_length=RESPONSE,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    allowed = sampling_mask(processor.tokenizer, hf_model.config.get_text_config().vocab_size, QWEN_MARKERS)
    with torch.no_grad():
        log_probs, _ = forward_response(hf_model, batch, allowed)
    assert log_probs.shape == (8, RESPONSE) and torch.isfinite(log_probs).all()
    # vLLM and the actor agree to ~2e-3 on image prompts in fp32 (ENVIRONMENT.md); video
    # positions that disagreed with vLLM's gave ~0.1.
    torch.testing.assert_close(log_probs, batch.rollout_log_probs, atol=2e-2, rtol=0)
