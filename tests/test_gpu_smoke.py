"""scripts/gpu_smoke.sh in its CPU mode, and that what it checks is vlmrl's own code.

The GPU run itself (Qwen2.5-VL-3B shapes in bf16) needs a GPU and is not run
here; these tests keep the same code path working at tiny shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import gpu_smoke
from vlmrl.train import packing
from vlmrl.train.actor import MicroBatching, compute_log_probs

LINE = re.compile(r"^gpu_smoke: (logprob|update) seconds=(\S+) tokens_per_s=(\S+) mfu=(\S+)", re.MULTILINE)


def test_cpu_mode_prints_finite_positive_throughput_and_mfu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--cpu", "--json", str(out)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {m.group(1): [float(v) for v in m.group(2, 3, 4)] for m in LINE.finditer(proc.stdout)}
    assert set(found) == {"logprob", "update"}, proc.stdout
    for phase, numbers in found.items():
        assert all(math.isfinite(x) and x > 0 for x in numbers), (phase, numbers)
    assert "gpu_smoke: ok" in proc.stdout and "FSDP2" in proc.stdout
    results = json.loads(out.read_text())
    assert results["tokens"] > results["response_tokens"] > 0
    assert results["logprob_tokens_per_s"] == pytest.approx(found["logprob"][1], rel=1e-3)
    assert results["packed_vs_alone_max_abs_diff"] < 1e-4
    # The MFU is vlmrl.driver.perf's count: the log-prob pass is one forward, 2 FLOPs per parameter per
    # token; the update (1 epoch) forward + backward, 6.
    n, t, peak = results["parameters"], results["tokens"], results["peak_flops"]
    assert results["logprob_mfu"] == pytest.approx(2 * n * t / (results["logprob_seconds"] * peak))
    assert results["update_mfu"] == pytest.approx(6 * n * t / (results["update_seconds"] * peak))
    # update_policy ran: its own metrics, one optimizer step that was not skipped.
    assert results["update_metrics"]["actor/skipped_steps"] == 0
    assert results["update_metrics"]["actor/micro_batches"] == 1


def test_no_gpu_without_cpu_flag_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_smoke.main([]) == 2
    assert "--cpu" in capsys.readouterr().err


def test_the_script_carries_no_copy_of_vlmrl_passes():
    """The packing, the log-probs, the loss and the FLOP count are vlmrl's, imported, not re-written here."""
    source = Path(gpu_smoke.__file__).read_text()
    for copied in ("log_softmax", "get_rope_index", "torch.exp(", "fully_shard(", "def pack"):
        assert copied not in source, copied
    assert gpu_smoke.compute_log_probs is compute_log_probs
    assert gpu_smoke.FlopsModel.__module__ == "vlmrl.driver.perf"


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args = gpu_smoke.parse_args(["--cpu", "--sequences", "3", "--response", "8"])
    model = gpu_smoke.build_model("tiny", torch.float32, torch.device("cpu"), None).eval()
    generations = gpu_smoke.make_generations(model, 3, 12, 4, 8, torch.Generator().manual_seed(0))
    config = gpu_smoke.run_config(args, torch.device("cpu"), max(t.prompt_length for t in generations))
    batch = gpu_smoke.make_batch(model, generations, config)
    batching = MicroBatching(len(batch), None, padding_free=True)
    return model, generations, batch, batching, gpu_smoke.allowed_tokens(model)


def _last_sequence_error(model, batch, batching, allowed) -> float:
    with torch.no_grad():
        log_probs, _ = compute_log_probs(model, batch, batching, allowed)
        return gpu_smoke.last_packed_vs_alone(model, batch, batching, allowed, log_probs)[0]


def test_the_batch_is_the_trajectories_view_and_packs_without_padding(tiny):
    model, trajectories, batch, _, allowed = tiny
    # Each row holds its prompt and its response, and packing keeps exactly those tokens, in one row.
    lengths = [len(t.token_ids) for t in trajectories]
    assert batch.attention_mask.sum(dim=1).tolist() == lengths
    assert batch.response_mask.sum(dim=1).tolist() == [len(t.completion_ids) for t in trajectories]
    packed = packing.pack(batch)
    assert tuple(packed.input_ids.shape) == (1, sum(lengths)) and len(packed.targets) == len(packed.logit_index)
    # The rollout's ban (sampling_mask): the four vision special tokens of the shapes get no probability.
    config = model.config
    banned = [config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id]
    assert not allowed[banned].any() and int(allowed.sum()) == config.text_config.vocab_size - 4


def test_packed_log_probs_match_each_sequence_alone(tiny):
    model, _, batch, batching, allowed = tiny
    assert _last_sequence_error(model, batch, batching, allowed) < 1e-4


def test_the_check_catches_leaking_attention_and_wrong_positions(tiny, monkeypatch):
    """The smoke check is only worth something if vlmrl's packing, broken in the usual ways, fails it."""
    model, _, batch, batching, allowed = tiny
    pack = packing.pack
    # Without the text-position row, transformers cannot see the boundaries and the
    # last sequence attends to the ones before it.
    no_boundaries = lambda b: dataclasses.replace(pack(b), position_ids=pack(b).position_ids[1:])
    # Plain 1-D positions in every rotary row: the image tokens lose their 2-D layout.
    flat = lambda b: dataclasses.replace(pack(b), position_ids=pack(b).position_ids[:1].expand(4, -1, -1).contiguous())
    for wrong in (no_boundaries, flat):
        monkeypatch.setattr(packing, "pack", wrong)
        assert _last_sequence_error(model, batch, batching, allowed) > 1e-3
