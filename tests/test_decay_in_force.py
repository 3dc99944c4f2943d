"""od.diagnostics.decay_in_force against closed forms and a simulated equilibrium."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od


def test_timescale_and_box_are_the_closed_forms():
    params = {"dense": {"kernel": jnp.array([[3.0, -4.0], [0.5, 1.0]]), "bias": jnp.ones(2)}}
    updates = {"dense": {"kernel": jnp.full((2, 2), 0.01), "bias": jnp.zeros(2)}}
    d = od.diagnostics.decay_in_force(
        params, updates, learning_rate=2e-3, weight_decay=0.05, convention="lr"
    )
    assert list(d) == ["decayed"]  # the bias is not decayed under "auto"
    g = d["decayed"]
    assert float(g["timescale"]) == pytest.approx(1 / (2e-3 * 0.05))
    assert float(g["box"]) == pytest.approx(0.05 * 4.0)
    assert float(g["update_ratio"]) == pytest.approx(0.02 / np.sqrt(9 + 16 + 0.25 + 1))
    assert float(g["equilibrium_ratio"]) == pytest.approx(np.sqrt(2 * 1e-4 * 0.1 / 1.9))
    sched = od.diagnostics.decay_in_force(
        params,
        updates,
        learning_rate=1e-3,
        weight_decay=0.05,
        convention="schedule",
        peak_learning_rate=2e-3,
    )
    assert float(sched["decayed"]["timescale"]) == pytest.approx(1 / (0.05 * 0.5))


def test_the_ratio_reaches_its_equilibrium_under_decay_and_random_steps():
    """θ ← (1 - s)θ + ηξ with ξ random (orthogonal to θ on average): ‖ηξ‖/‖θ‖ → √(2s)."""
    rng = np.random.default_rng(0)
    lr, lam = 1e-2, 0.5
    s = lr * lam
    theta = rng.normal(size=4096) * 1e-3
    for _ in range(int(8 / s)):  # many timescales
        step = lr * rng.choice([-1.0, 1.0], size=theta.shape)  # Adam-like unit steps
        theta = (1 - s) * theta + step
    step = lr * rng.choice([-1.0, 1.0], size=theta.shape)
    d = od.diagnostics.decay_in_force(
        {"w": jnp.asarray(theta.reshape(64, 64))},
        {"w": jnp.asarray(step.reshape(64, 64))},
        learning_rate=lr,
        weight_decay=lam,
        b1=0.0,
    )["decayed"]
    assert float(d["update_ratio"]) == pytest.approx(float(d["equilibrium_ratio"]), rel=0.05)


def test_adamw_on_noise_reaches_the_momentum_equilibrium():
    """AdamW on random gradients: ‖u‖/‖θ‖ settles at √(2ηλ(1-β1)/(1+β1))."""
    params = {"w": jax.random.normal(jax.random.key(0), (64, 64))}
    lr, lam = 1e-2, 0.5
    tx = od.adamw(lr, weight_decay=lam)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for t in range(3000):  # 15 timescales
        grads = {"w": jax.random.normal(jax.random.key(t + 1), (64, 64))}
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    d = od.diagnostics.decay_in_force(params, updates, learning_rate=lr, weight_decay=lam)
    assert float(d["decayed"]["update_ratio"]) == pytest.approx(
        float(d["decayed"]["equilibrium_ratio"]), rel=0.1
    )


@pytest.mark.parametrize(
    "kwargs, argument",
    [({"weight_decay": 0.0}, "weight_decay"), ({"convention": "l2"}, "convention")],
)
def test_bad_input_names_the_argument(kwargs, argument):
    args = {"learning_rate": 1e-3, "weight_decay": 0.1, **kwargs}
    with pytest.raises(ValueError, match=argument):
        od.diagnostics.decay_in_force({"w": jnp.ones((2, 2))}, {"w": jnp.ones((2, 2))}, **args)
