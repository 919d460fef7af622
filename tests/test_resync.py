"""The bucketed, streamed resync of the actor's weights into vLLM, and the engine's sleep/wake around it.

- Bucket plans keep the state dict's order and never mix dtypes in one all-gather.
- Over two FSDP2 ranks (gloo), the stream yields exactly the names and values
  of the whole-state-dict gather, for buckets of one tensor, a few, and all.
- Against a live in-process vLLM engine (tests/helpers/resync_check.py): a
  change to the vision tower alone shows in the next decode (a stale encoder or
  prefix cache would decode as before), and after resyncs of other weights, a
  resync of the weights the engine started on decodes exactly (tokens and
  log-probs) what the fresh engine decoded.
- A sink that fails mid-stream still lets every all-gather of the sync run.
- Sleep/wake order on GPU (weights, load, KV cache), none on CPU.
- The process-group backend follows the device.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers.runs import run_command

from vlmrl.workers.trainer import process_group_backend
from vlmrl.rollout.engine.vllm import VLLMEngine
from vlmrl.weight_sync.gather import plan_buckets


def test_bucket_plan_keeps_order_and_splits_on_size_and_key():
    # 40 + 40 fit in 100; 40 more would not; a 200-byte tensor gets its own bucket;
    # None (not bucketable) and another key (dtype/mesh) start new buckets.
    sizes = [("a", 40, 1), ("b", 40, 1), ("c", 40, 1), ("d", 200, 1), ("e", 8, None), ("f", 8, 1), ("g", 8, 2)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"], ["f"], ["g"]]
    assert plan_buckets(sizes, 1) == [[n] for n, _, _ in sizes]
    assert plan_buckets(sizes, 10**9) == [["a", "b", "c", "d"], ["e"], ["f"], ["g"]]
    assert plan_buckets([], 100) == []


def test_stream_over_two_ranks_equals_the_whole_state_dict(tmp_path):
    import torch.multiprocessing as mp
    from helpers.two_rank_stream import run

    out = tmp_path / "report.json"
    mp.spawn(run, args=(2, str(tmp_path / "store"), str(out)), nprocs=2)
    report = json.loads(out.read_text())
    # The last rank holds 3 of embed's 7 rows, 1 of the first Linear's 3 and none of the second's 1.
    assert report["local_rows"]["embed.weight"] == 3
    assert report["local_rows"]["blocks.0.weight"] == 1
    assert report["local_rows"]["blocks.1.weight"] == 0
    for case in ("1", "64", str(1 << 40)):
        assert report[case]["names"] and report[case]["values"], (case, report[case])
    # What one all-gather held, each rank's shard padded to ceil(rows / 2) rows. Per rank: embed 4 x 5 = 20,
    # blocks.0 2 x 5 + 2, blocks.1 1 x 3 + 1, norm 1 + 1 elements (the buffer is not gathered).
    # Alone, embed is the largest: 2 x 20 x 4 bytes. In 64-byte bf16 buckets embed (70 bytes) is alone,
    # 2 x 20 x 2, and the rest shares one (2 x 18 x 2 = 72). One bucket: 2 x 38 x 4.
    assert report["1"]["largest_bucket"] == 160
    assert report["64"]["largest_bucket"] == 80
    assert report[str(1 << 40)]["largest_bucket"] == 304


@pytest.fixture(scope="module")
def live_resync(tiny_assets):
    proc = run_command(
        [sys.executable, "tests/helpers/resync_check.py", "check", str(tiny_assets.model_dir), str(tiny_assets.val_file)],
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x["ids"] == y["ids"] and x["log_probs"] == y["log_probs"] for x, y in zip(a, b, strict=True))


def test_resync_decodes_exactly_as_a_fresh_engine_on_the_same_weights(live_resync):
    # The engine started on the target weights; two resyncs of other weights later, the target's weights
    # come back through the stream, every tensor in its own bucket. A tensor the resync skipped would still
    # hold the actor's earlier value, and the decode would differ.
    assert _same(live_resync["synced_target"], live_resync["fresh_target"])
    assert not _same(live_resync["actor"], live_resync["fresh_target"])  # the control: the resyncs changed the engine
    assert live_resync["names_match"] and live_resync["values_match"]
    assert live_resync["version"] == 3  # three syncs, each its version


def test_a_changed_vision_tower_is_not_served_from_stale_caches(live_resync):
    # Only model.visual.* changed: with the old image embeddings still cached, the same image prompts
    # would decode exactly as before. They must not.
    before, changed = live_resync["actor"], live_resync["vision_changed"]
    differ = [x["log_probs"][0] != y["log_probs"][0] for x, y in zip(before, changed, strict=True)]
    assert all(differ), differ  # even the first token, conditioned on the prompt alone
    metrics = live_resync["vision_sync"]
    assert metrics["timing_s/resync_worker"] > 0
    assert metrics["perf/resync_bucket_peak_mb"] == 0  # one rank: its shards are the tensors, nothing is gathered


class _FakeLLM:
    """Records the sleep-mode calls a VLLMEngine makes."""

    def __init__(self):
        self.calls = []
        self.llm_engine = self

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append(("rpc", method, list(kwargs["weights_iterator"])))

    def generate(self, requests, params, use_tqdm):
        self.calls.append(("generate",))
        return []

    def reset_encoder_cache(self):
        self.calls.append(("reset_encoder_cache",))

    def reset_mm_cache(self):
        self.calls.append(("reset_mm_cache",))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def has_unfinished_requests(self):
        return False


def _rollout(sleeps: bool) -> VLLMEngine:
    # The engine's memory handling only, without building an engine.
    rollout = object.__new__(VLLMEngine)
    rollout.llm, rollout.sleeps, rollout.freed, rollout.version = _FakeLLM(), sleeps, set(), 0
    rollout.engine_weight, rollout.remote_shards, rollout.cpu_moe_layers = None, False, 0
    return rollout


def test_gpu_engine_sleeps_after_generating_and_wakes_weights_before_kv_cache_on_resync():
    rollout = _rollout(sleeps=True)
    rollout.wake_up()
    rollout.llm.calls.append(("generate",))
    rollout.sleep()
    rollout.load_weights(iter([("w", torch.zeros(1))]), version=1)
    rollout.wake_up()  # the next generate: already awake
    calls = [c if c[0] != "rpc" else ("rpc", c[1], [n for n, _ in c[2]]) for c in rollout.llm.calls]
    assert calls == [
        ("generate",),
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("rpc", "reload_weights", ["w"]),
        ("wake_up", ["kv_cache"]),
        ("reset_encoder_cache",),
        ("reset_mm_cache",),
        ("reset_prefix_cache",),
    ]
    # Validation or a warm-up step: a generate with no resync since the sleep wakes both at once.
    rollout.sleep()
    rollout.wake_up()
    assert rollout.llm.calls[-2:] == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]


def test_cpu_engine_never_sleeps_but_still_drops_its_caches_on_resync():
    rollout = _rollout(sleeps=False)
    rollout.sleep()
    rollout.load_weights([("w", torch.zeros(1))], version=1)
    rollout.wake_up()
    assert [c[0] for c in rollout.llm.calls] == ["rpc", "reset_encoder_cache", "reset_mm_cache", "reset_prefix_cache"]


class _CountingGather:
    """Stands in for the bucketed gather: three tensors, counting how many were gathered."""

    largest_bucket_bytes = 0

    def __init__(self):
        self.gathered = 0

    def stream(self, dtype=None):
        for name in ("a", "b", "c"):
            self.gathered += 1
            yield name, torch.zeros(1)


class _FailingSink:
    def __init__(self, reads: int):
        self.reads = reads

    def load(self, named_tensors, version):
        stream = iter(named_tensors)
        for _ in range(self.reads):
            next(stream)
        raise RuntimeError("the engine failed")


@pytest.mark.parametrize("reads", [0, 1])
def test_a_failed_load_still_gathers_the_rest_so_other_ranks_do_not_hang(reads):
    from vlmrl.weight_sync import WeightSync

    sync = WeightSync(torch.nn.Linear(1, 1), _FailingSink(reads), torch.float32)
    sync.gather = _CountingGather()
    with pytest.raises(RuntimeError, match="the engine failed"):
        sync.sync(1)
    assert sync.gather.gathered == 3  # every all-gather of the sync ran, as on the ranks that did not fail


def test_process_group_backend_follows_the_device():
    assert process_group_backend("cuda") == "nccl"
    assert process_group_backend("cpu") == "gloo"


def test_resync_config_defaults():
    from vlmrl.config import RolloutConfig

    assert RolloutConfig().free_cache_engine is True  # EasyR1/verl sleep the engine on GPU
    assert RolloutConfig().resync_bucket_mb == 512
