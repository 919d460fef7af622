"""A rollout server as a separate Ray actor (``vlmrl.workers.rollout_server``), weights through the object store
(``vlmrl.weight_sync.object_store``): real Ray, real in-process vLLM, the quickstart's tiny model in fp32.

- A weight load that lands mid-generation: with ``continue`` and ``reprefill`` each response holds k > 0
  tokens of version v, then only v + 1; its first k tokens and log-probs are those of the same call run
  without the load (so v's weights sampled them) and its later log-probs are not (v + 1's did). With
  ``refuse`` the load waits for the call, whose tokens are all v.
- A push of perturbed weights, in several buckets: the engine's log-probs of what it sampled equal the HF
  model's with those weights (the trainer's forward, fp32, within 1e-4), and not the unperturbed model's.
- Two generate calls in flight at once on one server (sharing a group id at the same index) both finish,
  each with the tokens it samples alone.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray
import torch
from helpers.configs import CPU, QUICKSTART
from helpers.rollout_servers import launched_server
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.records import PromptSample
from vlmrl.records.views import to_batch
from vlmrl.rollout.engine import InterruptMode, Sampling
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.train.actor import forward_response
from vlmrl.validate import load_config
from vlmrl.weight_sync.object_store import push_weights

LENGTH = 256  # prompt and response budgets; a long response leaves a load plenty of time to land mid-way


@pytest.fixture(scope="module")
def config(quickstart_assets):
    return load_config([QUICKSTART, f"data.max_prompt_length={LENGTH}", f"data.max_response_length={LENGTH}"], CPU)


@pytest.fixture(scope="module")
def launched(config):
    """The server actor, launched first and not waited on: it starts vLLM while ``parts`` loads the data."""
    with launched_server(config, max_concurrency=6) as handle:
        yield handle


@pytest.fixture(scope="module")
def parts(config, quickstart_assets):
    model_dir = config.worker.actor.model.model_path
    processor = AutoProcessor.from_pretrained(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    data = RLHFDataset(
        str(quickstart_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=LENGTH, min_pixels=config.data.min_pixels,
        max_pixels=config.data.max_pixels, model_config=hf_config,
    )  # fmt: skip
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = PromptSample(
        index=0, raw_prompt_ids=ids, input_ids=ids, images=[], mm_inputs={}, ground_truth="", data_source="",
        prompt_text="", position_ids=torch.arange(len(ids)).expand(3, len(ids)).clone(),
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = {k: t.detach().clone() for k, t in model.state_dict().items()}  # not the model's own storage
    g = torch.Generator().manual_seed(0)
    perturbed = {  # other weights: the decoder layers' matrices with a little noise
        k: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) if ".layers." in k and t.dim() == 2 else t
        for k, t in weights.items()
    }
    return SimpleNamespace(
        model=model, processor=processor, hf_config=hf_config, prompts=[data[i] for i in range(4)], text=text,
        weights=weights, perturbed=perturbed,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(launched, parts):
    ray.get(launched.version.remote(), timeout=300)
    return launched


def _version(server) -> int:
    return ray.get(server.version.remote())


def _restart_on(server, weights) -> int:
    """Load ``weights`` into the idle server as the next version; that version."""
    version = _version(server) + 1
    push_weights(weights.items(), [server], version, InterruptMode.refuse)
    return version


def _wait_in_flight(server, count: int) -> None:
    deadline = time.monotonic() + 60
    while ray.get(server.in_flight.remote()) < count:
        assert time.monotonic() < deadline, "the server never had the call's requests in flight"
        time.sleep(0.005)


@pytest.mark.parametrize("interrupt", list(InterruptMode), ids=lambda m: m.value)
def test_a_load_mid_generation_splits_each_response_between_the_versions_that_sampled_it(
    server, parts, interrupt
):
    v = _restart_on(server, parts.weights)
    sampling = Sampling(n=2, temperature=1.0, max_tokens=200, ignore_eos=True, want_log_probs=True)
    call = (parts.prompts[:2], [0, 1], sampling)
    reference, _, _ = ray.get(server.generate.remote(*call))

    pending = server.generate.remote(*call)
    _wait_in_flight(server, 2)  # the loop has taken both requests: the load lands after their first step
    push_weights(parts.perturbed.items(), [server], v + 1, interrupt)
    trajectories, _, _ = ray.get(pending)
    assert _version(server) == v + 1

    assert len(trajectories) == len(reference) == 4
    for ours, theirs in zip(trajectories, reference, strict=True):
        p = ours.prompt_length
        assert theirs.versions == [-1] * p + [v] * 200
        assert ours.versions[:p] == [-1] * p and len(ours.token_ids) == p + 200
        if interrupt is InterruptMode.refuse:  # the load waited for the call: one version, the same samples
            assert ours.versions == theirs.versions and ours.token_ids == theirs.token_ids
            continue
        k = ours.versions.count(v)
        assert 0 < k < 200 and ours.versions[p:] == [v] * k + [v + 1] * (200 - k)
        # v's weights sampled the first k tokens: as in the call without a load.
        assert ours.token_ids[: p + k] == theirs.token_ids[: p + k]
        torch.testing.assert_close(ours.log_probs[: p + k], theirs.log_probs[: p + k], rtol=0, atol=1e-5)
        # v + 1's sampled the rest: the log-probs are no longer v's.
        assert max(abs(a - b) for a, b in zip(ours.log_probs[p + k :], theirs.log_probs[p + k :])) > 1e-3


def test_after_a_push_the_engine_log_probs_are_the_hf_models(server, parts):
    _restart_on(server, parts.weights)
    v = _version(server) + 1
    metrics = push_weights(parts.perturbed.items(), [server], v, bucket_bytes=1 << 20)
    assert metrics["perf/resync_buckets"] > 1 and _version(server) == v
    sampling = Sampling(n=4, temperature=1.0, max_tokens=16, ignore_eos=True, want_log_probs=True)
    trajectories, _, _ = ray.get(server.generate.remote([parts.text], [7], sampling))
    assert all(t.versions[t.prompt_length :] == [v] * 16 for t in trajectories)

    batch = to_batch(
        trajectories, max_prompt_length=LENGTH, max_response_length=LENGTH,
        pad_token_id=parts.processor.tokenizer.pad_token_id,
    )  # fmt: skip
    allowed = sampling_mask(parts.processor.tokenizer, parts.hf_config.get_text_config().vocab_size, QWEN_MARKERS)
    mask = batch.response_mask.bool()
    model = parts.model
    with torch.no_grad():
        before, _ = forward_response(model, batch, allowed, with_entropy=False)
        model.load_state_dict(parts.perturbed)
        after, _ = forward_response(model, batch, allowed, with_entropy=False)
        model.load_state_dict(parts.weights)
    assert int(mask.sum()) == 4 * 16
    assert (after - batch.rollout_log_probs).abs()[mask].max() < 1e-4
    assert (before - batch.rollout_log_probs).abs()[mask].max() > 1e-3  # the push did change the weights


def test_two_calls_in_flight_at_once_sample_what_each_samples_alone(server, parts):
    _restart_on(server, parts.weights)
    sampling = Sampling(n=2, temperature=1.0, max_tokens=64, ignore_eos=True)
    # The second call reuses group id 10 at the same index (validation and training calls may share ids).
    calls = [(parts.prompts[:2], [10, 11], sampling), (parts.prompts[2:4], [10, 21], sampling)]
    alone = [ray.get(server.generate.remote(*call))[0] for call in calls]

    pending = [server.generate.remote(*call) for call in calls]
    peak, deadline = 0, time.monotonic() + 60
    while len(ray.wait(pending, num_returns=2, timeout=0)[0]) < 2:
        assert time.monotonic() < deadline, "the two calls did not finish within 60 s"
        peak = max(peak, ray.get(server.in_flight.remote()))
    together = [trajectories for trajectories, _, _ in ray.get(pending)]
    assert peak == 4  # both calls' requests shared the engine's steps
    for ours, theirs in zip(together, alone, strict=True):
        assert [t.token_ids for t in ours] == [t.token_ids for t in theirs]
        assert [t.sample_id for t in ours] == [t.sample_id for t in theirs]
