"""How the reports print numbers: no "-0.00" for a value that rounds to zero."""

import math

import pytest

from optax_decoupled.experiments import formatting, grid


@pytest.mark.parametrize(
    "value, spec, expected",
    [
        (-0.001, "+.2f", "+0.00"),
        (-0.001, ".2f", "0.00"),
        (-0.0, "+.2e", "+0.00e+00"),
        (-4e-5, "+.2%", "+0.00%"),
        (-0.006, "+.2f", "-0.01"),  # rounds away from zero: keeps its sign
        (-0.0004, "+.4f", "-0.0004"),
        (-1e-9, ".2e", "-1.00e-09"),  # scientific notation shows it: keeps its sign
        (0.29, "+.2f", "+0.29"),
        (-math.inf, "+.2f", "-inf"),
        (math.nan, ".2f", "nan"),
    ],
)
def test_number(value, spec, expected):
    assert formatting.number(value, spec) == expected


def test_grid_summary_prints_a_tiny_negative_slope_as_zero():
    analysis = {
        "best": {"learning_rate": 1e-3, "weight_decay": 1e-2, "val_loss": 0.5},
        "log_slope": -0.001,
        "near_optimal_corr": -0.004,
        "near_optimal_cells": 3,
        "tolerance": 0.05,
        "best_wd_per_lr": [1e-2, 1e-2],
    }
    separability = {"slope": -0.001, "low": -0.004, "high": 0.002, "verdict": "separable",
                    "line": "separable: slope -0.00"}  # fmt: skip
    res = {"label": "Adam+L2", "runs": 4, "analysis": analysis, "separability": separability}
    row = grid.summary_table({"optimizers": {"adam_l2": res}}).splitlines()[2]
    assert "| +0.00 [+0.00, +0.00] | separable | +0.00 (3 cells within 5%) |" in row, row
