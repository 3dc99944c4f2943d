"""Diagnostics against hand computations on a small pytree."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled import diagnostics as D


def small():
    params = {
        "dense": {"kernel": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "bias": jnp.array([1.0, -1.0])},
        "A_log": jnp.array([0.5, 0.5]),
        "norm": {"scale": jnp.array([2.0, 2.0])},
    }
    grads = {
        "dense": {"kernel": jnp.array([[0.1, 1.0], [10.0, 0.0]]), "bias": jnp.array([1.0, 1.0])},
        "A_log": jnp.array([1.0, 1.0]),
        "norm": {"scale": jnp.array([1.0, 1.0])},
    }
    return params, grads


def test_decoupled_effective_decay_is_uniform_on_decayed_leaves():
    params, _ = small()
    eff = D.effective_decay(None, params, learning_rate=0.1, weight_decay=0.5, coupled=False)
    np.testing.assert_allclose(eff["dense"]["kernel"], 0.05)
    for leaf in (eff["dense"]["bias"], eff["A_log"], eff["norm"]["scale"]):
        np.testing.assert_array_equal(leaf, 0.0)
    sched = D.effective_decay(
        None, params, learning_rate=0.05, weight_decay=0.5, coupled=False,
        convention="schedule", peak_learning_rate=0.1,
    )  # fmt: skip
    np.testing.assert_allclose(sched["dense"]["kernel"], 0.25)
    # "constant" (decoupled) does not use the learning rate: None is accepted, as by decay_rate.
    const = D.effective_decay(
        None, params, learning_rate=None, weight_decay=0.5, coupled=False, convention="constant"
    )
    np.testing.assert_allclose(const["dense"]["kernel"], 0.5)
    with pytest.raises(ValueError, match="`learning_rate` must be"):
        D.effective_decay(None, params, learning_rate=None, weight_decay=0.5, coupled=False)


@pytest.mark.parametrize("eps_root", [0.0, 1e-3])
@pytest.mark.parametrize("amsgrad", [None, "pytorch", "optax", "paper"])
def test_coupled_effective_decay_by_hand(amsgrad, eps_root):
    """After one step of adam_l2: nu = (1 - b2) (g + wd θ)^2, and the hand formula follows."""
    params, grads = small()
    lr, wd, b2, eps = 0.1, 0.5, 0.999, 1e-8
    tx = od.adam_l2(lr, b2=b2, eps=eps, weight_decay=wd, amsgrad=amsgrad, eps_root=eps_root)
    _, state = tx.update(grads, tx.init(params), params)
    eff = D.effective_decay(
        state, params, learning_rate=lr, weight_decay=wd, coupled=True, b2=b2, eps=eps,
        eps_root=eps_root, amsgrad=amsgrad,
    )  # fmt: skip
    g = np.asarray(grads["dense"]["kernel"], np.float64) + wd * np.asarray(
        params["dense"]["kernel"], np.float64
    )
    nu = (1 - b2) * g**2
    if amsgrad != "paper":
        nu = nu / (1 - b2)  # bias correction at t = 1 (the max is of one value)
    expected = lr * wd / (np.sqrt(nu + eps_root) + eps)
    np.testing.assert_allclose(eff["dense"]["kernel"], expected, rtol=1e-5)
    np.testing.assert_array_equal(eff["dense"]["bias"], 0.0)


def test_coupled_effective_decay_of_an_nnx_optimizer():
    """``nnx.Optimizer``'s state holds OptState variables where the parameters are Param
    variables; pairing the two trees failed with a pytree structure error."""
    nnx = pytest.importorskip("flax.nnx")
    import jax

    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, od.adam_l2(1e-2, weight_decay=0.1), wrt=nnx.Param)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jnp.linspace(-1.0, 2.0, p.size).reshape(p.shape), params)
    kernel = np.asarray(params["kernel"].get_value(), np.float64)  # before the step
    opt.update(model, grads)
    kwargs = dict(learning_rate=1e-2, weight_decay=0.1, coupled=True)
    eff = D.effective_decay(opt.opt_state, params, **kwargs)
    # The same computation on plain arrays, by hand: one step, nu = (1 - b2) g^2 / (1 - b2).
    g = np.asarray(grads["kernel"].get_value(), np.float64) + 0.1 * kernel
    np.testing.assert_allclose(
        eff["kernel"].get_value(), 1e-2 * 0.1 / (np.abs(g) + 1e-8), rtol=1e-5
    )
    np.testing.assert_array_equal(eff["bias"].get_value(), 0.0)


def test_coupled_effective_decay_of_an_nnx_optimizer_with_8bit_state():
    """After a step, ``nnx.Optimizer`` holds each 8-bit moment as a State of its fields
    (codes, absmax): it counted as two leaves ('second moment has 3 leaves but `params` has
    2'). Equal to the same steps taken with plain Optax."""
    nnx = pytest.importorskip("flax.nnx")
    import jax
    import optax

    model = nnx.Linear(64, 128, rngs=nnx.Rngs(0))  # an 8,192-element kernel: 8-bit moments
    tx = od.adam_l2(1e-2, weight_decay=0.1, state_dtype="int8")
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = tx.init(params)
    for t in range(3):
        grads = jax.tree.map(lambda p, t=t: jnp.cos(p + t), nnx.state(model, nnx.Param))
        opt.update(model, grads)
        updates, state = tx.update(nnx.to_pure_dict(grads), state, params)
        params = optax.apply_updates(params, updates)
    kwargs = dict(learning_rate=1e-2, weight_decay=0.1, coupled=True)
    eff = D.effective_decay(opt.opt_state, nnx.state(model, nnx.Param), **kwargs)
    expected = D.effective_decay(state, params, **kwargs)
    np.testing.assert_array_equal(eff["kernel"].get_value(), expected["kernel"])
    assert float(np.max(expected["kernel"])) > 0


def test_coupled_effective_decay_reads_8bit_state_without_state_dtype():
    """An 8-bit state read without ``state_dtype="int8"`` raised AttributeError
    ('QuantizedArray' object has no attribute 'astype'); the state says it is quantized.
    Its values are those of the same step with float32 state, up to the quantization of
    nu (measured: at most 6.5% apart, near theta = 0 where nu is small within its block;
    0.1% at the median)."""
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)}
    kwargs = dict(learning_rate=1e-2, weight_decay=0.1, coupled=True, mask=None)
    states = {}
    for state_dtype in ("int8", None):
        tx = od.adam_l2(1e-2, weight_decay=0.1, state_dtype=state_dtype, mask=None)
        _, states[state_dtype] = tx.update(params, tx.init(params), params)
    state = states["int8"]
    told = D.effective_decay(state, params, state_dtype="int8", **kwargs)
    np.testing.assert_array_equal(D.effective_decay(state, params, **kwargs)["w"], told["w"])
    float32 = D.effective_decay(states[None], params, **kwargs)["w"]
    np.testing.assert_allclose(told["w"], float32, rtol=0.07)
    assert np.median(np.abs(np.asarray(told["w"]) / np.asarray(float32) - 1)) < 0.005
    with pytest.raises(ValueError, match="second moment has 1 leaves but `params` has 2"):
        D.effective_decay(state, {**params, "b": jnp.ones(3)}, **kwargs)


def test_group_norms_and_groups():
    params, _ = small()
    norms = D.group_norms(params)
    assert set(norms) == {"decayed", "bias", "A_log", "norm"}
    np.testing.assert_allclose(norms["decayed"], np.sqrt(1 + 4 + 9 + 16), rtol=1e-6)
    np.testing.assert_allclose(norms["bias"], np.sqrt(2), rtol=1e-6)
    np.testing.assert_allclose(norms["A_log"], np.sqrt(0.5), rtol=1e-6)
    np.testing.assert_allclose(norms["norm"], np.sqrt(8), rtol=1e-6)
    assert D.group_of(("layers", "D"), 2) == "D"
    assert D.group_of(("embed", "embedding"), 2) == "embedding"


def test_update_ratios():
    params, grads = small()
    ratios = D.update_ratios(grads, params)
    np.testing.assert_allclose(ratios["dense/bias"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        ratios["dense/kernel"], np.sqrt(0.01 + 1 + 100) / np.sqrt(30), rtol=1e-6
    )


def test_find_adam_state_through_wrappers():
    params, grads = small()
    tx = optax.apply_if_finite(optax.inject_hyperparams(od.adamw)(learning_rate=0.1), 3)
    state = tx.init(params)
    assert isinstance(D.find_adam_state(state), od.ScaleByAdamState)
    with pytest.raises(ValueError, match="no ScaleByAdamState"):
        D.find_adam_state(od.lion(0.1).init(params))


def _adam_l2_state(amsgrad):
    params, grads = small()
    tx = od.adam_l2(0.1, weight_decay=0.5, amsgrad=amsgrad)
    _, state = tx.update(grads, tx.init(params), params)
    return state, params


COUPLED = dict(learning_rate=0.1, weight_decay=0.5, coupled=True)


@pytest.mark.parametrize("value", ["bogus", True, np.array(["optax", "paper"])])
def test_effective_decay_checks_amsgrad(value):
    """An unknown amsgrad was read as an AMSGrad variant and failed blaming the parameters
    ('second moment has 0 leaves'); an array raised NumPy's ambiguous-truth error."""
    state, params = _adam_l2_state(None)
    with pytest.raises(ValueError, match=r"^`amsgrad` must be one of \("):
        D.effective_decay(state, params, amsgrad=value, **COUPLED)


def test_effective_decay_amsgrad_must_match_the_state():
    """An AMSGrad state read with the default amsgrad=None silently used nu instead of nu_max
    (other numbers); a plain Adam state read with a variant blamed the parameters."""
    state, params = _adam_l2_state("optax")
    with pytest.raises(ValueError, match="holds AMSGrad's running maximum .* `amsgrad` is None"):
        D.effective_decay(state, params, **COUPLED)
    D.effective_decay(state, params, amsgrad="optax", **COUPLED)
    state, params = _adam_l2_state(None)
    with pytest.raises(ValueError, match="`amsgrad` is 'pytorch' but the optimizer state is plain"):
        D.effective_decay(state, params, amsgrad="pytorch", **COUPLED)
    # Decoupled decay does not read the state: no check.
    D.effective_decay(state, params, learning_rate=0.1, weight_decay=0.5, coupled=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"peak_learning_rate": 0.0}, "`peak_learning_rate` must be a finite number > 0"),
        ({"peak_learning_rate": -1e-3}, "`peak_learning_rate` must be a finite number > 0"),
        ({"learning_rate": -0.1}, "`learning_rate` must be a finite number >= 0"),
        ({"weight_decay": float("nan")}, "`weight_decay` must be a finite number >= 0"),
        ({"eps": -1.0}, "`eps` must be a finite number >= 0"),
        ({"b2": 1.0}, r"`b2` must lie in \[0, 1\)"),
        ({"learning_rate": lambda count: 0.1}, "`learning_rate` must be a number or an array, not"),
        ({"coupled": None}, "`coupled` must be a bool, got None"),
        ({"coupled": "False"}, "`coupled` must be a bool, got 'False'"),
        ({"coupled": 1}, "`coupled` must be a bool, got 1"),
        ({"convention": "bogus"}, r"`convention` must be one of \("),
    ],
)
@pytest.mark.parametrize("coupled", [False, True])
def test_effective_decay_checks_its_hyperparameters(kwargs, message, coupled):
    """Checked as the transforms check them. Before: peak_learning_rate=0 raised
    ZeroDivisionError, a negative one or a negative learning rate gave negative decays, and
    coupled=None / "False" were used as truth values."""
    state, params = _adam_l2_state(None)
    full = {"learning_rate": 0.1, "weight_decay": 0.5, "coupled": coupled, "convention": "schedule"}
    full.update(kwargs)
    with pytest.raises(ValueError, match=message):
        D.effective_decay(state, params, **full)
