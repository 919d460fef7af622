"""scripts/gpu_smoke.sh in its CPU mode, and the packing check it relies on.

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

LINE = re.compile(
    r"^gpu_smoke: (logprob|update) seconds=(\S+) tokens_per_s=(\S+) mfu=(\S+)",
    re.MULTILINE,
)


def test_cpu_mode_prints_finite_positive_throughput_and_mfu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--cpu", "--json", str(out)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {
        m.group(1): [float(v) for v in m.group(2, 3, 4)]
        for m in LINE.finditer(proc.stdout)
    }
    assert set(found) == {"logprob", "update"}, proc.stdout
    for phase, numbers in found.items():
        assert all(math.isfinite(x) and x > 0 for x in numbers), (phase, numbers)
    assert "gpu_smoke: ok" in proc.stdout
    results = json.loads(out.read_text())
    assert results["tokens"] > results["response_tokens"] > 0
    assert results["logprob_tokens_per_s"] == pytest.approx(
        found["logprob"][1], rel=1e-3
    )
    assert results["packed_vs_alone_max_abs_diff"] < 1e-4


def test_no_gpu_without_cpu_flag_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_smoke.main([]) == 2
    assert "--cpu" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    cpu, fp32 = torch.device("cpu"), torch.float32
    model = gpu_smoke.build_model("tiny", fp32, cpu, "sdpa").eval()
    samples = gpu_smoke.make_samples(
        model, 3, 12, 4, 8, torch.Generator().manual_seed(0)
    )
    packed = gpu_smoke.pack(model, samples, cpu, fp32)
    alone = gpu_smoke.unpacked_log_probs(model, samples[-1], cpu, fp32)
    return model, packed, alone


def _last_sequence_error(model, packed, alone) -> float:
    with torch.no_grad():
        return float(
            (gpu_smoke.response_log_probs(model, packed)[-len(alone) :] - alone)
            .abs()
            .max()
        )


def test_packed_log_probs_match_each_sequence_alone(tiny):
    model, packed, alone = tiny
    assert packed.input_ids.shape[0] == 1 and packed.tokens == sum(
        packed.seq_lengths
    )  # one row, no padding
    assert len(packed.targets) == len(packed.logit_index)
    assert _last_sequence_error(model, packed, alone) < 1e-4


def test_the_check_catches_leaking_attention_and_wrong_positions(tiny):
    """The smoke check is only worth something if the usual packing mistakes fail it."""
    model, packed, alone = tiny
    # Without the text-position row, transformers cannot see the boundaries and the
    # last sequence attends to the ones before it.
    no_boundaries = dataclasses.replace(packed, position_ids=packed.position_ids[1:])
    # Plain 1-D positions in every rotary row: the image tokens lose their 2-D layout.
    flat = dataclasses.replace(
        packed, position_ids=packed.position_ids[:1].expand(4, -1, -1).contiguous()
    )
    for wrong in (no_boundaries, flat):
        assert _last_sequence_error(model, wrong, alone) > 1e-3


def test_flops_count_attention_per_sequence(tiny):
    model, packed, _ = tiny
    text = model.config.text_config
    one_long = dataclasses.replace(packed, seq_lengths=[packed.tokens])
    # The same tokens as one sequence cost more attention: (sum L)^2 > sum L^2.
    extra = (
        2
        * text.hidden_size
        * text.num_hidden_layers
        * (packed.tokens**2 - sum(n**2 for n in packed.seq_lengths))
    )
    assert gpu_smoke.forward_flops(model, one_long) - gpu_smoke.forward_flops(
        model, packed
    ) == pytest.approx(extra)
