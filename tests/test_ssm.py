"""Tests of the Mamba-2-style SSM: scan backends vs a naive recurrence, causality, init."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from optax_decoupled.experiments import ssm


def naive_ssm(x, dt, A, B, C):
    """Per-step reference: H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T, y_t = H_t C_t.

    x (b, l, h, p), dt (b, l, h), A (h,), B and C (b, l, n); one ``lax.scan`` step per time
    step, written as the recurrence (no chunking, no segment sums).
    """
    b, _, h, p = x.shape
    n = B.shape[-1]

    def step(state, inputs):  # state (b, h, p, n)
        x_t, dt_t, B_t, C_t = inputs  # (b, h, p), (b, h), (b, n), (b, n)
        inp = (dt_t[..., None] * x_t)[..., None] * B_t[:, None, None, :]
        state = jnp.exp(dt_t * A)[..., None, None] * state + inp
        return state, jnp.sum(state * C_t[:, None, None, :], axis=-1)  # (b, h, p)

    time_major = (jnp.moveaxis(v, 1, 0) for v in (x, dt, B, C))
    _, ys = jax.lax.scan(step, jnp.zeros((b, h, p, n), x.dtype), tuple(time_major))
    return jnp.moveaxis(ys, 0, 1)


def random_inputs(seed, b=2, l=37, h=3, p=4, n=5):
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (b, l, h, p))
    dt = jax.nn.softplus(jax.random.normal(k[1], (b, l, h)) - 1.0)
    A = -jnp.exp(jax.random.uniform(k[2], (h,), minval=0.0, maxval=math.log(16.0)))
    B = jax.random.normal(k[3], (b, l, n))
    C = jax.random.normal(k[4], (b, l, n))
    return x, dt, A, B, C


BACKENDS = {
    "ssd_q5": lambda x, dt, A, B, C: ssm.ssd_chunked(x, dt, A, B, C, 5),  # 2 full chunks
    "ssd_q4": lambda x, dt, A, B, C: ssm.ssd_chunked(x, dt, A, B, C, 4),  # padded last chunk
    "ssd_q16": lambda x, dt, A, B, C: ssm.ssd_chunked(x, dt, A, B, C, 16),  # one chunk > l
    "scan": ssm.selective_scan,
}


def output_and_grads(f, args, w):
    """f's output and the gradients of sum(f(...) * w) w.r.t. all five arguments."""
    y, vjp = jax.vjp(f, *args)
    return y, vjp(w)


@pytest.fixture(scope="module")
def reference():
    args = random_inputs(0, l=10)
    w = jax.random.normal(jax.random.key(9), args[0].shape)
    y, grads = jax.jit(lambda a, w: output_and_grads(naive_ssm, a, w))(args, w)
    return args, w, y, grads


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_matches_naive_forward_and_gradients(backend, reference):
    args, w, ref_y, ref_grads = reference
    y, grads = jax.jit(lambda a, w: output_and_grads(BACKENDS[backend], a, w))(args, w)
    chex.assert_shape(y, args[0].shape)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    for name, g, r in zip("x dt A B C".split(), grads, ref_grads, strict=True):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(
            g, r, rtol=1e-5, atol=1e-5 * float(np.abs(r).max()), err_msg=name
        )


def naive_ssm_numpy(x, dt, A, B, C):
    """The same per-step recurrence in float64 NumPy (forward only)."""
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    b, l, h, p = x.shape
    state = np.zeros((b, h, p, B.shape[-1]))
    y = np.zeros_like(x)
    for t in range(l):
        inp = np.einsum("bhp,bn->bhpn", dt[:, t, :, None] * x[:, t], B[:, t])
        state = np.exp(dt[:, t] * A)[..., None, None] * state + inp
        y[:, t] = np.einsum("bhpn,bn->bhp", state, C[:, t])
    return y


@pytest.mark.parametrize("backend", ["ssd_q8", "scan"])
def test_backend_forward_long_sequence_float64_reference(backend):
    args = random_inputs(1, l=37)
    fns = {"ssd_q8": lambda *a: ssm.ssd_chunked(*a, 8), "scan": ssm.selective_scan}
    out = jax.jit(fns[backend])(*args)
    np.testing.assert_allclose(out, naive_ssm_numpy(*args), rtol=1e-5, atol=1e-5)


def test_segsum():
    a = jnp.asarray([0.5, -1.0, 2.0, 0.25])
    out = np.asarray(ssm.segsum(a))
    for i in range(4):
        for j in range(4):
            want = float(np.sum(a[j + 1 : i + 1])) if j <= i else -np.inf
            np.testing.assert_allclose(out[i, j], want, rtol=1e-6)


def token_config(**kw):
    base = dict(d_model=16, n_layers=2, d_state=8, headdim=8, chunk_size=8, vocab_size=12)
    return ssm.SSMConfig(**{**base, "num_classes": 12, **kw})


@pytest.fixture(scope="module")
def token_models():
    """Same parameters (same seed), two backends; jitted forward functions."""
    out = {}
    for backend in ("ssd", "scan"):
        model = ssm.Mamba2Model(token_config(backend=backend), rngs=nnx.Rngs(1))
        out[backend] = nnx.jit(lambda m, t: m(t)), model
    return out


def test_model_backends_agree(token_models):
    tokens = jax.random.randint(jax.random.key(3), (3, 24), 0, 12)
    outs = {name: fwd(model, tokens) for name, (fwd, model) in token_models.items()}
    chex.assert_shape(outs["ssd"], (3, 24, 12))
    np.testing.assert_allclose(outs["ssd"], outs["scan"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["ssd", "scan"])
def test_causality_tokens(backend, token_models):
    forward, model = token_models[backend]
    l, cut = 24, 11
    tokens = jax.random.randint(jax.random.key(0), (3, l), 0, 12)
    changed = tokens.at[:, cut + 1 :].set(
        jax.random.randint(jax.random.key(1), (3, l - cut - 1), 0, 12)
    )
    assert not np.array_equal(tokens, changed)
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(a[:, : cut + 1], b[:, : cut + 1])
    assert not np.allclose(a[:, cut + 1 :], b[:, cut + 1 :])


def test_causality_real_inputs():
    cfg = ssm.SSMConfig(d_model=16, n_layers=1, d_state=4, headdim=8, chunk_size=8, input_dim=1)
    model = ssm.Mamba2Model(cfg, rngs=nnx.Rngs(2))
    forward = nnx.jit(lambda m, x: m(x))
    x = jax.random.uniform(jax.random.key(0), (2, 20, 1))
    for cut in (0, 7, 8, 18):
        y = x.at[:, cut + 1 :].add(1.0)
        a, b = forward(model, x), forward(model, y)
        np.testing.assert_array_equal(a[:, : cut + 1], b[:, : cut + 1])


def test_initialisation():
    cfg = ssm.SSMConfig(d_model=32, n_layers=3, d_state=8, headdim=2, vocab_size=8, num_classes=8)
    assert cfg.nheads == 32

    @jax.jit
    def init():
        model = ssm.Mamba2Model(cfg, rngs=nnx.Rngs(0))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    params = init()
    A_log = np.concatenate([params["layers"][i]["mixer"]["A_log"] for i in range(3)])
    dt_bias = np.concatenate([params["layers"][i]["mixer"]["dt_bias"] for i in range(3)])
    D = np.concatenate([params["layers"][i]["mixer"]["D"] for i in range(3)])
    assert A_log.shape == dt_bias.shape == D.shape == (96,)
    # -A = exp(A_log) ~ U(1, 16).
    neg_a = np.exp(A_log)
    assert neg_a.min() >= 1.0 - 1e-5 and neg_a.max() <= 16.0 + 1e-4
    assert neg_a.min() < 3.0 and neg_a.max() > 13.0  # spread over the range
    # dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1].
    dt = np.asarray(jax.nn.softplus(dt_bias))
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 1e-1 * (1 + 1e-4)
    log_dt = np.log(dt)
    assert log_dt.min() < math.log(3e-3) and log_dt.max() > math.log(3e-2)
    np.testing.assert_array_equal(D, 1.0)
    # Gains are 1, the conv has a bias, and the mask-relevant names are exact.
    mixer = params["layers"][0]["mixer"]
    assert set(mixer) == {"in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"}
    np.testing.assert_array_equal(mixer["norm"]["scale"], 1.0)
    assert mixer["conv1d"]["kernel"].shape == (4, cfg.d_inner + 2 * cfg.d_state)
    assert mixer["conv1d"]["bias"].shape == (cfg.d_inner + 2 * cfg.d_state,)
    assert mixer["in_proj"]["kernel"].shape == (32, 2 * 64 + 2 * 8 + 32)


def test_inverse_softplus_roundtrip():
    y = jnp.geomspace(1e-4, 10.0, 30)
    np.testing.assert_allclose(jax.nn.softplus(ssm.inverse_softplus(y)), y, rtol=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(d_model=16, headdim=5, vocab_size=4), "divisible"),
        (dict(backend="fft", vocab_size=4), "backend"),
        (dict(), "exactly one"),
        (dict(vocab_size=4, input_dim=1), "exactly one"),
        (dict(vocab_size=4, head="pixel"), "head"),
        (dict(vocab_size=4, dt_min=0.2, dt_max=0.1), "dt_min"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        ssm.SSMConfig(**kw)


def test_ssm_dispatch_rejects_unknown_backend():
    x = jnp.zeros((1, 4, 1, 2))
    with pytest.raises(ValueError, match="backend"):
        ssm.ssm(x, x[..., 0], jnp.ones((1,)), x[:, :, 0], x[:, :, 0], backend="cuda")
