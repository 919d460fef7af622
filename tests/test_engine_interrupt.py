"""A weight load that interrupts requests in flight, on the real in-process vLLM (tiny model, fp32).

- ``continue``: a swap forced after k tokens; tokens before it carry version v, after it v + 1, all
  max_tokens come back in order. Reloading the same weights changes nothing (the requests keep their KV
  cache and their seeded generators), while other weights change the log-probs from token k on only. A
  request added after the swap does not reuse prefix-cache blocks that the old weights computed, nor image
  embeddings that the old vision tower computed.
- ``reprefill``: an image request aborted after k tokens and re-added as prompt + those tokens gives, greedy
  and with the weights unchanged, the tokens and (within 2e-3) the log-probs of an uninterrupted one; a
  request of n = 2 comes back whole, under its own id, and an interrupted request can still be aborted.
- Interrupted three times (reprefill, continue, reprefill), a sample keeps every token in order, each with
  the version that sampled it.
- The default mode still refuses, before reading a tensor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine import EngineBusy, EngineRequest, InterruptMode, Sampling
from vlmrl.rollout.engine.vllm import derived_seed

MIN_PIXELS, MAX_PIXELS = 3136, 12544
K = 3  # tokens out before the swap: the prefill samples the first, each later step one more


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def engine(engine_tests_engine):
    """The float32 tiny engine (seed 3, max_model_len 512) that tests/test_engine.py and
    tests/test_engine_interrupt.py share (tests/conftest.py); each test leaves it idle, on its first weights."""
    return engine_tests_engine.get()


@pytest.fixture(scope="module")
def weights(tiny_assets) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def perturbed(weights) -> dict[str, torch.Tensor]:
    """Other weights: the decoder layers' matrices with a little noise."""
    g = torch.Generator().manual_seed(0)
    return {
        k: t + 0.05 * t.std() * torch.randn(t.shape, generator=g) if ".layers." in k and t.dim() == 2 else t
        for k, t in weights.items()
    }


@pytest.fixture(scope="module")
def image_prompt(tiny_assets, processor):
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )  # fmt: skip
    return ds[0]


def _text(request_id: str, sampling: Sampling) -> EngineRequest:
    ids = [10 + (i * 7 + len(request_id)) % 50 for i in range(12)]
    return EngineRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling)


def _image(request_id: str, prompt, sampling: Sampling) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt_token_ids=prompt.raw_prompt_ids,
        multi_modal_data=prompt.multi_modal_data, sampling=sampling,
    )  # fmt: skip


def _finish(engine) -> dict:
    outputs = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            assert out.request_id not in outputs  # each comes back once
            outputs[out.request_id] = out
    raise AssertionError("the engine did not finish")


def _swapped(engine, requests, weights, interrupt: InterruptMode) -> dict:
    """Add ``requests``, step until K tokens are out, load ``weights`` as version + 1, finish."""
    for r in requests:
        engine.add(r)
    for _ in range(K):
        assert engine.step() == []
    engine.load_weights(weights.items(), version=engine.version + 1, interrupt=interrupt)
    return _finish(engine)


def test_continue_tokens_carry_the_version_that_sampled_them(engine, weights, perturbed):
    sampling = Sampling(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=5, want_log_probs=True)
    reference = engine.generate([_text("c", sampling)])[0]
    v = engine.version

    same = _swapped(engine, [_text("c", sampling)], weights, InterruptMode.continue_)["c"]
    assert engine.version == v + 1 and same.version == v
    for ours, theirs in zip(same.samples, reference.samples, strict=True):
        assert len(ours.token_ids) == len(ours.log_probs) == 8 and ours.finish_reason == "length"
        assert ours.versions == [v] * K + [v + 1] * (8 - K)
        assert theirs.versions == [v] * 8
        # Same weights: the KV cache and the seeded generator carry on as if nothing happened.
        assert ours.token_ids == theirs.token_ids and ours.text == theirs.text
        torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=0, atol=1e-5)

    # Other weights sample from token K on: the first K log-probs are the old weights', the rest differ.
    greedy = Sampling(n=1, temperature=0.0, max_tokens=8, ignore_eos=True, want_log_probs=True)
    before = engine.generate([_text("p", greedy)])[0].samples[0]
    other = _swapped(engine, [_text("p", greedy)], perturbed, InterruptMode.continue_)["p"].samples[0]
    assert other.versions == [v + 1] * K + [v + 2] * (8 - K)
    assert other.token_ids[:K] == before.token_ids[:K]
    torch.testing.assert_close(other.log_probs[:K], before.log_probs[:K], rtol=0, atol=1e-5)
    assert max(abs(a - b) for a, b in zip(other.log_probs[K:], before.log_probs[K:])) > 1e-3
    engine.load_weights(weights.items(), version=engine.version + 1)  # idle: back to the weights it started on


def test_requests_added_after_a_continue_swap_never_reuse_the_old_weights_prefix_cache(engine, weights, perturbed):
    # 200 tokens: a full block (128 on CPU) that the prefix cache keeps and a later request could reuse.
    greedy = Sampling(n=1, temperature=0.0, max_tokens=2, want_log_probs=True)
    long = EngineRequest(request_id="a", prompt_token_ids=[10 + (i * 13) % 90 for i in range(200)], sampling=greedy)
    old = engine.generate([long])[0].samples[0]  # its first block stays in the prefix cache
    engine.add(_text("holds-blocks", Sampling(n=1, temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)))
    engine.step()  # a request holding KV blocks: vLLM cannot reset the prefix cache now
    engine.load_weights(perturbed.items(), version=engine.version + 1, interrupt=InterruptMode.continue_)
    engine.add(dataclasses.replace(long, request_id="b"))
    new = _finish(engine)["b"].samples[0]

    engine.load_weights(perturbed.items(), version=engine.version + 1)  # idle: every cache reset
    fresh = engine.generate([dataclasses.replace(long, request_id="c")])[0].samples[0]
    torch.testing.assert_close(new.log_probs, fresh.log_probs, rtol=0, atol=1e-5)
    assert max(abs(a - b) for a, b in zip(new.log_probs, old.log_probs)) > 1e-3  # the weights did change
    engine.load_weights(weights.items(), version=engine.version + 1)


def test_an_image_request_waiting_at_a_continue_swap_is_encoded_by_the_new_weights(
    engine, weights, perturbed, image_prompt
):
    greedy = Sampling(n=1, temperature=0.0, max_tokens=4, ignore_eos=True, want_log_probs=True)
    engine.add(_image("running", image_prompt, greedy))
    engine.step()  # its image is encoded by the old weights and cached under the image's hash
    engine.add(_image("waiting", image_prompt, greedy))  # the same image, not yet prefilled
    engine.load_weights(perturbed.items(), version=engine.version + 1, interrupt=InterruptMode.continue_)
    waiting = _finish(engine)["waiting"].samples[0]
    assert waiting.versions == [engine.version] * 4

    engine.load_weights(perturbed.items(), version=engine.version + 1)  # idle: every cache reset
    fresh = engine.generate([_image("fresh", image_prompt, greedy)])[0].samples[0]
    assert waiting.token_ids == fresh.token_ids
    torch.testing.assert_close(waiting.log_probs, fresh.log_probs, rtol=0, atol=1e-5)
    engine.load_weights(weights.items(), version=engine.version + 1)


def test_reprefill_of_an_image_request_continues_as_if_uninterrupted(engine, weights, image_prompt):
    greedy = Sampling(n=1, temperature=0.0, max_tokens=6, ignore_eos=True, want_log_probs=True)
    sampled = Sampling(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=9, want_log_probs=True)
    reference = engine.generate([_image("img", image_prompt, greedy)])[0].samples[0]
    v = engine.version

    outputs = _swapped(
        engine, [_image("img", image_prompt, greedy), _text("n2", sampled)], weights, InterruptMode.reprefill
    )
    assert sorted(outputs) == ["img", "n2"] and not engine.continuations and not engine.reassembled
    image = outputs["img"]
    assert image.version == v and len(image.samples) == 1
    (ours,) = image.samples
    assert ours.versions == [v] * K + [v + 1] * (6 - K)
    assert ours.token_ids == reference.token_ids and ours.text == reference.text
    # The re-prefill recomputes prompt + K tokens in one pass: decode vs prefill numerics, image included.
    torch.testing.assert_close(ours.log_probs, reference.log_probs, rtol=0, atol=2e-3)

    # n = 2: both samples come back under the request's id, in order, each of max_tokens tokens.
    pair = outputs["n2"]
    assert [len(s.token_ids) for s in pair.samples] == [8, 8]
    assert all(len(s.log_probs) == 8 and s.versions == [v] * K + [v + 1] * (8 - K) for s in pair.samples)
    assert pair.samples[0].token_ids != pair.samples[1].token_ids  # seeded apart (seed + i, then derived)
    assert derived_seed(9, 1, 0) == 10 and derived_seed(9, 1, K) not in (9, 10) and derived_seed(None, 0, K) is None


def test_interrupted_again_and_again_a_sample_keeps_every_token_in_order(engine, weights):
    greedy = Sampling(n=1, temperature=0.0, max_tokens=8, ignore_eos=True, want_log_probs=True)
    reference = engine.generate([_text("r", greedy)])[0]
    v = engine.version
    engine.add(_text("r", greedy))
    for _ in range(K):
        engine.step()
    engine.load_weights(weights.items(), version=v + 1, interrupt=InterruptMode.reprefill)
    engine.step()  # the continuation's prefill: one token
    engine.load_weights(weights.items(), version=v + 2, interrupt=InterruptMode.continue_)
    engine.step()
    engine.load_weights(weights.items(), version=v + 3, interrupt=InterruptMode.reprefill)  # extends the prefix
    out = _finish(engine)["r"]
    assert out.version == v
    for ours, theirs in zip(out.samples, reference.samples, strict=True):
        assert ours.versions == [v] * K + [v + 1, v + 2] + [v + 3] * (8 - K - 2)
        assert ours.token_ids == theirs.token_ids and ours.finish_reason == "length"
        torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=0, atol=2e-3)


def test_an_interrupted_request_can_still_be_aborted(engine, weights):
    sampling = Sampling(n=2, temperature=1.0, max_tokens=32, ignore_eos=True, seed=1)
    engine.add(_text("gone", sampling))
    engine.add(_text("kept", Sampling(n=1, temperature=1.0, max_tokens=4, ignore_eos=True, seed=2)))
    engine.step()
    engine.load_weights(weights.items(), version=engine.version + 1, interrupt=InterruptMode.reprefill)
    engine.step()
    engine.abort(["gone"])
    assert list(_finish(engine)) == ["kept"]
    assert not engine.has_unfinished() and not engine.requests and not engine.continuations


@pytest.mark.parametrize("interrupt", [None, InterruptMode.refuse])
def test_the_default_still_refuses_to_load_with_requests_in_flight(engine, weights, interrupt):
    engine.add(_text("in-flight", Sampling(n=1, temperature=1.0, max_tokens=16, ignore_eos=True)))
    engine.step()
    start, consumed = engine.version, []

    def stream():
        for item in weights.items():
            consumed.append(item[0])
            yield item

    kw = {} if interrupt is None else {"interrupt": interrupt}
    with pytest.raises(EngineBusy, match="unfinished"):
        engine.load_weights(stream(), version=start + 1, **kw)
    assert consumed == [] and engine.version == start
    engine.abort(["in-flight"])
    assert not engine.has_unfinished()
