r"""How optimizer moments are stored between steps (``state_dtype``).

Every moment (Adam's :math:`\mu`, :math:`\nu`, AMSGrad's :math:`\nu_{\max}`, Lion's
:math:`\mu`) goes through :class:`MomentStorage`: ``init`` makes the stored zeros, ``read``
returns the moment in the compute dtype, ``write`` encodes an updated one. A storage may add
``update``, a fused read-modify-write (8-bit storage's chunked requantization). Each step is
computed in ``promote_types(storage dtype, gradient dtype)``, at least float32 for 16- and
8-bit storage, so low-precision storage changes what is kept between steps, never the
arithmetic of one step. :func:`resolve_storage` maps a ``state_dtype`` argument to a storage:
``None`` (the parameter dtype, as Optax), ``"float32"``, ``"bfloat16"``, ``"float16"``,
``"float64"``, ``"int8"`` (:class:`BlockwiseInt8Storage`) or a storage object.

References:
  Dettmers et al., `8-bit Optimizers via Block-wise Quantization
  <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from optax_decoupled._src import quantization as quant_lib
from optax_decoupled._src import validation as V

StateDtype = Any  # None | str | jnp dtype

_FLOAT_NAMES = ("float32", "bfloat16", "float16", "float64")


class MomentStorage(Protocol):
    """The storage interface every moment goes through (see the module docstring)."""

    name: str

    def init(self, param: jax.Array, signed: bool) -> Any: ...

    def read(self, stored: Any, like: jax.Array) -> jax.Array: ...

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> Any: ...


def update_moments(
    store: MomentStorage,
    fn: Any,
    stored: tuple[Any, ...],
    operands: tuple[jax.Array, ...],
    *,
    like: jax.Array,
    signed: tuple[bool, ...],
    return_old: bool = False,
    step: jax.Array | None = None,
) -> Any:
    """The new stored moments ``write(v_k)`` for ``v = fn(*read(stored), *operands)``.

    ``fn`` must be element-wise (each output element depends only on the same element of the
    inputs), as every moment update is. A storage may then compute this in its own way: one
    with an ``update(fn, stored, operands, like, signed, return_old=False)`` method does
    (8-bit storage requantizes chunk by chunk on CPU,
    :func:`optax_decoupled._src.quantization.requantize`);
    for any other the result is exactly the read-compute-write above, which XLA fuses.

    With ``return_old`` the result is ``(new, stored)``.

    ``step`` (the transform's step count, an int32 scalar) seeds storages that round
    stochastically (``needs_step``, e.g. ``FloatStorage(..., rounding="stochastic")``),
    which need it; the others ignore it.
    """
    if getattr(store, "needs_step", False):
        _require_step(store, step)
        return store.update(fn, stored, operands, like, signed, return_old=return_old, step=step)
    update = getattr(store, "update", None)
    if update is not None:
        return update(fn, stored, operands, like, signed, return_old=return_old)
    return _read_compute_write(store, fn, stored, operands, like, signed, return_old)


def _require_step(store: Any, step: Any) -> None:
    if step is None:
        raise ValueError(
            f"{store!r} rounds stochastically and needs the step count: pass `step` to "
            "update_moments (the transforms of this package do)."
        )


def store_moments(
    store: MomentStorage,
    fn: Any,
    stored: tuple[Any, ...],
    new: tuple[jax.Array, ...],
    g: jax.Array,
    *,
    signed: tuple[bool, ...],
    step: jax.Array | None = None,
) -> tuple[Any, ...]:
    """The stored form of the new moments ``new = fn(*read(stored), g)``.

    A storage that rounds plainly writes ``new`` itself (``write(v, like=g)``; the parameter
    dtype's storage writes each moment in the dtype it was made in), so
    the stored moments are the values the transform computed its output from. One that
    updates in a pass of its own (``fused_update``: 8-bit storage's chunked requantization,
    stochastic rounding seeded by ``step``) runs :func:`update_moments` of the element-wise
    ``fn`` instead (the same values up to float rounding).
    """
    if getattr(store, "fused_update", False):
        return update_moments(store, fn, stored, (g,), like=g, signed=signed, step=step)
    if isinstance(store, ParamDtypeStorage):  # each moment keeps the dtype it was made in
        return tuple(
            store.write(v, s, signed=sg) for v, s, sg in zip(new, stored, signed, strict=True)
        )
    return tuple(store.write(v, g, signed=sg) for v, sg in zip(new, signed, strict=True))


def narrow(value: jax.Array, dtype: Any) -> jax.Array:
    r"""``value.astype(dtype)``, rounded even where XLA would keep the excess precision.

    XLA:GPU's simplifier (``xla_allow_excess_precision``, on by default) rewrites
    :math:`\mathrm{convert}(\mathrm{convert}(x, \mathrm{bf16}), \mathrm{f32})` to
    :math:`x`. In one jitted program that runs several optimizer steps, a moment stored in a
    narrower dtype and read back by the next step would then skip its rounding, and the result
    would depend on how many steps a program holds (measured on an H200,
    ``docs/devices.md``). So off the CPU a narrowing cast rounds explicitly: float32 to
    bfloat16 by :func:`jax.lax.reduce_precision` (the same round to nearest even, bit for bit,
    fused into the step), other narrowings through :func:`jax.lax.optimization_barrier` after
    the cast, which the rewrite cannot see through (``reduce_precision`` would flush float16's
    subnormals). XLA:CPU keeps the pair, and there the cast is a plain ``astype`` (chosen by
    :func:`jax.lax.platform_dependent`), as are casts that narrow nothing.
    """
    value = jnp.asarray(value)
    dtype = jnp.dtype(dtype)
    src = jnp.result_type(value)
    narrows = (
        jnp.issubdtype(src, jnp.floating)
        and jnp.issubdtype(dtype, jnp.floating)
        and (
            jnp.finfo(dtype).nmant < jnp.finfo(src).nmant
            or jnp.finfo(dtype).maxexp < jnp.finfo(src).maxexp
        )
    )
    if not narrows:
        return value.astype(dtype)

    def keep_rounding(v):
        if dtype == jnp.bfloat16 and src == jnp.float32:
            info = jnp.finfo(dtype)
            v = jax.lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)
            return v.astype(dtype)
        return jax.lax.optimization_barrier(v.astype(dtype))

    return jax.lax.platform_dependent(value, cpu=lambda v: v.astype(dtype), default=keep_rounding)


def _read_compute_write(store, fn, stored, operands, like, signed, return_old=False):
    values = fn(*(store.read(s, like) for s in stored), *operands)
    new = tuple(store.write(v, like, signed=sg) for v, sg in zip(values, signed, strict=True))
    return (new, tuple(stored)) if return_old else new


@dataclasses.dataclass(frozen=True)
class ParamDtypeStorage:
    """Moments stored in the parameter's own dtype (``state_dtype=None``).

    The moments keep the dtype :meth:`init` gave them, the parameter's, whatever the
    gradient's dtype: the update is computed in the promoted dtype, as ``jnp`` promotes,
    and cast back (so a float32 moment of a float32 parameter stays float32 under bfloat16
    gradients, and the state's types never change between steps, which ``jax.lax.scan``
    and ``jit``'s cache need). With ``dtype``, the moments are created in that dtype instead
    and kept in it the same way: Optax's ``mu_dtype``, computed in the promoted dtype and cast
    on write (no float32 floor, unlike :class:`FloatStorage`)."""

    name: str = "param"
    dtype: Any = None

    def init(self, param: jax.Array, signed: bool) -> jax.Array:
        del signed
        return jnp.zeros_like(param, dtype=self.dtype)

    def read(self, stored: jax.Array, like: jax.Array) -> jax.Array:
        del like
        return stored

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> jax.Array:
        """``value`` in ``like``'s dtype (``like``: the parameter, or a moment of its dtype)."""
        del signed
        return narrow(value, jnp.result_type(like))

    def update(
        self,
        fn: Any,
        stored: tuple[Any, ...],
        operands: tuple[jax.Array, ...],
        like: jax.Array,
        signed: tuple[bool, ...],
        return_old: bool = False,
    ) -> Any:
        """:func:`update_moments`, each new moment written in its stored dtype."""
        del like
        values = fn(*stored, *operands)
        new = tuple(
            self.write(v, s, signed=sg) for v, s, sg in zip(values, stored, signed, strict=True)
        )
        return (new, tuple(stored)) if return_old else new


#: The roundings of :class:`FloatStorage`.
ROUNDINGS = ("nearest", "stochastic")


def _mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: every input bit changes each output bit with
    probability about 1/2 (uint32, wrapping arithmetic)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def stochastic_round_bfloat16(x: jax.Array, step: jax.Array, stream: int = 0) -> jax.Array:
    r"""``x`` rounded to bfloat16 up or down at random, unbiased (a wider ``x`` is first
    rounded to float32):

    .. math::

        \operatorname{SR}(x) = \begin{cases} x_{\uparrow} & \text{with probability }
        (x - x_{\downarrow}) / (x_{\uparrow} - x_{\downarrow}) \\
        x_{\downarrow} & \text{otherwise} \end{cases}, \qquad
        \mathbb{E}[\operatorname{SR}(x)] = x

    with :math:`x_{\downarrow}, x_{\uparrow}` the neighbouring bfloat16 values (towards
    and away from zero). The classic bit form: add 16 random bits to the float32's low 16
    bits and truncate them (Gupta et al., "Deep Learning with Limited Numerical Precision",
    ICML 2015, for the rounding). The
    bits are a hash of the element's (row-major) index, ``step`` and ``stream``, so a step
    is reproducible (a resumed run rounds as the original did) and no key is stored;
    elements at the same index of different leaves share their bits, which correlates
    their roundings but biases none (inside ``shard_map`` the index is the shard's own, so
    shards share bits and the rounding differs from an unsharded run's, still unbiased).
    NaN stays NaN, infinities stay infinite; a finite value above the largest bfloat16 may
    round to infinity. Derivatives pass straight through, as for rounding to nearest
    (``x.astype(jnp.bfloat16)``).
    """
    x = jnp.asarray(x, jnp.float32)
    index = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)  # row-major element index
    noise = _mix32(index * jnp.uint32(0x27D4EB2F) ^ _stochastic_seed(step, stream))
    noise = noise & jnp.uint32(0xFFFF)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    finite = jnp.isfinite(x)  # keeps NaN payloads and infinities as they are
    out = jax.lax.bitcast_convert_type(jnp.where(finite, rounded, bits), jnp.float32)
    return out.astype(jnp.bfloat16)  # exact where finite: the low 16 bits are zero


def _stochastic_seed(step: jax.Array, stream: int) -> jax.Array:
    """The uint32 seed of :func:`stochastic_round_bfloat16`'s bits for ``step`` and ``stream``
    (one seed per moment)."""
    return _mix32(
        jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(stream + 1)
    )


@stochastic_round_bfloat16.defjvp
def _stochastic_round_jvp(stream, primals, tangents):
    x, step = primals
    dx, _ = tangents
    out = stochastic_round_bfloat16(x, step, stream)
    return out, jnp.asarray(dx, jnp.float32).astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class FloatStorage:
    """Moments stored in a fixed floating dtype, computed in the promoted dtype.

    Attributes:
      dtype: the storage dtype.
      name: a label.
      rounding: how the new moments are rounded to ``dtype``: ``"nearest"`` (to nearest,
        ties to even; the default) or, for bfloat16, ``"stochastic"``
        (:func:`stochastic_round_bfloat16`: up or down with probabilities that make the
        stored value unbiased, seeded by the step count, so that a moment can drift by
        less than half an ulp per step, as ν with ``b2 = 0.999`` does; see
        ``docs/memory.md``).

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> store = od.FloatStorage(jnp.bfloat16, "bfloat16", rounding="stochastic")
      >>> tx = od.adamw(1e-3, b2=0.9995, state_dtype=store)
      >>> state = tx.init({"w": jnp.ones((4, 4))})
      >>> od.diagnostics.find_adam_state(state).nu["w"].dtype
      dtype(bfloat16)
    """

    dtype: Any
    name: str = "float"
    rounding: str = "nearest"

    def __post_init__(self):
        try:  # (jnp.dtype(None) is float64: None is not a dtype here)
            floating = self.dtype is not None and jnp.issubdtype(
                jnp.dtype(self.dtype), jnp.floating
            )
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(
                f"`dtype` of FloatStorage must be a floating dtype (e.g. jnp.bfloat16), got "
                f"{self.dtype!r}; for 8-bit state use BlockwiseInt8Storage or 'int8'."
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"`rounding` must be one of {ROUNDINGS}, got {self.rounding!r}.")
        if self.rounding == "stochastic" and jnp.dtype(self.dtype) != jnp.bfloat16:
            raise ValueError(
                f"`rounding`='stochastic' is implemented for bfloat16 storage only, got dtype "
                f"{jnp.dtype(self.dtype).name}."
            )

    @property
    def needs_step(self) -> bool:
        """Whether :func:`update_moments` must pass the step count (stochastic rounding)."""
        return self.rounding == "stochastic"

    @property
    def fused_update(self) -> bool:
        """Whether :func:`store_moments` runs :meth:`update` (stochastic rounding) rather
        than :meth:`write`."""
        return self.needs_step

    def init(self, param: jax.Array, signed: bool) -> jax.Array:
        del signed
        return jnp.zeros_like(param, dtype=self.dtype)  # keeps a concrete param's sharding

    def compute_dtype(self, like: jax.Array) -> Any:
        """``promote_types(dtype, like's dtype)``, at least float32: a bfloat16 or float16
        moment of a bfloat16 gradient is still averaged in float32 (in bfloat16 arithmetic
        ``b2 = 0.999`` would round to 1)."""
        return jnp.promote_types(jnp.promote_types(self.dtype, jnp.result_type(like)), jnp.float32)

    def read(self, stored: jax.Array, like: jax.Array) -> jax.Array:
        return stored.astype(self.compute_dtype(like))

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> jax.Array:
        del like, signed
        if jnp.finfo(self.dtype).maxexp < jnp.finfo(jnp.float32).maxexp:
            # float16: a moment beyond its range (nu of a gradient above ~8e3) is kept at the
            # largest finite value, as 8-bit storage keeps its scales finite; as inf it
            # would freeze the element for good (every later update exactly 0). NaN stays.
            big = jnp.finfo(self.dtype).max
            value = jnp.clip(value, -big, big)
        return narrow(value, self.dtype)

    def update(
        self,
        fn: Any,
        stored: tuple[Any, ...],
        operands: tuple[jax.Array, ...],
        like: jax.Array,
        signed: tuple[bool, ...],
        return_old: bool = False,
        step: jax.Array | None = None,
    ) -> Any:
        """:func:`update_moments`: the read-compute-write. With stochastic rounding, moment
        ``k`` of the update is rounded with stream ``k`` of ``step``."""
        if not self.needs_step:
            return _read_compute_write(self, fn, stored, operands, like, signed, return_old)
        values = fn(*(self.read(s, like) for s in stored), *operands)
        new = tuple(stochastic_round_bfloat16(v, step, stream=k) for k, v in enumerate(values))
        return (new, tuple(stored)) if return_old else new


@dataclasses.dataclass(frozen=True)
class BlockwiseInt8Storage:
    """8-bit block-wise quantized moments (``state_dtype="int8"``); see the module docstring.

    Attributes:
      block_size: elements per block :math:`B` (one float32 absmax each). 256 (default, as
        bitsandbytes' optimizers) costs 1.016 bytes per element, 2048 (the paper's) 1.002.
      min_size: parameters with fewer elements keep float32 moments (bitsandbytes'
        ``min_8bit_size``, default 4096). ``0`` quantizes everything.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> tx = od.adamw(1e-3, state_dtype=od.BlockwiseInt8Storage(block_size=256, min_size=0))
      >>> mu = od.diagnostics.find_adam_state(tx.init({"w": jnp.ones((16, 32))})).mu["w"]
      >>> mu.codes.shape, mu.codes.dtype, mu.absmax.shape
      ((2, 256), dtype('uint8'), (2,))

    References:
      Dettmers, Lewis, Shleifer & Zettlemoyer, `8-bit Optimizers via Block-wise Quantization
      <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
    """

    block_size: int = quant_lib.DEFAULT_BLOCK_SIZE
    min_size: int = 4096
    name: str = "int8"
    #: :func:`store_moments` runs :meth:`update` (the chunked requantization).
    fused_update = True

    def __post_init__(self):
        quant_lib._check_block_size(self.block_size)
        if not V.is_int(self.min_size) or self.min_size < 0:
            raise ValueError(f"`min_size` must be a non-negative int, got {self.min_size!r}.")

    def quantizes(self, param: Any) -> bool:
        """Whether a parameter of this size gets 8-bit moments (else float32)."""
        size = int(np.prod(jnp.shape(param), dtype=np.int64))
        return size > 0 and size >= self.min_size

    def init(self, param: jax.Array, signed: bool) -> Any:
        if not self.quantizes(param):
            return jnp.zeros_like(param, dtype=jnp.float32)
        # Quantizing zeros (rather than building the codes from scratch) keeps the state's
        # layout, and any sharding, derived from the parameter. Eagerly (e.g. an
        # `nnx.Optimizer` being made) as one compiled program per shape: op by op, each of
        # quantize's few dozen operations was compiled for every new shape (11.3 s for ten
        # weight matrices of different shapes on 2 CPU cores, against 1.9 s compiled). Not
        # on a mesh with Explicit axes, where a jit needs the mesh set as its context.
        concrete = isinstance(param, jax.Array) and not isinstance(param, jax.core.Tracer)
        compiled = concrete and quant_lib._explicit_sharding(param) is None
        quantize_zeros = _quantized_zeros_jit if compiled else _quantized_zeros
        q = quantize_zeros(param, signed=signed, block_size=self.block_size)
        # Eagerly, codes and scales go where `stored_sharding` (so `jit_init`) puts them. On
        # an Explicit mesh quantize already does that; on an Auto mesh the compiler's choice
        # can differ (e.g. replicated scales when the last block is padded).
        if concrete and isinstance(param.sharding, jax.sharding.NamedSharding):
            q = jax.device_put(q, stored_sharding(q, param.sharding))
        return q

    def compute_dtype(self, like: jax.Array) -> Any:
        """The dtype moments are read and updated in: float32, or ``like``'s if wider."""
        return jnp.promote_types(jnp.float32, jnp.result_type(like))

    def read(self, stored: Any, like: jax.Array) -> jax.Array:
        dtype = self.compute_dtype(like)
        if isinstance(stored, quant_lib.QuantizedArray):
            # The array (not just its shape): on an Explicit mesh the moment takes its sharding.
            return quant_lib.dequantize(stored, like).astype(dtype)
        return stored.astype(dtype)

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> Any:
        if not self.quantizes(like):
            return narrow(value, jnp.float32)  # (float64 moments of x64 parameters)
        return quant_lib.quantize(value, signed=signed, block_size=self.block_size)

    def update(
        self,
        fn: Any,
        stored: tuple[Any, ...],
        operands: tuple[jax.Array, ...],
        like: jax.Array,
        signed: tuple[bool, ...],
        return_old: bool = False,
    ) -> Any:
        """:func:`update_moments` for 8-bit moments.

        Quantized moments go through :func:`~optax_decoupled._src.quantization.requantize`
        (on CPU a chunk loop; elsewhere, and on a mesh with Explicit axes, whole arrays).
        Float32 moments of small parameters take the plain read-compute-write.
        """
        if not all(isinstance(s, quant_lib.QuantizedArray) for s in stored):
            return _read_compute_write(self, fn, stored, operands, like, signed, return_old)
        return quant_lib.requantize(
            fn,
            tuple(stored),
            tuple(operands),
            shape=jnp.shape(like),
            signed=signed,
            dtype=self.compute_dtype(like),
            return_old=return_old,
        )


def _quantized_zeros(param: jax.Array, *, signed: bool, block_size: int) -> Any:
    """:func:`~optax_decoupled._src.quantization.quantize` of float32 zeros shaped like ``param``
    (8-bit moments' initial value). The zeros pass through an optimization barrier: as
    constants, XLA folded their quantization while compiling ``init``, which took 5 s at
    1e6 parameters and 23 s at 4e6 (2 cores); computed when the program runs it takes
    milliseconds."""
    zeros = jax.lax.optimization_barrier(jnp.zeros_like(param, dtype=jnp.float32))
    return quant_lib.quantize(zeros, signed=signed, block_size=block_size)


_quantized_zeros_jit = jax.jit(_quantized_zeros, static_argnames=("signed", "block_size"))


def stored_sharding(stored: Any, param_sharding: Any) -> Any:
    """The sharding(s) for a stored moment whose parameter has ``param_sharding``.

    A plain array moment takes the parameter's sharding. A
    :class:`~optax_decoupled._src.quantization.QuantizedArray` gets its codes ``(n_blocks, B)`` and
    absmax ``(n_blocks,)`` split along their leading axis like the parameter's leading axis
    when that axis is sharded over ``S`` devices and ``S`` divides ``n_blocks`` (each device
    then holds the blocks of its own rows whenever ``(size / S) % B == 0``), and replicated
    otherwise. Other sharding kinds (a single device) are used as they are.
    """
    if not isinstance(stored, quant_lib.QuantizedArray):
        return param_sharding
    if not isinstance(param_sharding, jax.sharding.NamedSharding):
        return quant_lib.QuantizedArray(param_sharding, param_sharding, stored.signed)
    # The rule quantize itself follows on a mesh with Explicit axes.
    lead = quant_lib._block_spec(param_sharding, stored.codes.shape[0])
    P = jax.sharding.PartitionSpec
    codes, absmax = (P(), P()) if lead is None else (P(lead, None), P(lead))
    named = lambda p: jax.sharding.NamedSharding(param_sharding.mesh, p)  # noqa: E731
    return quant_lib.QuantizedArray(named(codes), named(absmax), stored.signed)


_INT8_NAMES = ("int8",)


def _is_storage(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("init", "read", "write"))


def _as_float_name(state_dtype: Any) -> str | None:
    if isinstance(state_dtype, str):
        return state_dtype if state_dtype in _FLOAT_NAMES else None
    try:
        dtype = np.dtype(state_dtype)
    except TypeError:
        return None
    return dtype.name if dtype.name in _FLOAT_NAMES else None


def resolve_storage(state_dtype: StateDtype, *, argument: str = "state_dtype") -> MomentStorage:
    """Returns the :class:`MomentStorage` for a ``state_dtype`` argument.

    Raises:
      ValueError: naming ``argument`` if the dtype is not one of the accepted values.

    Examples:
      >>> import optax_decoupled as od
      >>> od.resolve_storage("int8")
      BlockwiseInt8Storage(block_size=256, min_size=4096, name='int8')
      >>> od.resolve_storage("bfloat16").name
      'bfloat16'
    """
    if state_dtype is None:
        return ParamDtypeStorage()
    if isinstance(state_dtype, str) and state_dtype in _INT8_NAMES:
        return BlockwiseInt8Storage()
    if isinstance(state_dtype, type) and _is_storage(state_dtype):
        raise ValueError(
            f"`{argument}` got the class {state_dtype.__name__}, not a storage object: "
            f"write {state_dtype.__name__}() (or e.g. {state_dtype.__name__}(block_size=2048))."
        )
    if _is_storage(state_dtype):
        return state_dtype
    name = _as_float_name(state_dtype)
    if name is None:
        raise ValueError(
            f"`{argument}` must be None (the parameter dtype), 'float32', 'bfloat16', "
            f"'float16', 'float64' (or the matching jnp dtype), the string 'int8' (8-bit "
            f"block-wise) or "
            f"a storage object such as BlockwiseInt8Storage(block_size=2048), got "
            f"{state_dtype!r}."
        )
    return FloatStorage(dtype=jnp.dtype(name), name=name)


def resolve_moment_storages(
    state_dtype: Any,
    moments: tuple[str, ...],
    *,
    mu_dtype: Any = None,
    argument: str = "state_dtype",
) -> dict[str, MomentStorage]:
    """The storage of each moment in ``moments`` (e.g. ``("mu", "nu")``).

    ``state_dtype`` is one specification for all of them (see :func:`resolve_storage`) or a
    mapping from moment names to specifications; moments it does not name keep the
    parameter dtype (``None``). AMSGrad's ``nu_max`` is kept like ``nu``. ``mu_dtype`` is
    Optax's argument: the first moment created and kept in that dtype (computed in the
    promoted dtype, cast on write); it cannot be combined with a ``state_dtype`` for ``mu``.
    Moments given equal specifications share one storage object, which then updates them
    together.

    Raises:
      ValueError: naming ``argument`` (or ``mu_dtype``) for an unknown moment name, a
        specification that is not accepted, or ``mu`` given twice.
    """
    if isinstance(state_dtype, Mapping):
        unknown = sorted(set(state_dtype) - set(moments))
        if unknown:
            raise ValueError(
                f"`{argument}` names moments {unknown}; this transform keeps {list(moments)}."
            )
        specs = {m: state_dtype.get(m) for m in moments}
    else:
        specs = {m: state_dtype for m in moments}
    if mu_dtype is not None:
        if specs.get("mu") is not None:
            raise ValueError(
                f"`mu_dtype` and `{argument}` both set the first moment's storage: give one."
            )
        try:
            dtype = jnp.dtype(mu_dtype)
        except TypeError:
            raise ValueError(f"`mu_dtype` must be a dtype, got {mu_dtype!r}.") from None
        specs["mu"] = ParamDtypeStorage(dtype=dtype)
    stores: dict[str, MomentStorage] = {}
    for name, spec in specs.items():
        # Equal specifications share one storage object, so their moments update together.
        shared = next((stores[k] for k in stores if _same(specs[k], spec)), None)
        stores[name] = shared if shared is not None else resolve_storage(spec, argument=argument)
    return stores


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except (TypeError, ValueError):
        return False


def check_complex_support(store: MomentStorage, params: Any, argument: str) -> None:
    """Complex parameters need moments in their own dtype, or in Optax's ``mu_dtype``
    (cast as Optax casts): other storages raise a ``ValueError`` naming ``argument`` and the
    leaf."""
    if isinstance(store, ParamDtypeStorage):
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating):
            raise ValueError(
                f"`{argument}`={getattr(store, 'name', store)!r} cannot keep the moments of the "
                f"complex parameter {jax.tree_util.keystr(path)}: complex parameters need "
                "state_dtype=None (moments in the parameter's own dtype)."
            )


def storage_tree_map(fn, params: Any, *stored_trees: Any) -> Any:
    """Maps ``fn(param_leaf, *stored_subtrees)`` with ``params`` giving the structure.

    Stored moments may be pytrees of their own (quantized storage keeps codes and scales), so
    the parameter tree is the prefix every other tree is matched against.
    """
    return jax.tree.map(fn, params, *stored_trees)
