"""The step benchmark's paired ratios: each round's vlmrl run against the raw passes and the TRL run of the same round.

Pure arithmetic on made-up timings; the benchmark itself runs end to end in test_benchmark_smoke.py.
"""

from __future__ import annotations

import math

from benchmarks.step import _trl_ratio, paired_rounds


def _round(step: float, ref: float, update: float, raw_ref: tuple[float, float], raw_update: tuple[float, float], trl):
    hf = [{"ref_s": r, "update_s": u} for r, u in zip(raw_ref, raw_update)]
    return {
        "vlmrl": {"timing_s": {"step": step, "ref": ref, "update_actor": update}, "log": []},
        "hf_before": hf[0],
        "hf_after": hf[1],
        "trl": None if trl is None else {"trl_step_s": trl, "trl_samples_per_s": 256 / trl},
    }


def test_each_round_is_divided_by_its_own_raw_passes_and_trl_run():
    # Round 1: raw ref (0.8 + 1.0) / 2 = 0.9, so 0.9 / 0.9 = 1; raw update (2.0 + 2.2) / 2 = 2.1, 2.31 / 2.1 = 1.1;
    # TRL 6.0 s a step against vlmrl's 4.0 s: 6 / 4 = 1.5 times the samples/s.
    # Round 2: the machine is slower; ref 1.2 / 1.2 = 1, update 2.4 / 3.0 = 0.8, TRL 6.0 / 6.0 = 1.
    rounds = paired_rounds(
        [
            _round(4.0, 0.9, 2.31, (0.8, 1.0), (2.0, 2.2), 6.0),
            _round(6.0, 1.2, 2.4, (1.1, 1.3), (2.9, 3.1), 6.0),
        ]
    )
    assert [round(r["ref_vs_raw"], 9) for r in rounds] == [1.0, 1.0]
    assert [round(r["update_vs_raw"], 9) for r in rounds] == [1.1, 0.8]
    assert [r["vlmrl_over_trl"] for r in rounds] == [1.5, 1.0]
    # The headline is the mean of the rounds' ratios, (1.5 + 1.0) / 2 = 1.25, not the ratio of the mean
    # steps (6.0 / 5.0 = 1.2), which lets one round's slow minute weigh on the other's.
    trl = {"trl_step_s": 6.0, "trl_samples_per_s": 256 / 6.0}
    assert _trl_ratio(256 / 5.0, trl, rounds) == 1.25


def test_without_trl_in_every_round_the_ratio_is_of_the_means():
    # A round without its TRL run cannot be paired: 256 / 5 samples/s against 256 / 6 is 6 / 5 = 1.2.
    rounds = paired_rounds(
        [_round(4.0, 0.9, 2.0, (0.9, 0.9), (2.0, 2.0), 6.0), _round(6.0, 0.9, 2.0, (0.9, 0.9), (2.0, 2.0), None)]
    )
    assert "vlmrl_over_trl" not in rounds[1]
    assert math.isclose(_trl_ratio(256 / 5.0, {"trl_step_s": 6.0, "trl_samples_per_s": 256 / 6.0}, rounds), 1.2)
