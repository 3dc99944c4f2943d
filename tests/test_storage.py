"""Moment storage: ``state_dtype="int8"`` (8-bit block-wise) in every optimizer and wrapper.

Small parameters keep float32 moments under the default ``min_size=4096``; most tests use
``TINY = BlockwiseInt8Storage(block_size=64, min_size=0)`` so that small test trees are really
quantized, with blocks that do not divide the parameter sizes (padding)."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled._src import quantization as Q
from optax_decoupled._src import storage as S

try:
    from tests import reference as ref
    from tests import wrapper_checks
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import reference as ref
    import wrapper_checks

TINY = S.BlockwiseInt8Storage(block_size=64, min_size=0)

FACTORIES = {
    "adamw": lambda lr, wd, sd: od.adamw(lr, weight_decay=wd, state_dtype=sd),
    "adam_l2": lambda lr, wd, sd: od.adam_l2(lr, weight_decay=wd, state_dtype=sd),
    "amsgrad": lambda lr, wd, sd: od.amsgrad(lr, weight_decay=wd, state_dtype=sd),
    "amsgrad_optax": lambda lr, wd, sd: od.amsgrad(
        lr, weight_decay=wd, variant="optax", state_dtype=sd
    ),
    "lion": lambda lr, wd, sd: od.lion(lr, weight_decay=wd, state_dtype=sd),
}


#: The other optimizers' variants of a compile-heavy test run in the integration tier.
SLOW = pytest.mark.slow


def make_params(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (40, 30)), "bias": jax.random.normal(k2, (30,))},
        "conv": jax.random.normal(k3, (3, 5, 7)),
    }


def grads_at(t, params):
    key = jax.random.fold_in(jax.random.key(1), t)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noise = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return treedef.unflatten([p + 0.5 * n for p, n in zip(leaves, noise, strict=True)])


def run(tx, steps, params=None, update=None):
    params = make_params() if params is None else params
    state = tx.init(params)
    update = update or tx.update
    for t in range(steps):
        updates, state = update(grads_at(t, params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def moments(state):
    """All QuantizedArray / float moments in an optimizer state, by identity."""
    return [
        x
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Q.QuantizedArray))
        if isinstance(x, Q.QuantizedArray) or (hasattr(x, "ndim") and x.ndim > 0)
    ]


# ---------------------------------------------------------------------------------------------
# resolve_storage and the storage object
# ---------------------------------------------------------------------------------------------


def test_resolve_int8_and_storage_objects():
    store = S.resolve_storage("int8")
    assert isinstance(store, S.BlockwiseInt8Storage)
    assert (store.block_size, store.min_size) == (256, 4096)
    assert S.resolve_storage(TINY) is TINY
    assert isinstance(S.resolve_storage("float32"), S.FloatStorage)
    for bad in ("int8x", "uint8", "int4", 8):
        with pytest.raises(ValueError, match="`state_dtype` must be None"):
            S.resolve_storage(bad)
    with pytest.raises(ValueError, match="block_size"):
        S.BlockwiseInt8Storage(block_size=0)
    with pytest.raises(ValueError, match="min_size"):
        S.BlockwiseInt8Storage(min_size=-1)
    with pytest.raises(ValueError, match="`block_size` must be a positive int, got True"):
        S.BlockwiseInt8Storage(block_size=True)
    with pytest.raises(ValueError, match="`min_size` must be a non-negative int, got False"):
        S.BlockwiseInt8Storage(min_size=False)
    for bad in (jnp.int8, "uint8", jnp.bool_, "not a dtype"):
        with pytest.raises(ValueError, match="`dtype` of FloatStorage must be a floating"):
            S.FloatStorage(bad)


@pytest.mark.parametrize("state_dtype", [None, "float32", "bfloat16", TINY])
@pytest.mark.parametrize("name", ["adamw", "amsgrad", "lion"])
@pytest.mark.parametrize(
    "param_dtype, grad_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]
)
def test_state_types_never_change_with_the_gradient_dtype(
    name, state_dtype, param_dtype, grad_dtype
):
    """Moments keep the dtype init gave them (state_dtype=None: the parameter's) whatever the
    gradient's dtype, so the state can be a lax.scan carry; the update has the gradient's.
    (Types are fixed when the program is traced: ``jax.eval_shape`` runs no computation.)"""
    params = jax.tree.map(lambda x: x.astype(param_dtype), make_params())
    tx = FACTORIES[name](1e-2, 0.1, state_dtype)
    state = jax.eval_shape(tx.init, params)
    grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads_at(0, params))

    def body(carry, _):
        updates, new_state = tx.update(grads, carry, params)
        return new_state, updates

    final, updates = jax.eval_shape(lambda s: jax.lax.scan(body, s, length=2), state)
    chex.assert_trees_all_equal_shapes_and_dtypes(final, state)
    assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype(grad_dtype)}
    if state_dtype is None:  # the parameter's dtype (Optax would promote bfloat16 moments)
        assert {m.dtype for m in jax.tree.leaves(final[0].mu)} == {jnp.dtype(param_dtype)}


@pytest.mark.parametrize("state_dtype", [None, TINY, "int8"])
def test_gradient_of_another_shape_is_named(state_dtype):
    """A gradient with its parameter's size but not its shape (or another size) is an error
    naming the leaf, also where 8-bit moments keep no shape."""
    params = {"w": jnp.ones((80, 64))}
    tx = od.scale_by_adam(state_dtype=state_dtype)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"update at \['w'\] has shape \(64, 80\)"):
        tx.update({"w": jnp.ones((64, 80))}, state, params)
    with pytest.raises(ValueError, match=r"update at \['w'\] has shape \(81, 64\)"):
        tx.update({"w": jnp.ones((81, 64))}, state)  # no params: the moments' size tells


def test_small_tensors_stay_float32_large_are_quantized():
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,)), "edge": jnp.ones((4095,))}
    state = od.adamw(1e-3, state_dtype="int8").init(params)
    adam = state[0]
    for moment, signed in ((adam.mu, True), (adam.nu, False)):
        assert isinstance(moment["w"], Q.QuantizedArray) and moment["w"].signed is signed
        assert moment["w"].codes.shape == (16, 256) and moment["w"].codes.dtype == jnp.uint8
        assert moment["w"].absmax.shape == (16,) and moment["w"].absmax.dtype == jnp.float32
        assert moment["b"].dtype == jnp.float32 and moment["b"].shape == (64,)
        assert moment["edge"].dtype == jnp.float32  # 4095 < min_size
    big = S.BlockwiseInt8Storage(block_size=2048)
    q = od.lion(1e-3, state_dtype=big).init({"w": jnp.ones((100, 100))})[0].mu["w"]
    assert q.codes.shape == (5, 2048)  # 10000 elements -> 5 blocks, the last one padded


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_params_compute_in_float32(dtype):
    params = jax.tree.map(lambda x: x.astype(dtype), make_params())
    tx = od.adamw(1e-2, state_dtype=TINY)
    state = tx.init(params)
    grads = jax.tree.map(lambda g: g.astype(dtype), grads_at(0, params))
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)
    chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_low_precision_state_averages_in_float32_whatever_the_gradient_dtype(
    state_dtype, param_dtype
):
    """bfloat16 and float16 moments are averaged in float32 also when the gradient is
    bfloat16: the same bfloat16 gradient values, given as bfloat16 or as float32, give the
    same state (in bfloat16 arithmetic b2 = 0.95 rounds to 0.9492 and 0.999 to 1, and ν
    would differ). Reference: a float64 NumPy average of the stored moments, rounded once."""
    params = {"w": jnp.linspace(-1.0, 1.0, 1000, dtype=param_dtype)}
    tx = od.scale_by_adam(b1=0.9, b2=0.95, state_dtype=state_dtype)
    g = jnp.sin(jnp.arange(1000.0) * 0.37).astype(jnp.bfloat16)
    states = []
    for grads in ({"w": g}, {"w": g.astype(jnp.float32)}):
        state = tx.init(params)
        for _ in range(2):
            _, state = jax.jit(tx.update)(grads, state, params)
        states.append(state)
    chex.assert_trees_all_equal(states[0].mu, states[1].mu)
    chex.assert_trees_all_equal(states[0].nu, states[1].nu)
    g64, dtype = np.asarray(g, np.float64), jnp.dtype(state_dtype)
    mu = nu = np.zeros(1000)
    for _ in range(2):
        mu = np.asarray(np.asarray(0.1 * g64 + 0.9 * mu, np.float32).astype(dtype), np.float64)
        nu = np.asarray(np.asarray(0.05 * g64**2 + 0.95 * nu, np.float32).astype(dtype), np.float64)
    np.testing.assert_allclose(np.asarray(states[0].mu["w"], np.float64), mu, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(states[0].nu["w"], np.float64), nu, rtol=1e-2)


def test_float64_params_with_x64():
    with jax.enable_x64(True):
        params = jax.tree.map(lambda x: x.astype(jnp.float64), make_params())
        tx = od.amsgrad(1e-2, state_dtype=TINY)
        p, state = run(tx, 3, params, update=jax.jit(tx.update))
        chex.assert_trees_all_equal_dtypes(p, params)
        assert all(x.dtype in (jnp.uint8, jnp.float32) for x in jax.tree.leaves(state[0].mu))


# ---------------------------------------------------------------------------------------------
# Values: nu >= 0, extreme gradients, first step exact, trajectory close to float32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_a_nan_gradient_makes_its_blocks_nan(param_dtype):
    """Without apply_if_finite a NaN gradient element poisons the moments of its block (and
    nothing else) in the chunked update; nu never reads back -inf."""
    w = jnp.linspace(-1.0, 1.0, 40 * 256).reshape(40, 256).astype(param_dtype)
    g = (0.1 * w).at[20, 255].set(jnp.nan)
    tx = od.amsgrad(1e-2, mask=None, state_dtype=S.BlockwiseInt8Storage())
    state = tx.init({"w": w})
    for _ in range(2):  # the NaN step, then a finite one
        _, state = jax.jit(tx.update)({"w": g}, state, {"w": w})
        g = 0.1 * w
    for moment in (state[0].mu, state[0].nu, state[0].nu_max):
        value = np.asarray(Q.dequantize(moment["w"], w.shape))
        assert np.all(np.isnan(value[20])), "the block with the NaN"
        rest = np.delete(value, 20, axis=0)
        assert np.all(np.isfinite(rest))
        assert moment["w"].signed or np.all(rest >= 0)


@pytest.mark.parametrize("name", ["adamw", "amsgrad", "amsgrad_optax"])
def test_nu_never_reads_back_negative(name):
    tx = FACTORIES[name](1e-2, 0.1, TINY)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(12):
        g = jax.tree.map(lambda x, t=t: x * (-1.0) ** t * 10.0 ** (t % 5 - 2), grads_at(t, params))
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        for moment in (state[0].nu, getattr(state[0], "nu_max", None)):
            if moment is None:  # plain Adam
                continue
            for q, like in zip(
                jax.tree.leaves(moment, is_leaf=lambda x: isinstance(x, Q.QuantizedArray)),
                jax.tree.leaves(params),
                strict=True,
            ):
                values = np.asarray(TINY.read(q, like))
                assert np.all(values >= 0) and np.all(np.isfinite(values))


@pytest.mark.parametrize("name", list(FACTORIES))
def test_extreme_gradients_give_finite_updates_and_state(name):
    """Gradients scaled by 0, 1e-30 and 1e30, in turn (twice each)."""
    tx = FACTORIES[name](1e-3, 0.1, TINY)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, scale in enumerate([0.0, 0.0, 1e-30, 1e-30, 1e30, 1e30]):
        g = jax.tree.map(lambda x: x * scale, grads_at(t, params))
        updates, state = update(g, state, params)
        chex.assert_tree_all_finite(updates)
        chex.assert_tree_all_finite(state)
        params = optax.apply_updates(params, updates)
    chex.assert_tree_all_finite(params)
    # Every stored moment dequantizes to finite values.
    for q in moments(state):
        if isinstance(q, Q.QuantizedArray):
            assert np.all(np.isfinite(np.asarray(Q.dequantize_blocks(q))))


def test_mixed_extreme_block():
    """One block holding 1e30, 1e-30 and zeros: finite, and the large value survives."""
    params = {"w": jnp.zeros((8, 8))}
    g = {"w": jnp.zeros((8, 8)).at[0, 0].set(1e30).at[0, 1].set(1e-30)}
    tx = od.adamw(1.0, weight_decay=0.0, state_dtype=TINY)
    updates, state = tx.update(g, tx.init(params), params)
    chex.assert_tree_all_finite((updates, state))
    mu = np.asarray(TINY.read(state[0].mu["w"], params["w"]))
    assert mu[0, 0] == pytest.approx(1e29, rel=1e-6) and np.all(mu[1:] == 0)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_first_step_equals_float32(name):
    """The first update is computed from the fresh (unquantized) moments: same as float32."""
    params = make_params()
    g = grads_at(0, params)
    tx8 = FACTORIES[name](1e-2, 0.1, TINY)
    u8, _ = tx8.update(g, tx8.init(params), params)
    tx32 = FACTORIES[name](1e-2, 0.1, "float32")
    u32, _ = tx32.update(g, tx32.init(params), params)
    chex.assert_trees_all_close(u8, u32, rtol=1e-6, atol=1e-9)


def _quadratic_run(state_dtype, tx_factory, steps=300, noise=0.1):
    """AdamW on 0.5 Σ a (θ - c)² with a log-uniform in [0.1, 10], θ of 64×256 (64 blocks of
    256), plus Gaussian gradient noise (σ = 0.1); returns the trajectory and the losses."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    shape = (64, 256)
    a = jnp.exp(jax.random.uniform(k1, shape, minval=np.log(0.1), maxval=np.log(10.0)))
    c = jax.random.normal(k2, shape)
    tx = tx_factory(state_dtype)

    def loss(p):
        return 0.5 * jnp.sum(a * (p["w"] - c) ** 2)

    def body(carry, t):
        p, s = carry
        g = jax.grad(loss)(p)
        g = {"w": g["w"] + noise * jax.random.normal(jax.random.fold_in(k3, t), shape)}
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return (p, s), (p["w"], loss(p))

    p0 = {"w": jnp.zeros(shape)}
    _, (traj, losses) = jax.jit(lambda: jax.lax.scan(body, (p0, tx.init(p0)), jnp.arange(steps)))()
    return np.asarray(traj), np.asarray(losses)


# The stated tolerances (docs/memory.md). Measured: largest distance to the float32 trajectory
# 3.2% (int8) and 0.3% (bf16) of |θ_final|; mean loss of the last 50 steps within 2.6% (int8)
# and 3.5% (bf16) of float32's.
@pytest.mark.parametrize(
    ("state_dtype", "max_distance", "max_loss_gap"),
    [("int8", 0.05, 0.05), ("bfloat16", 0.01, 0.05)],
)
def test_adamw_trajectory_close_to_float32_on_a_quadratic(state_dtype, max_distance, max_loss_gap):
    factory = lambda sd: od.adamw(1e-2, weight_decay=1e-2, state_dtype=sd)
    t32, l32 = _quadratic_run("float32", factory)
    tq, lq = _quadratic_run(state_dtype, factory)
    scale = np.linalg.norm(t32[-1])
    distance = np.linalg.norm((tq - t32).reshape(len(t32), -1), axis=1) / scale
    assert distance.max() < max_distance
    # The loss near the end is dominated by the gradient noise: compare the last 50 steps.
    gap = abs(lq[-50:].mean() - l32[-50:].mean()) / l32[-50:].mean()
    print(f"{state_dtype}: max distance {distance.max():.4f}, loss gap {gap:.4f}")
    assert gap < max_loss_gap
    assert lq[-1] < 0.05 * lq[0]  # and it did optimise


# ---------------------------------------------------------------------------------------------
# Against the NumPy reference of block-wise 8-bit state (tests/reference.py)
# ---------------------------------------------------------------------------------------------

BNB = np.load(os.path.join(os.path.dirname(__file__), "golden", "bnb_dynamic_maps.npz"))
#: bitsandbytes' maps (signed, unsigned), as recorded: the reference's only data.
BNB_MAPS = (BNB["signed"], BNB["unsigned"])
REF_SHAPE = (70, 301)  # 21,070 elements: 83 blocks of 256, the last one padded
REF_LR, REF_WD = 1e-2, 0.1


def _reference_gradients(steps):
    """Rows of scales from 1e-3 to 10 (a block of 256 spans two rows, so small and large
    values share blocks), decaying over the steps, a row of zeros and a recurring outlier."""
    rng = np.random.default_rng(7)
    row = np.exp(rng.uniform(np.log(1e-3), np.log(10.0), (REF_SHAPE[0], 1)))
    out = []
    for t in range(steps):
        g = row * rng.standard_normal(REF_SHAPE) * 0.97**t
        g[5] = 0.0
        if t % 7 == 3:
            g[11, 17] = 50.0
        out.append(g.astype(np.float32))
    return out


def _moment_pairs(variant, state, ref_state):
    """``(name, package QuantizedArray, reference Blockwise8bit, map)`` per 8-bit moment."""
    signed, unsigned = BNB_MAPS
    if variant == "lion":
        mu = next(x for x in state if isinstance(x, od.ScaleByLionState)).mu["w"]
        return [("mu", mu, ref_state[1], signed)]
    adam = od.diagnostics.find_adam_state(state)
    pairs = [("mu", adam.mu["w"], ref_state.m, signed), ("nu", adam.nu["w"], ref_state.v, unsigned)]
    if ref_state.v_max is not None:
        pairs.append(("nu_max", adam.nu_max["w"], ref_state.v_max, unsigned))
    return pairs


def _follow_reference(variant, store, ref_state, ref_step, param_rtol):
    """20 steps of ``variant`` (``"adamw"``, an AMSGrad convention or ``"lion"``) with
    ``store`` state and of the reference (``ref_step(g, ref_state) -> (u, ref_state)``) on
    the same gradients; asserts the parameters stay within ``param_rtol`` of max |θ| and
    yields ``(t, state, ref_state)`` after each step."""
    amsgrad = None if variant in ("adamw", "lion") else variant
    if variant == "lion":
        tx = od.lion(REF_LR, weight_decay=REF_WD, mask=None, state_dtype=store)
    else:
        tx = od.adamw(REF_LR, weight_decay=REF_WD, mask=None, amsgrad=amsgrad, state_dtype=store)
    p0 = np.random.default_rng(3).standard_normal(REF_SHAPE).astype(np.float32)
    params, theta = {"w": jnp.asarray(p0)}, p0.astype(np.float64)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t, g in enumerate(_reference_gradients(20)):
        updates, state = update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
        u, ref_state = ref_step(g, ref_state)
        theta = theta - REF_LR * u - REF_LR * REF_WD * theta  # "lr" convention, as the aliases
        yield t, state, ref_state
        distance = np.max(np.abs(np.asarray(params["w"], np.float64) - theta))
        assert distance <= param_rtol * np.max(np.abs(theta)), f"parameters at step {t}"


@pytest.mark.parametrize("variant", ["adamw", "pytorch", "optax", "paper", "lion"])
def test_8bit_state_follows_the_blockwise_reference(variant):
    """8-bit AdamW (and its AMSGrad conventions) and Lion against ``reference.py``'s NumPy
    implementation of Dettmers et al.'s block-wise 8-bit optimizers, which shares no code with
    the package: bitsandbytes' recorded maps, float64 arithmetic, nearest codes by brute force.
    Over 20 steps: at least 99.98% of the codes identical at every step,
    the others at most 0.017 apart in normalized value (one or two map steps: float32 against
    float64 rounding at a decision point, carried by the moving averages), scales within 2e-5,
    parameters within 9.1e-5 of max |θ|. The same run with float32 state is 2.5% (Lion) to
    100% (Adam: blocks shared by rows of gradient scales 1e-3 and 10 round the small rows' ν to
    0) away from this reference, so it tells the quantization apart."""
    store = S.BlockwiseInt8Storage()
    amsgrad = None if variant in ("adamw", "lion") else variant
    if variant == "lion":
        ref_state = (0, ref.quantize_8bit(np.zeros(REF_SHAPE), BNB_MAPS[0], 256))

        def ref_step(g, rs):
            return ref.lion_8bit_direction(g, rs, BNB_MAPS[0], 256)
    else:
        zeros = [ref.quantize_8bit(np.zeros(REF_SHAPE), m, 256) for m in BNB_MAPS]
        ref_state = ref.Adam8bitState(0, zeros[0], zeros[1], None if amsgrad is None else zeros[1])

        def ref_step(g, rs):
            return ref.adam_8bit_direction(g, rs, BNB_MAPS, 256, amsgrad=amsgrad)

    for t, state, ref_now in _follow_reference(variant, store, ref_state, ref_step, 2e-4):
        for name, q, r, qmap in _moment_pairs(variant, state, ref_now):
            codes = np.asarray(q.codes)
            where = f"{name} at step {t}"
            assert np.mean(codes == r.codes) >= 0.999, where
            gap = np.max(np.diff(np.sort(qmap.astype(np.float64))))
            apart = np.abs(qmap[codes].astype(np.float64) - qmap[r.codes])
            assert apart.max() <= 2 * gap, where
            np.testing.assert_allclose(np.asarray(q.absmax), r.absmax, rtol=1e-4, err_msg=where)


@pytest.mark.parametrize("variant", ["adamw", "pytorch", "optax", "paper", "lion"])
def test_bfloat16_state_follows_the_reference(variant):
    """The same against ``reference.py``'s bfloat16 state: the float64 update from the stored
    moments, the new moments rounded to float32 and then to the nearest bfloat16 (written from
    the format, checked against ml_dtypes in the next test). Over 20 steps: at
    least 99.69% of the stored moments identical at every step ("optax"
    stores ν/(1-β₂ᵗ), whose division rounds differently in float32; the others ≥ 99.99%), the
    rest one bfloat16 step apart or, where the moving average cancels, a few float32 steps of
    its terms; parameters within 2.1e-4 of max |θ|. Float32 state stores no bfloat16 values."""
    store = S.FloatStorage(jnp.bfloat16, "bfloat16")
    amsgrad = None if variant in ("adamw", "lion") else variant
    if variant == "lion":
        ref_state, ref_step = ref.lion_init(np.zeros(REF_SHAPE)), ref.lion_bf16_direction
    else:
        ref_state = ref.adam_init(np.zeros(REF_SHAPE), amsgrad)

        def ref_step(g, rs):
            return ref.adam_bf16_direction(g, rs, amsgrad=amsgrad)

    for t, state, ref_now in _follow_reference(variant, store, ref_state, ref_step, 4e-4):
        if variant == "lion":
            pairs = [(next(x for x in state if isinstance(x, od.ScaleByLionState)).mu, ref_now.m)]
        else:
            adam = od.diagnostics.find_adam_state(state)
            pairs = [(adam.mu, ref_now.m), (adam.nu, ref_now.v)]
            if amsgrad is not None:
                pairs.append((adam.nu_max, ref_now.v_max))
        for k, (stored, expected) in enumerate(pairs):
            assert stored["w"].dtype == jnp.bfloat16
            got = np.asarray(stored["w"], np.float64)
            where = f"moment {k} at step {t}"
            assert np.mean(got == expected) >= 0.995, where
            atol = 1e-6 * np.max(np.abs(expected))
            np.testing.assert_allclose(got, expected, rtol=2.0**-7, atol=atol, err_msg=where)


def test_reference_bfloat16_rounding_equals_ml_dtypes():
    """``reference.round_to_bfloat16`` (bit arithmetic) against ml_dtypes' conversion, on
    values over sixty decades and on exact ties."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(100_000) * 10.0 ** rng.uniform(-30, 30, 100_000)
    ties = (np.arange(1, 2**8, dtype=np.float64) * 2 + 1) * 2.0**-16  # halfway between bf16s
    x = np.concatenate([x, ties, -ties, [0.0, -0.0]])
    expected = x.astype(np.float32).astype(jnp.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(ref.round_to_bfloat16(x), expected)


# ---------------------------------------------------------------------------------------------
# Composition: jit, vmap, inject_hyperparams, MultiSteps, apply_if_finite, masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["adamw", pytest.param("amsgrad_optax", marks=SLOW), pytest.param("lion", marks=SLOW)]
)
def test_jit_equals_eager(name):
    tx = FACTORIES[name](1e-2, 0.1, TINY)
    pe, se = run(tx, 5)
    pj, sj = run(tx, 5, update=jax.jit(tx.update))
    chex.assert_trees_all_close(pe, pj, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_equal_structs(se, sj)


@pytest.mark.parametrize("name", ["adamw", "lion"])
@pytest.mark.parametrize("state_dtype", ["int8", TINY])
def test_inject_hyperparams_with_vmap_over_lr(name, state_dtype):
    """state_dtype as a string or a storage object passes through inject_hyperparams, and a
    vmapped batch of learning rates equals separate runs."""
    factory = lambda learning_rate, weight_decay: FACTORIES[name](
        learning_rate, weight_decay, state_dtype
    )
    params0 = {"w": jax.random.normal(jax.random.key(3), (80, 64))}  # 5120 >= 4096

    def train(lr):
        tx = optax.inject_hyperparams(factory)(learning_rate=lr, weight_decay=0.1)
        state = tx.init(params0)

        def body(carry, t):
            params, state = carry
            updates, state = tx.update(grads_at(t, params), state, params)
            return (optax.apply_updates(params, updates), state), None

        (params, state), _ = jax.lax.scan(body, (params0, state), jnp.arange(4))
        return params, state

    lrs = jnp.array([1e-3, 1e-2])
    batched, states = jax.jit(jax.vmap(train))(lrs)
    mu = states.inner_state[0].mu["w"]
    assert isinstance(mu, Q.QuantizedArray) and mu.codes.shape[0] == 2
    for i in range(2):
        one, _ = jax.jit(train)(lrs[i])
        # The batched and the single program may round the parameter update differently
        # (a contracted multiply-add), which can move a moment code by one step: parameters
        # of unit scale then differ by ~1e-9.
        chex.assert_trees_all_close(
            jax.tree.map(lambda x: x[i], batched), one, rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize(
    "name", ["adam_l2", pytest.param("amsgrad", marks=SLOW), pytest.param("lion", marks=SLOW)]
)
def test_vmap_over_parameter_batches(name):
    tx = FACTORIES[name](1e-2, 0.1, TINY)
    batch = jax.tree.map(lambda x: jnp.stack([x, 2 * x]), make_params())

    def step(params):
        state = tx.init(params)
        updates, state = tx.update(grads_at(0, params), state, params)
        updates, state = tx.update(grads_at(1, params), state, params)
        return optax.apply_updates(params, updates)

    out = jax.jit(jax.vmap(step))(batch)
    for i in range(2):
        one = jax.jit(step)(jax.tree.map(lambda x: x[i], batch))
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], out), one, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw", "amsgrad", "lion"])
def test_multi_steps_equals_averaged_gradients(name):
    k = 3
    multi = optax.MultiSteps(FACTORIES[name](1e-2, 0.1, TINY), every_k_schedule=k)
    inner = FACTORIES[name](1e-2, 0.1, TINY)
    rounds = wrapper_checks.multi_steps_vs_averaged_gradients(
        multi, inner, make_params(), grads_at, every_k=k, update_multi=jax.jit(multi.update)
    )
    for pm, pi in rounds:
        # A one-ulp difference in the averaged gradient can move a code by one step.
        chex.assert_trees_all_close(pm, pi, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "amsgrad", "lion"])
def test_apply_if_finite_skips_bad_steps(name):
    guarded = optax.apply_if_finite(FACTORIES[name](1e-2, 0.1, TINY), max_consecutive_errors=3)
    plain = FACTORIES[name](1e-2, 0.1, TINY)
    params = make_params()
    pg, sg = params, guarded.init(params)
    pp, sp = params, plain.init(params)
    update = jax.jit(guarded.update)
    clean = 0
    for t in range(5):
        if t in (1, 3):
            g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), pg)
            before = (pg, sg.inner_state)
            u, sg = update(g, sg, pg)
            pg = optax.apply_updates(pg, u)
            chex.assert_trees_all_equal((pg, sg.inner_state), before)
            continue
        u, sg = update(grads_at(clean, pg), sg, pg)
        pg = optax.apply_updates(pg, u)
        u, sp = plain.update(grads_at(clean, pp), sp, pp)
        pp = optax.apply_updates(pp, u)
        clean += 1
    assert int(sg.total_notfinite) == 2
    chex.assert_trees_all_close(pg, pp, rtol=1e-5, atol=1e-6)


def test_masks_and_chain_with_clipping():
    """Decay masks act on parameters, not on the stored moments: same mask, same result
    whatever the storage; int8 composes with clipping in a chain."""
    mask = od.decay_mask(exclude="conv")
    adamw = od.adamw(1e-2, weight_decay=0.5, mask=mask, state_dtype=TINY)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    zero_lr = od.adamw(0.0, weight_decay=0.5, mask=mask, state_dtype=TINY)
    params = make_params()
    updates, _ = zero_lr.update(grads_at(0, params), zero_lr.init(params), params)
    np.testing.assert_array_equal(updates["conv"], 0.0)  # masked out: no decay
    assert np.all(np.asarray(updates["dense"]["kernel"]) == 0.0)  # lr = 0 -> "lr" decay is 0
    p, _ = run(tx, 4)
    chex.assert_tree_all_finite(p)


def test_state_bytes_shrink():
    params = {"w": jnp.ones((1024, 1024))}
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    f32 = nbytes(od.adamw(1e-3, state_dtype="float32").init(params))
    i8 = nbytes(od.adamw(1e-3, state_dtype="int8").init(params))
    assert i8 / f32 == pytest.approx((1 + 4 / 256) / 4, rel=1e-4)  # 0.2539


def test_bfloat16_nu_cannot_decay_slowly():
    """A documented limit of bfloat16 state (docs/memory.md, *Does it change the result?*): with
    b2 = 0.999, ν's per-step decay (0.1%) is under half a bfloat16 ulp (0.2-0.4%), so after
    large gradients round-to-nearest writes the old ν back and it never comes down: 100
    steps of g = 1 then 2900 of g = 0.01 leave ν at 0.098 (float32: 0.0053) and the update
    4x too small. 8-bit state, whose block scale is float32, follows float32, and so does
    bfloat16 state with stochastic rounding, on average over the elements."""
    params = {"w": jnp.zeros((4096,))}

    def final(state_dtype):
        tx = od.scale_by_adam(state_dtype=state_dtype)
        gs = jnp.concatenate([jnp.ones(100), jnp.full(2900, 0.01)])

        def body(state, g):
            u, state = tx.update({"w": jnp.full((4096,), g)}, state)
            return state, u["w"][0]

        state, u = jax.lax.scan(body, tx.init(params), gs)
        nu = S.resolve_storage(state_dtype).read(state.nu["w"], params["w"])
        return float(nu[0]), float(u[-1])

    nu32, u32 = final(None)
    nu16, u16 = final("bfloat16")
    nu8, u8 = final(S.BlockwiseInt8Storage(min_size=0))
    assert nu32 == pytest.approx(0.00533, rel=1e-2) and u32 == pytest.approx(0.1336, rel=1e-2)
    assert nu16 == pytest.approx(0.0977, rel=1e-2) and u16 == pytest.approx(0.0319, rel=1e-2)
    assert nu8 == pytest.approx(nu32, rel=1e-2) and u8 == pytest.approx(u32, rel=1e-2)
    nu_sr, u_sr = final(SR)  # element 0; the mean over elements is checked below
    assert nu_sr == pytest.approx(nu32, rel=0.5) and u_sr == pytest.approx(u32, rel=0.5)


SR = S.FloatStorage(jnp.bfloat16, "bfloat16", rounding="stochastic")


def test_stochastic_rounding_lets_bfloat16_nu_decay():
    """The scenario above with ``rounding="stochastic"``: ν and the update follow float32
    on average (each element is float32's plus rounding noise of zero mean)."""
    params = {"w": jnp.zeros((4096,))}
    gs = jnp.concatenate([jnp.ones(100), jnp.full(2900, 0.01)])
    out = {}
    for name, state_dtype in (("float32", None), ("stochastic", SR)):
        tx = od.scale_by_adam(state_dtype=state_dtype)

        def body(state, g, tx=tx):
            u, state = tx.update({"w": jnp.full((4096,), g)}, state)
            return state, u["w"]

        state, u = jax.jit(lambda s, tx=tx, body=body: jax.lax.scan(body, s, gs))(tx.init(params))
        assert state.nu["w"].dtype == (jnp.bfloat16 if state_dtype else jnp.float32)
        out[name] = (np.asarray(state.nu["w"], np.float64), np.asarray(u[-1], np.float64))
    (nu32, u32), (nu_sr, u_sr) = out["float32"], out["stochastic"]
    assert np.mean(nu_sr) == pytest.approx(nu32[0], rel=0.01)
    assert np.mean(u_sr) == pytest.approx(u32[0], rel=0.01)
    assert 0.01 < np.std(nu_sr) / np.mean(nu_sr) < 0.3  # noise, not a constant offset


def _bf16_neighbours(x):
    """The bfloat16 values next to float32 ``x``: towards zero (truncation) and away."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    down = bits & np.uint32(0xFFFF0000)
    up = np.where(bits == down, down, down + np.uint32(0x10000))
    return down.view(np.float32), up.view(np.float32)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    """Each element rounds to one of its two bfloat16 neighbours; over many elements the
    mean is the float32 value (5 standard errors); exact values, NaN and infinities stay;
    the bits depend on the step and the stream and on nothing else."""
    values = np.float32([1 + 2**-9, -0.7, 3e-39, 1e-30, 65504.3, 2.0, -(2.0**-130)])
    n = 1 << 17
    x = jnp.asarray(np.repeat(values, n))
    r = np.asarray(S.stochastic_round_bfloat16(x, jnp.int32(5)).astype(jnp.float32))
    for k, v in enumerate(values):
        got = r[k * n : (k + 1) * n].astype(np.float64)
        down, up = (float(b) for b in _bf16_neighbours(v))
        assert np.all((got == down) | (got == up)), v
        if down == up:
            assert np.all(got == v)
            continue
        p = (float(v) - down) / (up - down)
        sigma = abs(up - down) * np.sqrt(p * (1 - p) / n)
        assert abs(got.mean() - float(v)) < 5 * sigma, (v, got.mean(), sigma)
    again = S.stochastic_round_bfloat16(x, jnp.int32(5))
    chex.assert_trees_all_equal(again.astype(jnp.float32), jnp.asarray(r))
    other_step = S.stochastic_round_bfloat16(x, jnp.int32(6)).astype(jnp.float32)
    other_stream = S.stochastic_round_bfloat16(x, jnp.int32(5), stream=1).astype(jnp.float32)
    assert np.mean(np.asarray(other_step) != r) > 0.1
    assert np.mean(np.asarray(other_stream) != r) > 0.1
    special = jnp.float32([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0])
    out = S.stochastic_round_bfloat16(special, jnp.int32(1)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(special))
    assert np.signbit(np.asarray(out)[4])


@pytest.mark.parametrize(
    "name", ["adamw", pytest.param("amsgrad", marks=SLOW), pytest.param("lion", marks=SLOW)]
)
def test_stochastic_rounding_composes(name):
    """A storage object with stochastic rounding through jit, lax.scan (state types kept),
    inject_hyperparams + vmap over learning rates (equal to separate runs: the bits do not
    depend on the batch), MultiSteps and apply_if_finite."""
    params0 = make_params()

    def make(lr):
        return optax.inject_hyperparams(
            lambda learning_rate: FACTORIES[name](learning_rate, 0.1, SR)
        )(learning_rate=lr)

    def train(lr):
        tx = make(lr)
        state = tx.init(params0)

        def body(carry, t):
            params, state = carry
            updates, state = tx.update(grads_at(t, params), state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(body, (params0, state), jnp.arange(4))[0]

    lrs = jnp.array([1e-3, 1e-2])
    batched, states = jax.jit(jax.vmap(train))(lrs)
    for i in range(2):
        one, one_state = jax.jit(train)(lrs[i])
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], batched), one, atol=1e-6)
    # The scanned state has init's types: the moments stay bfloat16.
    chex.assert_trees_all_equal_shapes_and_dtypes(one_state, make(lrs[1]).init(params0))
    tx = FACTORIES[name](1e-2, 0.1, SR)
    moments_of = [m for m in jax.tree.leaves(tx.init(params0)) if m.ndim > 0]
    assert {m.dtype for m in moments_of} == {jnp.dtype(jnp.bfloat16)}
    multi = optax.MultiSteps(FACTORIES[name](1e-2, 0.1, SR), every_k_schedule=2)
    inner = FACTORIES[name](1e-2, 0.1, SR)
    rounds = wrapper_checks.multi_steps_vs_averaged_gradients(
        multi, inner, params0, grads_at, every_k=2, update_multi=jax.jit(multi.update),
        update_inner=jax.jit(inner.update),
    )  # fmt: skip
    for pm, pi in rounds:
        chex.assert_trees_all_close(pm, pi, rtol=1e-4, atol=1e-5)
    guarded = optax.apply_if_finite(FACTORIES[name](1e-2, 0.1, SR), max_consecutive_errors=3)
    state = guarded.init(params0)
    bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), params0)
    _, after = jax.jit(guarded.update)(bad, state, params0)
    chex.assert_trees_all_equal(after.inner_state, state.inner_state)


def test_derivatives_pass_straight_through_stochastic_rounding():
    """As through rounding to nearest: the rounding's tangent is the input's, so a
    meta-gradient through steps with stochastically rounded state is float32's up to the
    rounding noise (it was 0: the bit manipulation has no derivative)."""
    x = jnp.linspace(-2.0, 2.0, 7)
    _, tangent = jax.jvp(lambda x: S.stochastic_round_bfloat16(x, jnp.int32(3)), (x,), (x,))
    _, nearest = jax.jvp(lambda x: x.astype(jnp.bfloat16), (x,), (x,))
    np.testing.assert_array_equal(np.asarray(tangent, np.float32), np.asarray(nearest, np.float32))
    params = {"w": jnp.linspace(-1.0, 1.0, 6400).reshape(64, 100)}

    def meta(b1, state_dtype):
        tx = optax.inject_hyperparams(od.adamw)(learning_rate=0.05, b1=b1, state_dtype=state_dtype)
        p, state = params, tx.init(params)
        for _ in range(3):
            u, state = tx.update(jax.tree.map(jnp.sin, p), state, p)
            p = optax.apply_updates(p, u)
        return jnp.sum(p["w"] ** 2)

    want = jax.grad(meta)(jnp.float32(0.8), None)
    got = jax.grad(meta)(jnp.float32(0.8), SR)
    assert abs(float(want)) > 1.0
    np.testing.assert_allclose(float(got), float(want), rtol=0.02)


def test_stochastic_rounding_arguments():
    with pytest.raises(ValueError, match="`rounding` must be one of"):
        S.FloatStorage(jnp.bfloat16, "bfloat16", rounding="up")
    with pytest.raises(ValueError, match="`rounding`='stochastic' is implemented for bfloat16"):
        S.FloatStorage(jnp.float16, "float16", rounding="stochastic")
    moments_fn = lambda m, g: (0.9 * m + 0.1 * g,)
    with pytest.raises(ValueError, match="needs the step count"):
        S.update_moments(SR, moments_fn, (jnp.zeros(3, jnp.bfloat16),), (jnp.ones(3),),
                         like=jnp.ones(3), signed=(True,))  # fmt: skip


@pytest.mark.parametrize("alias", ["adamw", "lion"])
def test_parameter_dtype_moments_are_computed_in_the_promoted_dtype(alias):
    """bfloat16 parameters, float32 gradients, ``state_dtype=None``: the moments are stored
    in bfloat16 (the parameters' dtype) but computed in float32, as jnp promotes and as the
    storage docs say; the gradient was rounded to bfloat16 first (0.8% off in one step).
    The same as ``state_dtype="bfloat16"``, whose moments are also computed in float32."""
    factory = {"adamw": od.adamw, "lion": od.lion}[alias]
    make = lambda sd: factory(1.0, mask=None, weight_decay=0.0, state_dtype=sd)  # noqa: E731
    params = {"w": jnp.ones((64,), jnp.bfloat16)}
    grads = [{"w": jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32) * (-1.0) ** k} for k in range(3)]
    runs = {}
    for sd in (None, "bfloat16"):
        tx = make(sd)
        state, out = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            out.append(np.asarray(u["w"], np.float64))
        assert jax.tree.leaves(state)[1].dtype == jnp.bfloat16  # stored as the parameter
        runs[sd] = out
    for a, b in zip(runs[None], runs["bfloat16"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    if alias == "adamw":  # step 1 from float64: m/sqrt(v) = g/|g| exactly, up to eps
        np.testing.assert_allclose(runs[None][0], -1.0, rtol=1e-5)


def test_lion_sign_of_a_bfloat16_momentum_and_a_float32_gradient():
    """(1 - b1) g + b1 m with m = 0.010009765625 (bfloat16), g = -0.01 (float32), b1 = 0.5
    is +4.9e-6 in float64 and float32; with g rounded to bfloat16 first it was 0."""
    tx = od.scale_by_lion(b1=0.5, b2=0.99)
    state = tx.init({"w": jnp.zeros((1,), jnp.bfloat16)})
    state = state._replace(mu={"w": jnp.full((1,), 0.010009765625, jnp.bfloat16)})
    u, _ = tx.update({"w": jnp.full((1,), -0.01, jnp.float32)}, state)
    assert float(u["w"][0]) == 1.0


def test_float16_moments_saturate_instead_of_freezing_an_element():
    """One gradient of 1e4 makes nu = 1e5 > float16's max (65504): stored as inf, every
    later update of that element was exactly 0. It is kept at the largest finite value, so
    the element moves on; the others are unaffected."""
    params = {"w": jnp.zeros((4,))}
    tx = od.adamw(1e-3, mask=None, weight_decay=0.0, state_dtype="float16")
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array([1e4, 1.0, 1.0, 1.0])}, state, params)
    nu = np.asarray(state[0].nu["w"], np.float32)
    assert nu[0] == np.finfo(np.float16).max and np.all(np.isfinite(nu))
    for _ in range(20):
        u, state = tx.update({"w": jnp.ones((4,))}, state, params)
    assert np.all(np.asarray(u["w"]) < 0), u["w"]
    nan = tx.update({"w": jnp.array([np.nan, 1.0, 1.0, 1.0])}, state, params)[1]
    assert np.isnan(np.asarray(nan[0].nu["w"], np.float32)[0])  # NaN is not hidden


def test_float16_parameters_under_float32_gradients():
    """state_dtype=None, float16 parameters, float32 gradients of size 300-500: g**2 was
    computed in float16 (overflow to inf) and eps rounded to 0, giving -0 and -inf updates.
    Computed in float32 (the promoted dtype), the first step is -lr * sign(g), as optax's."""
    params = {"w": jnp.zeros((4,), jnp.float16)}
    g = {"w": jnp.array([300.0, 1e-3, -500.0, 3e-4], jnp.float32)}
    tx = od.adamw(1e-3, mask=None, weight_decay=0.0)
    u, state = tx.update(g, tx.init(params), params)
    assert state[0].nu["w"].dtype == jnp.float16
    np.testing.assert_allclose(u["w"], -1e-3 * np.sign(g["w"]), rtol=1e-3)


def _float32_patterns(n=1 << 20, seed=0):
    """Random float32 bit patterns (every exponent, subnormals, NaNs) and the specials."""
    bits = np.random.default_rng(seed).integers(0, 1 << 32, size=n, dtype=np.uint64)
    special = np.array(
        [0.0, np.inf, np.nan, 65504.0, 65519.99, 65520.0, 6e-8, 2.98e-8, 3e-8, 1e-40, 3.4e38],
        np.float32,
    )
    return np.concatenate([bits.astype(np.uint32).view(np.float32), special, -special])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_narrow_rounds_as_astype(dtype):
    """The storages' narrowing cast (reduce_precision for bfloat16, a barrier for float16)
    gives the values of a plain cast, bit for bit, float16's subnormals included (which
    reduce_precision would flush to zero)."""
    x = jnp.asarray(_float32_patterns())
    got = np.asarray(jax.jit(S.narrow, static_argnums=1)(x, dtype))
    want = np.asarray(x.astype(dtype))
    assert got.dtype == want.dtype
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (np.asarray(x)[~same][:5], got[~same][:5], want[~same][:5])


@pytest.mark.parametrize(
    ("storage", "param_dtype", "op"),
    [
        (S.FloatStorage(jnp.bfloat16, "bfloat16"), jnp.float32, "reduce_precision"),
        (S.FloatStorage(jnp.float16, "float16"), jnp.float32, "optimization_barrier"),
        (S.ParamDtypeStorage(), jnp.bfloat16, "reduce_precision"),
        (S.BlockwiseInt8Storage(), jnp.float64, "optimization_barrier"),  # a small leaf: f32
    ],
    ids=["bfloat16", "float16", "bfloat16-params", "int8-small-leaf-x64"],
)
def test_the_gpu_program_keeps_the_rounding_the_cpu_program_a_plain_cast(storage, param_dtype, op):
    """What ``storage.narrow`` compiles to, lowered for both platforms here (no GPU needed):
    for a GPU, the cast XLA:GPU cannot drop (reduce_precision for float32 to bfloat16, an
    optimization barrier otherwise; see test_a_moment_read_back_in_the_same_program_is_rounded
    for why); for the CPU, whose XLA keeps the cast, neither (no cost there)."""
    with jax.enable_x64(param_dtype == jnp.float64):
        like = jnp.zeros((64,), param_dtype)
        value = jnp.zeros((64,), jnp.promote_types(param_dtype, jnp.float32))
        write = jax.jit(lambda v: storage.write(v, like, signed=True))
        gpu = jax.export.export(write, platforms=["cuda"])(value).mlir_module()
        cpu = jax.export.export(write, platforms=["cpu"])(value).mlir_module()
    assert op in gpu, gpu
    assert "reduce_precision" not in cpu and "optimization_barrier" not in cpu, cpu


@pytest.mark.parametrize(
    ("storage", "param_dtype"),
    [
        (S.FloatStorage(jnp.bfloat16, "bfloat16"), jnp.float32),
        (S.FloatStorage(jnp.float16, "float16"), jnp.float32),
        (S.ParamDtypeStorage(), jnp.bfloat16),
    ],
    ids=["bfloat16", "float16", "bfloat16-params"],
)
def test_a_moment_read_back_in_the_same_program_is_rounded(storage, param_dtype):
    """A moment written and read back inside ONE jitted program (as when a program runs
    several optimizer steps) holds the stored dtype's value. XLA:GPU's simplifier rewrites
    convert(convert(x, bf16), f32) to x (docs/devices.md; seen on an H200), which would keep
    the excess precision; XLA:CPU keeps the pair, so on a CPU-only machine this passes with
    a plain cast too: it guards the GPU backend (run there, see docs/devices.md). What the
    GPU program contains is checked on any machine by the test above."""
    like = jnp.zeros((4096,), param_dtype)
    value = jnp.asarray(_float32_patterns(4096, seed=1)).clip(-1e4, 1e4)
    value = jnp.where(jnp.isnan(value), 0.0, value)
    roundtrip = jax.jit(
        lambda v: storage.read(storage.write(v, like, signed=True), like).astype(jnp.float32)
    )
    stored = np.asarray(storage.write(value, like, signed=True).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(roundtrip(value)), stored)


@pytest.mark.parametrize("shape", [(37, 300), (64, 128)], ids=["ragged", "whole-blocks"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_eager_int8_init_is_one_program_and_equals_the_traced_one(shape, signed):
    """Eagerly (e.g. while an ``nnx.Optimizer`` is made) the 8-bit moments' initial value is
    computed by one compiled program per shape, not op by op (which compiled each of a few
    dozen operations for every new shape: 11 s for ten shapes on 2 cores), and equals the
    value traced inside ``jit``, codes and scales."""
    import logging

    storage = S.BlockwiseInt8Storage()
    param = jnp.ones(shape, jnp.float32)
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            eager = storage.init(param, signed)
    finally:
        logging.getLogger("jax").removeHandler(handler)
    compiled = [m for m in messages if m.startswith("Compiling")]
    assert len(compiled) <= 1, compiled  # 0 where an earlier test compiled this shape
    traced = jax.jit(lambda p: storage.init(p, signed))(param)
    chex.assert_trees_all_equal(eager, traced)
    assert eager.codes.dtype == jnp.uint8 and eager.absmax.dtype == jnp.float32


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_int8_init_is_computed_at_run_time_not_folded_by_the_compiler(signed):
    """The zeros the 8-bit moments start from are constants, and XLA constant-folded their
    quantization while compiling ``init``, which took seconds at 10^6 parameters (eagerly and
    under ``jit``). ``init`` hides them from the folding, so its compiled program (eager and
    traced) still computes the block absmax."""
    storage = S.BlockwiseInt8Storage()
    param = jnp.ones((64, 1024), jnp.float32)

    def computes_absmax(fn):
        text = jax.jit(fn).lower(param).compile().as_text()
        return any(" reduce(" in line for line in text.splitlines())

    assert computes_absmax(lambda p: S._quantized_zeros(p, signed=signed, block_size=256))
    assert computes_absmax(lambda p: storage.init(p, signed))
    traced = jax.jit(lambda p: storage.init(p, signed))(param)
    assert traced.absmax.shape == (256,) and not np.asarray(traced.absmax).any()
