"""What the family tests share: a family's tiny model with two image prompts, a count of the prompt passes
``worker.actor.share_prompts`` runs, a family's tiny engine, a batch of random responses, two LoRA steps and two
quickstart steps through the CLI."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoProcessor

from vlmrl.data.dataset import RLHFDataset
from vlmrl.rollout.engine.sampling import sampling_mask
from vlmrl.models.qwen_vision import SPECIAL_TOKENS as QWEN_MARKERS
from vlmrl.testing.tiny_vlm import build_tiny_vlm

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def family_prompts(family: str, directory, train_file):
    """``(path, prompts, allowed)``: the family's tiny model built in ``directory``, the first two image rows of
    ``train_file`` as its dataset prepares them, and the tokens a response may hold."""
    path = build_tiny_vlm(directory, family)
    processor, config = AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path)
    dataset = RLHFDataset(
        str(train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=2048, min_pixels=3136, max_pixels=12544, model_config=config,
    )  # fmt: skip
    allowed = sampling_mask(processor.tokenizer, config.get_text_config().vocab_size, QWEN_MARKERS)
    return path, [dataset[0], dataset[1]], allowed


def count_prompt_passes(monkeypatch) -> list[int]:
    """From now on, each prompt pass of the shared-prompt forward appends its number of distinct prompts."""
    from vlmrl.train import shared_prompts

    passes: list[int] = []
    original = shared_prompts.prompt_logits_and_cache

    def counted(model, **kwargs):
        passes.append(kwargs["input_ids"].shape[0])
        return original(model, **kwargs)

    monkeypatch.setattr(shared_prompts, "prompt_logits_and_cache", counted)
    return passes


__all__ = [
    "FAMILIES", "count_prompt_passes", "family_cli_steps", "family_engine", "family_prompts", "lora_two_steps",
    "random_batch",
]  # fmt: skip


def family_engine(model_dir, allowed, *, dtype: str, min_pixels: int, max_pixels: int, family=None):
    """A family's tiny in-process vLLM engine as the rollout worker builds it, for a module-scoped fixture to
    ``yield from``; torn down after, with torch's thread count put back (vLLM lowers it to 1 for serving).

    An engine of an earlier module left in a reference cycle would, collected while this one runs, tear down the
    parallel state this one set up ("pipeline model parallel group is not initialized"): it is collected first.
    """
    import gc

    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    from vlmrl.rollout.engine.vllm import VLLMEngine

    threads = torch.get_num_threads()
    gc.collect()
    engine = VLLMEngine(
        str(model_dir), dtype=dtype, seed=0, max_model_len=512, max_num_batched_tokens=512, enforce_eager=True,
        gpu_memory_utilization=0.5, cpu_kvcache_space_gb=1, min_pixels=min_pixels, max_pixels=max_pixels,
        allowed_tokens=allowed,
        **({"engine_weight": family.engine_weight, "recurrent_layers": family.recurrent_layers,
            "hf_overrides": family.engine_overrides(None)} if family else {}),
    )  # fmt: skip
    yield engine
    del engine
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)


def family_cli_steps(tmp_path_factory, name: str, *overrides: str) -> tuple[list[dict], Path]:
    """Two steps of the quickstart on ``${tiny:<name>_model_dir}`` through ``python -m vlmrl.main``, with
    ``overrides``: each step's metrics and the run's output directory. The random model earns no reward, so an
    entropy bonus (lr 1e-3) is what moves the weights; the engine's log-probs are on, so each step logs the
    rollout-vs-actor gap."""
    from helpers.runs import E2E_TRAINING, read_metrics, run_main, tail

    out = tmp_path_factory.mktemp(f"{name}_cli") / "out"
    overrides = (
        *E2E_TRAINING, "trainer.max_steps=2", f"worker.actor.model.model_path=${{tiny:{name}_model_dir}}",
        "worker.actor.entropy_coeff=0.5", "worker.actor.optim.lr=1e-3", "data.val_files=",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[file]", *overrides,
    )  # fmt: skip
    proc = run_main(out, *overrides, experiment=name, timeout=900)
    assert proc.returncode == 0, tail(proc)
    return [m for m in read_metrics(out, name) if "actor/pg_loss" in m], out / "vlmrl" / name


def lora_two_steps(model, batch, allowed) -> tuple[torch.Tensor, torch.Tensor]:
    """Two AdamW steps (lr 1e-2) of the adapters of a LoRA ``model`` raising the log-probs of ``batch``'s response
    tokens (padding-free passes); checks that the base weights got no gradient and did not move. Returns the
    log-probs of the last step's forward and of one after it, on the response tokens."""
    from vlmrl.train.actor import forward_response

    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mask = batch.response_mask
    model.train()
    for _ in range(2):  # B starts at zero: the first step moves B, the second A too
        log_probs, _ = forward_response(model, batch, allowed, padding_free=True, with_entropy=False)
        loss = -(log_probs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        after, _ = forward_response(model.eval(), batch, allowed, padding_free=True, with_entropy=False)
    real = mask.bool()
    return log_probs.detach()[real], after[real]


def random_batch(samples, lengths: list[int], pad_token_id: int, max_response_length: int):
    """One response of random tokens (below 890, in every tiny vocabulary) per prompt of ``samples``, of
    ``lengths``, as the padded batch the actor scores (seeded: the same batch every time)."""
    from helpers.trajectories import Response, batch_of

    generator = torch.Generator().manual_seed(0)
    responses = [
        Response(s, i, torch.randint(0, 890, (n,), generator=generator).tolist())
        for i, (s, n) in enumerate(zip(samples, lengths))
    ]
    return batch_of(
        responses, max_prompt_length=256, max_response_length=max_response_length, pad_token_id=pad_token_id
    )  # fmt: skip
