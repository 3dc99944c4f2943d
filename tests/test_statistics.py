"""The experiments' statistics on synthetic inputs with known answers."""

import numpy as np
import pytest

from optax_decoupled.experiments import statistics

LRS = np.logspace(-4, -2, 5)
WDS = np.logspace(-4, 0, 9)


def _landscape(slope, seeds=5, noise=0.002, rng=None):
    """Losses whose valley bottom is log10 λ*(η) = -2 + slope (log10 η + 3)."""
    rng = np.random.default_rng(0) if rng is None else rng
    log_lr, log_wd = np.log10(LRS)[:, None], np.log10(WDS)[None, :]
    bottom = -2.0 + slope * (log_lr + 3.0)
    base = 0.5 + 0.05 * (log_wd - bottom) ** 2
    return base[None] + noise * rng.standard_normal((seeds, *base.shape))


def test_a_separable_landscape_is_separable():
    out = statistics.valley_slope(LRS, WDS, _landscape(0.0))
    assert out["verdict"] == "separable"
    assert abs(out["slope"]) < 0.1 and out["low"] <= 0 <= out["high"]


def test_a_coupled_landscape_has_slope_minus_one():
    out = statistics.valley_slope(LRS, WDS, _landscape(-1.0))
    assert out["verdict"] == "coupled"
    assert out["slope"] == pytest.approx(-1.0, abs=0.1)
    assert out["low"] < -1.0 < out["high"] < 0


def test_a_noisy_landscape_is_inconclusive():
    out = statistics.valley_slope(LRS, WDS, _landscape(-0.5, seeds=3, noise=0.2))
    assert out["verdict"] in ("inconclusive", "coupled")
    assert out["high"] - out["low"] > 0.3


def test_the_valley_bottom_is_found_between_grid_points():
    log_wd = np.log10(WDS)
    losses = (log_wd - (-1.75)) ** 2
    assert statistics.valley_minimum(log_wd, losses) == pytest.approx(-1.75)
    assert statistics.valley_minimum(log_wd, -log_wd) == log_wd[-1]  # the edge: the edge


def test_a_known_paired_difference_and_its_interval():
    rng = np.random.default_rng(1)
    b = rng.normal(1.0, 0.3, size=8)  # seed-to-seed spread larger than the difference
    a = b - 0.05 + rng.normal(0, 0.01, size=8)
    out = statistics.paired_difference(a, b, names=("AdamW", "Adam + L2"))
    assert out["low"] < -0.05 < out["high"] < 0
    assert out["verdict"] == "AdamW better"
    assert "AdamW better" in out["line"]
    # Unpaired, the same numbers would not separate: the pairing is what resolves them.
    d = np.asarray(a) - np.asarray(b)
    assert np.std(a) > 10 * np.std(d)


def test_no_difference_is_not_distinguishable():
    rng = np.random.default_rng(2)
    b = rng.normal(1.0, 0.1, size=5)
    a = b + rng.normal(0, 0.01, size=5)
    out = statistics.paired_difference(a, b)
    assert out["verdict"] == "not distinguishable" and out["low"] < 0 < out["high"]
    assert "at this budget" in out["line"]


def test_higher_is_better_flips_the_verdict():
    out = statistics.paired_difference([0.9, 0.91, 0.92], [0.8, 0.8, 0.81], lower_is_better=False)
    assert out["verdict"] == "a better"


@pytest.mark.parametrize("a, b", [([1.0, 2.0], [1.0]), ([], []), ([1.0, np.nan], [1.0, 2.0])])
def test_bad_input(a, b):
    with pytest.raises(ValueError):
        statistics.paired_difference(a, b)


def test_a_valley_at_the_edge_of_the_grid_is_inconclusive():
    """A landscape whose best λ lies beyond the grid for some η is not called separable,
    even though its clamped minima have slope 0 and a zero-width interval."""
    losses = _landscape(0.0)[:, :, :4]  # λ* = 1e-2 and the grid stops at 10^-2.5
    out = statistics.valley_slope(LRS, WDS[:4], losses)
    assert out["verdict"] == "inconclusive"
    assert out["edge"] == pytest.approx(list(LRS))
    assert "edge of the grid" in out["line"]
    assert statistics.valley_slope(LRS, WDS, _landscape(0.0))["edge"] == []
