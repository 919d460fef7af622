"""verl's N-sample validation views (mean@N, best@N, maj@N) per data source: ``at_n_metrics`` with
hand-derived numbers. The real run that logs them is tests/test_resume.py's val_only run (n=2)."""

from __future__ import annotations

import math

import pytest

from vlmrl.driver.validation import at_n_metrics

NAN = math.nan

# Rows are interleaved on purpose: a prompt is its id, never its position.
#   geo, prompt 0: overall 1, 0, 1, .1   accuracy 1, 0, 1, 0   answers "4", "5", "4", "3"
#   geo, prompt 1: overall 0, .1, 0, 1   accuracy 0, 0, 0, 1   answers "7", "7", "8", "8"
#   chart, prompt 2: one response (adds nothing)
#   chart, prompt 3: overall .2, .6      accuracy NaN, 1       answers "a", "b"
ROWS = [  # (source, prompt, overall, accuracy, answer)
    ("geo", 0, 1.0, 1.0, "4"),
    ("geo", 1, 0.0, 0.0, "7"),
    ("chart", 3, 0.2, NAN, "a"),
    ("geo", 0, 0.0, 0.0, "5"),
    ("geo", 1, 0.1, 0.0, "7"),
    ("chart", 2, 0.9, 1.0, "z"),
    ("geo", 0, 1.0, 1.0, "4"),
    ("geo", 1, 0.0, 0.0, "8"),
    ("chart", 3, 0.6, 1.0, "b"),
    ("geo", 0, 0.1, 0.0, "3"),
    ("geo", 1, 1.0, 1.0, "8"),
]


def _metrics(rows=ROWS):
    sources, ids, overall, accuracy, answers = zip(*rows)
    return at_n_metrics(sources, ids, {"overall": overall, "accuracy": accuracy}, answers)


def test_mean_best_and_majority_per_source():
    m = _metrics()
    # geo overall:  prompt 0 mean (1 + 0 + 1 + .1) / 4 = .525, best 1, majority "4" (2 votes) -> mean(1, 1) = 1
    #               prompt 1 mean (0 + .1 + 0 + 1) / 4 = .275, best 1, "7" and "8" tie at 2; "7" came first
    #                        -> mean(0, .1) = .05
    #   over the 2 prompts: mean@4 = (.525 + .275) / 2 = .4, best@4 = 1, maj@4 = (1 + .05) / 2 = .525
    assert m["val/geo/overall/mean@4"] == pytest.approx(0.4)
    assert m["val/geo/overall/best@4"] == pytest.approx(1.0)
    assert m["val/geo/overall/maj@4"] == pytest.approx(0.525)
    # geo accuracy: prompt 0 mean .5, prompt 1 mean .25 -> .375; best 1 and 1 -> 1;
    #               majority "4" -> 1, majority "7" -> mean(0, 0) = 0 -> maj@4 = .5
    assert m["val/geo/accuracy/mean@4"] == pytest.approx(0.375)
    assert m["val/geo/accuracy/best@4"] == pytest.approx(1.0)
    assert m["val/geo/accuracy/maj@4"] == pytest.approx(0.5)
    # chart: prompt 2 has one response and adds nothing; prompt 3: overall mean .4, best .6, "a" and "b" tie,
    # "a" first -> .2.  Its accuracy is NaN (does not apply) for "a": mean and best over the rest (1), and no
    # maj@2, since the majority answer has no accuracy.
    assert m["val/chart/overall/mean@2"] == pytest.approx(0.4)
    assert m["val/chart/overall/best@2"] == pytest.approx(0.6)
    assert m["val/chart/overall/maj@2"] == pytest.approx(0.2)
    assert m["val/chart/accuracy/mean@2"] == pytest.approx(1.0)
    assert m["val/chart/accuracy/best@2"] == pytest.approx(1.0)
    assert "val/chart/accuracy/maj@2" not in m
    assert len(m) == 6 + 5


def test_one_response_per_prompt_gives_nothing():
    one_each = [ROWS[0], ROWS[1], ROWS[2], ROWS[5]]  # prompts 0, 1, 3, 2: one response each
    assert sorted(r[1] for r in one_each) == [0, 1, 2, 3]
    assert _metrics(one_each) == {}


def test_the_vote_decides_maj_not_the_score():
    # Three responses; two give the wrong answer "2" (score 0), one the right "3" (score 1):
    # mean@3 = 1/3, best@3 = 1, maj@3 = 0. With the answers swapped the majority is right: maj@3 = 1.
    rows = [("s", 0, 0.0, 0.0, "2"), ("s", 0, 1.0, 1.0, "3"), ("s", 0, 0.0, 0.0, "2")]
    m = _metrics(rows)
    assert (m["val/s/overall/mean@3"], m["val/s/overall/best@3"], m["val/s/overall/maj@3"]) == pytest.approx(
        (1 / 3, 1.0, 0.0)
    )
    rows = [("s", 0, 0.0, 0.0, "2"), ("s", 0, 1.0, 1.0, "3"), ("s", 0, 1.0, 1.0, "3")]
    assert _metrics(rows)["val/s/overall/maj@3"] == pytest.approx(1.0)
