"""The compiled CPU kernel for 8-bit moment updates (`optax_decoupled.cpu_kernel`).

References: a NumPy float32 implementation of dequantize -> moving averages -> block absmax
-> nearest code (the formula as written, multiplies and adds rounded separately, codes from
the lookup tables of `quantization._tables`), which the kernel must match bit for bit; and
XLA's own program (`quantize_blocks`) for the encoder alone, on every float32 near every
decision point of both maps.
"""

import logging
import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_decoupled as od
from optax_decoupled import cpu_kernel
from optax_decoupled import quantization as Q
from optax_decoupled import storage as storage_lib
from optax_decoupled.moment_updates import AdamDirection, EmaMoments
from optax_decoupled.storage import BlockwiseInt8Storage

try:
    from tests import kernel_checks as K
except ImportError:  # tests/ itself is on sys.path (pytest's rootdir-less "prepend" import)
    import kernel_checks as K

NO_KERNEL, OUTPUTS, entry_copies, needs_kernel = (
    K.NO_KERNEL, K.OUTPUTS, K.entry_copies, K.needs_kernel
)  # fmt: skip


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The kernel is a CPU kernel: on a machine with an accelerator these tests still run
    their programs on the CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(params=cpu_kernel.decode_paths())
def kernel_path(request, monkeypatch):
    """Each of the kernel's decodes and encoders that this CPU runs
    (`cpu_kernel.decode_paths`; see `test_avx512_is_used_where_the_cpu_has_it`): the AVX-512
    VBMI byte permutes (``best``, on CPUs with VBMI), the AVX-512F register permutes, the
    AVX2 loads (on every CPU with AVX2, those with AVX-512 included) and the portable loops,
    each with its encoder. A path the CPU cannot run is not a case here: it would run the
    next one down again."""
    monkeypatch.setattr(cpu_kernel, "DECODE", request.param)
    return request.param


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_is_zen1() -> bool:
    """An AMD Zen 1 (family 17h, models below 30h) by /proc/cpuinfo, where the kernel keeps
    its portable loops rather than AVX2 (csrc/requantize_cpu.cc, CpuHasAvx2)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's fields
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return False
    return (
        fields.get("vendor_id") == "AuthenticAMD"
        and fields.get("cpu family") == "23"
        and int(fields.get("model", "0")) < 0x30
    )


@needs_kernel
def test_the_library_was_built_from_this_source():
    """The loaded library records the SHA-256 of `csrc/requantize_cpu.cc` it was compiled
    from, and it is that of the file as it is: the extension is optional, so a change that
    fails to compile leaves the previous library in place, and every other test here would
    run that one. Skipped where the package has no source next to it (a wheel install)."""
    if not cpu_kernel.SOURCE.is_file():
        pytest.skip("no csrc/requantize_cpu.cc next to the package (a wheel install)")
    assert cpu_kernel.built_source_sha256() not in (None, "unknown")
    assert cpu_kernel.source_matches_build() is True, (
        "the kernel library is stale: rebuild it (pip install --no-deps -e .) and read the "
        "compiler's output"
    )


@needs_kernel
def test_a_changed_source_is_told_apart(tmp_path):
    """`source_matches_build` compares the recorded hash with a source file's: another
    file's content gives False, a missing file None (nothing to tell)."""
    assert cpu_kernel.built_source_sha256() not in (None, "unknown")
    other = tmp_path / "requantize_cpu.cc"
    other.write_text("// not the kernel\n")
    assert cpu_kernel.source_matches_build(other) is False
    assert cpu_kernel.source_matches_build(tmp_path / "missing.cc") is None


@needs_kernel
def test_avx512_is_used_where_the_cpu_has_it():
    """The kernel's run-time choice of the AVX-512 decode follows the CPU, as Linux reports
    its flags in /proc/cpuinfo (skipped where there is no such file)."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no CPU flags in /proc/cpuinfo: nothing to compare the choice with")
    assert cpu_kernel.uses_avx512() == ("avx512f" in flags)
    vbmi = {"avx512f", "avx512bw", "avx512vbmi", "avx512_vbmi2"} <= flags
    assert cpu_kernel.uses_avx512_vbmi() == vbmi
    avx2 = "avx2" in flags and not _cpu_is_zen1()
    assert cpu_kernel.uses_avx2() == (avx2 and "avx512f" not in flags)
    expected = [("best", vbmi), ("avx512f", "avx512f" in flags), ("avx2", avx2)]
    assert cpu_kernel.decode_paths() == (*(p for p, has in expected if has), "portable")


def test_kernel_is_built():
    """The test command builds the package from source with a C++ compiler, so the kernel
    must be there (a silently missing kernel would leave the XLA loop everywhere)."""
    if NO_KERNEL:
        assert not cpu_kernel.available()
        return
    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()


@needs_kernel
def test_kernel_ffi_api_version_matches_the_running_jaxlib():
    """The loader refuses a library compiled against a newer XLA FFI API than the running
    jaxlib's (registering it would take the CPU backend down); the test command builds the
    kernel against the installed jax, so the two versions are equal here."""
    import ctypes

    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
    lib = ctypes.CDLL(str(cpu_kernel._library_path()))
    running = cpu_kernel._jaxlib_ffi_api_version()
    assert running is not None, "the FFI header of the installed jaxlib could not be read"
    assert cpu_kernel._ffi_api_version(lib) == running


@pytest.mark.parametrize(
    "built, running, ok",
    [
        ((0, 3), (0, 3), True),
        ((0, 2), (0, 3), True),  # older minor: accepted by XLA
        ((0, 4), (0, 3), False),  # newer minor: the CPU backend would fail to start
        ((1, 0), (0, 9), False),
        ((0, 1), (1, 1), False),
        ((0, 9), None, True),  # header unreadable: assumed compatible
    ],
)
def test_ffi_api_compatibility_rule(built, running, ok):
    assert cpu_kernel.ffi_api_compatible(built, running) is ok


@needs_kernel
def test_an_incompatible_kernel_is_refused_with_its_reason():
    """With the running jaxlib's FFI API taken as a newer major version, the loader refuses
    the library (registering it could take the CPU backend down) and says how to rebuild it;
    the 8-bit step then runs XLA's program. In a subprocess: a refused library stays refused."""
    code = (
        "import warnings, jax.numpy as jnp, optax_decoupled as od\n"
        "from optax_decoupled import cpu_kernel as k\n"
        "k._jaxlib_ffi_api_version = lambda: (99, 0)\n"
        "assert not k.available()\n"
        "print(k.unavailable_reason())\n"
        "tx = od.adamw(1e-3, state_dtype=od.BlockwiseInt8Storage(min_size=0))\n"
        "p = {'w': jnp.ones((4, 300))}\n"
        "with warnings.catch_warnings():\n"
        "    warnings.simplefilter('ignore')\n"
        "    u, s = tx.update(p, tx.init(p), p)\n"
        "print(bool(jnp.all(jnp.isfinite(u['w']))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "which the installed jaxlib's FFI API 99.0 cannot load" in out
    assert "--no-build-isolation" in out
    assert out.strip().endswith("True")


# --- NumPy reference ----------------------------------------------------------------------


def _np_encode(y, signed):
    """Codes of float32 values y in the map's range: `quantize_normalized` in NumPy."""
    t = Q._tables(signed)
    y = np.asarray(y, np.float32)
    bits = y.view(np.uint32)
    neg = (bits >> 31).astype(np.int64)
    mag = bits & np.uint32(0x7FFFFFFF)
    n = t.code_pair.shape[1]
    index = np.minimum((mag >> t.shift).astype(np.int64), n - 1) + neg * n
    below = (t.code_pair.reshape(-1) & 0xFF)[index]
    above = mag.view(np.float32) > t.threshold.reshape(-1)[index]
    return (below + np.where(above, 1 - 2 * neg, 0)).astype(np.uint8)


def _np_quantize_blocks(x, signed):
    """`quantize_blocks` in NumPy float32 (true division, as the formula is written)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        absmax = np.max(np.abs(x), axis=-1)
        absmax = np.where(np.isnan(absmax), absmax, np.minimum(absmax, np.finfo(np.float32).max))
        factor = np.where(absmax > 2.0**100, 2.0**-64, np.where(absmax < 2.0**-100, 2.0**64, 1.0))
        factor = factor.astype(np.float32)
        scale = np.where(absmax > 0, absmax * factor, np.float32(1)).astype(np.float32)
        y = (x * factor[:, None]) / scale[:, None]
        lo = np.float32(-1 if signed else 0)
        y = np.where(np.isnan(y), y, np.minimum(np.maximum(y, lo), np.float32(1)))
    return _np_encode(y, signed), absmax.astype(np.float32)


def _np_update(update, stored, g, size):
    """The kernel's computation in NumPy float32: per block, dequantize, average, requantize."""
    _, new = _np_moments(update, stored, g, size)
    return [_np_quantize_blocks(v, q.signed) for v, q in zip(new, stored, strict=True)]


def _np_moments(update, stored, g, size):
    """``(old, new)``: the dequantized moments and the averaged ones, in the block layout."""
    g = np.asarray(g, np.float32).reshape(-1)
    n_blocks, block = stored[0].codes.shape
    g = np.pad(g, (0, n_blocks * block - size)).reshape(n_blocks, block)
    valid = (np.arange(n_blocks * block) < size).reshape(n_blocks, block)
    old = [
        Q.dynamic_map(q.signed)[np.asarray(q.codes)] * np.asarray(q.absmax)[:, None] for q in stored
    ]
    new = []
    with np.errstate(invalid="ignore", over="ignore"):
        for beta, power, m in zip(update.decays, update.powers, old, strict=False):
            c_in, c_keep = np.float32(1 - beta), np.float32(beta)
            source = g if power == 1 else g * g
            new.append(np.where(valid, (c_in * source) + (c_keep * m), np.float32(0)))
        if update.running_max:
            seen = new[1]
            if update.max_divisor is not None:
                seen = seen / np.float32(update.max_divisor)
            prev = old[2]
            keep = (prev > seen) | np.isnan(prev)
            new.append(np.where(valid, np.where(keep, prev, seen), np.float32(0)))
    return old, new


def _np_output(direction, update, stored, g, size):
    """The transform's output in NumPy float32, as the kernel computes it in its pass:
    Adam's bias corrections as multiplications by their float32 reciprocals (how XLA:CPU
    compiles a division by a scalar), Lion's sign from the old momentum."""
    old, new = _np_moments(update, stored, g, size)
    f32 = np.float32
    gb = np.pad(np.asarray(g, f32).reshape(-1), (0, old[0].size - size)).reshape(old[0].shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if isinstance(direction, AdamDirection):
            n, d = new[0], new[direction.denominator]
            if direction.scales_numerator:
                n = n * (f32(1) / f32(direction.bc1))
            if direction.scales_denominator:
                d = d * (f32(1) / f32(direction.bc2))
            u = n / (np.sqrt(d + f32(direction.eps_root)) + f32(direction.eps))
        else:
            t = f32(1 - direction.b1) * gb + f32(direction.b1) * old[0]
            u = np.where(t > 0, f32(1), np.where(t < 0, f32(-1), t))
    return u.reshape(-1)[:size]


def _assert_equal_to_numpy(got, want):
    for q, (codes, absmax) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(q.absmax), absmax)
        np.testing.assert_array_equal(np.asarray(q.codes), codes)


# --- The encoder --------------------------------------------------------------------------


def _near_every_decision_point(signed, ulps=4096):
    """Every float32 within `ulps` ulps of every decision point of the map, both signs, plus
    0, -0, 1, -1, the smallest values and NaN (the unsigned map clips negative values to 0:
    code 0, also for -0.0, which the AVX-512 encoder keeps negative)."""
    t = Q._tables(signed)
    points = np.unique(t.threshold[np.isfinite(t.threshold)])
    bits = points.view(np.int32)[:, None] + np.arange(-ulps, ulps + 1, dtype=np.int32)[None]
    values = np.unique(bits.reshape(-1)).view(np.float32)
    values = values[(values >= 0) & (values <= 1)]
    extra = np.array([0.0, 1.0, 1e-45, 1e-38, 1e-7, np.nan], np.float32)
    values = np.concatenate([values, extra])
    return np.concatenate([values, -values, [-0.0]]).astype(np.float32)


def _kernel_and_xla_encode(x, signed):
    """``(kernel, XLA)``: the blocks ``x`` (n_blocks, B) quantized by the kernel, as the new
    moment of an average with beta = 0 (the "gradient" itself), and by `quantize_blocks`."""
    n_blocks, block = x.shape
    zeros = Q.QuantizedArray(
        jnp.full((n_blocks, block), Q._tables(signed).code_pair[0, 0] & 0xFF, jnp.uint8),
        jnp.zeros((n_blocks,), jnp.float32),
        signed,
    )
    (got,) = jax.jit(lambda q, g: cpu_kernel.requantize_ema(EmaMoments((0.0,), (1,)), (q,), g))(
        zeros, jnp.asarray(x.reshape(-1))
    )
    want = jax.jit(lambda v: Q.quantize_blocks(v, signed=signed))(jnp.asarray(x))
    return got, want


@needs_kernel
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_encoder_equals_the_table_lookup_near_every_decision_point(signed, kernel_path):
    """Blocks whose absmax is 1 (one element is 1.0), so that x / absmax = x exactly and the
    codes are those of the normalized values; compared with XLA's table lookup
    (`quantize_blocks`) and with the NumPy one. Every encoder: the AVX-512 one (an explicit
    gather) and the portable loop."""
    values = _near_every_decision_point(signed)
    block = 256
    per_block = block - 1
    n_blocks = -(-values.size // per_block)
    padded = np.zeros(n_blocks * per_block, np.float32)
    padded[: values.size] = values
    x = np.concatenate([np.ones((n_blocks, 1), np.float32), padded.reshape(n_blocks, -1)], 1)
    got, want = _kernel_and_xla_encode(x, signed)
    nan_blocks = np.isnan(x).any(axis=1)
    np.testing.assert_array_equal(np.asarray(got.absmax)[~nan_blocks], 1.0)
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.codes), _np_encode(x, signed))


def _encoder_edge_blocks(signed, block=256):
    """Blocks that take the encoders' less common paths: absmax above 2**100 and below
    2**-100 (the division by a rescaled absmax); a NaN with values just above 1 (scale 1:
    (1, 1 + 2**-7) shares 1's top 16 bits, above it the clip), +-inf; values below the map's
    first octave with entries at every exponent down to 0, with random mantissas, and again
    with mantissas of all ones (the VBMI encoder's key then equals the 0xffff of the entry
    it reads them in: the AVX-512 encoder decides); for the
    unsigned map, negative values (clipped to 0)."""
    rng = np.random.default_rng(7)
    f32 = np.float32
    normal = rng.standard_normal((2, block)).astype(f32)
    base = normal if signed else np.abs(normal)
    near_one = f32(1) + np.arange(block, dtype=f32) * f32(2.0**-12)  # 1 to 1.0623
    nan_block = near_one.copy()
    nan_block[3] = np.nan
    inf_block = base[0].copy()
    inf_block[[5, 77]] = [np.inf, -np.inf if signed else np.inf]
    exponents = (np.arange(block) % 110).astype(np.uint32)  # |y| from 2**-127 (and 0) to 2**-18
    tiny_ones = (exponents << 23 | np.uint32(0x7FFFFF)).view(f32)
    tiny = (exponents << 23 | rng.integers(0, 2**23, block, dtype=np.uint32)).view(f32)
    tiny_ones[0] = tiny[0] = 1.0  # absmax 1: the values are |y| themselves
    blocks = [
        base[0] * f32(2.0**110),
        base[1] * f32(2.0**-110),
        nan_block,
        inf_block,
        tiny,
        tiny_ones,
    ]
    if signed:
        blocks += [-nan_block, -tiny, np.where(np.arange(block) % 3 == 0, -1, 1) * tiny]
    else:
        blocks += [normal[0], np.where(np.arange(block) % 2 == 0, f32(-0.0), base[1])]
    return np.stack(blocks).astype(f32)


@needs_kernel
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_encoder_on_rescaled_clipped_and_tiny_blocks(signed, kernel_path):
    """The codes of `_encoder_edge_blocks` equal XLA's `quantize_blocks` (and the NumPy
    reference's) on every decode and encoder path, the absmax too where it is not NaN."""
    x = _encoder_edge_blocks(signed)
    got, want = _kernel_and_xla_encode(x, signed)
    np.testing.assert_array_equal(np.asarray(got.absmax), np.asarray(want.absmax))
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.codes), _np_quantize_blocks(x, signed)[0])


# --- The whole update ---------------------------------------------------------------------


def _state(shape, block, key):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(key), 4)
    mu = Q.quantize(0.1 * jax.random.normal(k1, shape), signed=True, block_size=block)
    nu = Q.quantize(jax.random.uniform(k2, shape) ** 4, signed=False, block_size=block)
    nu_max = Q.quantize(jax.random.uniform(k3, shape) ** 3, signed=False, block_size=block)
    size = int(np.prod(shape))
    g = jax.random.normal(k4, shape) * jnp.logspace(-6, 1, size).reshape(shape)
    return mu, nu, nu_max, g


UPDATES = {
    "adam": (EmaMoments((0.9, 0.999), (1, 2)), 2),
    "amsgrad": (EmaMoments((0.9, 0.999), (1, 2), running_max=True), 3),
    "amsgrad-divided": (
        EmaMoments((0.9, 0.999), (1, 2), running_max=True, max_divisor=0.0123),
        3,
    ),
    "lion": (EmaMoments((0.99,), (1,)), 1),
}


@needs_kernel
@pytest.mark.parametrize("name", sorted(UPDATES))
@pytest.mark.parametrize(
    "shape, block",
    [
        ((300, 1001), 256),  # ragged: the last block is padded; several threads' tasks
        ((64, 1024), 2048),  # the paper's block size
        ((100,), 256),  # one padded block
        ((37, 53), 100),  # a block size that is not a multiple of 16 (the AVX-512 tail)
        ((15, 64), 256),  # the last block's 192 elements whole 64s: a tail of padding only
    ],
)
def test_update_equals_numpy(name, shape, block, kernel_path):
    update, k = UPDATES[name]
    mu, nu, nu_max, g = _state(shape, block, key=len(name))
    stored = (mu, nu, nu_max)[:k]
    got = jax.jit(lambda s, g: cpu_kernel.requantize_ema(update, s, g))(stored, g)
    _assert_equal_to_numpy(got, _np_update(update, stored, g, int(np.prod(shape))))


@needs_kernel
@pytest.mark.parametrize("name", sorted(UPDATES))
@pytest.mark.parametrize("shape, block", [((300, 1001), 256), ((37, 53), 100), ((15, 64), 256)])
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_emit_old_copies_the_stored_moments(name, shape, block, donate, kernel_path):
    """With `emit_old` the kernel also returns a copy of the moments it read (what the
    transforms compute their output from) and writes the new ones in place: the copy equals
    the stored moments bit for bit, and the new ones equal the NumPy reference, whether the
    stored moments are donated (updated in their own buffers) or not."""
    update, k = UPDATES[name]
    mu, nu, nu_max, g = _state(shape, block, key=len(name) + 1)
    stored = (mu, nu, nu_max)[:k]
    before = jax.tree.map(np.array, stored)
    want = _np_update(update, stored, g, int(np.prod(shape)))
    step = jax.jit(
        lambda s, g: cpu_kernel.requantize_ema(update, s, g, emit_old=True),
        donate_argnums=(0,) if donate else (),
    )
    got, old = step(stored, g)
    _assert_equal_to_numpy(got, want)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, old), before)
    if not donate:
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, stored), before)


@needs_kernel
@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("shape, block", [((300, 1001), 256), ((37, 53), 100), ((100,), 256)])
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_output_equals_numpy(name, shape, block, donate, kernel_path):
    """With `output` the kernel also computes the transform's output in its pass (the
    gradient's buffer is donated, as a gradient computed in the step is, or not): the output
    equals the NumPy reference bit for bit, and so do the new moments."""
    update_name, direction = OUTPUTS[name]
    update, k = UPDATES[update_name]
    mu, nu, nu_max, g = _state(shape, block, key=len(name) + 2)
    stored = (mu, nu, nu_max)[:k]
    size = int(np.prod(shape))
    want_moments = _np_update(update, stored, g, size)
    want_u = _np_output(direction, update, stored, g, size).reshape(shape)
    got, u = K.call_with_output(
        lambda s, g: cpu_kernel.requantize_ema(update, s, g, output=direction), stored, g, donate
    )
    _assert_equal_to_numpy(got, want_moments)
    np.testing.assert_array_equal(np.asarray(u), want_u)


@needs_kernel
def test_output_with_traced_coefficients_and_vmap():
    """Coefficients as traced float32 scalars (`inject_hyperparams`, the bias corrections
    from the step count) and a vmapped kernel: the same bits as the NumPy reference."""
    update, _ = UPDATES["adam"]
    shape, block = (4, 40, 64), 256
    parts = [_state(shape[1:], block, key=10 + i) for i in range(shape[0])]
    mu, nu, g = (jax.tree.map(lambda *x: jnp.stack(x), *[p[i] for p in parts]) for i in (0, 1, 3))

    def one(mu, nu, g, bc1, bc2):
        out = AdamDirection(bc1, bc2, 1e-8, 0.0)
        return cpu_kernel.requantize_ema(update, (mu, nu), g, output=out)

    direction = OUTPUTS["adam"][1]
    bc1, bc2 = direction.bc1, direction.bc2
    got, u = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None, None)))(mu, nu, g, bc1, bc2)
    for i, p in enumerate(parts):
        size = int(np.prod(shape[1:]))
        want = _np_output(direction, update, (p[0], p[1]), p[3], size).reshape(shape[1:])
        np.testing.assert_array_equal(np.asarray(u[i]), want)
        _assert_equal_to_numpy(
            jax.tree.map(lambda x, i=i: x[i], got), _np_update(update, (p[0], p[1]), p[3], size)
        )


@needs_kernel
def test_extreme_values_equal_numpy(kernel_path):
    """Zeros, tiny and huge gradients, +-inf and NaN in their own blocks and mixed."""
    block = 256
    pieces = [
        np.zeros(block),
        np.full(block, 1e-30),
        np.full(block, 1e30),
        np.full(block, 1e-45),
        np.r_[np.inf, -np.inf, np.ones(block - 2)],
        np.r_[np.nan, np.ones(block - 1)],
        np.linspace(-1e20, 1e-20, block),
    ]
    g = jnp.asarray(np.concatenate(pieces).astype(np.float32))
    shape = g.shape
    mu, nu, nu_max, _ = _state(shape, block, key=3)
    update, k = UPDATES["amsgrad"]
    stored = (mu, nu, nu_max)[:k]
    got = jax.jit(lambda s, g: cpu_kernel.requantize_ema(update, s, g))(stored, g)
    want = _np_update(update, stored, g, g.size)
    for q, (codes, absmax) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(q.absmax), absmax)  # NaN == NaN here
        finite = np.isfinite(absmax)
        np.testing.assert_array_equal(np.asarray(q.codes)[finite], codes[finite])
    assert np.all(np.asarray(Q.dequantize(got[1], shape))[: -2 * block] >= 0)


@needs_kernel
def test_traced_coefficients_and_vmap():
    """Coefficients as traced arrays (inject_hyperparams) and a vmapped batch of states
    (one kernel call per item) give the per-item NumPy results."""
    shape, block = (40, 300), 256
    parts = [_state(shape, block, key=k) for k in range(3)]
    mu = jax.tree.map(lambda *x: jnp.stack(x), *[p[0] for p in parts])
    nu = jax.tree.map(lambda *x: jnp.stack(x), *[p[1] for p in parts])
    g = jnp.stack([p[3] for p in parts])
    b1 = jnp.float32(0.8)

    def one(mu, nu, g, b1):
        update = EmaMoments((b1, 0.99), (1, 2))
        return cpu_kernel.requantize_ema(update, (mu, nu), g, emit_old=True)

    got, old = jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None)))(mu, nu, g, b1)
    chex.assert_trees_all_equal(old, (mu, nu))
    for i, p in enumerate(parts):
        want = _np_update(
            EmaMoments((np.float32(0.8), 0.99), (1, 2)), (p[0], p[1]), p[3], int(np.prod(shape))
        )
        _assert_equal_to_numpy(jax.tree.map(lambda x, i=i: x[i], got), want)


@needs_kernel
@pytest.mark.parametrize(
    "name, output",
    [
        ("adamw_int8", "own buffer"),
        ("adamw_int8", "old copy"),
        ("lion_int8", "own buffer"),
        ("lion_int8", "old copy"),
        ("adamw_bfloat16", "own buffer"),  # its copy would be as large: always the output
        ("lion_bfloat16", "old copy"),
    ],
)
def test_kernel_calls_of_a_tree_run_in_order(name, output, monkeypatch):
    """The kernel calls of one update run one after another (storage.KernelOrder): each but
    the first takes a result of the previous call as an operand (`n_after = 1`), so XLA
    reuses one leaf's temporaries (the output, or the copy of the old moments) for the next.
    XLA:CPU's scheduler ran all six calls first before, with every leaf's temporaries live
    at once: six times these bounds. The order changes no value: the kernel's results for
    the tree equal those of its leaves updated one at a time, bit for bit."""
    if output == "old copy":
        monkeypatch.setattr(storage_lib, "OUTPUT_BUFFER_MAX_BYTES", 0)
    opt, state_dtype = name.split("_")
    tx = (od.adamw if opt == "adamw" else od.lion)(1e-3, mask=None, state_dtype=state_dtype)
    shape = (300, 1001)
    params = {
        f"w{i}": jnp.cos(jnp.linspace(0.0, 1.0 + i, 300 * 1001)).reshape(shape) for i in range(6)
    }
    params["b"] = jnp.ones(7)  # too small for 8-bit state: XLA's program, outside the order
    grads = jax.tree.map(lambda x: jnp.sin(7.0 * x), params)
    state = tx.init(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    text = compiled.as_text()
    target = cpu_kernel.TARGET if state_dtype == "int8" else cpu_kernel.BF16_TARGET
    calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    n_calls = 6 if state_dtype == "int8" else 7
    assert len(calls) == n_calls
    assert sum("n_after = 1" in c for c in calls) == n_calls - 1
    copy = output == "old copy"
    assert all(("emit_old = 1" in c) == copy and ("out_mode = 0" in c) == copy for c in calls)
    leaf_state = sum(x.nbytes for x in jax.tree.leaves(_leaf_state(state, "w0")))
    one_leaf = params["w0"].nbytes if output == "own buffer" else leaf_state
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.2 * one_leaf + 64 * 1024, (temp, one_leaf)

    tree_u, tree_s = jax.jit(tx.update)(grads, state, params)
    for k in params:
        single = {k: params[k]}
        u, s = jax.jit(tx.update)({k: grads[k]}, tx.init(single), single)
        # XLA's programs (the float32 moments of the bias with 8-bit state; Adam's output
        # from the copy of the old moments) fuse the bias corrections differently in the
        # two programs: an ulp apart. The kernel's results are equal.
        if (k == "b" and state_dtype == "int8") or (output == "old copy" and opt == "adamw"):
            chex.assert_trees_all_close(u[k], tree_u[k], rtol=3e-7, atol=0)
        else:
            chex.assert_trees_all_equal(u[k], tree_u[k])
        if k != "b" or state_dtype != "int8":
            chex.assert_trees_all_equal(_leaf_state(s, k), _leaf_state(tree_s, k))


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_training_step_kernel_calls_are_not_ordered(state_dtype):
    """Where the kernel writes the output in place of a gradient the program computes (a
    training step) it has no temporaries to keep apart, and the calls are not chained: each
    may run as soon as its gradient is there, overlapping the rest of the backward pass."""
    tx = od.adamw(1e-3, mask=None, state_dtype=state_dtype)
    params = {
        f"w{i}": jnp.cos(jnp.linspace(0.0, 1.0 + i, 64 * 100)).reshape(64, 100) for i in range(3)
    }
    x = jnp.linspace(-1.0, 1.0, 8 * 64).reshape(8, 64)

    def train_step(p, s):
        g = jax.grad(lambda p: sum(jnp.sum(jnp.tanh(x @ w)) for w in p.values()))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    text = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state).compile().as_text()
    target = cpu_kernel.TARGET if state_dtype == "int8" else cpu_kernel.BF16_TARGET
    calls = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    assert len(calls) == 3
    assert all("out_mode = 1" in c and "n_after = 0" in c for c in calls), calls


def _leaf_state(state, key):
    """The moments of parameter `key` in an optimizer state (chains of NamedTuples)."""
    found = []
    for part in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dict) and key in x):
        if isinstance(part, dict) and key in part:
            found.append(part[key])
    return found


@needs_kernel
def test_optimizer_uses_the_kernel_on_one_device_only_on_cpu(monkeypatch):
    params = {"w": jnp.ones((300, 1001))}
    tx = od.adamw(1e-3, weight_decay=0.1, mask=None, state_dtype="int8")
    state = tx.init(params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
    assert cpu_kernel.TARGET in compiled.as_text()
    # The gradient is an argument: the kernel writes the new codes and scales in place of the
    # donated ones and the transform's output to a buffer of its own (at most
    # storage.OUTPUT_BUFFER_MAX_BYTES): XLA copies neither the codes nor the gradient, and
    # its temporaries are that output and nothing else.
    text = compiled.as_text()
    assert not entry_copies(text, "u8["), entry_copies(text, "u8[")
    assert not entry_copies(text, "f32["), entry_copies(text, "f32[")
    assert "out_mode = 1" in text and "emit_old = 0" in text
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= params["w"].nbytes + 4096, (temp, params["w"].nbytes)

    # Above that size the kernel writes a copy of the old codes instead, half the output's
    # bytes, from which XLA computes the output, fused into the parameter update: the
    # temporaries are that copy, no float32 array of the parameter's size.
    monkeypatch.setattr(storage_lib, "OUTPUT_BUFFER_MAX_BYTES", params["w"].nbytes - 1)

    def step_above(p, s, g):
        return step(p, s, g)

    compiled = jax.jit(step_above, donate_argnums=(0, 1)).lower(params, state, params).compile()
    text = compiled.as_text()
    assert not entry_copies(text, "u8["), entry_copies(text, "u8[")
    assert not entry_copies(text, "f32["), entry_copies(text, "f32[")
    assert "out_mode = 0" in text and "emit_old = 1" in text
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= state_bytes + 4096, (temp, state_bytes)
    assert temp < params["w"].nbytes

    # The gradient computed in the step (a training step): the kernel computes the output
    # in its pass and writes it in the gradient's buffer, the new codes in place. No copies,
    # no copy of the codes among the temporaries: they are the gradient and nothing else.
    compiled = K.compiled_training_step(step, params, state)
    text = compiled.as_text()
    assert "out_mode = 1" in text and "emit_old = 0" in text
    assert not entry_copies(text, "u8["), entry_copies(text, "u8[")
    assert not entry_copies(text, "f32["), entry_copies(text, "f32[")
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= params["w"].nbytes + 64 * 1024, (temp, params["w"].nbytes)
    for platform in ("cuda", "tpu"):
        lowered = jax.jit(step).trace(params, state, params).lower(lowering_platforms=(platform,))
        assert cpu_kernel.TARGET not in lowered.as_text()
    loop = BlockwiseInt8Storage(cpu_kernel=False)
    off = od.adamw(1e-3, weight_decay=0.1, mask=None, state_dtype=loop)
    text = jax.jit(lambda p, s, g: off.update(g, s, p)).lower(params, off.init(params), params)
    assert cpu_kernel.TARGET not in text.as_text()


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_eager_and_disable_jit_steps(state_dtype):
    """Outside jit the dispatch ran a jit of a new function per call: it recompiled the
    kernel's program on every eager step, and under jax.disable_jit re-entered itself until
    RecursionError. Eager steps (also under disable_jit) now call the kernel directly: the
    same state as the jitted step, updates to float rounding, and no compilation of the
    kernel's program after the first step."""
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)}
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), params)
    tx = od.adamw(1e-3, mask=None, state_dtype=state_dtype)
    state = tx.init(params)
    want_u, want_s = jax.jit(tx.update)(grads, state, params)
    with jax.disable_jit():
        got = tx.update(grads, state, params)
    eager = tx.update(grads, state, params)
    for u, s in (got, eager):
        chex.assert_trees_all_equal(s, want_s)
        np.testing.assert_allclose(u["w"], want_u["w"], rtol=1e-6, atol=1e-9)
    calls = cpu_kernel.calls_compiled()
    compiled = []
    with jax.log_compiles():
        handler = _ListHandler(compiled)
        logging.getLogger("jax").addHandler(handler)
        try:
            for _ in range(2):
                _, state = tx.update(grads, state, params)
        finally:
            logging.getLogger("jax").removeHandler(handler)
    kernel_programs = [m for m in compiled if "integer_pow" not in m]  # b**count, eager
    assert not kernel_programs, kernel_programs
    assert cpu_kernel.calls_compiled() == calls


class _ListHandler(logging.Handler):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def emit(self, record):
        if "Finished XLA compilation" in record.getMessage():
            self.out.append(record.getMessage())


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_differentiating_through_the_update(state_dtype):
    """Meta-gradients through optimizer steps (w.r.t. the learning rate and b1, injected)
    work with the kernels' storages: the kernels themselves have no derivatives, so the
    derivative is XLA's program's (the storage with ``cpu_kernel=False``), while the values
    are still computed by the kernel (to float32 rounding the step's that is not
    differentiated: XLA fuses the rest of a differentiated program differently, which moves
    parameters by an ulp with float32 state too)."""
    storages = {
        "int8": (BlockwiseInt8Storage(), BlockwiseInt8Storage(cpu_kernel=False)),
        "bfloat16": (
            od.FloatStorage(jnp.bfloat16, "bfloat16"),
            od.FloatStorage(jnp.bfloat16, "bfloat16", cpu_kernel=False),
        ),
    }[state_dtype]
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 100).reshape(64, 100)}  # quantized (> 4096)

    def meta(hp, storage):
        tx = optax.inject_hyperparams(od.adamw)(
            learning_rate=hp["lr"], b1=hp["b1"], state_dtype=storage
        )
        p, state = params, tx.init(params)
        for _ in range(3):
            u, state = tx.update(jax.tree.map(jnp.sin, p), state, p)
            p = optax.apply_updates(p, u)
        return sum(jnp.sum(x**2) for x in jax.tree.leaves(p)), p

    hp = {"lr": jnp.float32(0.05), "b1": jnp.float32(0.8)}
    kernel, xla = storages
    grad = jax.jit(jax.grad(meta, has_aux=True), static_argnums=1)
    calls = cpu_kernel.calls_compiled()
    (g_kernel, p_kernel), (g_xla, _) = grad(hp, kernel), grad(hp, xla)
    assert cpu_kernel.calls_compiled() > calls  # the kernel computed the values
    chex.assert_trees_all_close(g_kernel, g_xla, rtol=1e-4)
    assert all(np.isfinite(v) and v != 0 for v in jax.tree.leaves(g_kernel))
    plain = jax.jit(meta, static_argnums=1)(hp, kernel)[1]
    chex.assert_trees_all_close(p_kernel, plain, rtol=0, atol=2.5e-7)
    tangent = jax.jvp(lambda lr: meta({**hp, "lr": lr}, kernel)[0], (hp["lr"],), (1.0,))[1]
    np.testing.assert_allclose(tangent, g_kernel["lr"], rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda")], ids=["cpu", "cpu+cuda"])
def test_exported_programs_use_the_loop(platforms):
    """A step serialized with jax.export carries no call of the kernel (it may run where the
    kernel is not registered, and jax.export refuses such custom calls): it computes what
    the same step with `cpu_kernel=False` computes, while the jitted step calls the kernel."""
    params = {"w": jnp.linspace(-1.0, 1.0, 300 * 1001).reshape(300, 1001)}
    grads = {"w": jnp.cos(37.0 * params["w"])}

    def make(storage):
        tx = od.adamw(1e-2, weight_decay=0.1, mask=None, state_dtype=storage)

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return tx, jax.jit(step)

    tx, step = make("int8")
    state = tx.init(params)
    assert cpu_kernel.TARGET in step.lower(params, state, grads).as_text()
    exported = jax.export.export(step, platforms=platforms)(params, state, grads)
    assert cpu_kernel.TARGET not in exported.mlir_module()
    loop_tx, loop_step = make(BlockwiseInt8Storage(cpu_kernel=False))
    p, s = params, state
    lp, ls = params, loop_tx.init(params)
    for _ in range(3):
        p, s = exported.call(p, s, grads)
        lp, ls = loop_step(lp, ls, grads)
    chex.assert_trees_all_equal(p, lp)
    chex.assert_trees_all_equal(s, ls)


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_programs_lowered_for_several_platforms_use_the_loop(state_dtype):
    """A step lowered for a GPU and the CPU at once (``lowering_platforms``) may be compiled
    where the kernel is not registered: its CPU branch takes XLA's program, as for
    jax.export; lowered for the CPU alone it calls the kernel."""
    storage = BlockwiseInt8Storage(min_size=0) if state_dtype == "int8" else state_dtype
    tx = od.adamw(1e-3, state_dtype=storage)
    params = {"w": jnp.ones((64, 128), jnp.float32)}
    traced = jax.jit(tx.update).trace(params, tx.init(params), params)
    targets = (cpu_kernel.TARGET, cpu_kernel.BF16_TARGET)
    cpu_only = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert any(t in cpu_only for t in targets)
    for platforms in [("cuda", "cpu"), ("cpu", "cuda")]:
        text = traced.lower(lowering_platforms=platforms).as_text()
        assert not any(t in text for t in targets), platforms


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_closed_over_state_lowered_for_a_gpu_has_no_kernel(state_dtype):
    """A jitted function that closes over concrete CPU arrays traces them as constants: the
    choice of program is still made per lowering platform, not by where those arrays are."""
    storage = BlockwiseInt8Storage(min_size=0) if state_dtype == "int8" else state_dtype
    tx = od.adamw(1e-3, weight_decay=0.1, state_dtype=storage)
    cpu0 = jax.devices("cpu")[0]
    params = {"w": jax.device_put(jnp.ones((64, 128), jnp.float32), cpu0)}
    grads = {"w": jax.device_put(jnp.full((64, 128), 0.01, jnp.float32), cpu0)}
    state = tx.init(params)
    traced = jax.jit(lambda: tx.update(grads, state, params)).trace()
    targets = (cpu_kernel.TARGET, cpu_kernel.BF16_TARGET)
    assert any(t in traced.lower(lowering_platforms=("cpu",)).as_text() for t in targets)
    for platforms in [("cuda",), ("cpu", "cuda")]:
        text = traced.lower(lowering_platforms=platforms).as_text()
        assert not any(t in text for t in targets), platforms


def test_encoder_table_layout():
    """The packed table holds the lookup table of quantize_normalized from `first` on; every
    entry dropped below it equals entry `first`."""
    for signed in (True, False):
        t = Q._tables(signed)
        table = cpu_kernel.encoder_table(signed)
        shift, first, n, sgn = table[:4]
        assert shift == t.shift and n == t.code_pair.shape[1] - first and sgn == int(signed)
        entries = table[8:].reshape(2, n)
        np.testing.assert_array_equal(entries & 0xFF, t.code_pair[:, first:] & 0xFF)
        assert np.all((t.code_pair[:, :first] & 0xFF) == (t.code_pair[:, first : first + 1] & 0xFF))


@needs_kernel
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_vbmi_encoder_holds_both_maps_tables(signed):
    """The VBMI encoder (byte permutes of a table of at most 256 entries, built in the kernel
    from `encoder_table`) accepts both maps' tables, so that on CPUs with AVX-512 VBMI the
    `best` case of `test_encoder_equals_the_table_lookup_near_every_decision_point` runs it
    (the kernel would silently keep the gather for a table it cannot hold). A table whose
    entries stop short of 1.0 is refused."""
    import ctypes

    lib = ctypes.CDLL(str(cpu_kernel._library_path()))
    lib.OdByteTableAccepted.restype = ctypes.c_int
    lib.OdByteTableAccepted.argtypes = [ctypes.c_void_p, ctypes.c_int64]

    def accepted(table):
        table = np.ascontiguousarray(table, np.int32)
        return lib.OdByteTableAccepted(table.ctypes.data, table.size)

    table = cpu_kernel.encoder_table(signed)
    if accepted(table) == -1:
        pytest.skip("the kernel has no AVX-512 code on this platform (not x86-64)")
    assert accepted(table) == 1
    shift, first, n = (int(v) for v in table[:3])
    cut = n - 64  # drop the top 64 entries of each side
    short = np.concatenate([[shift, first, cut, table[3], 0, 0, 0, 0],
                            table[8 : 8 + cut], table[8 + n : 8 + n + cut]])  # fmt: skip
    assert accepted(short) == 0


@needs_kernel
def test_inside_shard_map_the_loop_is_used():
    """The experiments train grids of configurations with a shard_map over devices; there
    the update takes XLA's loop (its results carry shard_map's manual-axis types), and
    equals the single-device run, which calls the kernel, up to float32 rounding."""
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("configs",))
    tx = od.adamw(1e-2, weight_decay=0.1, mask=None, state_dtype=BlockwiseInt8Storage(min_size=0))

    def train(p):
        s = tx.init(p)
        for i in range(3):
            u, s = tx.update(jnp.sin(p * (i + 1.0)), s, p)
            p = optax.apply_updates(p, u)
        return p

    batch = jnp.stack([jnp.linspace(-1, 1, 8 * 512).reshape(8, 512) * k for k in (1, 2)])
    sharded = jax.jit(
        jax.shard_map(jax.vmap(train), mesh=mesh, in_specs=P("configs"), out_specs=P("configs"))
    )
    # calls_compiled() counts the kernel calls lowered (what the report records).
    before = cpu_kernel.calls_compiled()
    assert cpu_kernel.TARGET not in sharded.lower(batch).as_text()
    assert cpu_kernel.calls_compiled() == before
    single = jax.jit(jax.vmap(train))
    assert cpu_kernel.TARGET in single.lower(batch).as_text()
    assert cpu_kernel.calls_compiled() == before + 3  # one per step (both moments)
    np.testing.assert_allclose(sharded(batch), single(batch), rtol=0, atol=1e-6)


def _kernel_warnings(records) -> list:
    return [w for w in records if "kernel" in str(w.message) and w.category is RuntimeWarning]


def test_without_the_extension_the_xla_loop_is_used(monkeypatch):
    """A package built without a C++ compiler has no extension: `available()` is False with
    a reason, and 8-bit optimizers run XLA's loop."""
    monkeypatch.setattr(cpu_kernel, "_library_path", lambda: None)
    monkeypatch.setattr(cpu_kernel, "_warned", False)
    cpu_kernel._register.cache_clear()
    try:
        assert not cpu_kernel.available()
        assert "not built" in cpu_kernel.unavailable_reason()
        params = {"w": jnp.ones((600, 256))}  # 600 blocks: more than one chunk of the loop
        tx = od.adamw(1e-2, weight_decay=0.1, mask=None, state_dtype="int8")
        state = tx.init(params)
        step = jax.jit(lambda p, s: tx.update(jax.tree.map(jnp.sin, p), s, p))
        if jax.default_backend() == "cpu":  # the user is told, once, and why
            with pytest.warns(RuntimeWarning, match="kernel .* is unavailable .*not built"):
                lowered = step.lower(params, state).as_text()
            with warnings.catch_warnings(record=True) as again:  # a new trace: once is enough
                warnings.simplefilter("always")
                jax.jit(lambda p, s: tx.update(p, s, p)).lower(params, state)
            assert not _kernel_warnings(again)
        else:
            lowered = step.lower(params, state).as_text()
        assert cpu_kernel.TARGET not in lowered
        assert "stablehlo.while" in lowered
        updates, _ = step(params, state)
        assert np.all(np.isfinite(np.asarray(updates["w"])))
        # Choosing the loop explicitly is not warned about.
        monkeypatch.setattr(cpu_kernel, "_warned", False)
        explicit = od.adamw(
            1e-2, weight_decay=0.1, mask=None, state_dtype=od.BlockwiseInt8Storage(cpu_kernel=False)
        )
        with warnings.catch_warnings(record=True) as chosen:
            warnings.simplefilter("always")
            jax.jit(lambda p, s: explicit.update(p, s, p)).lower(params, explicit.init(params))
        assert not _kernel_warnings(chosen)
    finally:
        monkeypatch.undo()
        cpu_kernel._register.cache_clear()
    assert cpu_kernel.available() or NO_KERNEL


# --- The output in the kernel, in training steps, under Optax's wrappers ---------------------


def _wrapped(name, storage):
    """An 8-bit optimizer under one of Optax's wrappers, every tensor quantized."""
    if name == "lion":
        return od.lion(1e-4, weight_decay=0.3, mask=None, state_dtype=storage)
    make = {
        "adamw": lambda: od.adamw(1e-3, weight_decay=0.1, state_dtype=storage),
        "inject_hyperparams": lambda: optax.inject_hyperparams(od.adamw)(
            learning_rate=1e-3, b1=0.8, weight_decay=0.1, state_dtype=storage
        ),
        "apply_if_finite": lambda: optax.apply_if_finite(
            od.amsgrad(1e-3, weight_decay=0.1, state_dtype=storage), max_consecutive_errors=5
        ),
        "multi_steps": lambda: optax.MultiSteps(
            od.adamw(1e-3, weight_decay=0.1, state_dtype=storage), every_k_schedule=2
        ),
        "multi_transform": lambda: optax.multi_transform(
            {
                "l2": od.adam_l2(1e-3, weight_decay=0.1, state_dtype=storage),
                "sgd": optax.sgd(1e-3),
            },
            {"dense": {"kernel": "l2", "bias": "sgd"}, "emb": "l2"},
        ),
    }
    return make[name]()


def _train_params():
    return {
        "dense": {
            "kernel": jnp.linspace(-1.0, 1.0, 96 * 80).reshape(96, 80),
            "bias": jnp.ones(80),
        },
        "emb": jnp.cos(jnp.linspace(0.0, 9.0, 50 * 70)).reshape(50, 70),
    }


def _loss(p, x, t):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return jnp.mean((h[:, :70] @ p["emb"].T - t) ** 2)


@needs_kernel
@pytest.mark.parametrize(
    "name",
    ["adamw", "lion", "inject_hyperparams", "apply_if_finite", "multi_steps", "multi_transform"],
)
@pytest.mark.parametrize("loop", ["steps", "scan", "vmap"])
def test_training_steps_equal_the_xla_loop(name, loop):
    """Training steps that compute the gradient themselves (so the kernel computes the
    transform's output in its pass and writes it in the gradient's buffer, where the
    gradient reaches it as a value the program computed) against the same optimizer with
    XLA's chunk loop, under Optax's wrappers, in a Python loop of jitted steps, a `lax.scan`
    over steps and `vmap` over two batches; the fourth step's gradient is NaN where the
    wrapper is `apply_if_finite`, which must skip it in both. Both runs round each operation
    in float32, but XLA may contract a multiply-add: the tolerance is the one of the
    optimizer tests against the unfused storage (test_requantize.py)."""
    lr = 1e-4 if name == "lion" else 1e-3
    xs = jnp.sin(jnp.arange(6 * 8 * 96, dtype=jnp.float32)).reshape(6, 8, 96)
    ts = jnp.cos(jnp.arange(6 * 8 * 50, dtype=jnp.float32)).reshape(6, 8, 50)
    if name == "apply_if_finite":
        xs = xs.at[3, 0, 0].set(jnp.nan)
    results, texts = [], []
    for kernel in (True, False):
        tx = _wrapped(name, BlockwiseInt8Storage(min_size=0, cpu_kernel=kernel))

        def step(carry, batch, tx=tx):
            p, s = carry
            g = jax.grad(_loss)(p, *batch)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        params = _train_params()
        carry = (params, tx.init(params))
        if loop == "steps":
            jitted = jax.jit(lambda c, b, step=step: step(c, b)[0], donate_argnums=0)
            texts.append(jitted.lower(carry, (xs[0], ts[0])).compile().as_text())
            for i in range(6):
                carry = jitted(carry, (xs[i], ts[i]))
        elif loop == "scan":
            run = jax.jit(lambda c, step=step: jax.lax.scan(step, c, (xs, ts))[0])
            texts.append(run.lower(carry).compile().as_text())
            carry = run(carry)
        else:  # two runs side by side, on batches 0-2 and 3-5
            both = jax.tree.map(lambda x: jnp.stack([x, x]), carry)

            def run(c, step=step):
                def three(c, xs, ts):
                    for i in range(3):
                        c = step(c, (xs[i], ts[i]))[0]
                    return c

                return jax.vmap(three)(c, xs.reshape(2, 3, 8, 96), ts.reshape(2, 3, 8, 50))

            run = jax.jit(run)
            texts.append(run.lower(both).compile().as_text())
            carry = run(both)
        results.append(carry)
    (p_kernel, s_kernel), (p_loop, s_loop) = results
    assert cpu_kernel.TARGET in texts[0] and cpu_kernel.TARGET not in texts[1]
    # MultiSteps and apply_if_finite update inside lax.cond, whose branches get the
    # gradient as an argument: there the kernel writes the copy of the old codes instead.
    if name not in ("multi_steps", "apply_if_finite"):
        assert "out_mode = 1" in texts[0] or "out_mode = 2" in texts[0]
    for a, b in zip(jax.tree.leaves(p_kernel), jax.tree.leaves(p_loop), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a))
        assert np.mean(~np.isclose(a, b, rtol=0, atol=1e-7)) < 2e-3
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05 * lr)
    for a, b in zip(jax.tree.leaves(s_kernel), jax.tree.leaves(s_loop), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == np.uint8:
            assert np.abs(a.astype(np.int32) - b.astype(np.int32)).max() <= 2
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-12)
    if name == "apply_if_finite":  # one step skipped in each run
        counts = [int(np.max(np.asarray(s.notfinite_count))) for s in (s_kernel, s_loop)]
        assert counts == [0, 0]
        totals = [int(np.max(np.asarray(s.total_notfinite))) for s in (s_kernel, s_loop)]
        assert totals == [1, 1]
