"""The critic for GAE: a value head on the VLM's backbone, its value pass and its update.

The critic is the policy's architecture without the LM head: the same vision
tower and language model (loaded from ``worker.critic.model.model_path``, the
actor's checkpoint by default) with a linear head from the last hidden state
to one scalar per position. The head starts at zero, so the first values are
0 on every worker (identical before sharding) and the critic starts as a
neutral baseline.

With ``worker.critic.model.lora.rank`` > 0 the backbone gets LoRA adapters
(``vlmrl.train.lora``) and its own weights are frozen; the value head, made
after the adapters, is trained whole. The critic's weights never reach vLLM,
so its adapters are never merged: its checkpoints hold them as they are.

Its passes batch and lay out tokens as the actor's do (``MicroBatching``):
fixed micro-batches of rows of similar length, trimmed of the columns every
row pads, or token-budget micro-batches, or packed rows without padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vlmrl.config import Config, LoraConfig
from vlmrl.plan import Plan
from vlmrl.records import Batch
from vlmrl import algos
from vlmrl.algos import LossAvgMode
from vlmrl.train import packing, ulysses
from vlmrl.train.lr_schedule import LRSchedule
from vlmrl.train.image_features import share_image_features
from vlmrl.train.lora import add_lora
from vlmrl.train.models import load_pretrained
from vlmrl.train.micro_batches import MicroBatching, merged_mm_inputs
from vlmrl.train.update_loop import run_epochs


class ValueModel(torch.nn.Module):
    """``backbone`` (the VLM minus its LM head) and a linear value head."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        dtype: torch.dtype,
        trust_remote_code: bool,
        override_config: dict | None = None,
        lora: LoraConfig | None = None,
    ) -> ValueModel:
        """The critic of ``model_path``; with ``lora``, adapters in its backbone and the backbone frozen."""
        vlm = load_pretrained(model_path, dtype, trust_remote_code, override_config)  # a VLM, or a text causal LM
        share_image_features(vlm)  # each distinct image of a pass through the vision tower once
        if lora is not None:
            # On the whole LM, so peft's all-linear leaves out its output head as it does for the actor; the head
            # is dropped just below. Before the value head exists, which peft would otherwise freeze.
            add_lora(vlm, lora, "worker.critic.model.lora")
        model = cls(vlm.model, vlm.config.get_text_config().hidden_size, dtype)
        model.no_split_modules = list(getattr(vlm, "_no_split_modules", None) or [])
        return model

    def forward(self, **inputs) -> torch.Tensor:
        """``(b, S)`` the value of each position's state."""
        hidden = self.backbone(**inputs).last_hidden_state  # (b, S, H)
        return self.value_head(hidden).squeeze(-1).float()


def forward_values(
    model: ValueModel, batch: Batch, padding_free: bool = False, sequence: ulysses.SequenceGroup | None = None
) -> torch.Tensor:
    """``(b, R)``: for each response token, the value of the state just before it (0 on response padding
    past every row's end, or on all response padding when ``padding_free``).

    ``sequence`` (padding-free only): the Ulysses group the packed row is split over (``vlmrl.train.ulysses``,
    the backbone ``ulysses.install``-ed); the values come back whole on every rank of the group.
    """
    if sequence is not None and not padding_free:
        raise ValueError("Ulysses sequence parallelism splits packed rows: the pass must be padding-free")
    device = next(model.parameters()).device
    mm = {key: value.to(device) for key, value in merged_mm_inputs(batch).items()}
    shape = tuple(batch.responses.shape)
    inputs, layout = packing.model_inputs(batch, padding_free, device, packing.is_text_only(model))
    if padding_free and sequence is not None:
        inputs, shard = ulysses.split(inputs, layout.logit_index, sequence)
        with ulysses.sharded(model.backbone, shard):
            values = model(**inputs, use_cache=False, **mm)  # (1, T / sp) this rank's slice
        mine = values[0, shard.local_logit_index.to(device)]  # the states before this slice's response tokens
        return layout.unpack(ulysses.gather(mine, shard), shape)
    values = model(**inputs, use_cache=False, **mm)  # (1, T) packed, (b, S) trimmed
    if padding_free:
        # The position before a response token is the state in which it is chosen: the actor's logit index.
        return layout.unpack(values[0, layout.logit_index.to(device)], shape)
    r = layout.responses.shape[1]
    # Position P+t-1 has read the prompt and the first t response tokens: the state in which token t is chosen.
    return torch.nn.functional.pad(values[:, -r - 1 : -1], (0, shape[1] - r))


@torch.no_grad()
def compute_values(
    model: ValueModel, batch: Batch, batching: MicroBatching, sequence: ulysses.SequenceGroup | None = None
) -> torch.Tensor:
    """``(B, R)`` values, micro-batch by micro-batch, in the batch's row order; ``sequence``: the Ulysses group."""
    model.eval()
    values = torch.zeros(batch.responses.shape)
    for rows in batching.groups(batch):
        values[rows] = forward_values(model, batch.select(rows), batching.padding_free, sequence).cpu()
    return values


@dataclass(frozen=True)
class CriticSettings:
    """What one critic update does; built by the driver and sent with each batch."""

    samples_per_update: int
    """Samples in one optimizer step on this worker."""
    micro_batch_size: int
    ppo_epochs: int
    cliprange_value: float
    loss_avg_mode: LossAvgMode
    max_grad_norm: float
    norm_len: int
    max_token_len: int | None = None
    """Dynamic batching: the token budget of an update micro-batch; None: micro_batch_size samples."""
    padding_free: bool = False
    lr_schedule: LRSchedule | None = None
    """The learning rate of each critic update; None keeps the optimizer's (optim.lr)."""

    @property
    def batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_token_len, self.padding_free)

    @classmethod
    def from_config(cls, config: Config, plan: Plan, training_steps: int | None = None) -> CriticSettings:
        critic = config.worker.critic
        shards = ulysses.data_shards(plan.world_size, config.worker.actor.ulysses_size)
        return cls(
            # The workers of an actor's Ulysses group hold the same rows (vlmrl.workers.group), the critic's too.
            samples_per_update=critic.global_batch_size * config.worker.rollout.n // shards,
            micro_batch_size=critic.micro_batch_size_per_device_for_update,
            ppo_epochs=critic.ppo_epochs,
            cliprange_value=critic.cliprange_value,
            loss_avg_mode=critic.loss_avg_mode,
            max_grad_norm=critic.max_grad_norm,
            norm_len=config.data.max_response_length,
            max_token_len=plan.critic_update_token_budget,
            padding_free=critic.padding_free,
            lr_schedule=None if training_steps is None else LRSchedule.from_optim(critic.optim, training_steps),
        )


def update_critic(
    model: ValueModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    settings: CriticSettings,
    sequence: ulysses.SequenceGroup | None = None,
) -> dict[str, float]:
    """Clipped value-loss epochs towards ``batch.returns``, in the loop the actor's update uses.

    ``sequence`` (padding-free): the Ulysses group; its ranks hold the same ``batch`` (``vlmrl.train.ulysses``).
    """
    batch.require("values", "returns")
    mode = settings.loss_avg_mode

    def micro_loss(mb: Batch, rows: list[int], sums: dict[str, list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        values = forward_values(model, mb, settings.padding_free, sequence)
        device = values.device
        mask = mb.response_mask.to(device)
        loss, metrics = algos.value_loss_clipped(
            values,
            mb.returns.to(device),
            mb.values.to(device),
            mask,
            settings.cliprange_value,
            mode,
            settings.norm_len,
        )
        for key, value in metrics.items():
            sums[f"critic/{key}"].append(float(value))
        return loss, mask

    sums, skipped = run_epochs(
        model,
        optimizer,
        batch,
        epochs=settings.ppo_epochs,
        samples_per_update=settings.samples_per_update,
        batching=settings.batching,
        mode=mode,
        max_grad_norm=settings.max_grad_norm,
        micro_loss=micro_loss,
        prefix="critic",
    )
    metrics = {key: sum(values) / len(values) for key, values in sums.items()}
    metrics["critic/skipped_steps"] = float(skipped)
    return metrics
