"""Block-wise 8-bit quantization: the maps against bitsandbytes, rounding, error bounds,
padding, extreme values."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_decoupled._src import quantization as Q

GOLDEN = np.load(os.path.join(os.path.dirname(__file__), "golden", "bnb_dynamic_maps.npz"))
MAPS = {"signed": True, "unsigned": False}
F32_EPS = float(np.finfo(np.float32).eps)


def _nearest_error(qmap, x):
    """Distance from each normalized x to the nearest map value (float64)."""
    q = np.asarray(qmap, np.float64)
    x = np.asarray(x, np.float64)
    i = np.clip(np.searchsorted(q, x), 1, len(q) - 1)
    return np.minimum(np.abs(q[i] - x), np.abs(q[i - 1] - x))


def test_golden_file_records_bitsandbytes():
    meta = json.loads(str(GOLDEN["meta"]))
    assert meta["bitsandbytes"] and "create_dynamic_map" in meta["maps"]


@pytest.mark.parametrize("name", list(MAPS))
def test_maps_equal_bitsandbytes(name):
    ours = Q.dynamic_map(MAPS[name])
    assert ours.dtype == np.float32 and ours.shape == (256,)
    # Ours is built in float64 and rounded once; bitsandbytes computes in float32.
    np.testing.assert_allclose(ours, GOLDEN[name], rtol=2e-7, atol=0)


@pytest.mark.parametrize("name", list(MAPS))
def test_map_structure(name):
    q = Q.dynamic_map(MAPS[name]).astype(np.float64)
    assert np.all(np.diff(q) > 0) and q[-1] == 1.0 and 0.0 in q
    if name == "unsigned":
        assert q[0] == 0.0  # nothing negative: nu can never read back negative
    else:
        assert q[0] == pytest.approx(-0.99296875) and np.sum(q < 0) == 127
    positive = q[q > 0]
    # Seven decades, finest near the top: 2^(6-E) (signed) or 2^(7-E) (unsigned) per decade.
    extra = 0 if name == "signed" else 1
    for e in range(7):
        in_decade = np.sum((positive < 10.0**-e) & (positive > 10.0 ** -(e + 1)))
        assert in_decade == 2 ** (6 - e + extra)


@pytest.mark.parametrize("name", list(MAPS))
def test_decode_matches_map(name):
    codes = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(
        Q.dequantize_normalized(codes, signed=MAPS[name]), Q.dynamic_map(MAPS[name])
    )


@pytest.mark.parametrize("name", list(MAPS))
def test_codes_are_exactly_nearest(name):
    """The lookup-table encoder returns a nearest code, at every decision point too."""
    signed = MAPS[name]
    q = Q.dynamic_map(signed).astype(np.float64)
    mids = (q[1:] + q[:-1]) / 2
    rng = np.random.default_rng(0)
    lo = -1.0 if signed else 0.0
    mags = 10.0 ** rng.uniform(-10, 0, 50_000)
    x = np.concatenate(
        [
            rng.uniform(lo, 1.0, 50_000),
            mags * (rng.choice([-1.0, 1.0], mags.size) if signed else 1.0),
            q,
            mids,
            np.nextafter(mids.astype(np.float32), np.float32(2)),
            np.nextafter(mids.astype(np.float32), np.float32(-2)),
            [0.0, -0.0, 1.0, lo, 1e-45, -1e-45],
        ]
    ).astype(np.float32)
    x = np.clip(x, lo, 1.0)
    codes = np.asarray(Q.quantize_normalized(jnp.asarray(x), signed=signed))
    err = np.abs(q[codes] - x.astype(np.float64))
    assert np.all(err <= _nearest_error(q, x))
    exact = np.isin(x.astype(np.float64), q)  # a map value gets its own code
    np.testing.assert_array_equal(codes[exact], np.searchsorted(q, x[exact].astype(np.float64)))


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("block", [256, 2048])
def test_never_farther_than_bitsandbytes(name, block):
    """Same blocks and absmax as bitsandbytes; our dequantized values are never farther from
    the input than bitsandbytes' (its CPU kernel is not always nearest)."""
    x = GOLDEN["inputs"]
    if name == "unsigned":
        x = np.abs(x)
    q = Q.quantize(jnp.asarray(x), signed=MAPS[name], block_size=block)
    np.testing.assert_array_equal(q.absmax, GOLDEN[f"absmax.{name}.{block}"])
    ours = np.asarray(Q.dequantize(q, x.shape), np.float64)
    qmap = GOLDEN[name].astype(np.float64)
    absmax = np.repeat(GOLDEN[f"absmax.{name}.{block}"].astype(np.float64), block)
    theirs = qmap[GOLDEN[f"codes.{name}.{block}"]] * absmax
    slack = 4 * F32_EPS * absmax  # float32 products
    assert np.all(np.abs(ours - x) <= np.abs(theirs - x) + slack)
    # Where bitsandbytes did find the nearest value, the codes are the same.
    same = np.asarray(q.codes).reshape(-1) == GOLDEN[f"codes.{name}.{block}"]
    theirs_nearest = np.abs(theirs - x) <= np.abs(ours - x)
    assert np.mean(same[theirs_nearest]) > 0.999


# The measured round-trip bounds, for N(0, 1) data in blocks of 256 (stated in docs/memory.md).
@pytest.mark.parametrize("name", list(MAPS))
def test_roundtrip_error_bound(name):
    signed = MAPS[name]
    qmap = Q.dynamic_map(signed)
    bound = Q.max_roundtrip_error(qmap)
    x = np.asarray(jax.random.normal(jax.random.key(1), (64, 1000)))
    if not signed:
        x = x**2  # a second moment
    q = Q.quantize(jnp.asarray(x), signed=signed)
    back = np.asarray(Q.dequantize(q, x.shape), np.float64)
    absmax = np.repeat(np.asarray(q.absmax, np.float64), 256)[: x.size].reshape(x.shape)
    codes = np.asarray(q.codes).reshape(-1)[: x.size].reshape(x.shape)
    err = np.abs(back - x)
    # Per element: half the gap to the neighbouring map value, times the block's absmax.
    slack = 4 * F32_EPS * absmax  # float32 division and product
    assert np.all(err <= bound[codes] * absmax + slack)
    # Overall: the largest gap of the map is its top bin (0.9/64 signed, 0.9/128 unsigned).
    assert bound.max() == pytest.approx(0.9 / (128 if signed else 256), rel=1e-5)
    rel_to_absmax = err / absmax
    assert rel_to_absmax.max() <= bound.max() + 4 * F32_EPS
    # Relative error of elements not too far below their block's max: at most ~1/(2·n bins).
    big = np.abs(x) > 0.1 * absmax
    assert np.max(err[big] / np.abs(x[big])) < (0.0725 if signed else 0.037)


@pytest.mark.parametrize(
    ("size", "block", "signed", "scale"),
    [
        (1, 256, True, 1.0),
        (100, 7, False, 1e-30),
        (257, 256, True, 1e30),
        (257, 2048, False, 1e-3),
        (3000, 256, False, 1.0),
        (3000, 64, True, 1e-3),
        (4099, 2048, True, 1.0),
    ],
)
def test_padding_does_not_change_results(size, block, signed, scale):
    """An array whose size is not a multiple of B reads back exactly as the same elements
    inside a zero-padded array that is."""
    x = np.random.default_rng(size).standard_normal(size).astype(np.float32) * np.float32(scale)
    if not signed:
        x = np.abs(x)
    padded = np.zeros(Q.num_blocks(size, block) * block, np.float32)
    padded[:size] = x

    @jax.jit
    def roundtrip(v):
        q = Q.quantize(v, signed=signed, block_size=block)
        return q, Q.dequantize(q, v.shape)

    q, back = roundtrip(jnp.asarray(x))
    qp, back_p = roundtrip(jnp.asarray(padded))
    np.testing.assert_array_equal(q.codes, qp.codes)
    np.testing.assert_array_equal(q.absmax, qp.absmax)
    np.testing.assert_array_equal(back, np.asarray(back_p)[:size])
    assert q.codes.shape == (Q.num_blocks(size, block), block) and q.codes.dtype == jnp.uint8
    assert np.all(np.isfinite(back))
    if not signed:
        assert np.all(np.asarray(back) >= 0)


def test_shapes_and_rank():
    x = jnp.arange(2 * 3 * 50, dtype=jnp.float32).reshape(2, 3, 50) - 100
    q = Q.quantize(x, signed=True, block_size=64)
    assert q.codes.shape == (5, 64) and q.absmax.shape == (5,) and q.block_size == 64
    np.testing.assert_allclose(Q.dequantize(q, x), x, rtol=0.08, atol=1.0)
    scalar = Q.quantize(jnp.float32(-3.0), signed=True)
    assert float(Q.dequantize(scalar, ())) == pytest.approx(-3.0 * 0.99296875)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("value", [0.0, 1e-30, 1e-45, 1e30, 3e38, np.inf, -np.inf])
def test_extreme_values_stay_finite(signed, value):
    x = np.full(600, value, np.float32)
    x[::3] = 0.0
    x[1::7] = np.float32(value) * np.float32(1e-3)
    if not signed:
        x = np.abs(x)
    q = jax.jit(lambda v: Q.quantize(v, signed=signed))(jnp.asarray(x))
    back = np.asarray(Q.dequantize(q, x.shape))
    assert np.all(np.isfinite(back)) and np.all(np.isfinite(q.absmax))
    if not signed:
        assert np.all(back >= 0)
    finite = np.isfinite(x)
    if np.all(finite):
        np.testing.assert_allclose(back, x, rtol=0.08, atol=1e-38)
    else:  # ±inf saturates to ±float32.max
        np.testing.assert_array_equal(np.sign(back[~finite]), np.sign(x[~finite]))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n_blocks, size", [(2, 512), (16, 4096), (40, 40 * 256 - 100)])
@pytest.mark.parametrize("where", ["first", "middle", "last", "all"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_nan_makes_its_block_nan(signed, n_blocks, size, where, dtype):
    """A NaN anywhere in a block makes that block's absmax and every value NaN, and nothing
    else: XLA:CPU's vectorized float max drops NaNs (from 16 blocks on it gave 1.0 or -inf),
    so the absmax is taken on the bit patterns (a NaN read back as finite or -inf would let
    a NaN gradient pass unnoticed, or make nu negative)."""
    x = np.linspace(0.01, 1.0, size).astype(np.float32)
    block = n_blocks // 2
    lo, hi = block * 256, min((block + 1) * 256, size)
    index = {"first": [lo], "middle": [lo + 100], "last": [hi - 1], "all": range(lo, hi)}[where]
    x[list(index)] = np.nan
    q = jax.jit(lambda v: Q.quantize(v, signed=signed))(jnp.asarray(x, dtype))
    absmax = np.asarray(q.absmax)
    assert q.codes.shape[0] == n_blocks
    assert np.isnan(absmax[block]) and np.all(np.isfinite(np.delete(absmax, block)))
    back = np.asarray(Q.dequantize(q, x.shape))
    assert np.all(np.isnan(back[lo:hi]))
    others = np.concatenate([back[:lo], back[hi:]])
    assert np.all(np.isfinite(others)) and np.all(others >= 0)


def test_zero_block_has_zero_absmax_and_zero_values():
    q = Q.quantize(jnp.zeros(512), signed=True)
    np.testing.assert_array_equal(q.absmax, 0.0)
    np.testing.assert_array_equal(Q.dequantize(q, (512,)), 0.0)


def test_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        Q.quantize(jnp.ones(4), signed=True, block_size=0)


def test_quantized_array_is_a_pytree_with_static_signedness():
    q = Q.quantize(jnp.ones(300), signed=False, block_size=128)
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 2
    again = jax.tree.unflatten(treedef, leaves)
    assert again.signed is False
    doubled = jax.jit(lambda q: jax.tree.map(lambda a: a, q))(q)
    assert doubled.signed is False
