r"""Cautious weight decay (Chen et al. 2025) against a float64 NumPy implementation.

.. math::

    \theta_{t+1} = \theta_t - \eta_t d_t - s_t \mathbb{1}[d_t \odot \theta_t \ge 0] \theta_t

with :math:`d_t` the optimizer's direction (Adam's or Lion's) and :math:`s_t` the decay of the
convention: the decay acts only where it pulls the parameter the same way as the step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

STEPS = 30
PEAK = 1e-2
SCHEDULE = optax.linear_schedule(PEAK, PEAK / 10, STEPS)


def _grads(theta, t):
    return np.sin(3.0 * theta * (t + 1)) + 0.3 * np.cos(theta + t)


def _reference(optimizer, convention, lam, theta0, b1=0.9, b2=0.999, eps=1e-8):
    """float64 NumPy: Adam's or Lion's direction, then the cautious decay."""
    theta = np.asarray(theta0, np.float64)
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    for t in range(STEPS):
        g = _grads(theta, t)
        lr = float(SCHEDULE(t))
        if optimizer == "adamw":
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            d = (m / (1 - b1 ** (t + 1))) / (np.sqrt(v / (1 - b2 ** (t + 1))) + eps)
        else:  # lion, (b1, b2) = (0.9, 0.99)
            d = np.sign(0.9 * m + 0.1 * g)
            m = 0.99 * m + 0.01 * g
        s = {"lr": lam * lr, "schedule": lam * lr / PEAK, "constant": lam}[convention]
        theta = theta - lr * d - s * (d * theta >= 0) * theta
    return theta


@pytest.mark.parametrize("convention", ["lr", "schedule", "constant"])
@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
def test_cautious_decay_matches_the_float64_reference(optimizer, convention):
    lam = {"lr": 0.5, "schedule": 5e-3, "constant": 5e-3}[convention]
    theta0 = np.linspace(-1.0, 1.0, 24).reshape(4, 6)
    alias = od.adamw if optimizer == "adamw" else od.lion
    tx = alias(
        SCHEDULE,
        weight_decay=lam,
        decay_convention=convention,
        peak_learning_rate=PEAK,
        mask=None,
        cautious=True,
    )
    params = {"w": jnp.asarray(theta0, jnp.float32)}
    state = tx.init(params)
    for t in range(STEPS):
        g = {"w": jnp.asarray(_grads(np.asarray(params["w"], np.float64), t), jnp.float32)}
        updates, state = jax.jit(tx.update)(g, state, params)
        params = optax.apply_updates(params, updates)
    expected = _reference(optimizer, convention, lam, theta0)
    np.testing.assert_allclose(np.asarray(params["w"], np.float64), expected, rtol=2e-4, atol=2e-5)


def test_cautious_decay_skips_coordinates_where_it_opposes_the_step():
    params = {"w": jnp.array([[1.0, 1.0], [-1.0, -1.0]])}
    # Adam's first direction is sign(g): +1 for the first column, -1 for the second.
    grads = {"w": jnp.array([[1.0, -1.0], [1.0, -1.0]])}
    tx = od.adamw(0.1, weight_decay=0.5, mask=None, cautious=True)
    updates, _ = tx.update(grads, tx.init(params), params)
    plain, _ = od.adamw(0.1, weight_decay=0.5, mask=None).update(grads, tx.init(params), params)
    decayed = np.asarray(updates["w"]) != np.asarray(plain["w"])
    # d·θ >= 0 (decayed) at (0, 0) and (1, 1); elsewhere the decay is skipped.
    np.testing.assert_array_equal(decayed, [[False, True], [True, False]])


def test_cautious_is_a_bool_and_decoupled_only():
    with pytest.raises(ValueError, match="cautious"):
        od.adamw(1e-3, cautious=1)
    with pytest.raises(ValueError, match="cautious"):
        od.amsgrad(1e-3, weight_decay=0.1, coupled=True, cautious=True)
    with pytest.raises(ValueError, match="cautious"):
        od.decoupled_weight_decay(0.1, learning_rate=1e-3, cautious="yes")
