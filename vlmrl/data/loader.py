"""A resumable loader over RLHFDataset.

Batches are lists of PromptSample: the rollout pads per worker, so there is
nothing to stack here.
"""

from __future__ import annotations

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from vlmrl.data.dataset import RLHFDataset


def _as_list(samples):
    return samples


def make_loader(dataset: RLHFDataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool) -> StatefulDataLoader:
    if batch_size > len(dataset):
        raise ValueError(
            f"{dataset.files}: {len(dataset)} usable rows, fewer than one batch of {batch_size}; "
            "lower the batch size or add data"
        )
    generator = torch.Generator()
    generator.manual_seed(seed)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=drop_last,
        collate_fn=_as_list,
        num_workers=0,
    )
