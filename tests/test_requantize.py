"""The fused 8-bit read-modify-write (`quantization.requantize`, `storage.update_moments`):
the CPU loop over chunks of blocks gives exactly what dequantize -> fn -> quantize gives, and
it is staged out for CPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled._src import quantization as Q
from optax_decoupled._src import storage as S


def _adam_like(mu, nu, g):
    g = g.astype(mu.dtype)
    return 0.9 * mu + 0.1 * g, 0.999 * nu + 0.001 * g * g


def _inputs(size, block, key=0, dtype=jnp.float32):
    shape = (size,) if size % 7 else (7, size // 7)

    @jax.jit  # one program instead of an eager op at a time (each compiled for its shapes)
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        mu = Q.quantize(0.1 * jax.random.normal(k1, shape), signed=True, block_size=block)
        nu = Q.quantize(jax.random.uniform(k2, shape) ** 4, signed=False, block_size=block)
        g = jax.random.normal(k3, shape, dtype) * jnp.logspace(-6, 1, size).reshape(shape)
        return mu, nu, g.astype(dtype)

    return (shape, *make(jax.random.key(key)))


def _written_out(fn, stored, operands, shape, signed, block):
    """The definition: dequantize, compute on whole arrays, quantize (jitted, like the fused
    path, so that both round the same way)."""

    @jax.jit
    def run(stored, operands):
        values = fn(*(Q.dequantize(q, shape) for q in stored), *operands)
        return tuple(
            Q.quantize(v, signed=s, block_size=block) for v, s in zip(values, signed, strict=True)
        )

    return run(tuple(stored), tuple(operands))


def _assert_same(got, want):
    """Equal up to float32 rounding: the loop and the whole-array program are different XLA
    programs, which may round the moment update (e.g. contract a multiply-add) differently
    by one ulp. So a block's absmax may differ in its last bit and an element that lies at a
    rounding boundary may get the neighbouring code; nothing more."""
    for a, b in zip(got, want, strict=True):
        assert a.signed == b.signed
        np.testing.assert_allclose(np.asarray(a.absmax), np.asarray(b.absmax), rtol=3e-7)
        diff = np.abs(np.asarray(a.codes, np.int32) - np.asarray(b.codes, np.int32))
        assert diff.max() <= 1
        assert np.mean(diff) < 2e-3, np.mean(diff)


@pytest.mark.parametrize(
    "size, block, chunk",
    [
        (64 * 256, 256, 10 * 256),  # 6 whole chunks, the last one moved back
        (64 * 256 + 77, 256, 8 * 256),  # ragged: padded last block handled after the loop
        (7 * 2048 + 5, 2048, 2048),  # the paper's block size, one block per chunk
        (3 * 256 + 1, 256, 2**17),  # fewer blocks than one chunk: no loop
        (100, 256, 256),  # a single padded block
    ],
)
def test_chunked_equals_written_out(size, block, chunk):
    shape, mu, nu, g = _inputs(size, block)
    fn = jax.jit(
        lambda mu, nu, g: Q.requantize(
            _adam_like, (mu, nu), (g,), shape=shape, signed=(True, False), chunk_elements=chunk
        )
    )
    want = _written_out(_adam_like, (mu, nu), (g,), shape, (True, False), block)
    _assert_same(fn(mu, nu, g), want)


def test_chunked_under_vmap_and_bfloat16_operands():
    size, block = 40 * 256 + 3, 256
    parts = [_inputs(size, block, key=k, dtype=jnp.bfloat16) for k in range(3)]
    shape = parts[0][0]
    mu, nu, g = (jax.tree.map(lambda *x: jnp.stack(x), *[p[i] for p in parts]) for i in (1, 2, 3))

    def one(mu, nu, g):
        return Q.requantize(
            _adam_like, (mu, nu), (g,), shape=shape, signed=(True, False), chunk_elements=7 * 256
        )

    got = jax.jit(jax.vmap(one))(mu, nu, g)
    for k in range(3):
        want = _written_out(
            _adam_like, (parts[k][1], parts[k][2]), (parts[k][3],), shape, (True, False), block
        )
        _assert_same(jax.tree.map(lambda x, k=k: x[k], got), want)


def test_three_moments_and_a_max():
    """AMSGrad's shape of update: three stored moments in, three out, one a running max."""
    size, block = 30 * 256 + 9, 256
    shape, mu, nu, g = _inputs(size, block)
    nu_max = Q.quantize(Q.dequantize(nu, shape) * 1.5, signed=False, block_size=block)

    def fn(mu, nu, nu_max, g):
        mu, nu = _adam_like(mu, nu, g)
        return mu, nu, jnp.maximum(nu_max, nu)

    signed = (True, False, False)
    got = jax.jit(
        lambda *a: Q.requantize(fn, a[:3], a[3:], shape=shape, signed=signed, chunk_elements=4096)
    )(mu, nu, nu_max, g)
    _assert_same(got, _written_out(fn, (mu, nu, nu_max), (g,), shape, signed, block))


@pytest.mark.parametrize("b2_shape", ["column", "element"])
@pytest.mark.parametrize("running_max", [False, True])
def test_array_coefficients_in_the_chunked_loop(b2_shape, running_max):
    """Per-element betas (an EmaMoments with array decays) on a leaf of several chunks: the
    loop handed the update ``(chunk, B)`` blocks, against which a ``(512,)`` or ``(32, 512)``
    b2 raised a broadcasting error (any leaf over 131,072 elements with array b1/b2 and
    8-bit state). The coefficients now travel with the gradient."""
    from optax_decoupled._src.moment_updates import EmaMoments

    shape, block = (32, 512), 256
    _, mu, nu, g = _inputs(32 * 512, block)
    g = g.reshape(shape)
    b2 = jnp.linspace(0.99, 0.9999, 512, dtype=jnp.float32)
    if b2_shape == "element":
        b2 = jnp.broadcast_to(b2, shape) * jnp.linspace(1.0, 0.999, 32)[:, None]
    b1 = jnp.float32(0.9)  # a scalar array stays in the update
    fn = EmaMoments((b1, b2), (1, 2), running_max=running_max)
    stored = (mu, nu, nu) if running_max else (mu, nu)
    signed = (True, False, False) if running_max else (True, False)
    got = jax.jit(
        lambda st, g: Q.requantize(
            fn, st, (g,), shape=shape, signed=signed, chunk_elements=4 * block
        )
    )(stored, g)
    _assert_same(got, _written_out(fn, stored, (g,), shape, signed, block))


def test_array_betas_with_8bit_state_on_a_leaf_of_several_chunks(monkeypatch):
    """The same through the optimizer (a smaller chunk stands in for a leaf over 131,072
    elements): 8-bit AdamW with a per-column b2 follows the float32 state's steps."""
    monkeypatch.setattr(Q, "CHUNK_ELEMENTS", 4096)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((32, 512)), jnp.float32)}
    b2 = jnp.linspace(0.99, 0.999, 512, dtype=jnp.float32)
    int8 = od.adamw(1e-2, b2=b2, state_dtype=od.BlockwiseInt8Storage(min_size=0))
    f32 = od.adamw(1e-2, b2=b2, state_dtype="float32")
    grads = [
        {"w": jnp.asarray(rng.standard_normal((32, 512)) * (t + 1), jnp.float32)} for t in range(3)
    ]
    results = []
    for tx in (int8, f32):
        p, state, step = params, tx.init(params), jax.jit(tx.update)
        for g in grads:
            u, state = step(g, state, p)
            p = optax.apply_updates(p, u)
        results.append(p["w"])
    # 8-bit moments: each Adam step moves a parameter by at most lr; the codes' rounding
    # changes the direction a little (Dettmers et al.; the 8-bit vs fp32 trajectory tests).
    np.testing.assert_allclose(results[0], results[1], atol=3e-3)


def test_mismatched_layouts_are_refused():
    shape, mu, _, g = _inputs(4096, 256)
    other = Q.quantize(jnp.zeros(shape), signed=False, block_size=512)
    with pytest.raises(ValueError, match="block layout"):
        Q.requantize(_adam_like, (mu, other), (g,), shape=shape, signed=(True, False))


@pytest.mark.parametrize(
    "lr, make",
    [
        (1e-3, lambda sd: od.adamw(1e-3, weight_decay=0.1, mask=None, state_dtype=sd)),
        (1e-3, lambda sd: od.amsgrad(1e-3, weight_decay=0.1, mask=None, state_dtype=sd)),
        (
            1e-3,
            lambda sd: od.amsgrad(
                1e-3, weight_decay=0.1, mask=None, state_dtype=sd, variant="optax"
            ),
        ),
        (
            1e-3,
            lambda sd: od.amsgrad(
                1e-3, weight_decay=0.1, mask=None, state_dtype=sd, variant="paper", eps=0.0
            ),
        ),
        (1e-3, lambda sd: od.adam_l2(1e-3, weight_decay=0.1, mask=None, state_dtype=sd)),
        (1e-4, lambda sd: od.lion(1e-4, weight_decay=0.3, mask=None, state_dtype=sd)),
    ],
    ids=["adamw", "amsgrad", "amsgrad-optax", "amsgrad-paper", "adam-l2", "lion"],
)
def test_optimizers_equal_the_unfused_storage(lr, make):
    """An int8 optimizer (fused: XLA's chunk loop on CPU) against the same storage with its
    fused `update` hidden (plain read-compute-write), over three steps, parameters big enough
    for several chunks and with a padded last block."""

    class Unfused:  # the MomentStorage protocol without `update`
        name = "int8-unfused"

        def __init__(self):
            self.inner = S.BlockwiseInt8Storage()

        def init(self, p, signed):
            return self.inner.init(p, signed)

        def read(self, s, like):
            return self.inner.read(s, like)

        def write(self, v, like, signed):
            return self.inner.write(v, like, signed)

    params = {
        "w": jax.random.normal(jax.random.key(1), (300, 1001)),
        "b": jnp.ones((10,)),  # under min_size: float32 moments
    }
    results = []
    for sd in (S.BlockwiseInt8Storage(), Unfused()):
        tx = make(sd)
        state = tx.init(params)
        p = params

        @jax.jit
        def step(p, state, i, tx=tx):
            g = jax.tree.map(lambda x: jnp.sin(x * (i + 1.0)), p)
            u, state = tx.update(g, state, p)
            return optax.apply_updates(p, u), state

        # On CPU the fused storage stages its chunk loop out; the unfused one does not.
        lowered = step.trace(p, state, 0).lower(lowering_platforms=("cpu",)).as_text()
        assert ("stablehlo.while" in lowered) == (not isinstance(sd, Unfused))
        for i in range(3):
            p, state = step(p, state, i)
        results.append((p, state))
    (p_fused, s_fused), (p_plain, s_plain) = results
    # Same rounding caveat as _assert_same: a moment code may move by one step, which moves
    # that element's update by a fraction of the learning rate.
    for a, b in zip(jax.tree.leaves(p_fused), jax.tree.leaves(p_plain), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        close = np.isclose(a, b, rtol=0, atol=1e-7)
        assert np.mean(~close) < 2e-3
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * lr)  # measured: 0.012 lr
    for a, b in zip(jax.tree.leaves(s_fused), jax.tree.leaves(s_plain), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == np.uint8:
            diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
            assert diff.max() <= 2 and diff.mean() < 2e-3
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5)


def _lowered_text(platform):
    shape, mu, nu, g = _inputs(64 * 256, 256)

    def fn(mu, nu, g):
        return Q.requantize(
            _adam_like, (mu, nu), (g,), shape=shape, signed=(True, False), chunk_elements=4096
        )

    return jax.jit(fn).trace(mu, nu, g).lower(lowering_platforms=(platform,)).as_text()


def test_loop_is_staged_out_for_cpu_only():
    """On GPU/TPU the whole-array computation is kept (XLA fuses it into parallel kernels);
    the chunk loop is for XLA:CPU only."""
    assert "stablehlo.while" in _lowered_text("cpu")
    for platform in ("cuda", "tpu"):
        assert "stablehlo.while" not in _lowered_text(platform)
