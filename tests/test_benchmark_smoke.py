"""The step benchmark runs end to end at a tiny shape and reports every number.

Only the report's shape is checked: timings depend on the machine and are never asserted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from helpers.runs import joined

from benchmarks import step as step_benchmark

ROOT = Path(__file__).resolve().parents[1]

FIELDS = (
    "vlmrl_step_s",
    "vlmrl_response_length_mean",
    "vlmrl_samples_per_s",
    "raw_gen_s",
    "raw_logprob_old_s",
    "raw_logprob_ref_s",
    "raw_update_s",
    "raw_state_dict_copy_s",
    "raw_total_s",
    "overhead",
    "padding_share",
    "raw_gen_tokens_per_s",
    "vlmrl_gen_tokens_per_s",
    "rollout_efficiency",
    "resync_share",
    "raw_gen_seeded_s",
    "overhead_same_passes",
    "padding_share_update",
    "padding_share_logprob",
    "ref_vs_raw",
    "update_vs_raw",
)


def test_step_benchmark_smoke(tmp_path, monkeypatch):
    # The command's own main, in this process. Its parts are still processes of their own, started as forks of
    # the session's fork server, with torch, transformers and vLLM imported (helpers/runs.py); its vlmrl run joins
    # the session's cluster, as the suite's other runs do. Their timings are never asserted.
    real_run_part = step_benchmark.run_part

    def run_part(cmd, log, timeout, env=None):
        cmd, env = joined(cmd, env)
        return real_run_part(cmd, log, timeout, env)

    monkeypatch.setattr(step_benchmark, "run_part", run_part)
    monkeypatch.chdir(ROOT)
    step_benchmark.main(["--smoke", f"--out={tmp_path}", "--timeout=300"])
    report = json.loads((tmp_path / "step_smoke.json").read_text())
    for name in FIELDS:
        assert isinstance(report[name], (int, float)) and math.isfinite(report[name]), (name, report.get(name))
    # One on-policy update per step: no old-log-prob pass, and its raw counterpart is left out of the floor.
    assert report["vlmrl_skipped_old_pass"] is True and "old" not in report["vlmrl_timing_s"]
    assert report["raw_total_same_passes_s"] == report["raw_total_s"] - report["raw_logprob_old_s"]
    for name in ("step", "gen", "ref", "update_actor", "update_weights"):
        assert math.isfinite(report["vlmrl_timing_s"][name]), name
    for phase in report["phase_s_vlmrl_vs_raw"].values():
        assert math.isfinite(phase["vlmrl"]) and math.isfinite(phase["raw"])
    assert report["peak_rss_mib"] and all(v > 0 for v in report["peak_rss_mib"].values())
    assert 0.0 <= report["padding_share"] < 1.0
    # The in-loop rollout's pieces, from the run's timing_s/gen/* metrics.
    profile = report["vlmrl_gen_profile_s"]
    for name in ("requests", "engine", "outputs", "trajectories", "driver_call"):
        assert math.isfinite(profile[name]) and profile[name] >= 0, name
    assert (tmp_path / "step_smoke.md").read_text().startswith("Shape:")
    # The smoke runs one paired round: its ratios are the headline, against the mean of the raw passes
    # timed before and after the vlmrl run.
    (only,) = report["rounds"]
    assert report["ref_vs_raw"] == only["ref_vs_raw"] == only["vlmrl_ref_s"] / only["raw_ref_s"]
    assert report["update_vs_raw"] == only["update_vs_raw"] == only["vlmrl_update_s"] / only["raw_update_s"]
    assert only["vlmrl_ref_s"] == report["vlmrl_timing_s"]["ref"]
    # Every step's phases are kept per round (the one step of the smoke is the mean), to see drift within a run.
    (step,) = only["vlmrl_phase_s_by_step"]
    assert step["ref"] == report["vlmrl_timing_s"]["ref"] and step["step"] > step["gen"] > 0
    assert "Paired rounds" in (tmp_path / "step_smoke.md").read_text()
