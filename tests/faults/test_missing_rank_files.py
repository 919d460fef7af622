"""Fault: a save in which some rank's files never arrived (nodes without a shared filesystem), or arrived cut short.

Before, COMPLETE was written regardless, giving a "complete" checkpoint with no
shards. ``verify_shards`` must refuse it, naming the missing files.
"""

from __future__ import annotations

import pytest
import torch

from vlmrl.driver.checkpoint import CheckpointError, verify_shards
from vlmrl.train.checkpoint import save_actor


@pytest.fixture
def save(tmp_path):
    """A save's temporary directory holding rank 0's real actor files."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    save_actor(tmp_path / "actor", model, optimizer, rank=0, model_only=False)
    return tmp_path


def test_a_whole_one_rank_save_passes(save):
    verify_shards(save, world_size=1)


def test_the_rng_file_of_a_rank_that_wrote_elsewhere_is_missing(save):
    with pytest.raises(CheckpointError, match=r"actor/rng_rank1\.pt is missing.*shares"):
        verify_shards(save, world_size=2)


def test_a_shard_the_metadata_names_is_missing(save):
    shard = next((save / "actor").glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"actor/{shard.name} is missing"):
        verify_shards(save, world_size=1)


def test_a_shard_cut_short_is_refused(save):
    shard = next((save / "actor").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"actor/{shard.name} is cut short"):
        verify_shards(save, world_size=1)


def test_a_role_without_its_metadata_is_refused(save):
    (save / "critic").mkdir()
    with pytest.raises(CheckpointError, match=r"critic/\.metadata is missing"):
        verify_shards(save, world_size=1)
