"""The engine interface on the real in-process vLLM (tiny model): requests in one at a time, each out when done.

- Two requests of different lengths come back from ``step`` as each finishes, once, under their own ids.
- An aborted request never comes back, and the engine is idle after it.
- ``stream`` hands outputs back in completion order, and stopping it early aborts the rest.
- ``generate`` (written once over add/step, through ``stream``) hands back what stepping by hand gives, in request order, and
  the same tokens and log-probs as vLLM's own blocking ``LLM.generate`` with the same seeds, image
  prompts included.
- Content ids of images (``multi_modal_ids``) change no sample, and the engine keys the images by them.
- Weights: refused while a request is unfinished; after a load the version is the one given and the
  outputs carry it; reloading the weights the engine started on decodes as before.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine import EngineBusy, EngineRequest, Sampling, image_content_id
from vlmrl.rollout.engine.sampling import seeded_requests

MIN_PIXELS, MAX_PIXELS = 3136, 12544


@pytest.fixture(scope="module")
def processor(tiny_assets):
    return AutoProcessor.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(scope="module")
def engine(engine_tests_engine):
    """The float32 tiny engine (seed 3, max_model_len 512) that tests/test_engine.py and
    tests/test_engine_interrupt.py share (tests/conftest.py); each test leaves it idle, on its first weights."""
    return engine_tests_engine.get()


@pytest.fixture(scope="module")
def image_prompts(tiny_assets, processor):
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )  # fmt: skip
    return [ds[i] for i in range(3)]


def _text(request_id: str, max_tokens: int, n: int = 1, seed: int | None = 0, **kw) -> EngineRequest:
    ids = [10 + (i * 7 + len(request_id)) % 50 for i in range(12)]
    sampling = Sampling(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, **kw)
    return EngineRequest(request_id=request_id, prompt_token_ids=ids, sampling=sampling)


def _step_until_idle(engine, limit: int = 1000) -> list[tuple[int, object]]:
    """(step index, output) for every output, until nothing is unfinished."""
    seen = []
    for i in range(limit):
        if not engine.has_unfinished():
            return seen
        seen += [(i, out) for out in engine.step()]
    raise AssertionError("the engine did not finish")


def _llm_generate(engine, requests: list[EngineRequest]):
    """vLLM's own blocking ``LLM.generate`` on ``requests`` (temperature 1), with their seeds, the allowed list and
    the sampled tokens' log-probs, on the engine's ``LLM``: what the engine's outputs must equal."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            n=r.sampling.n, temperature=1.0, max_tokens=r.sampling.max_tokens, ignore_eos=r.sampling.ignore_eos,
            seed=r.sampling.seed, logprobs=0, allowed_token_ids=engine.allowed_token_ids,
        )
        for r in requests
    ]  # fmt: skip
    prompts = [
        {"prompt_token_ids": r.prompt_token_ids, **({"multi_modal_data": r.multi_modal_data} if r.multi_modal_data else {})}
        for r in requests
    ]
    return engine.llm.generate(prompts, params, use_tqdm=False)


# Before the tests that use the shared engine: a test without it in between would tear it down (tests/conftest.py).
def test_image_content_id_is_the_pixels():
    from PIL import Image

    a = Image.new("RGB", (4, 4), (10, 20, 30))
    assert image_content_id(a) == image_content_id(a.copy())
    b = a.copy()
    b.putpixel((3, 3), (10, 20, 31))
    assert image_content_id(b) != image_content_id(a)
    # The same bytes in another shape or mode are another image.
    assert image_content_id(Image.frombytes("RGB", (2, 8), a.tobytes())) != image_content_id(a)
    assert image_content_id(Image.frombytes("L", (12, 4), a.tobytes())) != image_content_id(a)


def test_requests_come_back_as_each_finishes(engine):
    engine.add(_text("long", max_tokens=8, n=2))
    engine.add(_text("short", max_tokens=2))
    assert engine.has_unfinished()
    seen = _step_until_idle(engine)
    assert sorted(out.request_id for _, out in seen) == ["long", "short"]  # each exactly once
    step_of = {out.request_id: i for i, out in seen}
    assert step_of["short"] < step_of["long"]  # handed back when it finished, not with the batch
    by_id = {out.request_id: out for _, out in seen}
    assert [len(s.token_ids) for s in by_id["long"].samples] == [8, 8]
    assert [len(s.token_ids) for s in by_id["short"].samples] == [2]
    assert all(s.finish_reason == "length" and s.log_probs is None for out in by_id.values() for s in out.samples)
    assert {out.version for out in by_id.values()} == {engine.version}
    assert not engine.has_unfinished()


def test_an_aborted_request_never_comes_back(engine):
    engine.add(_text("kept", max_tokens=3))
    engine.add(_text("dropped", max_tokens=64, n=2))
    first = engine.step() + engine.step()  # the dropped request is under way (prefill, a token or two)
    assert engine.has_unfinished()
    engine.abort(["dropped", "never-added"])
    rest = _step_until_idle(engine)
    returned = [out.request_id for out in first] + [out.request_id for _, out in rest]
    assert returned == ["kept"]
    assert not engine.has_unfinished()


def test_stream_hands_each_output_back_as_it_finishes_and_closing_it_aborts_the_rest(engine):
    requests = [_text("long", max_tokens=12), _text("short", max_tokens=2), _text("mid", max_tokens=6)]
    streamed = list(engine.stream(requests))
    assert [out.request_id for out in streamed] == ["short", "mid", "long"]  # completion order
    # The same outputs as generate's, which is written over stream and puts them in request order.
    by_id = {out.request_id: out for out in engine.generate(requests)}
    assert all(out.samples == by_id[out.request_id].samples for out in streamed)
    assert set(engine.last_timings) == {"requests", "engine", "outputs"}
    # A caller that stops after the first output leaves nothing unfinished behind.
    stream = engine.stream([_text("a", max_tokens=2), _text("b", max_tokens=40)])
    assert next(stream).request_id == "a"
    stream.close()
    assert not engine.has_unfinished()


def test_generate_is_add_and_step_in_request_order_and_samples_as_llm_generate(engine, image_prompts):
    sampling = Sampling(n=2, temperature=1.0, max_tokens=6, want_log_probs=True)
    requests = [_text("t0", 6, n=2, seed=11, want_log_probs=True)]
    requests += seeded_requests(image_prompts, [5, 6, 7], sampling, engine.seed)
    requests += [_text("t1", 2, n=2, seed=13, want_log_probs=True)]  # finishes first, returned last
    outputs = engine.generate(requests)
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert set(engine.last_timings) == {"requests", "engine", "outputs"}

    for r in requests:
        engine.add(r)
    by_hand = {out.request_id: out for _, out in _step_until_idle(engine)}
    assert [by_hand[r.request_id] for r in requests] == outputs

    # vLLM's blocking generate, with the same seeds (sample i of a request gets seed + i) and allowed tokens. The
    # engine's requests carry no allowed list: its own logits processor bans the tiny model's 5 vision tokens, and
    # the samples and log-probs must be the allowed list's to the bit.
    processors = engine.llm.llm_engine.model_config.logits_processors
    assert [p.__name__ for p in processors] == ["BanTokens"]
    reference = _llm_generate(engine, requests)
    for ours, theirs in zip(outputs, reference, strict=True):
        assert [s.token_ids for s in ours.samples] == [list(c.token_ids) for c in theirs.outputs]
        assert [s.log_probs for s in ours.samples] == [
            [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in theirs.outputs
        ]
        assert [s.text for s in ours.samples] == [c.text for c in theirs.outputs]
    # The two samples of a request are seeded apart.
    assert any(o.samples[0].token_ids != o.samples[1].token_ids for o in outputs)


def test_texts_are_vllms_own_detokenization(engine, image_prompts):
    """The engine asks vLLM for no text and decodes each finished sample once; the texts are vLLM's, both where a
    whole decode gives them (the random tiny model's samples hold bytes that are not UTF-8 all over) and where a
    sample ends inside a character and goes through a primed decode stream."""
    sampling = Sampling(n=4, temperature=1.0, max_tokens=48, ignore_eos=True)
    requests = seeded_requests(image_prompts, [21, 22, 23], sampling, engine.seed)
    requests += [_text(f"short{i}", 2, n=4, seed=100 + i) for i in range(3)]  # short: most decode whole
    outputs = engine.generate(requests)
    reference = _llm_generate(engine, requests)
    ours = [s.text for o in outputs for s in o.samples]
    theirs = [c.text for o in reference for c in o.outputs]
    assert ours == theirs
    # Both ways of decoding ran, and whole decodes with U+FFFD inside were taken as they were.
    tokenizer = engine.llm.get_tokenizer()
    whole = tokenizer.batch_decode([s.token_ids for o in outputs for s in o.samples], skip_special_tokens=True)
    streamed = sum(text.endswith("\ufffd") for text in whole)
    assert 0 < streamed < len(whole), streamed
    assert any("\ufffd" in text and not text.endswith("\ufffd") for text in whole)


def test_image_content_ids_change_no_sample_and_key_the_engines_media_cache(engine, image_prompts):
    p0, p1 = image_prompts[0], image_prompts[1]
    assert image_content_id(p0.images[0]) != image_content_id(p1.images[0])
    sampling = Sampling(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=21)

    def request(rid, images, ids=None):
        return EngineRequest(
            request_id=rid, prompt_token_ids=p0.raw_prompt_ids, multi_modal_data={"image": images},
            sampling=sampling, multi_modal_ids={"image": ids} if ids else {},
        )  # fmt: skip

    def tokens(req):
        return [s.token_ids for s in engine.generate([req])[0].samples]

    plain = tokens(request("plain", p0.images))
    assert tokens(request("named", p0.images, [image_content_id(p0.images[0])])) == plain
    other = tokens(request("other", p1.images, [image_content_id(p1.images[0])]))
    assert other != plain  # another image, another sample: the image matters to what is sampled
    # Proof that the engine goes by the id: p1's pixels under p0's id are served p0's cached inputs. (This is why
    # two different images must never share an id.)
    assert tokens(request("lying", p1.images, [image_content_id(p0.images[0])])) == plain


def test_generate_needs_an_idle_engine_and_unique_ids(engine):
    with pytest.raises(ValueError, match="unique"):
        engine.generate([_text("same", 2), _text("same", 2)])
    assert not engine.has_unfinished()
    engine.add(_text("outside", 2))
    with pytest.raises(EngineBusy):
        engine.generate([_text("inside", 2)])
    engine.abort(["outside"])
    assert not engine.has_unfinished()


def test_weights_load_only_when_idle_and_set_the_version(engine, tiny_assets):
    weights = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).state_dict()
    sampling = Sampling(n=1, temperature=0.0, max_tokens=5, want_log_probs=True)
    greedy = [EngineRequest(request_id="g", prompt_token_ids=_text("g", 5).prompt_token_ids, sampling=sampling)]
    before = engine.generate(greedy)[0]
    start = engine.version

    engine.add(_text("in-flight", 32))
    engine.step()
    consumed = []

    def stream():
        for item in weights.items():
            consumed.append(item[0])
            yield item

    with pytest.raises(EngineBusy, match="unfinished"):
        engine.load_weights(stream(), version=start + 1)
    assert consumed == [] and engine.version == start  # refused before reading a tensor
    engine.abort(["in-flight"])

    engine.load_weights(weights.items(), version=start + 7)
    assert engine.version == start + 7
    after = engine.generate(greedy)[0]
    assert after.version == start + 7 and before.version == start
    # The weights it started on: the same greedy tokens and log-probs.
    assert after.samples == before.samples
