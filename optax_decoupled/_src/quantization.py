"""Block-wise 8-bit quantization with the dynamic (tree) maps of Dettmers et al. (2022).

:func:`quantize` and :func:`dequantize` convert an array to and from a
:class:`QuantizedArray` (uint8 codes and one float32 scale per block); :func:`requantize` is
the fused read-modify-write that 8-bit optimizer state uses each step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_decoupled._src import validation as V

#: Default block size (bitsandbytes' optimizers use 256 for 8-bit block-wise state; the
#: paper's experiments use 2048).
DEFAULT_BLOCK_SIZE = 256

_F32_MAX = float(np.finfo(np.float32).max)


def dynamic_map(signed: bool = True) -> np.ndarray:
    """The 256-value dynamic (tree) quantization map, sorted ascending, float32.

    Built from the description in Dettmers (2016, 2022); see the module docstring.

    Args:
      signed: ``True`` for the signed map (values in ``[-0.993, 1]``), ``False`` for the
        unsigned map (values in ``[0, 1]``).

    Examples:
      >>> from optax_decoupled import contrib
      >>> q = contrib.dynamic_map(signed=False)
      >>> q.shape, float(q[0]), float(q[-1])
      ((256,), 0.0, 1.0)
    """
    return _dynamic_map(bool(signed)).copy()


@functools.lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> np.ndarray:
    values = [0.0, 1.0]
    for exponent in range(7):  # E leading zero bits: the decade [10^-(E+1), 10^-E]
        fraction_bits = 6 - exponent + (0 if signed else 1)
        edges = np.linspace(0.1, 1.0, 2**fraction_bits + 1)
        mids = (edges[:-1] + edges[1:]) / 2 * 10.0**-exponent
        values.extend(mids)
        if signed:
            values.extend(-mids)
    out = np.sort(np.asarray(values, np.float64)).astype(np.float32)
    assert out.shape == (256,) and len(np.unique(out)) == 256
    return out


def max_roundtrip_error(qmap: np.ndarray) -> np.ndarray:
    """Per code, the largest ``|x - Q[c]|`` (for ``absmax = 1``) of inputs that get code ``c``.

    Half the gap to each neighbour; at the ends, the distance to the end of ``[-1, 1]``
    (or ``[0, 1]`` for a non-negative map) that still rounds to it.
    """
    q = np.asarray(qmap, np.float64)
    lo_end = -1.0 if q[0] < 0 else 0.0
    left = np.concatenate([[q[0] - lo_end], np.diff(q) / 2])
    right = np.concatenate([np.diff(q) / 2, [1.0 - q[-1]]])
    return np.maximum(left, right)


class _Tables(NamedTuple):
    qmap: np.ndarray  # (256,) float32
    shift: int  # the table index is (float32 bits of |x|) >> shift
    code_pair: np.ndarray  # (2, n) int32: code below | code above << 8, for x >= 0 and x < 0
    threshold: np.ndarray  # (2, n) float32: |x| > threshold selects the code above


@functools.lru_cache(maxsize=8)
def _tables(signed: bool) -> _Tables:
    """Lookup tables that give the nearest code of ``x`` in ``[-1, 1]`` with two gathers.

    The table index is the top bits of ``|x|`` as a float32 (exponent and ``k`` leading
    mantissa bits). ``k`` is the smallest number of bits for which every index interval
    contains at most one decision point (midpoint between neighbouring map values of one sign);
    the entry then stores the codes below and above it and the midpoint itself.
    """
    qmap = _dynamic_map(signed)
    one_bits = int(np.float32(1.0).view(np.uint32))
    for mantissa_bits in range(4, 13):
        shift = 23 - mantissa_bits
        n = (one_bits >> shift) + 1
        lo = (np.arange(n, dtype=np.uint64) << shift).astype(np.uint32).view(np.float32)
        hi_bits = (np.arange(1, n + 1, dtype=np.uint64) << shift).astype(np.uint32)
        hi = hi_bits.view(np.float32).astype(np.float64)
        lo = lo.astype(np.float64)
        code_pair = np.zeros((2, n), np.int32)
        threshold = np.full((2, n), np.inf, np.float32)
        ok = True
        for side, sign in enumerate((1.0, -1.0)):
            # Candidates of this sign (and zero), by increasing magnitude.
            idx = np.nonzero(sign * qmap.astype(np.float64) >= 0)[0]
            mags = np.abs(qmap[idx].astype(np.float64))
            order = np.argsort(mags, kind="stable")
            idx, mags = idx[order], mags[order]
            mids = (mags[1:] + mags[:-1]) / 2  # |x| > mids[r-1] <=> rank >= r (ties: smaller)
            if len(mids) == 0:  # only zero has this sign (negative x, unsigned map)
                code_pair[side] = idx[0] | (idx[0] << 8)
                continue
            rank_lo = np.searchsorted(mids, lo, side="left")  # rank at |x| = lo
            rank_hi = np.searchsorted(mids, hi, side="left")  # rank just below hi
            if np.any(rank_hi - rank_lo > 1):
                ok = False
                break
            has = rank_hi > rank_lo
            below = idx[rank_lo]
            above = idx[np.minimum(rank_lo + 1, len(idx) - 1)]
            code_pair[side] = below | (np.where(has, above, below) << 8)
            mid = mids[np.minimum(rank_lo, len(mids) - 1)]
            # Round the decision point down to float32, so that for a float32 |x|,
            # |x| > threshold exactly when |x| > mid.
            thr = mid.astype(np.float32)
            thr = np.where(thr > mid, np.nextafter(thr, np.float32(-np.inf)), thr)
            threshold[side] = np.where(has, thr, np.inf)
        if ok:
            return _Tables(qmap, shift, code_pair, threshold)
    raise AssertionError("no table size separates the map's decision points")  # pragma: no cover


def _explicit_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    """The sharding in ``x``'s type when it lives on a mesh with Explicit axes, else ``None``.

    On such a mesh (the default of ``jax.make_mesh``) the sharding is part of the type, and
    gathers, reshapes, slices and pads of sharded dimensions need an explicit output sharding.
    """
    try:
        sharding = jax.typeof(x).sharding
    except TypeError:  # pragma: no cover - not an array
        return None
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return None
    return sharding


def _named(like: jax.sharding.NamedSharding, *spec: Any) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(like.mesh, jax.sharding.PartitionSpec(*spec))


def _padded_spec(sharding: jax.sharding.NamedSharding, ndim: int) -> tuple[Any, ...]:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _lookup(table: np.ndarray, index: jax.Array) -> jax.Array:
    """``table[index]``; on an Explicit mesh the result takes ``index``'s sharding."""
    sharding = _explicit_sharding(index)
    if sharding is None:
        return jnp.asarray(table)[index]
    return jnp.asarray(table).at[index].get(out_sharding=sharding)


def _leading_axes(sharding: jax.sharding.NamedSharding) -> tuple[Any, int]:
    """``(entry, S)``: the spec entry of the leading axis and the number of shards it makes."""
    spec = sharding.spec
    lead = spec[0] if len(spec) else None
    names = () if lead is None else (lead if isinstance(lead, tuple) else (lead,))
    shards = int(np.prod([sharding.mesh.shape[n] for n in names], dtype=np.int64))
    return (lead if names else None), shards


def _block_spec(sharding: jax.sharding.NamedSharding, n_blocks: int) -> Any:
    """The leading spec entry of the codes ``(n_blocks, B)`` and scales ``(n_blocks,)`` of an
    array with this (parameter) sharding: its leading axis's mesh axes when they divide
    ``n_blocks``, else ``None`` (replicated). :func:`quantize` and
    :func:`optax_decoupled._src.storage.stored_sharding` share this rule."""
    lead, shards = _leading_axes(sharding)
    return lead if lead is not None and n_blocks % shards == 0 else None


def quantize_normalized(x: jax.Array, *, signed: bool) -> jax.Array:
    """Codes (uint8) of values already scaled into ``[-1, 1]`` (clipped if outside)."""
    t = _tables(signed)
    x = jnp.clip(x.astype(jnp.float32), -1.0 if signed else 0.0, 1.0)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31).astype(jnp.int32)
    mag_bits = bits & jnp.uint32(0x7FFFFFFF)
    n = t.code_pair.shape[1]
    index = jnp.minimum((mag_bits >> t.shift).astype(jnp.int32), n - 1) + negative * n
    # Each table is gathered once, so that XLA fuses the whole lookup into one loop.
    below = _lookup((t.code_pair.reshape(-1) & 0xFF).astype(np.int32), index)
    threshold = _lookup(t.threshold.reshape(-1), index)
    above = jax.lax.bitcast_convert_type(mag_bits, jnp.float32) > threshold
    # Above the decision point the code moves one step away from zero.
    return (below + jnp.where(above, 1 - 2 * negative, 0)).astype(jnp.uint8)


def dequantize_normalized(codes: jax.Array, *, signed: bool) -> jax.Array:
    """Map values (float32) of ``codes``."""
    return _lookup(_dynamic_map(signed), codes.astype(jnp.int32))


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["codes", "absmax"], meta_fields=["signed"]
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-wise quantized array, a pytree with two array leaves.

    Attributes:
      codes: ``(n_blocks, B)`` uint8, indices into :func:`dynamic_map` ``(signed)``.
      absmax: ``(n_blocks,)`` float32, the scale :math:`N_b` of each block.
      signed: which map the codes index (static pytree metadata, not a leaf).

    The original shape is not stored: :func:`dequantize` takes it (or an array of that shape).
    """

    codes: jax.Array
    absmax: jax.Array
    signed: bool = True

    @property
    def block_size(self) -> int:
        return self.codes.shape[-1]


def _is_quantized_mapping(x: Any) -> bool:
    """A mapping with exactly the fields of a :class:`QuantizedArray` (uint8 codes of shape
    ``(n_blocks, B)`` or batched) that is not one."""
    if isinstance(x, QuantizedArray) or not isinstance(x, Mapping):
        return False
    if set(x.keys()) != {"codes", "absmax"}:
        return False
    codes = x["codes"]
    return hasattr(codes, "dtype") and codes.dtype == jnp.uint8 and jnp.ndim(codes) >= 2


def restore_quantized(tree: Any, *, signed: bool) -> Any:
    """``tree`` with every ``{"codes": ..., "absmax": ...}`` mapping turned back into a
    :class:`QuantizedArray` with this ``signed``.

    Flax NNX's ``nnx.Optimizer`` writes the state back with ``nnx.update(opt_state,
    nnx.state(new_state))``, which flattens a moment's :class:`QuantizedArray` (a pytree
    with two leaves, held by one ``OptVariable``) into an ``nnx.State`` of its fields and
    drops the static ``signed`` flag. The transforms call this on each moment tree, with the
    flag the moment always has (first moments signed, second moments unsigned), so that
    8-bit state keeps working from the second step on."""

    def rebuild(x):
        return QuantizedArray(x["codes"], x["absmax"], signed) if _is_quantized_mapping(x) else x

    return jax.tree.map(rebuild, tree, is_leaf=_is_quantized_mapping)


def num_blocks(size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Number of blocks of ``block_size`` elements that hold ``size`` elements."""
    return -(-int(size) // int(block_size))


def _check_block_size(block_size: int) -> None:
    if not V.is_int(block_size) or block_size < 1:
        raise ValueError(f"`block_size` must be a positive int, got {block_size!r}.")


def _scales(absmax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(absmax, factor, scale)``: the stored absmax (saturated at float32.max) and the
    per-block ``x * factor / scale`` that maps a block into ``[-1, 1]``.

    XLA turns ``x / scale`` into ``x * (1 / scale)`` and on CPU flushes denormals to zero, so
    blocks whose absmax is near the float32 limits are first rescaled by an exact power of two.
    A block of zeros gets scale 1 (no division by zero)."""
    absmax = jnp.minimum(absmax, _F32_MAX)
    factor = jnp.where(absmax > 2.0**100, 2.0**-64, jnp.where(absmax < 2.0**-100, 2.0**64, 1.0))
    scale = jnp.where(absmax > 0, absmax * factor, 1.0)
    return absmax, factor, scale


def _block_absmax(x: jax.Array) -> jax.Array:
    """``max |x|`` over the last axis, NaN if the block holds a NaN.

    Taken as the integer max of the bit patterns of ``|x|`` (ordered as the values are, with
    NaN above infinity): XLA:CPU's vectorized float max drops
    NaNs (with 16 blocks or more it gave ``1.0`` for a block with a NaN inside and ``-inf``
    for one ending in a NaN), which would let a NaN gradient pass as a finite or a negative
    second moment."""
    a = jnp.abs(x)
    bits = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), a.dtype)


def quantize_blocks(blocks: jax.Array, *, signed: bool) -> QuantizedArray:
    """Quantize an array of blocks ``(..., n_blocks, B)``, one absmax per block."""
    x = blocks.astype(jnp.float32)
    # Saturate ±inf to ±float32.max: a clipped absmax, and x / absmax clipped to [-1, 1] in
    # quantize_normalized (NaN stays NaN: a block with a NaN becomes NaN).
    absmax, factor, scale = _scales(_block_absmax(x))
    codes = quantize_normalized((x * factor[..., None]) / scale[..., None], signed=signed)
    return QuantizedArray(codes, absmax, signed)


def dequantize_blocks(q: QuantizedArray) -> jax.Array:
    """Float32 blocks ``(..., n_blocks, B)`` of a :class:`QuantizedArray`."""
    return dequantize_normalized(q.codes, signed=q.signed) * q.absmax[..., None]


def _per_element(per_block: jax.Array, block_size: int, size: int) -> jax.Array:
    """A per-block value repeated for each of the first ``size`` elements (a broadcast)."""
    n = per_block.shape[0]
    return jnp.broadcast_to(per_block[:, None], (n, block_size)).reshape(-1)[:size]


def quantize(x: jax.Array, *, signed: bool, block_size: int = DEFAULT_BLOCK_SIZE) -> QuantizedArray:
    r"""Block-wise quantize ``x`` (any shape): flatten (row-major), zero-pad, cut into blocks.

    Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise Quantization",
    ICLR 2022 (Sec. 2): a tensor is cut into blocks of :math:`B` consecutive elements; each block
    keeps one float32 scale :math:`N_b = \max_{i\in b}|x_i|` (its *absmax*) and one 8-bit code per
    element, the index of the entry of a 256-value *map* :math:`Q` (sorted, in :math:`[-1, 1]`)
    nearest to :math:`x_i / N_b`:

    .. math::

        c_i = \operatorname*{arg\,min}_{j} \big| Q_j - x_i / N_b \big|, \qquad
        \tilde x_i = Q_{c_i} \, N_b .

    **The dynamic maps.** *Dynamic tree quantization* (Dettmers, "8-Bit Approximations for
    Parallelism in Deep Learning", ICLR 2016; the 2022 paper, Sec. 2.2 and Fig. 2) reads an 8-bit
    code as: a sign bit; :math:`E` zero bits giving the decimal exponent :math:`10^{-E}`; an
    indicator bit (the first 1); and the remaining :math:`F = 7 - E - 1` bits as a *linear fraction*
    that splits :math:`[0.1, 1]` into :math:`2^F` equal bins, represented by their midpoints. So
    every decade :math:`[10^{-E-1}, 10^{-E}]` for :math:`E = 0..6` gets :math:`2^{6-E}` values:
    many near the block's maximum, few but still some down to :math:`\approx 5\cdot10^{-7}`. The
    all-zero pattern is 0 and the remaining pattern is 1.0 (so a block's maximum is exact).

    * :func:`dynamic_map` ``(signed=True)``: the signed map, for moments of either sign (Adam's and
      Lion's :math:`\mu`): 127 positive, 127 negative values, 0 and 1 (it has no -1: a block whose
      absmax is a negative element stores it as :math:`-0.993 N_b`).
    * ``dynamic_map(signed=False)``: the unsigned map, for non-negative moments (:math:`\nu`,
      :math:`\nu_{max}`): the sign bit becomes one more fraction bit, :math:`2^{7-E}` values per
      decade, 0 and 1. It has no negative value, so a quantized :math:`\nu` never dequantizes
      to a negative number.

    Both are built here from that description and checked (``tests/test_quantization.py``)
    against the maps recorded from bitsandbytes' ``create_dynamic_map`` by
    ``tests/golden/make_dynamic_maps.py``.

    **Rounding.** :func:`quantize_blocks` rounds to the *nearest* map value exactly (ties toward
    the value of smaller magnitude), so the round-trip error of an element is at most half the gap
    between the two map values around :math:`x_i/N_b`, times :math:`N_b`
    (:func:`max_roundtrip_error`). The nearest code is found with a lookup table indexed by the
    top bits of :math:`|x_i/N_b|` as a float32 (exponent and the leading mantissa bits) plus one
    comparison, i.e. two small gathers per element, instead of a binary search over the map.
    bitsandbytes' CPU kernel uses an approximate search and picks a farther code for some
    elements: on the 8192 recorded inputs of ``tests/golden/bnb_dynamic_maps.npz``, 17-30% of all
    (per map and block size), 0.2-1.2% of those with :math:`|x_i/N_b| \ge 10^{-3}` and 36-73% of
    the smaller ones (e.g. a value near zero stored as a small nonzero code). The tests check that
    our error is never larger than its error.

    **Extreme values.** Non-finite magnitudes are first saturated to :math:`\pm` the float32
    maximum, so an overflowing :math:`\nu = g^2 = \infty` is stored as ``float32.max`` (and reads
    back finite) instead of turning its whole block into NaN. A block of zeros has
    :math:`N_b = 0` and stores code 0 (the value 0) without dividing by zero. NaN stays NaN (for the
    whole block; ``optax.apply_if_finite`` is the tool for skipping such steps).

    **Layout.** :func:`quantize` flattens an array in row-major (C) order, pads it with zeros to a
    multiple of :math:`B` and reshapes to ``(n_blocks, B)``; the codes keep that 2-D shape and the
    scales have shape ``(n_blocks,)``. Padding never changes the result: zeros do not raise a
    block's absmax, and :func:`dequantize` drops the padded tail. Block ``b`` holds the flat
    elements ``[b B, (b+1) B)``, so a shard along the leading axis of a parameter of shape
    ``(d_0, ...)`` split over :math:`S` devices is a whole number of blocks exactly when
    :math:`(\mathrm{size}/S) \bmod B = 0`, e.g. whenever the product of the trailing dimensions is
    a multiple of :math:`B` and :math:`S` divides :math:`d_0`. Then the codes' and scales'
    leading axis shards the same way and quantization needs no communication.

    **Explicit meshes.** On a mesh with *Explicit* axes (the default of ``jax.make_mesh``) the
    sharding is part of an array's type and reshapes of sharded dimensions need an output
    sharding, so :func:`quantize` lays the blocks out itself, by the rule of
    :func:`~optax_decoupled._src.storage.stored_sharding`: codes and scales split over the mesh
    axes of the array's leading axis when their number of shards divides ``n_blocks``, replicated
    otherwise. With whole blocks per shard each device quantizes its own rows (local reshapes, no
    communication); otherwise the array is gathered, quantized whole and the result sliced.
    :func:`dequantize` given an array rather than a shape returns values with that array's
    sharding. The values are the same as on one device.

    Examples:
      >>> import jax.numpy as jnp
      >>> from optax_decoupled import contrib
      >>> x = jnp.linspace(-1.0, 1.0, 1000)
      >>> q = contrib.quantize(x, signed=True, block_size=256)
      >>> q.codes.shape, q.absmax.shape
      ((4, 256), (4,))
      >>> err = jnp.max(jnp.abs(contrib.dequantize(q, x.shape) - x))
      >>> print(bool(err < 0.01))
      True

    References:
      Dettmers, Lewis, Shleifer & Zettlemoyer, `8-bit Optimizers via Block-wise Quantization
      <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
    """
    _check_block_size(block_size)
    sharding = _explicit_sharding(x)
    if sharding is not None:
        return _quantize_explicit(x, sharding, signed=signed, block_size=block_size)
    return _quantize(x, signed=signed, block_size=block_size)


def _quantize_explicit(
    x: jax.Array, sharding: jax.sharding.NamedSharding, *, signed: bool, block_size: int
) -> QuantizedArray:
    """:func:`quantize` of an array on a mesh with Explicit axes: the same values, laid out as
    :func:`_block_spec` says.

    When every shard of the leading axis is a whole number of blocks, each device quantizes
    its own rows (explicit reshapes, no communication). Otherwise the array is gathered
    (replicated), quantized like an unsharded one and the codes and scales are then split
    along their leading axis (a local slice) when :func:`_block_spec` says so.
    """
    size = int(np.prod(x.shape, dtype=np.int64))
    n_blocks = num_blocks(size, block_size)
    lead = _block_spec(sharding, n_blocks)
    if lead is not None and size % block_size == 0:
        # Whole blocks per shard (the leading axis divides evenly on an Explicit mesh).
        rows = _named(sharding, lead)
        if tuple(sharding.spec) != (lead,) + (None,) * (len(sharding.spec) - 1):
            x = jax.sharding.reshard(x, rows)  # keep only the leading axis's split
        flat = jnp.reshape(x, (size,), out_sharding=rows)
        blocks = jnp.reshape(
            flat, (n_blocks, block_size), out_sharding=_named(sharding, lead, None)
        )
        return quantize_blocks(blocks, signed=signed)
    q = _quantize(jax.sharding.reshard(x, _named(sharding)), signed=signed, block_size=block_size)
    if lead is None:
        return q
    codes = jax.sharding.reshard(q.codes, _named(sharding, lead, None))
    return QuantizedArray(codes, jax.sharding.reshard(q.absmax, _named(sharding, lead)), signed)


def _quantize(x: jax.Array, *, signed: bool, block_size: int) -> QuantizedArray:
    flat = jnp.ravel(x)
    size = flat.size
    full, rest = divmod(size, block_size)
    if not rest:
        return quantize_blocks(flat.reshape(full, block_size), signed=signed)
    # A size that is not a multiple of B. Padding the float array would make XLA keep padded
    # float copies of it; instead the scales come from the full blocks and the (padded) last
    # block, the codes are computed in the array's own layout, and only the uint8 codes are
    # padded. Same result as padding first (tested).
    flat = jax.lax.optimization_barrier(flat.astype(jnp.float32))
    tail = jnp.pad(flat[full * block_size :], (0, block_size - rest))
    parts = [tail.reshape(1, block_size)]
    if full:
        parts.insert(0, flat[: full * block_size].reshape(full, block_size))
    absmax = jnp.concatenate([_block_absmax(p) for p in parts])
    absmax, factor, scale = _scales(absmax)
    normalized = (flat * _per_element(factor, block_size, size)) / _per_element(
        scale, block_size, size
    )
    codes = quantize_normalized(normalized, signed=signed)
    zero_code = int(np.searchsorted(_dynamic_map(signed), 0.0))  # padding quantizes to 0
    codes = jnp.pad(codes, (0, block_size - rest), constant_values=zero_code)
    codes = codes.reshape(full + 1, block_size)
    return QuantizedArray(codes, absmax, signed)


#: Elements per step of :func:`requantize`'s loop on CPU (512 blocks of 256): the chunk's
#: float32 temporaries (512 kB each) stay in a core's L2 cache.
CHUNK_ELEMENTS = 2**17


def requantize(
    fn: Any,
    stored: tuple[QuantizedArray, ...],
    operands: tuple[jax.Array, ...],
    *,
    shape: tuple[int, ...],
    signed: tuple[bool, ...],
    dtype: Any = jnp.float32,
    chunk_elements: int | None = None,
    return_old: bool = False,
) -> Any:
    r"""``quantize(v_k, signed=signed[k])`` for ``v = fn(*dequantize(stored), *operands)``.

    The fused read-modify-write of quantized moments: ``fn`` is *element-wise* and gets the
    dequantized ``stored`` arrays (as ``dtype``, in the block layout) followed by the
    ``operands`` (arrays of ``shape``, e.g. the gradient), and returns a tuple of new values,
    one per ``signed`` entry. All ``stored`` arrays share the block layout of ``shape``.

    The result is that of dequantizing, calling ``fn`` on whole arrays and quantizing, up
    to float rounding: the two are different XLA programs, which may round ``fn`` differently
    by one ulp (e.g. by contracting a multiply-add), so an element at a rounding boundary can
    get the neighbouring code (``tests/test_requantize.py`` bounds this). How it is computed
    depends on the platform (:func:`jax.lax.platform_dependent`):

    * **CPU**: a loop over chunks of ``chunk_elements`` (default :data:`CHUNK_ELEMENTS`)
      whole blocks. Each chunk is decoded, updated, reduced to its blocks' absmax and encoded
      while it is in cache, so no float32 array of the parameter's size is ever written. On
      one big array this is what makes 8-bit state cost about 2x float32 instead of 7-10x
      (``benchmarks/state_memory.py``): XLA:CPU would otherwise materialise the decoded and
      the new moments (several parameter-sized temporaries) because the block max and the
      encoder both need them.
    * **Other platforms** (GPU, TPU): the whole-array computation, which XLA fuses into a
      few parallel kernels.
    * **A mesh with Explicit axes** (any platform): :func:`dequantize`, ``fn`` and
      :func:`quantize` of whole arrays, which lay out the sharded reshapes and gathers.

    The last block of a size that is not a multiple of :math:`B` is handled apart from the
    loop (its padding is zero, as in :func:`quantize`).

    With ``return_old``, returns ``(new, stored)``.
    """

    def result(new):
        return (new, tuple(stored)) if return_old else new

    fn, operands = _coefficients_as_operands(fn, tuple(operands), tuple(shape))
    size = int(np.prod(shape, dtype=np.int64))
    block_size = stored[0].block_size
    if any(q.codes.shape[-2:] != stored[0].codes.shape[-2:] for q in stored):
        raise ValueError("`stored` arrays must share one block layout.")
    chunk = max(1, int(chunk_elements or CHUNK_ELEMENTS) // block_size)
    full = size // block_size
    if any(_explicit_sharding(x) is not None for x in (*operands, stored[0].codes)):
        like = operands[0] if operands else tuple(shape)
        values = fn(*(dequantize(q, like).astype(dtype) for q in stored), *operands)
        pairs = zip(values, signed, strict=True)
        return result(tuple(quantize(v, signed=s, block_size=block_size) for v, s in pairs))

    n_in = len(stored) + len(operands)

    def whole_with(fn, *args):
        qs, ops = args[: len(stored)], args[len(stored) : n_in]
        values = fn(*(_dequantize(q, shape).astype(dtype) for q in qs), *ops)
        return tuple(
            _quantize(v, signed=s, block_size=block_size)
            for v, s in zip(values, signed, strict=True)
        )

    def chunked_with(fn, *args):
        if full <= chunk:  # one chunk: nothing to loop over
            return whole_with(fn, *args)
        qs, ops = args[: len(stored)], args[len(stored) : n_in]
        return _requantize_chunked(fn, qs, ops, size, signed, dtype, chunk)

    if full <= chunk:
        return result(whole_with(fn, *stored, *operands))
    return result(
        jax.lax.platform_dependent(
            *stored,
            *operands,
            cpu=functools.partial(chunked_with, fn),
            default=functools.partial(whole_with, fn),
        )
    )


def _coefficients_as_operands(fn, operands, shape):
    """``(fn, operands)`` with ``fn``'s array coefficients that are not scalars (per-element
    betas, e.g. ``b2`` of shape ``(512,)`` or of the parameter's shape) passed as operands
    of ``shape`` instead, so that every path slices them with the gradient: the loop over
    chunks hands ``fn`` blocks of ``(chunk, B)``, against which such a coefficient would not
    broadcast. Costs one float32 array of ``shape`` per such coefficient; scalar and Python
    coefficients stay in ``fn``."""
    split = getattr(fn, "split_dynamic", None)
    if split is None:
        return fn, operands
    arrays, rebuild = split()
    lifted = [i for i, a in enumerate(arrays) if jnp.ndim(a) > 0]
    if not lifted:
        return fn, operands
    extra = tuple(jnp.broadcast_to(arrays[i], shape) for i in lifted)

    def with_coefficients(*args):
        values = list(arrays)
        for i, a in zip(lifted, args[len(args) - len(extra) :], strict=True):
            values[i] = a
        return rebuild(values)(*args[: len(args) - len(extra)])

    return with_coefficients, (*operands, *extra)


def _block_rows(q: QuantizedArray, start: Any, count: int) -> QuantizedArray:
    """Blocks ``[start, start + count)`` of ``q`` (``start`` may be traced)."""
    return QuantizedArray(
        jax.lax.dynamic_slice_in_dim(q.codes, start, count),
        jax.lax.dynamic_slice_in_dim(q.absmax, start, count),
        q.signed,
    )


def _put_block_rows(q: QuantizedArray, rows: QuantizedArray, start: Any) -> QuantizedArray:
    """``q`` with its blocks from ``start`` on replaced by ``rows``."""
    return QuantizedArray(
        jax.lax.dynamic_update_slice_in_dim(q.codes, rows.codes, start, 0),
        jax.lax.dynamic_update_slice_in_dim(q.absmax, rows.absmax, start, 0),
        q.signed,
    )


def _requantize_chunked(fn, qs, ops, size, signed, dtype, chunk):
    """:func:`requantize` as a loop over ``chunk`` whole blocks at a time (then the tail)."""
    block_size = qs[0].block_size
    n_blocks = qs[0].codes.shape[0]
    full, rest = divmod(size, block_size)
    flat_ops = [jnp.ravel(o) for o in ops]

    def apply(rows, op_rows, mask=None):
        values = fn(*(dequantize_blocks(r).astype(dtype) for r in rows), *op_rows)
        if mask is not None:  # the padded tail of the last block is zero, as in quantize
            values = [jnp.where(mask, v, 0) for v in values]
        return [quantize_blocks(v, signed=s) for v, s in zip(values, signed, strict=True)]

    def body(i, outs):
        # The last chunk is moved back to end at the last full block; the blocks it repeats
        # are computed again from the same (old) inputs, so rewriting them changes nothing.
        start = jnp.minimum(i * chunk, full - chunk)
        op_rows = [
            jax.lax.dynamic_slice_in_dim(o, start * block_size, chunk * block_size).reshape(
                chunk, block_size
            )
            for o in flat_ops
        ]
        new = apply([_block_rows(q, start, chunk) for q in qs], op_rows)
        return [_put_block_rows(o, n, start) for o, n in zip(outs, new, strict=True)]

    init = [
        QuantizedArray(
            jnp.zeros((n_blocks, block_size), jnp.uint8), jnp.zeros((n_blocks,), jnp.float32), s
        )
        for s in signed
    ]
    outs = jax.lax.fori_loop(0, -(-full // chunk), body, init)
    if rest:
        op_rows = [
            jnp.pad(o[full * block_size :], (0, block_size - rest)).reshape(1, block_size)
            for o in flat_ops
        ]
        mask = jnp.arange(block_size) < rest
        new = apply([_block_rows(q, full, 1) for q in qs], op_rows, mask)
        outs = [_put_block_rows(o, n, full) for o, n in zip(outs, new, strict=True)]
    return tuple(outs)


def dequantize(q: QuantizedArray, shape: tuple[int, ...] | jax.Array) -> jax.Array:
    """Float32 array of ``shape`` (a tuple, or an array whose shape is used) from ``q``."""
    out_sharding = None
    if not isinstance(shape, tuple | list):
        out_sharding = _explicit_sharding(shape)
        shape = jnp.shape(shape)
    sharding = _explicit_sharding(q.codes)
    if sharding is not None:
        return _dequantize_explicit(q, tuple(shape), sharding, out_sharding)
    return _dequantize(q, shape)


def _dequantize_explicit(
    q: QuantizedArray,
    shape: tuple[int, ...],
    sharding: jax.sharding.NamedSharding,
    out_sharding: jax.sharding.NamedSharding | None,
) -> jax.Array:
    """:func:`dequantize` of codes on a mesh with Explicit axes. The result has
    ``out_sharding`` (the sharding of the array ``shape`` was taken from) if given, else its
    leading axis split like the codes' when that divides it, else it is replicated."""
    size = int(np.prod(shape, dtype=np.int64))
    lead, shards = _leading_axes(sharding)
    local = lead is not None and size == q.codes.size and len(shape) > 0 and shape[0] % shards == 0
    if out_sharding is None:
        out_sharding = _named(sharding, lead) if local else _named(sharding)
    if local:
        # Each shard of the codes holds whole rows of the result: local reshapes.
        values = dequantize_blocks(q)
        values = jnp.reshape(values, (size,), out_sharding=_named(sharding, lead))
        values = jnp.reshape(values, shape, out_sharding=_named(sharding, lead))
    else:
        replicated = _named(sharding)
        q = QuantizedArray(
            jax.sharding.reshard(q.codes, replicated),
            jax.sharding.reshard(q.absmax, replicated),
            q.signed,
        )
        values = _dequantize(q, shape)
    if _padded_spec(jax.typeof(values).sharding, values.ndim) != _padded_spec(
        out_sharding, values.ndim
    ):
        values = jax.sharding.reshard(values, out_sharding)
    return values


def _dequantize(q: QuantizedArray, shape: tuple[int, ...]) -> jax.Array:
    size = int(np.prod(shape, dtype=np.int64))
    block_size = q.codes.shape[-1]
    if size == q.codes.size:
        return dequantize_blocks(q).reshape(shape)
    # Drop the padding from the uint8 codes before the lookup (see quantize).
    codes = q.codes.reshape(-1)[:size]
    absmax = _per_element(q.absmax, block_size, size)
    values = dequantize_normalized(codes, signed=q.signed) * absmax
    return values.reshape(shape)
