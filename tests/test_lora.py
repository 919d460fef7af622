"""LoRA on the actor: what trains, the reference, the resync into vLLM, checkpoints and the HF export.

One worker group (one FSDP worker with its vLLM engine, on real Ray) serves
every test that needs one: the ``lora_run`` fixture drives it through a step by
hand (generate, old and reference log-probs, update, resync, generate again),
saves a checkpoint, moves on one more update and loads the checkpoint back,
recording what each test then checks. The reference the log-probs are held
to is the plain HF model loaded from the same directory, in this process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.runs import SMALL
from helpers.shared_cluster import forked_runtime_env
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlmrl.config import LoraConfig

from vlmrl.validate import load_config
from vlmrl.export import export
from vlmrl.plan import detect_cluster, resolve
from vlmrl.driver.runner import _dataset
from vlmrl.train import lora
from vlmrl.train.actor import UpdateSettings, compute_log_probs
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.train.checkpoint import check_lora_matches
from vlmrl.rollout.engine import Sampling
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS

RANK, ALPHA = 8, 16
# Adam moves every adapter entry by about lr on the first step; this lr makes the merged
# update large enough that vLLM on the base weights would be far outside the tolerance.
LR = 2e-2
# vLLM vs the actor on image prompts in fp32 (tests/test_data_vllm.py, ENVIRONMENT.md: ~2e-3).
VLLM_ATOL = 2e-2


def log_probs_of(model, batch, allowed) -> torch.Tensor:
    return compute_log_probs(model.eval(), batch, MicroBatching(len(batch)), allowed)[0]


def with_training_signal(batch, old, ref, seed: int):
    """The batch with old/ref log-probs and random +-1 advantages, ready for an update."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(len(batch), 1, generator=gen) < 0.5, -1.0, 1.0)
    return dataclasses.replace(
        batch, old_log_probs=old, ref_log_probs=ref, advantages=signs.expand_as(old) * batch.response_mask
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    import ray

    from vlmrl.workers.group import WorkerGroup

    tmp = tmp_path_factory.mktemp("lora")
    config = load_config([
        "config=examples/quickstart.yaml",
        f"trainer.output_dir={tmp / 'outputs'}",
        *SMALL,
        f"worker.actor.model.lora.rank={RANK}",
        f"worker.actor.model.lora.alpha={ALPHA}",
        f"worker.actor.optim.lr={LR}",
        "trainer.logger=[file]",
        "data.filter_overlong_prompts=false",  # the quickstart's prompts fit; checking 1024 rows costs seconds
    ])  # fmt: skip
    plan = resolve(config, detect_cluster())
    assert plan.world_size == 1 and plan.use_reference
    model_dir = config.worker.actor.model.model_path
    processor = AutoProcessor.from_pretrained(model_dir)
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    allowed = sampling_mask(processor.tokenizer, base.config.get_text_config().vocab_size, QWEN_MARKERS)
    dataset = _dataset(config, config.data.train_files, processor)
    sampling = Sampling(
        n=config.worker.rollout.n, temperature=1.0, max_tokens=config.data.max_response_length, want_log_probs=True
    )
    settings = UpdateSettings.from_config(config, plan)

    started_ray = not ray.is_initialized()
    if started_ray:
        # address="local": a Ray of our own, even while another process on this machine runs one.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=forked_runtime_env())
    workers = WorkerGroup(config, plan)
    try:
        r = {"config": config, "model_dir": model_dir, "base": base, "allowed": allowed, "tmp": tmp}
        # Step 0: adapters initialised with B = 0, so the actor is the base model.
        batch0 = workers.generate([dataset[0], dataset[1]], [0, 1], sampling)
        r["batch0"], r["old0"] = batch0, workers.compute_old_log_probs(batch0)[0]
        r["ref0"] = workers.compute_ref_log_probs(batch0)
        r["base0"] = log_probs_of(base, batch0, allowed)
        r["update_metrics"] = workers.update_actor(with_training_signal(batch0, r["old0"], r["ref0"], 0), settings, old_from_forward=False).metrics
        workers.sync_weights()
        # Step 1: the engine samples with the merged weights; the actor and reference score the samples.
        batch1 = workers.generate([dataset[2], dataset[3]], [2, 3], sampling)
        r["batch1"], r["old1"] = batch1, workers.compute_old_log_probs(batch1)[0]
        r["ref1"] = workers.compute_ref_log_probs(batch1)
        r["base1"] = log_probs_of(base, batch1, allowed)
        r["merged"] = workers.full_weights()
        # A checkpoint, then one more update, then back to the checkpoint.
        r["checkpoint"] = tmp / "global_step_1"
        workers.save_checkpoint(str(r["checkpoint"]), model_only=False, hf_weights=True)
        workers.update_actor(with_training_signal(batch1, r["old1"], r["ref1"], 1), settings, old_from_forward=False)
        r["old1_moved"] = workers.compute_old_log_probs(batch1)[0]
        r["restored_optimizer"] = workers.load_checkpoint(str(r["checkpoint"]))
        r["old1_restored"] = workers.compute_old_log_probs(batch1)[0]
        # The engine was resynced by the load: greedy samples score as the restored actor scores them.
        greedy = dataclasses.replace(sampling, n=1, temperature=0.0)
        r["batch_restored"] = workers.generate([dataset[4], dataset[5]], [4, 5], greedy)
        r["old_restored_greedy"] = workers.compute_old_log_probs(r["batch_restored"])[0]
        yield r
    finally:
        workers.shutdown()
        if started_ray:
            ray.shutdown()


def checkpoint_tensors(actor_dir: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` (model. or optim.) in a DCP checkpoint, read in this process."""
    metadata = dcp.FileSystemReader(str(actor_dir)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(actor_dir), no_dist=True)
    return state


# ------------------------------------------------------------------ the run


def test_training_changes_only_the_adapters(lora_run):
    original = lora_run["base"].state_dict()
    actor_dir = lora_run["checkpoint"] / "actor"
    saved = {k.removeprefix("model."): v for k, v in checkpoint_tensors(actor_dir, "model.").items()}
    adapters = {k: v for k, v in saved.items() if ".lora_" in k}
    base = {lora.hf_name(k): v for k, v in saved.items() if ".lora_" not in k}
    # Every base tensor, the vision tower's included, is bit-identical to the loaded model's.
    assert base.keys() == original.keys()
    changed = [k for k in original if not torch.equal(base[k], original[k])]
    assert not changed, changed
    assert any(k.startswith("model.visual.") for k in base)
    # all-linear: an adapter on every Linear of the language model, none in the vision tower (excluded by
    # default) and none on the output head.
    linear = [n for n, m in lora_run["base"].named_modules() if isinstance(m, torch.nn.Linear)]
    adapted = sorted(k.removesuffix(".lora_A.default.weight") for k in adapters if ".lora_A." in k)
    assert adapted == sorted(n for n in linear if n.startswith("model.language_model."))
    # B started at 0 and moved; the optimizer holds state for the adapters alone.
    b = [v for k, v in adapters.items() if ".lora_B." in k]
    assert all(float(v.abs().max()) > 0 for v in b)
    optim_keys = {k for k in checkpoint_tensors(actor_dir, "optim.state.")}
    assert optim_keys and all(".lora_" in k for k in optim_keys), sorted(optim_keys)[:5]
    assert lora_run["update_metrics"]["actor/grad_norm"] > 0


def test_reference_is_the_base_model_and_the_actor_at_step_0(lora_run):
    r = lora_run
    for batch, ref, base in ((r["batch0"], r["ref0"], r["base0"]), (r["batch1"], r["ref1"], r["base1"])):
        mask = batch.response_mask.bool()
        torch.testing.assert_close(ref[mask], base[mask], rtol=0, atol=1e-5)
    mask0 = r["batch0"].response_mask.bool()
    torch.testing.assert_close(r["old0"][mask0], r["ref0"][mask0], rtol=0, atol=1e-6)  # B = 0: adapters add nothing
    # After the update the actor has moved away from the reference, which stayed put.
    mask1 = r["batch1"].response_mask.bool()
    assert float((r["old1"] - r["ref1"])[mask1].abs().max()) > 0.2


def test_vllm_after_resync_scores_like_the_merged_actor(lora_run):
    r = lora_run
    batch, mask = r["batch1"], r["batch1"].response_mask.bool()
    vllm = batch.rollout_log_probs
    torch.testing.assert_close(vllm[mask], r["old1"][mask], rtol=0, atol=VLLM_ATOL)
    assert float((vllm - r["old1"])[mask].abs().mean()) <= 1e-2
    # Control: an engine that kept the base weights would be far off.
    assert float((vllm - r["base1"])[mask].abs().max()) > 10 * VLLM_ATOL
    # full_weights: plain HF names, and a plain HF model on them computes the actor's log-probs.
    merged = r["merged"]
    assert merged.keys() == r["base"].state_dict().keys()
    model = AutoModelForImageTextToText.from_pretrained(r["model_dir"], dtype=torch.float32)
    model.load_state_dict(merged)
    torch.testing.assert_close(log_probs_of(model, batch, r["allowed"])[mask], r["old1"][mask], rtol=0, atol=1e-5)


def test_checkpoint_resume_restores_the_adapters_and_resyncs_vllm(lora_run):
    r = lora_run
    mask = r["batch1"].response_mask.bool()
    assert float((r["old1_moved"] - r["old1"])[mask].abs().max()) > 1e-3  # the extra update moved the actor
    assert r["restored_optimizer"]
    torch.testing.assert_close(r["old1_restored"][mask], r["old1"][mask], rtol=0, atol=1e-6)
    batch = r["batch_restored"]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.rollout_log_probs[mask], r["old_restored_greedy"][mask], rtol=0, atol=VLLM_ATOL)
    # A run with other LoRA settings (or none) is refused before it loads the adapters.
    with pytest.raises(ValueError, match=r"rank=8 alpha=16 .* but worker.actor.model.lora has no LoRA"):
        check_lora_matches(r["checkpoint"] / "actor", None)
    check_lora_matches(r["checkpoint"] / "actor", r["config"].worker.actor.model.lora)


def test_hf_export_is_merged_and_loads_in_transformers_with_the_same_outputs(lora_run):
    r = lora_run
    batch, mask = r["batch1"], r["batch1"].response_mask.bool()
    hf_dir = r["checkpoint"] / "actor" / "huggingface"
    on_disk = load_file(hf_dir / "model.safetensors")
    # The names the base checkpoint has on disk (transformers writes its original Qwen layout), no peft names.
    assert on_disk.keys() == load_file(Path(r["model_dir"]) / "model.safetensors").keys()
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    loaded = model.state_dict()
    assert loaded.keys() == r["merged"].keys()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, r["merged"][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(log_probs_of(model, batch, r["allowed"])[mask], r["old1"][mask], rtol=0, atol=1e-5)
    # python -m vlmrl.export merges the DCP checkpoint the same way.
    exported = load_file(export(r["checkpoint"] / "actor", r["tmp"] / "exported") / "model.safetensors")
    assert exported.keys() == on_disk.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, on_disk[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


# -------------------------------------------------------------- the pieces


def test_merged_weights_follow_the_formula_in_any_order_and_under_peft_prefixes():
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(5, 3, generator=gen), torch.randn(5, generator=gen)
    a, b = torch.randn(2, 3, generator=gen), torch.randn(5, 2, generator=gen)
    m = "base_model.model.model.language_model.layers.0.mlp.up_proj"
    items = [
        (f"{m}.lora_B.default.weight", b),  # the adapters first: the base weight is waited for
        (f"{m}.base_layer.bias", bias),
        ("base_model.model.lm_head.weight", torch.ones(2)),
        (f"{m}.lora_A.default.weight", a),
        (f"{m}.base_layer.weight", w),
    ]
    out = dict(lora.merged_weights(iter(items), 0.5))
    hf = "model.language_model.layers.0.mlp.up_proj"
    assert list(out) == [f"{hf}.bias", "lm_head.weight", f"{hf}.weight"]
    torch.testing.assert_close(out[f"{hf}.weight"], w + 0.5 * b @ a)
    assert out[f"{hf}.bias"] is bias
    bf16 = dict(lora.merged_weights([("q.base_layer.weight", w.bfloat16()), ("q.lora_A.default.weight", a),
                                     ("q.lora_B.default.weight", b)], 0.5))  # fmt: skip
    assert bf16["q.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"q_proj': \['A'\]"):
        list(lora.merged_weights([("q_proj.base_layer.weight", w), ("q_proj.lora_B.default.weight", b)], 1.0))


def test_add_lora_skips_the_vision_tower_and_trains_only_adapters(tiny_assets):
    model = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32)
    lora.add_lora(model, LoraConfig(rank=4, alpha=8))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and "visual" not in n for n in trainable)
    assert any("language_model.layers.1.mlp.down_proj.lora_A" in n for n in trainable)
    # The disable switch keeps requires_grad as it was (peft's own switch would turn frozen adapters back on).
    frozen = next(p for n, p in model.named_parameters() if ".lora_A." in n)
    frozen.requires_grad_(False)
    with lora.adapters_disabled(model):
        assert not any(p.requires_grad for p in model.parameters())
    assert not frozen.requires_grad and sum(p.requires_grad for p in model.parameters()) == len(trainable) - 1
    # Names select modules; a non-Linear one (the vision tower's Conv3d patch embedding) is refused.
    with pytest.raises(ValueError, match=r"not Linear: model.visual.patch_embed.proj \(Conv3d\)"):
        lora.add_lora(
            AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32),
            LoraConfig(rank=4, alpha=8, target_modules="proj", exclude_modules="^$"),
        )
    with pytest.raises(ValueError, match="selects no module"):
        lora.add_lora(
            AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir, dtype=torch.float32),
            LoraConfig(rank=4, alpha=8, target_modules="no_such_proj"),
        )
