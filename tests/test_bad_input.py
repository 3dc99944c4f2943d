"""Every documented bad input raises ValueError naming the argument; traced values pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od

ALIASES = {
    "adamw": lambda **kw: od.adamw(**{"learning_rate": 1e-3, **kw}),
    "adam_l2": lambda **kw: od.adam_l2(**{"learning_rate": 1e-3, "weight_decay": 1e-4, **kw}),
    "amsgrad": lambda **kw: od.amsgrad(**{"learning_rate": 1e-3, **kw}),
    "lion": lambda **kw: od.lion(**{"learning_rate": 1e-4, **kw}),
}
ADAM_ALIASES = ["adamw", "adam_l2", "amsgrad"]


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
def test_learning_rate_must_be_non_negative_and_finite(alias, value):
    with pytest.raises(ValueError, match="`learning_rate` must be a finite number >= 0"):
        ALIASES[alias](learning_rate=value)


@pytest.mark.parametrize("alias", list(ALIASES))
def test_weight_decay_must_be_non_negative(alias):
    with pytest.raises(ValueError, match="`weight_decay` must be a finite number >= 0"):
        ALIASES[alias](weight_decay=-0.1)


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("name", ["b1", "b2"])
@pytest.mark.parametrize("value", [1.0, -0.1, 1.5])
def test_betas_must_lie_in_unit_interval(alias, name, value):
    with pytest.raises(ValueError, match=rf"`{name}` must lie in \[0, 1\)"):
        ALIASES[alias](**{name: value})


@pytest.mark.parametrize("name", ["b1", "b2", "eps", "eps_root"])
def test_schedules_only_for_learning_rate_and_weight_decay(name):
    """Only the learning rate and the weight decay are called with the step count; a schedule
    elsewhere is an error at construction, not a TypeError in the first update."""
    with pytest.raises(ValueError, match=f"`{name}` must be a number or an array, not a sched"):
        od.scale_by_adam(**{name: lambda count: 0.9})
    with pytest.raises(ValueError, match=f"`{name}` must be a number or an array, not a sched"):
        od.adamw(1e-3, **{name: optax.constant_schedule(0.1)})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": jnp.asarray(-1e-2)}, "`learning_rate` must be a finite number >= 0"),
        ({"learning_rate": np.array([1e-3, -1e-3])}, "every element of `learning_rate` must"),
        ({"b1": jnp.asarray(1.0)}, r"`b1` must lie in \[0, 1\)"),
        ({"b2": jnp.array([0.9, 1.2])}, r"every element of `b2` must lie in \[0, 1\)"),
        ({"weight_decay": jnp.asarray(-5.0)}, "`weight_decay` must be a finite number >= 0"),
        ({"eps": jnp.asarray(jnp.nan)}, "`eps` must be a finite number >= 0"),
        ({"learning_rate": "1e-3"}, "`learning_rate` must be a number, a schedule or an array"),
        ({"weight_decay": jnp.asarray(True)}, "`weight_decay` must be a number, a schedule"),
    ],
)
def test_concrete_arrays_are_checked(kwargs, message):
    """Concrete JAX and NumPy arrays are checked like numbers, element by element (what
    optax.inject_hyperparams passes to the factory in an eager init)."""
    with pytest.raises(ValueError, match=message):
        od.adamw(**{"learning_rate": 1e-3, **kwargs})


def test_inject_hyperparams_checks_concrete_values_at_init():
    params = {"w": jnp.ones((2, 2))}
    tx = optax.inject_hyperparams(od.adamw)(learning_rate=-1e-3)
    with pytest.raises(ValueError, match="`learning_rate` must be a finite number >= 0"):
        tx.init(params)
    tx = optax.inject_hyperparams(od.adamw)(learning_rate=1e-3, weight_decay=0.1)
    state = tx.init(params)
    jax.jit(tx.update)(params, state, params)  # traced there: not checked, and valid anyway


_HYPERPARAMETERS = {  # name: (the transform that uses it, a valid value)
    "learning_rate": ("scale_by_learning_rate", 1e-3),
    "weight_decay": ("(decoupled_weight_decay|add_l2_gradient)", 1e-3),
    "b1": ("scale_by_(adam|lion)", 0.9),
    "b2": ("scale_by_(adam|lion)", 0.99),
    "eps": ("scale_by_adam", 1e-8),
    "eps_root": ("scale_by_adam", 0.0),
}


@pytest.mark.parametrize(
    ("alias", "name"),
    [(a, n) for a in ALIASES for n in _HYPERPARAMETERS if a != "lion" or not n.startswith("eps")],
)
def test_hyperparameter_arrays_must_broadcast_to_the_parameters(alias, name):
    """An array hyperparameter whose shape would change the update's by broadcasting ((3, 1)
    against a (3,) parameter: a (3, 3) update) is a ValueError naming it, also traced; before,
    adam_l2's learning rate and adamw's weight decay gave (3, 3) updates silently. Arrays of
    the parameter's shape (per-element values) still work."""
    transform, value = _HYPERPARAMETERS[name]
    params = {"w": jnp.ones((3,)), "b": jnp.ones((3,))}
    tx = ALIASES[alias](mask=None, **{name: jnp.full((3, 1), value)})
    with pytest.raises(ValueError, match=rf"{transform}: `{name}` has shape \(3, 1\)"):
        jax.jit(tx.update)(params, tx.init(params), params)
    tx = ALIASES[alias](mask=None, **{name: jnp.full((3,), value)})
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


def test_a_schedules_array_learning_rate_is_checked_too():
    tx = od.adam_l2(lambda count: jnp.full((2, 1), 1e-3), weight_decay=0.0, mask=None)
    params = {"w": jnp.ones((2,))}
    with pytest.raises(
        ValueError, match=r"`learning_rate` \(a schedule\) changed the shape .* from \(2,\) to"
    ):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("alias", list(ALIASES))
def test_schedules_with_python_control_flow_run_eagerly(alias):
    """The learning rate's shape check does not trace the schedule: one that branches on the
    step count in Python still works in an eager update (as with optax's own chain)."""
    params = {"w": jnp.ones((4, 3))}
    tx = ALIASES[alias](learning_rate=lambda count: 1e-3 if count < 10 else 1e-4)
    updates, _ = tx.update(params, tx.init(params), params)
    assert updates["w"].shape == (4, 3)


def test_per_row_weight_decay_is_checked_on_the_decayed_leaves_only():
    """A (4, 1) weight decay (one value per row of the one decayed matrix) with the default
    mask: the bias, which is not decayed and to whose (3,) shape (4, 1) does not broadcast,
    is not checked, and every row decays at its own rate (AdamW: -lr * wd_row * w; Adam + L2
    with zero gradients: Adam's step -lr * sign, where wd_row > 0)."""
    params = {"w": jnp.ones((4, 3)), "bias": jnp.ones((3,))}
    zeros = jax.tree.map(jnp.zeros_like, params)
    wd = jnp.array([[0.0], [0.1], [0.2], [0.3]])
    for tx in (od.adamw(1.0, weight_decay=wd), od.adam_l2(1.0, weight_decay=wd)):
        updates, _ = tx.update(zeros, tx.init(params), params)
        assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
        assert float(jnp.abs(updates["bias"]).max()) == 0.0
        assert float(updates["w"][0].max()) == 0.0 and bool(jnp.all(updates["w"][1:] < 0))
    tx = od.adamw(1.0, weight_decay=wd)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -wd * jnp.ones((4, 3)), rtol=1e-6)


@pytest.mark.parametrize("alias", ADAM_ALIASES)
@pytest.mark.parametrize("name", ["eps", "eps_root"])
def test_eps_must_be_non_negative(alias, name):
    with pytest.raises(ValueError, match=f"`{name}` must be a finite number >= 0"):
        ALIASES[alias](**{name: -1e-8})


def test_unknown_choices():
    with pytest.raises(ValueError, match="`convention` must be one of"):
        od.decoupled_weight_decay(0.1, convention="torch", learning_rate=1e-3)
    # The aliases' argument is `decay_convention`: the message names it, not the transform's.
    for alias in (od.adamw, od.lion, od.amsgrad):
        with pytest.raises(ValueError, match="`decay_convention` must be one of"):
            alias(1e-3, decay_convention="decoupled")
    with pytest.raises(ValueError, match="`amsgrad` must be one of"):
        od.scale_by_adam(amsgrad="keras")
    with pytest.raises(ValueError, match="`amsgrad` must be one of"):
        od.adamw(1e-3, amsgrad=True)
    with pytest.raises(ValueError, match="`variant` must be one of"):
        od.amsgrad(1e-3, variant=None)


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("dtype", ["int8x", "float8", jnp.int32, "complex64"])
def test_unknown_state_dtype(alias, dtype):
    with pytest.raises(ValueError, match="`state_dtype` must be None"):
        ALIASES[alias](state_dtype=dtype)


@pytest.mark.parametrize("convention", ["schedule", "corrected"])
def test_peak_learning_rate_needed_for_relative_conventions(convention):
    sched = optax.cosine_decay_schedule(1e-3, 100)
    with pytest.raises(ValueError, match="pass `peak_learning_rate`"):
        od.adamw(sched, decay_convention=convention)
    with pytest.raises(ValueError, match="pass `peak_learning_rate`"):
        od.lion(jnp.asarray(1e-4), decay_convention=convention)
    with pytest.raises(ValueError, match="`peak_learning_rate` must be a finite number > 0"):
        od.adamw(sched, decay_convention=convention, peak_learning_rate=0.0)
    with pytest.raises(ValueError, match="`peak_learning_rate` must be a number or an array"):
        od.adamw(sched, decay_convention=convention, peak_learning_rate=sched)
    od.adamw(1e-3, decay_convention=convention)  # a constant float is its own peak
    od.adamw(sched, decay_convention=convention, peak_learning_rate=1e-3)


@pytest.mark.parametrize("convention", ["lr", "constant"])
def test_peak_learning_rate_is_checked_where_the_convention_ignores_it(convention):
    """An invalid value is a mistake whether or not this convention reads it."""
    with pytest.raises(ValueError, match="`peak_learning_rate` must be a finite number > 0"):
        od.adamw(1e-3, decay_convention=convention, peak_learning_rate=-5.0)
    with pytest.raises(ValueError, match="`peak_learning_rate` must be a number"):
        od.lion(1e-4, decay_convention=convention, peak_learning_rate="x")
    od.adamw(1e-3, decay_convention=convention, peak_learning_rate=1e-2)  # valid, unused


def test_decoupled_decay_needs_learning_rate():
    with pytest.raises(ValueError, match="needs `learning_rate`"):
        od.decoupled_weight_decay(0.1)
    od.decoupled_weight_decay(0.1, convention="constant")


def test_coupled_amsgrad_has_no_convention():
    with pytest.raises(ValueError, match="coupled L2"):
        od.amsgrad(1e-3, coupled=True, decay_convention="schedule")
    with pytest.raises(ValueError, match="`coupled` must be a bool"):
        od.amsgrad(1e-3, coupled="yes")


def test_bool_hyperparameters_are_rejected():
    with pytest.raises(ValueError, match="`weight_decay` must be a number"):
        od.adamw(1e-3, weight_decay=True)


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_integer_and_bool_parameters_are_rejected(alias, dtype):
    """Deliberate (Optax accepts integer dummies): a fractional step on them is meaningless.
    Complex parameters are accepted, as in Optax (tests/test_optax_dropin.py)."""
    params = {"w": jnp.zeros((2, 2)), "steps": jnp.zeros((3,), dtype)}
    with pytest.raises(ValueError, match=r"parameter \['steps'\] has .*dtype"):
        ALIASES[alias]().init(params)


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_integer_and_bool_gradients_are_rejected(alias, dtype):
    """The update was cast to the gradient's dtype: an int32 gradient's Adam step of about
    -lr became 0 and the L2 term vanished (optax keeps float results)."""
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((3,))}
    tx = ALIASES[alias](mask=None)
    grads = {"w": jnp.ones((2, 2)), "b": jnp.ones((3,), dtype)}
    with pytest.raises(ValueError, match=r"gradient \['b'\] has dtype"):
        tx.update(grads, tx.init(params), params)


def test_float_storage_refuses_none():
    """jnp.dtype(None) is float64: FloatStorage(None) was accepted as float64 storage."""
    with pytest.raises(ValueError, match="`dtype` of FloatStorage must be a floating dtype"):
        od.FloatStorage(None)


def test_complex_and_bfloat16_hyperparameters():
    """A complex NumPy scalar was accepted (and made the updates complex); a bfloat16 one,
    e.g. from inject_hyperparams on a bfloat16 model, was refused as not a number."""
    with pytest.raises(ValueError, match="`learning_rate` must be a number"):
        od.adamw(np.complex128(1e-3 + 1j))
    with pytest.raises(ValueError, match="`learning_rate` must be a number"):
        od.adamw(np.array(1e-3 + 1j))
    od.adamw(jnp.asarray(1e-3, jnp.bfloat16))  # a real number
    params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    # inject_hyperparams casts every numeric hyperparameter to the parameters' dtype, where
    # b2 = 0.999 becomes 1.0: a clear error that says what to do ...
    with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
        optax.inject_hyperparams(od.adamw)(learning_rate=1e-3).init(params)
    # ... and what it says works.
    tx = optax.inject_hyperparams(od.adamw, hyperparam_dtype=jnp.float32)(learning_rate=1e-3)
    u, _ = tx.update(params, tx.init(params), params)
    assert u["w"].dtype == jnp.float32  # float32 updates (a float32 lr)
    assert np.all(np.asarray(u["w"]) < 0)
    assert optax.apply_updates(params, u)["w"].dtype == jnp.bfloat16


@pytest.mark.parametrize("make", [lambda: od.add_l2_gradient(0.1), lambda: od.adamw(1e-3)])
def test_update_without_params(make):
    tx = make()
    params = {"w": jnp.zeros((2, 2))}
    with pytest.raises(ValueError, match="needs the current parameters"):
        tx.update(params, tx.init(params))


def test_traced_hyperparameters_are_not_checked():
    """Inside jit the values are unknown: no error, the computation just uses them. With
    gradients and parameters of ones, the first step is -lr (1 + wd) (Adam's direction is
    1/(1 + eps), and 1.3e-5 less from the float32 bias corrections): 0.5 for lr = -1 and
    wd = -0.5, neither clamped (0 or 1) nor refused."""
    params = {"w": jnp.ones((2, 2))}

    @jax.jit
    def step(lr, wd):
        tx = od.adamw(lr, weight_decay=wd, mask=None)
        updates, _ = tx.update(params, tx.init(params), params)
        return updates

    out = step(-1.0, -0.5)
    np.testing.assert_allclose(out["w"], 0.5, rtol=1e-4)


# A schedule's values are checked like numbers where they are concrete (an eager update).
_NEGATIVE_SCHEDULE = {  # case: (alias, keyword arguments)
    "adamw": (od.adamw, {}),
    "adamw_constant": (od.adamw, {"decay_convention": "constant"}),  # lr read by the scaling
    "adam_l2": (od.adam_l2, {}),
    "amsgrad": (od.amsgrad, {}),
    "amsgrad_coupled": (od.amsgrad, {"coupled": True}),
    "lion": (od.lion, {}),
}


@pytest.mark.parametrize("case", list(_NEGATIVE_SCHEDULE))
@pytest.mark.parametrize("name", ["learning_rate", "weight_decay"])
def test_schedule_values_are_checked_in_eager_updates(case, name):
    """``od.adamw(lambda count: -1e-3)`` ascended the gradient and a negative weight-decay
    schedule grew the weights, while optax.inject_hyperparams, which passes the schedule's
    value, was refused. Now the value is checked at the step it is read, naming the argument
    and the step (here a schedule that turns negative at step 1)."""
    alias, extra = _NEGATIVE_SCHEDULE[case]
    params = {"w": jnp.ones((2, 3))}

    def schedule(count):
        return 1e-3 - 2e-3 * count

    kwargs = {"learning_rate": 1e-3, "weight_decay": 1e-4, "mask": None, **extra}
    kwargs[name] = schedule
    tx = alias(**kwargs)
    state = tx.init(params)
    _, state = tx.update(params, state, params)  # step 0: 1e-3, fine
    with pytest.raises(
        ValueError,
        match=rf"^`{name}` must be a finite number >= 0, got .* from its schedule at step 1",
    ):
        tx.update(params, state, params)
    # The same values injected: refused too (the factory sees the schedule's value).
    injected = optax.inject_hyperparams(alias, static_args=("mask", *extra))(**kwargs)
    state = injected.init(params)
    _, state = injected.update(params, state, params)
    with pytest.raises(ValueError, match=rf"`{name}` must be a finite number >= 0"):
        injected.update(params, state, params)


def test_schedule_values_are_named_by_step_and_nan_is_refused():
    params = {"w": jnp.ones((2, 3))}
    tx = od.adam_l2(1e-3, weight_decay=lambda count: jnp.where(count > 0, jnp.nan, 0.1))
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    with pytest.raises(
        ValueError, match=r"`weight_decay` .* got .*nan.* from its schedule at step 1"
    ):
        tx.update(params, state, params)
    # The transforms read schedules the same way.
    tx = od.decoupled_weight_decay(0.1, learning_rate=lambda count: -1.0, mask=None)
    with pytest.raises(ValueError, match="`learning_rate` must be a finite number >= 0, got -1.0"):
        tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("alias", list(ALIASES))
def test_schedule_values_are_not_checked_under_jit(alias):
    """Under jit the step count, hence the schedule's value, is traced: not checked (as
    documented in optax_decoupled._validation and the aliases' module docstring)."""
    params = {"w": jnp.ones((2, 3))}

    def schedule(count):
        return -1e-3 * (count + 1)

    tx = ALIASES[alias](learning_rate=schedule, mask=None)
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    # The negative value is used: an ascent step of -schedule(0) x (direction 1 + a weight
    # decay of at most 1e-2), gradients and parameters being ones.
    np.testing.assert_allclose(updates["w"], 1e-3, rtol=0.02)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: od.adamw(1e-3, decay_convention=v),
        lambda v: od.lion(1e-4, decay_convention=v),
        lambda v: od.amsgrad(1e-3, variant=v),
        lambda v: od.adamw(1e-3, amsgrad=v),
        lambda v: od.scale_by_adam(amsgrad=v),
        lambda v: od.decoupled_weight_decay(0.1, convention=v, learning_rate=1e-3),
    ],
)
@pytest.mark.parametrize("value", [np.array(["lr", "x"]), np.array(["pytorch"]), 1, b"lr"])
def test_choices_must_be_strings(make, value):
    """A NumPy array of strings raised NumPy's 'truth value of an array is ambiguous' error,
    which names no argument; anything but a str (or None where allowed) is now refused."""
    with pytest.raises(ValueError, match=r"^`\w+` must be one of \("):
        make(value)


def test_decay_rate_validates_its_arguments():
    """decay_rate is public: a zero peak raised ZeroDivisionError, a negative one returned a
    negative decay, a negative learning rate was used as given."""
    assert od.decay_rate(0.1, "schedule", 1e-3, 2e-3) == pytest.approx(0.05)
    assert od.decay_rate(0.1, "constant", None, None) == 0.1
    for peak in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="`peak_learning_rate` must be a finite number > 0"):
            od.decay_rate(0.1, "schedule", 1e-3, peak)
    with pytest.raises(ValueError, match="`peak_learning_rate` must be a finite number > 0"):
        od.decay_rate(0.1, "lr", 1e-3, -1.0)  # checked where ignored, as by the transform
    with pytest.raises(ValueError, match="`learning_rate` must be a finite number >= 0"):
        od.decay_rate(0.1, "lr", -1e-3, None)
    with pytest.raises(ValueError, match="`weight_decay` must be a finite number >= 0"):
        od.decay_rate(-0.1, "constant", None, None)
    with pytest.raises(ValueError, match="convention='lr' needs `learning_rate`"):
        od.decay_rate(0.1, "lr", None, None)
    with pytest.raises(ValueError, match="`weight_decay` must be its value at step t"):
        od.decay_rate(lambda count: 0.1, "lr", 1e-3, None)
    with pytest.raises(ValueError, match="`convention` must be one of"):
        od.decay_rate(0.1, np.array(["lr"]), 1e-3, None)
    # Traced values are used as given.
    assert float(jax.jit(od.decay_rate, static_argnums=1)(0.1, "lr", -1.0, None)) < 0


@pytest.mark.parametrize("convention", ["lr", "constant"])
def test_peak_learning_rate_is_ignored_where_the_convention_does_not_use_it(convention):
    """Documented (adamw, lion, amsgrad, decoupled_weight_decay): "lr" and "constant" accept a
    valid peak and ignore it, so one set of arguments can be swept over every convention
    (the experiments and tests/test_properties.py rely on that)."""
    params = {"w": jnp.full((2, 3), 2.0)}
    with_peak = od.adamw(1e-3, decay_convention=convention, peak_learning_rate=5.0, mask=None)
    without = od.adamw(1e-3, decay_convention=convention, mask=None)
    a, _ = with_peak.update(params, with_peak.init(params), params)
    b, _ = without.update(params, without.init(params), params)
    np.testing.assert_array_equal(a["w"], b["w"])
