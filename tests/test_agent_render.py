"""Multi-turn assembly with the real processors of each tiny family, over an engine that replays set turns.

The engine here is scripted (its "model" writes given texts, encoded with the tokenizer and closed with the
end-of-turn token), so what is checked is the agent loop's own logic:

- token-in/token-out: the assembled ids equal the processor's rendering of the whole conversation (written
  out here by hand as chat messages) over 1-3 turns with tool images, for Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  Qwen3-VL-MoE, Qwen3.5 and GLM-4.1V (whose replies stop at the next turn's ``<|user|>``); a template that is
  not append-only is reported as a mismatch;
- the mask, log-prob and version invariants, turn ends and turn rewards, positions over the whole sequence;
- bad tool behaviour (unknown tool, exception, timeout, wrong arguments, wrong result, malformed call, too
  many calls) becomes error observations and counted statuses, never an exception;
- the budget is checked before an observation (and its images) is added;
- environments: the reset observation before the first turn, step rewards and done.

The real-engine checks (vLLM's log-probs against the actor's, turn by turn) are in test_agent_vllm.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from transformers import AutoConfig, AutoProcessor

from helpers import agent_tools
from vlmrl.data.chat import tools_system_message
from vlmrl.data.dataset import MODEL_INPUT_KEYS, RLHFDataset
from vlmrl.data.media import resize_to_grid
from vlmrl.models import family_of
from vlmrl.records import PromptSample
from vlmrl.rollout.engine import Engine, EngineOutput, EngineRequest, SampleOutput, Sampling
from vlmrl.rollout.turns.loop import AgentLoop, Limits, turn_seed
from vlmrl.rollout.turns.observations import ConversationRenderer
from vlmrl.rollout.turns.tool_parsers import ParsedTurn, ToolCall
from vlmrl.rollout.turns.tools import ToolRunner, load_tools
from vlmrl.testing.tiny_qwen3_5 import BUILDERS as QWEN3_5_BUILDERS
from vlmrl.testing.tiny_qwen3_5 import build_tiny_qwen3_5_family
from vlmrl.testing.tiny_vlm import build_tiny_vlm

MIN_PIXELS, MAX_PIXELS = 3136, 12544
TOOLS = "tests/helpers/agent_tools.py"


class ScriptedEngine(Engine):
    """An engine whose model writes ``script(request, turn)``; records every request it was given."""

    def __init__(self, tokenizer, script: Callable[[EngineRequest, int], str], seed: int = 5):
        self.tokenizer, self.script, self.seed = tokenizer, script, seed
        self.queue: list[EngineRequest] = []
        self.requests: list[EngineRequest] = []

    def add(self, request):
        self.queue.append(request)
        self.requests.append(request)

    def step(self):
        out = []
        for r in self.queue:
            turn = int(r.request_id.rsplit(":", 1)[1])
            ids = self.tokenizer.encode(self.script(r, turn), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            finish = "stop"
            if len(ids) > r.sampling.max_tokens:
                ids, finish = ids[: r.sampling.max_tokens], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            log_probs = [-0.5 - 0.01 * i for i in range(len(ids))]
            out.append(EngineOutput(r.request_id, [SampleOutput(ids, text, log_probs, finish)], self.version))
        self.queue = []
        return out

    def abort(self, request_ids):
        self.queue = [r for r in self.queue if r.request_id not in set(request_ids)]

    def has_unfinished(self):
        return bool(self.queue)

    def _load(self, named_tensors):
        pass


@pytest.fixture(scope="module")
def tiny(tiny_assets):
    """The tiny Qwen2.5-VL's processor and config, read once for the module."""
    return AutoProcessor.from_pretrained(tiny_assets.model_dir), AutoConfig.from_pretrained(tiny_assets.model_dir)


@pytest.fixture(
    scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v"]
)
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    build = build_tiny_qwen3_5_family if request.param in QWEN3_5_BUILDERS else build_tiny_vlm
    path = build(out, request.param)
    return request.param, AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)


def _prompts(tiny_assets, processor, config, tools, n=2) -> list[PromptSample]:
    ds = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=2048, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        model_config=config, tools=[t.schema() for t in tools],
    )  # fmt: skip
    return [ds[i] for i in range(n)]


def _loop(processor, config, engine, tools, *, parser, chat_template=None, env_class=None, **limits) -> AgentLoop:
    adapter = family_of(config)
    sizes = adapter.sizes(processor, MIN_PIXELS, MAX_PIXELS)
    renderer = ConversationRenderer(
        processor,
        chat_template=chat_template,
        tools=[t.schema() for t in tools],
        template_has_tools=False,  # the tiny models' template, like Qwen2.5-VL's, has no tools
        resize=lambda image: resize_to_grid(image, sizes),
        model_input_keys=MODEL_INPUT_KEYS,
        stop_opens_turn=adapter.stop_opens_turn,
    )
    settings = dict(max_turns=3, max_response_length=400, max_tokens_per_turn=None, max_tool_response_length=64,
                    max_images=4, tool_timeout=0.5, max_parallel_calls=8)  # fmt: skip
    settings.update(limits)
    return AgentLoop(
        engine, renderer, Limits(**settings),
        positions=adapter.positions(config).positions,
        pad_ids=adapter.media_pad_ids(processor.tokenizer),
        runner=None if env_class else ToolRunner(tools, settings["tool_timeout"]),
        parser=parser, env_class=env_class,
    )  # fmt: skip


def _sampling(n=2, **kw):
    return Sampling(n=n, temperature=1.0, max_tokens=64, want_log_probs=True, **kw)


TURN_TEXTS = ["I will look closer.", "Still not sure, once more.", "It is <answer>red</answer>."]


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_assembled_ids_equal_the_processors_rendering_of_the_whole_conversation(tiny_assets, family, turns):
    name, processor, config = family
    adapter = family_of(config)
    tools = load_tools([f"{TOOLS}:reveal"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn])
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_reveal, max_turns=turns)
    # The observations' patch tokens come from the renderer's own expansion, which this test holds to the processor.
    assert loop.renderer.expansion is not None, name
    (t, _), _ = loop.run(prompts, [7], _sampling(n=1)), None
    t = t[0]
    # The conversation as a user would write it for the chat template, tool images inline.
    messages = [
        {"role": "system", "content": tools_system_message([x.schema() for x in tools])},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
    ]
    images = list(prompts[0].images)
    for turn in range(turns):
        messages.append({"role": "assistant", "content": TURN_TEXTS[turn]})
        if turn + 1 < turns:
            image = agent_tools.card(turn)
            images.append(resize_to_grid(image, adapter.sizes(processor, MIN_PIXELS, MAX_PIXELS)))
            messages.append({"role": "user", "content": [
                {"type": "text", "text": "<tool_response>\n"}, {"type": "image"},
                {"type": "text", "text": f"picture {turn}\n</tool_response>"},
            ]})  # fmt: skip
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    expected = processor(text=[text], images=images, do_resize=False, return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    if adapter.stop_opens_turn:
        # GLM: each reply stops at <|user|>, which opens the next turn; the template writes it there once (the
        # assembly leaves the rendered one out), and after the last reply it opens a turn not yet written.
        ids.append(processor.tokenizer.eos_token_id)
    assert t.token_ids == ids[: len(t.token_ids)], name
    # What the template adds after the last turn's end token, which the model never samples (GLM: nothing).
    assert processor.tokenizer.decode(ids[len(t.token_ids) :]) == ("" if adapter.stop_opens_turn else "\n")
    assert t.num_turns == turns and t.stop_reason == "max_turns"
    assert t.render_mismatch is False
    # Pixel values and grids of every image, the prompt's then the tools', in order.
    assert t.mm_inputs["image_grid_thw"].tolist() == expected["image_grid_thw"].tolist()
    assert (t.mm_inputs["pixel_values"] == expected["pixel_values"]).all()
    # Positions are the family's own function over the whole sequence.
    assert (t.position_ids == family_of(config).positions(config).positions(t.token_ids, dict(expected))).all()


def test_text_tool_results_assemble_as_the_processor_renders_them(tiny_assets, family):
    # Tool results without images: a plain-text user turn after each reply (GLM: after the reply's <|user|>).
    name, processor, config = family
    adapter = family_of(config)
    tools = load_tools([f"{TOOLS}:calculator"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn])
    compute = lambda text: ParsedTurn(calls=[ToolCall("calculator", {"expression": "2*(3+4)"})])
    loop = _loop(processor, config, engine, tools, parser=compute, max_turns=3)
    [t], _ = loop.run(prompts, [3], _sampling(n=1))
    messages = [
        {"role": "system", "content": tools_system_message([x.schema() for x in tools])},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
    ]
    for turn in range(3):
        messages.append({"role": "assistant", "content": TURN_TEXTS[turn]})
        if turn < 2:
            messages.append({"role": "user", "content": "<tool_response>\n14\n</tool_response>"})
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = processor(text=[text], images=list(prompts[0].images), do_resize=False, return_tensors="pt")["input_ids"]
    ids = ids[0].tolist() + ([processor.tokenizer.eos_token_id] if adapter.stop_opens_turn else [])
    assert t.token_ids == ids[: len(t.token_ids)] and len(ids) - len(t.token_ids) <= 1, name
    # The last turn's call is not run: no turn follows to read it.
    assert t.num_turns == 3 and [c["status"] for c in t.tool_calls] == ["ok", "ok", "skipped"]
    assert t.render_mismatch is False


def test_a_repeated_observation_renders_as_the_first_without_the_template(tiny, monkeypatch):
    processor, config = tiny
    loop = _loop(processor, config, ScriptedEngine(processor.tokenizer, lambda r, turn: ""), [], parser=agent_tools.call_reveal)
    renderer = loop.renderer
    messages = renderer.tool_messages([("picture 0", [agent_tools.card(0)])])
    first = renderer.render(messages, [agent_tools.card(0)])
    prompt_side = renderer.render(messages, [agent_tools.card(0)], after_turn=False)
    calls = []
    template = processor.apply_chat_template
    monkeypatch.setattr(processor, "apply_chat_template", lambda *a, **k: calls.append(1) or template(*a, **k))
    again = renderer.render(messages, [agent_tools.card(0)])
    assert calls == []  # the text and its ids came from the renderer's cache
    assert (again.text, again.raw_ids, again.ids) == (first.text, first.raw_ids, first.ids)
    assert torch.equal(again.mm_inputs["pixel_values"], first.mm_inputs["pixel_values"])
    again.raw_ids.append(-1)  # a caller's list is its own: the cached ids do not change
    assert renderer.render(messages, [agent_tools.card(0)]).raw_ids == first.raw_ids
    # After the prompt there is no end-of-turn separator: a key of its own, not the after-turn text.
    assert prompt_side.text == first.text[len(renderer.end_of_turn) :] and renderer.end_of_turn
    other = renderer.render(renderer.tool_messages([("picture 1", [agent_tools.card(1)])]), [agent_tools.card(1)])
    assert calls and "picture 1" in other.text


def test_a_repeated_image_is_processed_once_and_each_observation_gets_its_own_tensors(tiny, monkeypatch):
    processor, config = tiny
    loop = _loop(processor, config, ScriptedEngine(processor.tokenizer, lambda r, turn: ""), [], parser=agent_tools.call_reveal)
    renderer = loop.renderer
    messages = renderer.tool_messages([("picture", [agent_tools.card(0)])])
    first = renderer.render(messages, [agent_tools.card(0)])
    calls = []
    image_processor = renderer.expansion.image_processor
    process = type(image_processor).__call__
    monkeypatch.setattr(type(image_processor), "__call__", lambda self, *a, **k: calls.append(1) or process(self, *a, **k))
    # A new image object with the same pixels: the same content id, so the processor is not called again.
    again = renderer.render(messages, [agent_tools.card(0)])
    assert calls == [] and again.image_ids == first.image_ids
    assert again.ids == first.ids
    for key, tensor in first.mm_inputs.items():
        assert torch.equal(again.mm_inputs[key], tensor)
    # No two observations share a tensor: writing into one leaves the next render's as processed.
    pixels = first.mm_inputs["pixel_values"].clone()
    again.mm_inputs["pixel_values"].zero_()
    assert torch.equal(renderer.render(messages, [agent_tools.card(0)]).mm_inputs["pixel_values"], pixels)
    # Other pixels, another id: processed.
    other = renderer.render(messages, [agent_tools.card(1)])
    assert calls == [1] and other.image_ids != first.image_ids
    assert not torch.equal(other.mm_inputs["pixel_values"], pixels)


def test_a_template_that_is_not_append_only_is_reported_as_a_mismatch(tiny_assets, family):
    _, processor, config = family
    tools = load_tools([f"{TOOLS}:reveal"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn])
    # Like Qwen3's templates, which drop the reasoning of earlier turns: here earlier assistant turns vanish.
    template = processor.tokenizer.chat_template.replace(
        "{{ message['content'] }}",
        "{% if message['role'] != 'assistant' or loop.last %}{{ message['content'] }}{% endif %}",
    )
    assert template != processor.tokenizer.chat_template
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_reveal, chat_template=template, max_turns=3)
    trajectories, _ = loop.run(prompts, [0], _sampling(n=2))
    # Checked on the group's first trajectory only (a whole re-render per trajectory costs as much as its turns).
    assert [t.render_mismatch for t in trajectories] == [True, None]
    plain = _loop(processor, config, ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn]), tools,
                  parser=agent_tools.call_reveal, max_turns=3)  # fmt: skip
    assert plain.run(prompts, [0], _sampling(n=1))[0][0].render_mismatch is False


def test_masks_log_probs_versions_turn_ends_and_rewards(tiny_assets, tiny):
    processor, config = tiny
    tools = load_tools([f"{TOOLS}:reveal"])
    prompts = _prompts(tiny_assets, processor, config, tools)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn])
    engine.version = 3
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_reveal, max_turns=3)
    trajectories, timings = loop.run(prompts, [4, 9], _sampling(n=2))
    assert [t.sample_id for t in trajectories] == ["4:0", "4:1", "9:0", "9:1"]
    eos = processor.tokenizer.eos_token_id
    for t in trajectories:
        sampled = [processor.tokenizer.encode(x, add_special_tokens=False) + [eos] for x in TURN_TEXTS]
        trained = [tok for tok, m in zip(t.token_ids, t.loss_mask) if m]
        assert trained == [tok for turn in sampled for tok in turn]  # exactly the model's tokens, in order
        assert t.loss_mask[: t.prompt_length] == [0] * t.prompt_length
        # An <|im_end|> inside the trajectory does not end the mask: later turns are trained too.
        assert t.token_ids.count(eos) >= 3 and t.loss_mask[t.turn_ends[-1]] == 1
        for i, m in enumerate(t.loss_mask):
            assert t.versions[i] == (3 if m else -1)
            if not m:
                assert t.log_probs[i] == 0.0
        assert [t.token_ids[i] for i in t.turn_ends] == [eos] * 3
        # reveal gives 0.25 a call; turns 0 and 1 called it and were answered. Turn 2, the last allowed, called it
        # too: that call is recorded but not run (no turn would read its result), so it gives no reward.
        assert t.turn_rewards == [0.25, 0.25, 0.0]
        assert len(t.images) == 3 and t.prompt_media == 1 and t.has_own_media
        assert [c["status"] for c in t.tool_calls] == ["ok", "ok", "skipped"]
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        merge = processor.image_processor.merge_size ** 2
        assert t.token_ids.count(pad) == int(t.mm_inputs["image_grid_thw"].prod(dim=1).sum()) // merge
    # Each turn is its own request, seeded by (group, sample, turn): turn 0 has the single-turn seed.
    seeds = {r.request_id: r.sampling.seed for r in engine.requests}
    first = 5 * 1_000_000_007 + 4 * 2 + 1
    assert seeds["4:1:0"] == first and seeds["4:1:2"] == turn_seed(first, 2)
    assert len(set(seeds.values())) == len(seeds)
    assert set(timings) >= {"engine", "tools"}


def test_bad_tool_calls_become_error_observations_and_never_raise(tiny_assets, tiny):
    processor, config = tiny
    names = ["calculator", "broken", "hang", "wrong_result"]
    tools = load_tools([f"{TOOLS}:{n}" for n in names])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: "calling")
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_everything, max_turns=2, max_parallel_calls=5,
                 max_response_length=3000, max_tool_response_length=200)
    start = time.perf_counter()
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    # The hanging tool costs one timeout (0.5 s), not 30 s.
    assert time.perf_counter() - start < 10
    statuses = [(c["name"], c["status"]) for c in t.tool_calls if c["turn"] == 0]
    assert statuses == [
        ("calculator", "ok"), ("nope", "unknown_tool"), ("broken", "error"), ("hang", "timeout"),
        ("calculator", "bad_arguments"), ("wrong_result", "skipped"), ("", "parse_error"),
    ]  # fmt: skip
    assert t.stop_reason == "max_turns", t.stop_reason
    observation = processor.tokenizer.decode([x for x, m in zip(t.token_ids, t.loss_mask) if not m][t.prompt_length :])
    assert "14" in observation  # 2*(3+4)
    for needle in ("unknown tool 'nope'", "broken failed: RuntimeError", "timed out", "bad arguments", "at most 5 tool calls", "not JSON"):
        assert needle in observation, needle
    assert t.stop_reason == "max_turns"


def test_a_result_of_the_wrong_type_is_an_error(tiny_assets, tiny):
    processor, config = tiny
    tools = load_tools([f"{TOOLS}:wrong_result"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: '<tool_call>{"name": "wrong_result", "arguments": {}}</tool_call>')
    loop = _loop(processor, config, engine, tools, parser=agent_tools.parse_qwen, max_turns=2)
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    assert [c["status"] for c in t.tool_calls] == ["error", "skipped"]  # the last turn's call is not run


def test_an_answer_without_a_call_ends_the_trajectory_and_done_ends_it_too(tiny_assets, tiny):
    processor, config = tiny
    tools = load_tools([f"{TOOLS}:submit", f"{TOOLS}:calculator"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=2)
    scripts = {
        0: ['<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>', "It is 2."],
        1: ['<tool_call>{"name": "finish", "arguments": {"answer": "2"}}</tool_call>'],
    }
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: scripts[int(r.request_id.split(":")[0]) % 2][turn])
    loop = _loop(processor, config, engine, tools, parser=agent_tools.parse_qwen, max_turns=4)
    trajectories, _ = loop.run(prompts, [0, 1], _sampling(n=1))
    a, b = trajectories
    assert (a.stop_reason, a.num_turns, a.response_text, a.turn_rewards) == ("done", 2, "It is 2.", [0.0, 0.0])
    assert (b.stop_reason, b.num_turns, b.turn_rewards) == ("done", 1, [1.0])
    assert a.messages[0]["role"] == "assistant" and a.messages[1]["content"] == "<tool_response>\n2\n</tool_response>"


def test_the_budget_is_checked_before_an_observation_and_its_images_are_added(tiny_assets, tiny):
    processor, config = tiny
    tools = load_tools([f"{TOOLS}:reveal"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: TURN_TEXTS[turn])
    # Room for the first turn (6 tokens) and the first observation (~25 with its 4 image tokens), not a second.
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_reveal, max_turns=3, max_response_length=45)
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    assert t.stop_reason == "length"
    assert len(t.token_ids) - t.prompt_length <= 45
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grids = t.mm_inputs["image_grid_thw"]
    assert t.token_ids.count(pad) == int(grids.prod(dim=1).sum()) // processor.image_processor.merge_size**2
    assert len(t.images) == grids.shape[0]
    # A tiny budget: the observation never fits, no image is added at all.
    loop = _loop(processor, config, ScriptedEngine(processor.tokenizer, lambda r, turn: "x"), tools,
                 parser=agent_tools.call_reveal, max_turns=3, max_response_length=10)  # fmt: skip
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    assert t.stop_reason == "length" and len(t.images) == 1 and not t.has_own_media


def test_images_past_max_images_are_left_out_and_the_model_is_told(tiny_assets, tiny):
    processor, config = tiny
    tools = load_tools([f"{TOOLS}:reveal"])
    prompts = _prompts(tiny_assets, processor, config, tools, n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: "look")
    loop = _loop(processor, config, engine, tools, parser=agent_tools.call_reveal, max_turns=3, max_images=1)
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    assert len(t.images) == 2  # the prompt's and one from the tool
    context = processor.tokenizer.decode([x for x, m in zip(t.token_ids, t.loss_mask) if not m][t.prompt_length :])
    assert "1 image(s) left out" in context


def test_an_environment_shows_its_reset_observation_first_and_rewards_its_steps(tiny_assets, tiny):
    processor, config = tiny
    prompts = _prompts(tiny_assets, processor, config, [], n=1)
    engine = ScriptedEngine(processor.tokenizer, lambda r, turn: f"move {turn}")
    loop = _loop(processor, config, engine, [], parser=None, env_class=agent_tools.CountingEnv, max_turns=5)
    (t,), _ = loop.run(prompts, [0], _sampling(n=1))
    assert (t.stop_reason, t.num_turns, t.turn_rewards) == ("done", 2, [0.0, 1.0])
    # The prompt's own tokens, without its generation prompt, then the reset observation as context.
    gen = processor.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert t.token_ids[: t.prompt_length] == prompts[0].input_ids[: len(prompts[0].input_ids) - len(gen)]
    first_turn = t.loss_mask.index(1)
    context = processor.tokenizer.decode(t.token_ids[t.prompt_length : first_turn])
    assert context.startswith("<|im_start|>user\n<|vision_start|>") and "start" in context
    assert context.endswith("<|im_start|>assistant\n")
    assert len(t.images) == 3  # the prompt's, reset's, and step 1's (step 2 is done: not shown)
    (broken,), _ = _loop(processor, config, ScriptedEngine(processor.tokenizer, lambda r, turn: "go"), [],
                         parser=None, env_class=agent_tools.BrokenEnv).run(prompts, [0], _sampling(n=1))  # fmt: skip
    assert broken.stop_reason == "error" and broken.tool_calls[-1]["status"] == "error"
    assert "the simulator crashed" in broken.tool_calls[-1]["error"]


def test_tool_latency_is_hidden_by_concurrency(tiny_assets, tiny):
    """16 trajectories each calling a 0.1 s tool per turn: one turn's tools take about 0.1 s, not 1.6 s."""
    processor, config = tiny
    prompts = _prompts(tiny_assets, processor, config, [], n=2)
    for name, parser in (("slow", agent_tools.call_slow), ("sleepy", agent_tools.call_sleepy)):
        tools = load_tools([f"{TOOLS}:{name}"])
        engine = ScriptedEngine(processor.tokenizer, lambda r, turn: "wait")
        loop = _loop(processor, config, engine, tools, parser=parser, max_turns=3)
        trajectories, timings = loop.run(prompts, [0, 1], _sampling(n=8))
        assert len(trajectories) == 16 and all(len(t.tool_calls) == 3 for t in trajectories)
        assert timings["tools"] < 3 * 0.1 * 4, (name, timings)  # serial would be 3 x 16 x 0.1 = 4.8 s


def test_a_text_model_assembles_a_conversation_the_same_way():
    """A tokenizer alone as the processor (tiny Qwen3 text LM): text tool results, the same ids as a full render."""
    import torch
    from transformers import AutoTokenizer

    from vlmrl.testing.assets import ensure_text_assets

    tokenizer = AutoTokenizer.from_pretrained(ensure_text_assets().qwen3_model_dir)
    tools = load_tools([f"{TOOLS}:calculator"])
    schemas = [t.schema() for t in tools]
    system = {"role": "system", "content": tools_system_message(schemas)}
    question = {"role": "user", "content": "What is 2*(3+4)?"}
    text = tokenizer.apply_chat_template([system, question], add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = PromptSample(index=0, raw_prompt_ids=ids, input_ids=ids, images=[], mm_inputs={}, ground_truth="14",
                          data_source="math", prompt_text=text, position_ids=torch.arange(len(ids)).expand(3, len(ids)))  # fmt: skip
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}</tool_call>'
    engine = ScriptedEngine(tokenizer, lambda r, turn: [call, "It is 14."][turn])
    renderer = ConversationRenderer(tokenizer, chat_template=None, tools=schemas, template_has_tools=False,
                                    resize=lambda image: image, model_input_keys=MODEL_INPUT_KEYS)  # fmt: skip
    loop = AgentLoop(
        engine, renderer,
        Limits(max_turns=3, max_response_length=400, max_tokens_per_turn=None, max_tool_response_length=64,
               max_images=0, tool_timeout=5.0, max_parallel_calls=2),
        positions=lambda ids, _mm: torch.arange(len(ids)).expand(3, len(ids)).clone(), pad_ids=(-1, -1),
        runner=ToolRunner(tools, 5.0), parser=agent_tools.parse_qwen,
    )  # fmt: skip
    (t,), _ = loop.run([prompt], [0], _sampling(n=1))
    assert (t.stop_reason, t.num_turns, t.response_text) == ("done", 2, "It is 14.")
    full = [system, question, {"role": "assistant", "content": call},
            {"role": "user", "content": "<tool_response>\n14\n</tool_response>"}, {"role": "assistant", "content": "It is 14."}]  # fmt: skip
    expected = tokenizer.encode(tokenizer.apply_chat_template(full, tokenize=False), add_special_tokens=False)
    assert t.token_ids == expected[: len(t.token_ids)] and tokenizer.decode(expected[len(t.token_ids) :]) == "\n"
    assert t.render_mismatch is False and t.mm_inputs == {}
