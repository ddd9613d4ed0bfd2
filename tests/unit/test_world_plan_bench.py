"""The world_plan bench's figures from (label, predicted, measured) rows."""

import math

import pytest

from meshfold.tools.bench.world_plan import GOALS, _figures


def test_figures_read_the_rows():
    rows = [("a", 1.0, 2.0), ("b", 2.0, 3.0), ("c", 3.0, 2.5)]
    got = _figures(rows, "b")
    assert got["chosen_vs_fastest"] == pytest.approx(3.0 / 2.0)
    # NOTE: predicted order a < b < c, measured a < c < b: one swap of three
    assert got["spearman"] == pytest.approx(0.5)
    assert got["relative_error"] == pytest.approx((0.5 + 1 / 3 + 0.2) / 3)
    assert got["worst_relative_error"] == pytest.approx(0.5)


def test_a_perfect_prediction_meets_every_goal():
    rows = [(str(i), t, t) for i, t in enumerate([1.0, 2.0, 4.0, 8.0])]
    got = _figures(rows, "0")
    assert got["chosen_vs_fastest"] == 1.0 <= GOALS["chosen_vs_fastest"]
    assert got["spearman"] == pytest.approx(1.0)
    assert got["relative_error"] == 0.0


def test_a_chosen_label_that_was_not_measured_is_nan():
    assert math.isnan(_figures([("a", 1.0, 1.0), ("b", 2.0, 2.0), ("c", 3.0, 3.0)], "z")["chosen_vs_fastest"])
