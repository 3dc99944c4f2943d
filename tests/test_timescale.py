"""λ from an EMA timescale and between conventions, against the closed forms."""

import itertools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

CONVENTIONS = ("lr", "schedule", "constant", "corrected")


def _per_step_decay_at_peak(weight_decay, convention, peak):
    """s_t at η_t = η_peak, from the transform's own formula (od.decay_rate)."""
    return od.decay_rate(weight_decay, convention, peak, peak)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("tau, peak, steps_per_epoch", [(100.0, 1e-3, None), (2.5, 3e-4, 400)])
def test_timescale_gives_one_over_tau_decay_per_step_at_the_peak(
    convention, tau, peak, steps_per_epoch
):
    lam = od.weight_decay_for_timescale(
        tau, peak, convention=convention, steps_per_epoch=steps_per_epoch
    )
    steps = tau * (steps_per_epoch or 1)
    np.testing.assert_allclose(_per_step_decay_at_peak(lam, convention, peak), 1.0 / steps)
    back = od.timescale_for_weight_decay(
        lam, peak, convention=convention, steps_per_epoch=steps_per_epoch
    )
    np.testing.assert_allclose(back, tau)


def test_adamw_timescale_is_wang_aitchison_one_over_eta_lambda():
    # τ_iter = 1/(ηλ): λ = 0.1, η = 1e-3 -> 10^4 steps; 20 epochs of 500 steps.
    assert od.timescale_for_weight_decay(0.1, 1e-3) == pytest.approx(1e4)
    assert od.timescale_for_weight_decay(0.1, 1e-3, steps_per_epoch=500) == pytest.approx(20.0)
    assert od.weight_decay_for_timescale(20, 1e-3, steps_per_epoch=500) == pytest.approx(0.1)


def test_the_ema_of_decoupled_decay_has_that_timescale():
    """θ_{t+1} = (1 - s)θ_t + s·x with s from the timescale is an EMA whose weight on a step
    τ steps back is e^{-1} of the newest (to O(1/τ))."""
    tau, peak = 200.0, 2e-3
    lam = od.weight_decay_for_timescale(tau, peak)
    s = lam * peak
    weights = s * (1 - s) ** np.arange(1000)
    assert weights[int(tau)] / weights[0] == pytest.approx(np.exp(-1), rel=5e-3)


@pytest.mark.parametrize("src, dst", list(itertools.product(CONVENTIONS, CONVENTIONS)))
def test_conversion_keeps_the_decay_at_the_peak(src, dst):
    peak = 4e-4
    lam = od.convert_weight_decay(
        0.05, from_convention=src, to_convention=dst, peak_learning_rate=peak
    )
    np.testing.assert_allclose(
        _per_step_decay_at_peak(lam, dst, peak), _per_step_decay_at_peak(0.05, src, peak)
    )
    again = od.convert_weight_decay(
        lam, from_convention=dst, to_convention=src, peak_learning_rate=peak
    )
    np.testing.assert_allclose(again, 0.05)


def test_converted_decay_matches_the_transform_over_a_schedule_at_its_peak():
    """The transforms themselves decay by the same amount at the peak of a schedule."""
    peak = 1e-3
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak, 5, 20)
    params = {"w": jnp.ones((2, 2))}
    lam_sched = od.convert_weight_decay(
        0.1, from_convention="lr", to_convention="schedule", peak_learning_rate=peak
    )
    shrink = {}
    for conv, lam in (("lr", 0.1), ("schedule", lam_sched)):
        tx = od.decoupled_weight_decay(
            lam, convention=conv, learning_rate=schedule, peak_learning_rate=peak, mask=None
        )
        state = tx.init(params)
        for _ in range(5):  # step 5 is the peak
            _, state = tx.update({"w": jnp.zeros((2, 2))}, state, params)
        u, _ = tx.update({"w": jnp.zeros((2, 2))}, state, params)
        shrink[conv] = float(-u["w"][0, 0])
    assert shrink["lr"] == pytest.approx(1e-4, rel=1e-5)
    assert shrink["schedule"] == pytest.approx(shrink["lr"], rel=1e-5)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: od.weight_decay_for_timescale(0.0, 1e-3), "timescale"),
        (lambda: od.weight_decay_for_timescale(float("inf"), 1e-3), "timescale"),
        (lambda: od.weight_decay_for_timescale(10.0), "peak_learning_rate"),
        (lambda: od.weight_decay_for_timescale(10.0, -1e-3), "peak_learning_rate"),
        (lambda: od.weight_decay_for_timescale(10.0, 1e-3, steps_per_epoch=0), "steps_per_epoch"),
        (lambda: od.weight_decay_for_timescale(10.0, 1e-3, convention="l2"), "convention"),
        (lambda: od.timescale_for_weight_decay(0.0, 1e-3), "weight_decay"),
        (
            lambda: od.convert_weight_decay(-0.1, from_convention="lr", to_convention="lr"),
            "weight_decay",
        ),
        (
            lambda: od.convert_weight_decay(0.1, from_convention="lr", to_convention="constant"),
            "peak_learning_rate",
        ),
        (
            lambda: od.convert_weight_decay(0.1, from_convention="x", to_convention="lr"),
            "from_convention",
        ),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_schedule_only_conventions_need_no_peak():
    assert od.weight_decay_for_timescale(50.0, convention="schedule") == pytest.approx(0.02)
    assert od.weight_decay_for_timescale(50.0, convention="constant") == pytest.approx(0.02)
