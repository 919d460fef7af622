"""One rank of the two-rank resync-stream check in tests/test_resync.py (spawned; imports torch and vlmrl only).

A small module with awkward shapes for FSDP2's dim-0 sharding over two ranks:
7 rows (4 + 3), 3 rows (2 + 1), 1 row (1 + an empty shard), a 1-D bias and a
LayerNorm of width 1, plus a persistent buffer that FSDP2 leaves whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vlmrl.weight_sync.gather import BucketedGather

# (bucket bytes, dtype cast before the gather): one tensor per all-gather, 64-byte buckets in bf16, one bucket.
CASES = ((1, None), (64, torch.bfloat16), (1 << 40, None))


class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.blocks = nn.ModuleList([nn.Linear(5, 3), nn.Linear(3, 1)])
        self.norm = nn.LayerNorm(1)
        self.register_buffer("scale", torch.arange(3.0))


def run(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank, as from a checkpoint
    model = Awkward()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    gather = BucketedGather(model)
    report = {"local_rows": {n: t.to_local().shape[0] for n, t in model.state_dict().items() if n != "scale"}}
    for bucket_bytes, dtype in CASES:
        gather.bucket_bytes = bucket_bytes
        streamed = list(gather.stream(dtype))
        want = {k: v if dtype is None else v.to(dtype) for k, v in full.items()}
        report[str(bucket_bytes)] = {
            "names": [n for n, _ in streamed] == list(want),
            "values": all(t.dtype == want[n].dtype and torch.equal(t, want[n]) for n, t in streamed),
            "largest_bucket": gather.largest_bucket_bytes,
        }
    if rank == world - 1:  # the rank with the short and empty shards
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()
