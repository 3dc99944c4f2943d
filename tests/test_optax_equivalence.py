"""Where Optax implements the same optimizer, ``optax_decoupled`` must produce the same steps.

Both optimizers run side by side in one ``jax.lax.scan`` (all cases of a dtype in one program,
to compile once) for ``NUM_STEPS`` steps on
``g_k = n_k + COUPLING * theta_k`` (a fixed random sequence plus a quadratic's gradient, so the
parameters feed back), and the parameters (or, for lone transforms, their outputs) are compared
at every step.

Tolerances: the two sides evaluate the same formulas with different operation orders, so float32
results agree to a few float32 ulps of the parameters (|theta| ~ 1: rtol 2e-6, atol 2e-7 over 60
steps); float64 runs (``jax.enable_x64``) agree to rtol 1e-12.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

NUM_STEPS = 60
COUPLING = 0.5
SHAPES = {
    "dense": {"kernel": (3, 4), "bias": (5,)},
    "conv": {"kernel": (2, 3, 2)},
    "temperature": (),
}
AUTO_MASK = {
    "dense": {"kernel": True, "bias": False},
    "conv": {"kernel": True},
    "temperature": False,
}
TREE_MASK = {
    "dense": {"kernel": False, "bias": True},
    "conv": {"kernel": True},
    "temperature": True,
}
TOL = {"float32": dict(rtol=2e-6, atol=2e-7), "float64": dict(rtol=1e-12, atol=1e-14)}


def float_count(schedule):
    """Optax's linear schedules divide an int32 count in float32 even under x64; a float count
    keeps float64 runs in float64 (see test_reference.float_count)."""
    return lambda count: schedule(jnp.asarray(count, dtype=float))


SCHED = float_count(optax.warmup_cosine_decay_schedule(1e-4, 1e-2, 10, NUM_STEPS, 1e-3))
LION_SCHED = float_count(optax.warmup_cosine_decay_schedule(3e-5, 3e-3, 10, NUM_STEPS, 3e-4))
L2_SCHED = float_count(optax.linear_schedule(0.1, 0.01, 40))


def build(fn, shapes=SHAPES):
    if isinstance(shapes, dict):
        return {key: build(fn, sub) for key, sub in shapes.items()}
    return fn(shapes)


def problem(seed: int, dtype: str):
    """Initial params (tree) and the noise sequence (tree of (NUM_STEPS, *shape) arrays)."""
    rng = np.random.default_rng(seed)
    params = build(lambda s: jnp.asarray(rng.standard_normal(s), dtype))
    scale = np.array([1.0 + 2.0 * math.exp(-k / 8.0) for k in range(NUM_STEPS)])
    noise = build(
        lambda s: jnp.asarray(
            scale.reshape((-1,) + (1,) * len(s)) * rng.standard_normal((NUM_STEPS, *s)), dtype
        )
    )
    return params, noise


def _trajectories(pairs: dict, params, noise):
    """Runs every (ours, optax's) pair of ``pairs`` in one jitted ``lax.scan``, all from
    ``params`` on g_k = n_k + COUPLING * theta_k; returns name -> (ours, optax's) trajectories
    stacked over steps (entry k: the params after step k)."""
    opts = [opt for pair in pairs.values() for opt in pair]

    def body(carry, n):
        new = []
        for opt, (p, s) in zip(opts, carry, strict=True):
            g = jax.tree.map(lambda n_, p_: n_ + COUPLING * p_, n, p)
            u, s = opt.update(g, s, p)
            new.append((optax.apply_updates(p, u), s))
        return new, [p for p, _ in new]

    @jax.jit
    def run(params, noise):
        return jax.lax.scan(body, [(params, opt.init(params)) for opt in opts], noise)[1]

    trajs = jax.device_get(run(params, noise))
    return {name: (trajs[2 * i], trajs[2 * i + 1]) for i, name in enumerate(pairs)}


def _outputs(pairs: dict, inputs, params):
    """Feeds ``inputs[k]`` and ``params[k]`` to every transform pair in one jitted scan;
    returns name -> (ours, optax's) outputs stacked over steps."""
    txs = [tx for pair in pairs.values() for tx in pair]

    def body(states, x):
        u, p = x
        outs = [tx.update(u, s, p) for tx, s in zip(txs, states, strict=True)]
        return [o[1] for o in outs], [o[0] for o in outs]

    @jax.jit
    def run(inputs, params):
        first = jax.tree.map(lambda x: x[0], params)
        return jax.lax.scan(body, [tx.init(first) for tx in txs], (inputs, params))[1]

    outs = jax.device_get(run(inputs, params))
    return {name: (outs[2 * i], outs[2 * i + 1]) for i, name in enumerate(pairs)}


@functools.cache
def alias_results(dtype: str):
    with jax.enable_x64(dtype == "float64"):
        params, noise = problem(1, dtype)
        pairs = {name: make() for name, make in ALIASES.items()}
        return jax.device_get(params), _trajectories(pairs, params, noise)


@functools.cache
def transform_results(dtype: str):
    with jax.enable_x64(dtype == "float64"):
        _, inputs = problem(2, dtype)
        _, params = problem(3, dtype)
        pairs = {name: make() for name, make in TRANSFORMS.items()}
        return _outputs(pairs, inputs, params)


def assert_close(actual, expected, dtype: str, what: str) -> None:
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == np.dtype(dtype), (what, path, a.dtype)
        bad = ~np.isclose(a, b, **TOL[dtype])
        step = int(np.argwhere(bad)[0][0]) if bad.any() else 0
        np.testing.assert_allclose(
            a[step],
            b[step],
            **TOL[dtype],
            err_msg=f"{what}: {jax.tree_util.keystr(path)} step {step}",
        )


# name -> (ours, optax's)
ALIASES = {
    "adamw_schedule_mask_none": lambda: (
        od.adamw(SCHED, weight_decay=0.1, mask=None),
        optax.adamw(SCHED, weight_decay=0.1),
    ),
    "adamw_constant_betas_mask_none": lambda: (
        od.adamw(3e-3, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-4, weight_decay=0.3, mask=None),
        optax.adamw(3e-3, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-4, weight_decay=0.3),
    ),
    "adamw_mask_auto": lambda: (
        od.adamw(SCHED, weight_decay=0.3, mask="auto"),
        optax.adamw(SCHED, weight_decay=0.3, mask=AUTO_MASK),
    ),
    "adamw_mask_tree": lambda: (
        od.adamw(SCHED, weight_decay=0.3, mask=TREE_MASK),
        optax.adamw(SCHED, weight_decay=0.3, mask=TREE_MASK),
    ),
    "amsgrad_optax": lambda: (
        od.amsgrad(SCHED, b2=0.95, variant="optax"),
        optax.amsgrad(SCHED, b2=0.95),
    ),
    "amsgrad_paper": lambda: (
        od.amsgrad(SCHED, b2=0.95, variant="paper"),
        optax.amsgrad(SCHED, b2=0.95, bias_correction_mu=False, bias_correction_nu=False),
    ),
    "lion_mask_none": lambda: (
        od.lion(LION_SCHED, weight_decay=0.5, mask=None),
        optax.lion(LION_SCHED, weight_decay=0.5),
    ),
    "lion_mask_auto": lambda: (
        od.lion(3e-3, b1=0.95, b2=0.98, weight_decay=0.5, mask="auto"),
        optax.lion(3e-3, b1=0.95, b2=0.98, weight_decay=0.5, mask=AUTO_MASK),
    ),
    "adam_l2_mask_none": lambda: (
        od.adam_l2(SCHED, b2=0.95, weight_decay=0.05, mask=None),
        optax.chain(optax.add_decayed_weights(0.05), optax.adam(SCHED, b2=0.95)),
    ),
    "adam_l2_wd_schedule_mask_tree": lambda: (
        od.adam_l2(3e-3, weight_decay=L2_SCHED, mask=TREE_MASK),
        optax.chain(optax.add_decayed_weights(L2_SCHED, mask=TREE_MASK), optax.adam(3e-3)),
    ),
}

TRANSFORMS = {
    "scale_by_adam": lambda: (od.scale_by_adam(), optax.scale_by_adam()),
    "scale_by_adam_hp": lambda: (
        od.scale_by_adam(b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-3),
        optax.scale_by_adam(b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-3),
    ),
    "scale_by_adam_amsgrad_optax": lambda: (
        od.scale_by_adam(b2=0.95, eps_root=1e-3, amsgrad="optax"),
        optax.scale_by_amsgrad(b2=0.95, eps_root=1e-3),
    ),
    "scale_by_adam_amsgrad_paper": lambda: (
        od.scale_by_adam(b2=0.95, amsgrad="paper"),
        optax.scale_by_amsgrad(b2=0.95, bias_correction_mu=False, bias_correction_nu=False),
    ),
    "scale_by_lion": lambda: (od.scale_by_lion(b1=0.8, b2=0.95), optax.scale_by_lion(0.8, 0.95)),
    "add_l2_gradient": lambda: (od.add_l2_gradient(0.1, mask=None), optax.add_decayed_weights(0.1)),
    "add_l2_gradient_schedule_mask_auto": lambda: (
        od.add_l2_gradient(L2_SCHED, mask="auto"),
        optax.add_decayed_weights(L2_SCHED, mask=AUTO_MASK),
    ),
    # Decoupled "lr" decay after the lr scaling == Optax's add_decayed_weights before it.
    "decoupled_weight_decay_lr": lambda: (
        optax.chain(
            optax.scale_by_learning_rate(SCHED),
            od.decoupled_weight_decay(0.3, convention="lr", learning_rate=SCHED, mask=None),
        ),
        optax.chain(optax.add_decayed_weights(0.3), optax.scale_by_learning_rate(SCHED)),
    ),
}


# Each dtype's cases run together (one compilation); the tests below read their results.
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(ALIASES))
def test_alias_matches_optax(name, dtype):
    params, results = alias_results(dtype)
    traj_ours, traj_optax = results[name]
    assert_close(traj_ours, traj_optax, dtype, name)
    # The comparison is not vacuous: the parameters moved.
    moved = max(
        float(np.max(np.abs(t[-1] - p)))
        for t, p in zip(jax.tree.leaves(traj_ours), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-2, moved


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_matches_optax(name, dtype):
    out_ours, out_optax = transform_results(dtype)[name]
    assert_close(out_ours, out_optax, dtype, name)
