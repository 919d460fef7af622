"""A LoRA critic (``worker.critic.model.lora.rank`` > 0) trains its adapters and its whole value head, never its base.

The critic is built as the worker builds it (``ValueModel.from_pretrained``
with the LoRA settings, sharded with FSDP2 on a one-rank gloo group, AdamW
over the parameters that require grad) from the tiny Qwen2.5-VL and runs the
critic's real PPO update (``update_critic``: clipped value loss towards the
returns) on a batch of image prompts. The value head and LoRA's B start at
zero, so the gradient reaches the head at the first step, B at the second and
A at the third: three updates move every trained parameter.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoProcessor

from helpers.trajectories import Response, batch_of
from vlmrl.algos import LossAvgMode
from vlmrl.config import FSDPConfig, LoraConfig, OptimConfig
from vlmrl.data.dataset import RLHFDataset
from vlmrl.train import checkpoint as ckpt
from vlmrl.train.critic import CriticSettings, ValueModel, compute_values, update_critic
from vlmrl.train.fsdp_options import ShardOptions, shard
from vlmrl.train.micro_batches import MicroBatching
from vlmrl.train.optimizers import build_optimizer

RESPONSE = 5
LORA = LoraConfig(rank=4, alpha=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mesh():
    """A one-rank gloo group for this module (the group another module left, if any)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if own:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


@pytest.fixture(scope="module")
def critic_batch(tiny_assets):
    """Four image rows with ragged responses (values and returns are filled in by the test)."""
    processor = AutoProcessor.from_pretrained(tiny_assets.model_dir)
    dataset = RLHFDataset(
        str(tiny_assets.train_file), processor, prompt_key="problem", answer_key="answer", image_key="images",
        image_dir=None, max_prompt_length=128, min_pixels=3136, max_pixels=12544, filter_overlong_prompts=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    responses = [
        Response(dataset[i // 2], i // 2, torch.randint(10, 200, (n,), generator=gen).tolist())
        for i, n in enumerate([5, 2, 4, 3])
    ]
    return batch_of(
        responses, max_prompt_length=128, max_response_length=RESPONSE, pad_token_id=processor.tokenizer.pad_token_id
    )


def _lora_critic(tiny_assets, mesh) -> ValueModel:
    critic = ValueModel.from_pretrained(str(tiny_assets.model_dir), torch.float32, False, None, LORA)
    return shard(critic, critic.no_split_modules, mesh, ShardOptions.from_config(FSDPConfig(), "cpu"))


def test_a_lora_critic_trains_its_adapters_and_value_head_and_not_its_base(tiny_assets, mesh, critic_batch):
    critic = _lora_critic(tiny_assets, mesh)
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trained
    adapters = {n for n in trained if ".lora_A." in n or ".lora_B." in n}
    assert adapters and trained == adapters | {"value_head.weight", "value_head.bias"}
    assert not any("visual" in n for n in adapters)  # the default exclude_modules: none in the vision tower
    assert any(".base_layer." in n for n, _ in critic.named_parameters())  # the adapted Linears' frozen weights

    optimizer = build_optimizer([p for p in critic.parameters() if p.requires_grad], OptimConfig(lr=1e-2))
    settings = CriticSettings(
        samples_per_update=len(critic_batch), micro_batch_size=2, ppo_epochs=1, cliprange_value=0.5,
        loss_avg_mode=LossAvgMode.token_mean, max_grad_norm=1e9, norm_len=RESPONSE,
    )  # fmt: skip
    before = {n: _local(p) for n, p in critic.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = critic_batch.select(list(range(len(critic_batch))))
        batch.values = compute_values(critic, batch, MicroBatching(2))
        batch.returns = batch.values + torch.randn(batch.values.shape, generator=gen)
        metrics = update_critic(critic, optimizer, batch, settings)
        assert metrics["critic/skipped_steps"] == 0 and metrics["critic/vf_loss"] > 0
    after = {n: _local(p) for n, p in critic.named_parameters()}
    for name, p in critic.named_parameters():
        if name in trained:
            assert p.grad is not None and not torch.equal(after[name], before[name]), name
        else:
            assert p.grad is None and torch.equal(after[name], before[name]), name


def test_a_lora_critic_checkpoint_resumes_only_into_the_same_adapters(tmp_path):
    ckpt.save_lora_config(tmp_path, LORA)
    ckpt.check_lora_matches(tmp_path, LORA, "worker.critic.model.lora")
    with pytest.raises(ValueError, match=r"checkpoint's critic has LoRA rank=4 .* but worker.critic.model.lora has no"):
        ckpt.check_lora_matches(tmp_path, None, "worker.critic.model.lora")


def test_lora_target_errors_name_the_critics_section(tiny_assets):
    with pytest.raises(ValueError, match=r"^worker\.critic\.model\.lora: target_modules='no_such_layer'"):
        ValueModel.from_pretrained(
            str(tiny_assets.model_dir), torch.float32, False, None, LoraConfig(rank=4, target_modules="no_such_layer")
        )
