"""optax-decoupled as a drop-in for Optax: the same bits, the same state, checkpoints both ways.

With ``mask=None`` and the ``"lr"`` convention, ``od.adamw`` is ``optax.adamw``, ``od.lion``
is ``optax.lion`` and ``od.amsgrad(variant="optax")`` is ``optax.amsgrad``: exact equality
(not allclose) of every parameter after 100 float32 steps, eagerly and under ``jit``, and
states with the same tree structure, so that either side's state restores into the other.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

STEPS = 100
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS)


def _params(dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w": jax.random.normal(k1, (16, 8)),
        "b": jax.random.normal(k2, (8,)),
        "s": jax.random.normal(k3, ()),
    }
    if jnp.issubdtype(dtype, jnp.complexfloating):
        params = jax.tree.map(lambda x: (x + 0.5j * jnp.cos(x)).astype(dtype), params)
    return params


def _grads(params, t):
    return jax.tree.map(lambda x: jnp.sin(x * (t + 1)) + 0.1 * x, params)


def _run(tx, params, steps, jit, state=None, start=0):
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update) if jit else tx.update
    for t in range(start, start + steps):
        updates, state = update(_grads(params, t), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


PAIRS = {
    "adamw": (
        lambda: od.adamw(1e-2, weight_decay=0.1, mask=None),
        lambda: optax.adamw(1e-2, weight_decay=0.1),
    ),
    "adamw-schedule": (
        lambda: od.adamw(SCHEDULE, weight_decay=0.1, mask=None),
        lambda: optax.adamw(SCHEDULE, weight_decay=0.1),
    ),
    "adamw-scheduled-decay": (
        lambda: od.adamw(1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, STEPS), mask=None),
        lambda: optax.adamw(1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, STEPS)),
    ),
    "adamw-nesterov": (
        lambda: od.adamw(1e-2, weight_decay=0.1, mask=None, nesterov=True),
        lambda: optax.adamw(1e-2, weight_decay=0.1, nesterov=True),
    ),
    "adamw-eps-root": (
        lambda: od.adamw(1e-2, 0.8, 0.99, 1e-6, 1e-8, weight_decay=1e-3, mask=None),
        lambda: optax.adamw(1e-2, 0.8, 0.99, 1e-6, 1e-8, weight_decay=1e-3),
    ),
    "adamw-no-decay": (
        lambda: od.adamw(1e-2, weight_decay=0.0, mask=None),
        lambda: optax.adamw(1e-2, weight_decay=0.0),
    ),
    "adam": (lambda: od.adam(1e-2), lambda: optax.adam(1e-2)),
    "adam-schedule-nesterov": (
        lambda: od.adam(SCHEDULE, nesterov=True),
        lambda: optax.adam(SCHEDULE, nesterov=True),
    ),
    "lion": (
        lambda: od.lion(1e-3, weight_decay=0.1, mask=None),
        lambda: optax.lion(1e-3, weight_decay=0.1),
    ),
    "lion-schedule": (
        lambda: od.lion(SCHEDULE, weight_decay=0.1, mask=None),
        lambda: optax.lion(SCHEDULE, weight_decay=0.1),
    ),
    "amsgrad": (
        lambda: od.amsgrad(1e-2, variant="optax"),
        lambda: optax.amsgrad(1e-2),
    ),
    "adamw-injected": (
        lambda: optax.inject_hyperparams(od.adamw)(learning_rate=1e-2, weight_decay=0.1, mask=None),
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1),
    ),
    "lion-injected": (
        lambda: optax.inject_hyperparams(od.lion)(learning_rate=1e-3, weight_decay=0.1, mask=None),
        lambda: optax.inject_hyperparams(optax.lion)(learning_rate=1e-3, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_bit_identical_to_optax_over_100_steps(name, jit):
    ours, theirs = PAIRS[name]
    steps = STEPS if jit else 30  # eager steps dispatch op by op: fewer, same arithmetic
    p_ours, s_ours = _run(ours(), _params(), steps, jit)
    p_theirs, s_theirs = _run(theirs(), _params(), steps, jit)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(s_ours), jax.tree.leaves(s_theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: od.scale_by_adam(), lambda: optax.scale_by_adam()),
        (
            lambda: od.scale_by_adam(mu_dtype=jnp.bfloat16),
            lambda: optax.scale_by_adam(mu_dtype=jnp.bfloat16),
        ),
        (lambda: od.scale_by_adam(amsgrad="optax"), lambda: optax.scale_by_amsgrad()),
        (lambda: od.scale_by_lion(), lambda: optax.scale_by_lion()),
        (
            lambda: od.scale_by_lion(mode="smooth", smooth_beta=3.0),
            lambda: optax.scale_by_lion(mode="smooth", smooth_beta=3.0),
        ),
        (lambda: od.scale_by_lion(mode="refined"), lambda: optax.scale_by_lion(mode="refined")),
        (
            lambda: od.scale_by_lion(mu_dtype=jnp.bfloat16),
            lambda: optax.scale_by_lion(mu_dtype=jnp.bfloat16),
        ),
    ],
    ids=["adam", "adam-mu-bf16", "amsgrad", "lion", "lion-smooth", "lion-refined", "lion-mu-bf16"],
)
def test_transforms_are_optax_transforms(ours, theirs):
    params = _params()
    p_ours, s_ours = _run(ours(), params, 20, jit=True)
    p_theirs, s_theirs = _run(theirs(), params, 20, jit=True)
    assert type(s_ours) is type(s_theirs)
    for a, b in zip(
        jax.tree.leaves((p_ours, s_ours)), jax.tree.leaves((p_theirs, s_theirs)), strict=True
    ):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["adamw", "lion", "amsgrad", "adamw-nesterov"])
def test_complex_parameters_as_optax(name):
    ours, theirs = PAIRS[name]
    params = _params(jnp.complex64)
    p_ours, _ = _run(ours(), params, 20, jit=True)
    p_theirs, _ = _run(theirs(), params, 20, jit=True)
    for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs), strict=True):
        assert a.dtype == jnp.complex64
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16", "float32", {"nu": "bfloat16"}])
def test_complex_parameters_need_moments_in_their_own_dtype(state_dtype):
    with pytest.raises(ValueError, match=r"state_dtype.*complex parameter \['b'\]"):
        od.adamw(1e-3, state_dtype=state_dtype).init(_params(jnp.complex64))


def test_inside_multi_transform_where_one_side_gets_no_leaves():
    params = _params()
    labels = jax.tree.map(lambda _: "frozen", params)
    for inner in (od.adamw(1e-2, mask=None), od.lion(1e-3, mask=None), od.amsgrad(1e-2)):
        tx = optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()}, labels)
        updates, _ = tx.update(_grads(params, 0), tx.init(params), params)
        assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))


def test_mu_dtype_on_complex_parameters_as_optax():
    params = _params(jnp.complex64)
    ours = od.adamw(1e-2, mask=None, weight_decay=0.0, mu_dtype=jnp.complex64)
    theirs = optax.adamw(1e-2, weight_decay=0.0, mu_dtype=jnp.complex64)
    p_ours, _ = _run(ours, params, 5, jit=True)
    p_theirs, _ = _run(theirs, params, 5, jit=True)
    for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_integer_parameters_are_refused_on_purpose():
    # Optax accepts integer dummy parameters; a fractional step on them is meaningless.
    with pytest.raises(ValueError, match=r"parameter \['w'\] has dtype int32"):
        od.adamw(1e-3, mask=None).init({"w": jnp.zeros((2,), jnp.int32)})


def _roundtrip_through_orbax(state, target, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, state)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)


@pytest.mark.parametrize("name", ["adamw", "adamw-schedule", "lion", "amsgrad", "adam"])
@pytest.mark.parametrize("direction", ["optax-to-od", "od-to-optax"])
def test_checkpoint_restores_across_and_training_continues_identically(name, direction, tmp_path):
    ours, theirs = PAIRS[name]
    first, second = (theirs, ours) if direction == "optax-to-od" else (ours, theirs)
    params = _params()
    p_mid, state = _run(first(), params, 25, jit=True)
    target = second().init(params)  # the other library's state, as a restore target
    restored = _roundtrip_through_orbax(state, target, tmp_path)
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    # Continue both ways: in the first library from its own state, in the second from the
    # restored one. Every update is the same.
    p_a, _ = _run(first(), p_mid, 25, jit=True, state=state, start=25)
    p_b, _ = _run(second(), p_mid, 25, jit=True, state=restored, start=25)
    for a, b in zip(jax.tree.leaves(p_a), jax.tree.leaves(p_b), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optax_state_utilities_see_optax_fields():
    state = od.adamw(1e-2, weight_decay=0.1, mask=None).init(_params())
    mu = optax.tree_utils.tree_get(state, "mu")
    assert jax.tree.structure(mu) == jax.tree.structure(_params())
    zeroed = optax.tree_utils.tree_set(state, mu=jax.tree.map(jnp.ones_like, mu))
    assert float(optax.tree_utils.tree_get(zeroed, "mu")["s"]) == 1.0


def test_mu_dtype_sets_the_first_moment_only():
    state = od.adamw(1e-3, mu_dtype=jnp.bfloat16).init(_params())
    adam = od.diagnostics.find_adam_state(state)
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32


def test_state_dtype_per_moment():
    params = _params()
    tx = od.adamw(
        1e-2, weight_decay=0.1, mask=None, state_dtype={"mu": "bfloat16", "nu": "float32"}
    )
    p_mixed, state = _run(tx, params, 50, jit=True)
    adam = od.diagnostics.find_adam_state(state)
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32
    p_f32, _ = _run(od.adamw(1e-2, weight_decay=0.1, mask=None), params, 50, jit=True)
    for a, b in zip(jax.tree.leaves(p_mixed), jax.tree.leaves(p_f32), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"state_dtype": {"m": "bfloat16"}}, "state_dtype"),
        ({"state_dtype": {"mu": "float8"}}, "state_dtype"),
        ({"mu_dtype": jnp.bfloat16, "state_dtype": {"mu": "float32"}}, "mu_dtype"),
        ({"mu_dtype": "not-a-dtype"}, "mu_dtype"),
        ({"nesterov": 1}, "nesterov"),
    ],
)
def test_bad_storage_arguments_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        od.adamw(1e-3, **kwargs)


@pytest.mark.parametrize(
    "kwargs, argument",
    [({"mode": "soft"}, "mode"), ({"mode": "smooth", "smooth_beta": 0.0}, "smooth_beta")],
)
def test_bad_lion_mode_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        od.lion(1e-3, **kwargs)


def test_amsgrad_without_decay_needs_no_params():
    tx = od.amsgrad(1e-2, variant="optax")
    params = _params()
    updates, _ = tx.update(_grads(params, 0), tx.init(params))  # no params, as optax.amsgrad
    assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_zero_decay_needs_no_params():
    tx = od.adamw(1e-2, weight_decay=0.0)
    params = _params()
    tx.update(_grads(params, 0), tx.init(params))
    with pytest.raises(ValueError, match="needs the current parameters"):
        od.adamw(1e-2, weight_decay=0.1).update(_grads(params, 0), tx.init(params))
