"""How a worker's samples are grouped into forward passes, and what those passes cost in tokens.

Micro-batches are either a fixed number of samples of similar length or, with
dynamic batching, groups of samples under a token budget (``MicroBatching``).
FSDP gathers parameters on every forward, so all ranks run the same number of
micro-batches: with dynamic batching they agree on the largest count any rank
needs. Shared by the actor's and the critic's passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlmrl.records import Batch
from vlmrl.train import packing
from vlmrl.train.partition import balanced_partition, parts_for_budget


def merged_mm_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """The micro-batch's image and video inputs, each key concatenated in sample order, as the model wants them."""
    return merge_mm_inputs(batch.mm_inputs)


def merge_mm_inputs(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples' image and video inputs, each key concatenated in sample order.

    Samples may differ in what they have (text only, images, videos, both); a key
    is concatenated over the samples that have it.
    """
    keys = dict.fromkeys(key for mm in rows for key in mm)
    return {key: torch.cat([mm[key] for mm in rows if key in mm], dim=0) for key in keys}


@dataclass(frozen=True)
class MicroBatching:
    """How a worker's samples are grouped into forward passes."""

    micro_batch_size: int
    """Samples per pass (fixed micro-batches)."""
    max_token_len: int | None = None
    """Dynamic batching: the token budget of a pass (real tokens, prompt + response); None: fixed micro-batches."""
    padding_free: bool = False
    """Pack each micro-batch's real tokens into one row instead of running the padded layout."""
    share_prompts: bool = False
    """Padded passes run each distinct prompt of a micro-batch once (``vlmrl.train.shared_prompts``)."""

    def groups(self, batch: Batch) -> list[list[int]]:
        """Sample indices of each micro-batch; a collective (all ranks call it) with dynamic batching."""
        n = len(batch)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        if self.max_token_len is None:
            # Rows of similar length share a micro-batch, so trimming the columns every row pads removes most
            # padding. Accumulation is exact, so grouping changes no result beyond float rounding.
            key = lambda i: lengths[i]  # noqa: E731
            if self.share_prompts:
                # A prompt's rows side by side (groups ordered by their longest row), so that a micro-batch
                # holds the rows it can run on one prompt pass; the responses then pad to their group's longest.
                groups = batch.group_ids.tolist()
                longest: dict[int, int] = {}
                for g, length in zip(groups, lengths):
                    longest[g] = max(longest.get(g, 0), length)
                key = lambda i: (longest[groups[i]], groups[i], lengths[i])  # noqa: E731
            order = sorted(range(n), key=key)
            return [order[i : i + self.micro_batch_size] for i in range(0, n, self.micro_batch_size)]
        parts = torch.tensor(parts_for_budget(lengths, self.max_token_len))
        if dist.is_available() and dist.is_initialized():
            parts = all_reduce(parts, dist.ReduceOp.MAX)
        return balanced_partition(lengths, int(parts))


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    """``tensor`` reduced over all ranks, on CPU; NCCL only reduces CUDA tensors, so it travels there and back."""
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=op)
    return tensor.cpu()


def computed_tokens(batch: Batch, padding_free: bool) -> int:
    """Token positions the model body runs for ``batch``: the real ones padding-free, else the trimmed layout."""
    return int(batch.attention_mask.sum()) if padding_free else packing.trim(batch).attention_mask.numel()


@dataclass
class TokenCount:
    """Real tokens against the token positions the model computed, over some passes."""

    real: int = 0
    computed: int = 0

    def add(self, batch: Batch, padding_free: bool) -> None:
        self.add_counts(int(batch.attention_mask.sum()), computed_tokens(batch, padding_free))

    def add_counts(self, real: int, computed: int) -> None:
        self.real += real
        self.computed += computed

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real / self.computed if self.computed else 0.0
