"""How optimizer moments are stored between steps.

Every moment (Adam's :math:`\\mu`, :math:`\\nu`, AMSGrad's :math:`\\nu_{\\max}`, Lion's
:math:`\\mu`) goes through one small interface, :class:`MomentStorage`:

* ``init(param, signed)`` returns the stored zeros for a parameter leaf;
* ``read(stored, like)`` returns the moment as an array in the *compute* dtype;
* ``write(value, like, signed)`` encodes an updated moment for storage.

A storage may also have ``update(fn, stored, operands, like, signed)``, a fused
read-modify-write that :func:`update_moments` uses when it exists (8-bit storage does), and
``output_kernel(fn, output, stored, g)``, the compiled CPU kernel that computes the moments
and the transform's output in one pass, or ``None``, for :func:`update_moments_and_output`
(8-bit and bfloat16 storage).

``signed`` says whether the moment can be negative (:math:`\\mu`) or not (:math:`\\nu`), which
matters to quantized storage. The update itself is always computed in the compute dtype:
``promote_types(storage dtype, gradient dtype)``, and at least float32 for bfloat16, float16
and 8-bit storage (with ``None``, ``promote_types(parameter dtype, gradient dtype)``: what
Optax computes in). So
low-precision storage changes only what
is kept between steps, never the arithmetic of one step.

Accepted ``state_dtype`` values:

=====================  ==========================================================
``None``               the parameter's own dtype, no casts (what Optax does)
``"float32"``          float32 moments (e.g. for bfloat16/float16 parameters)
``"bfloat16"``         bfloat16 moments, round-to-nearest-even on write
                       (:class:`FloatStorage`; on CPU the moving averages run in a
                       compiled kernel). With ``b2 > 0.998``, :math:`\\nu` cannot
                       decay (its step is under half an ulp) unless rounded
                       stochastically (:class:`FloatStorage` with
                       ``rounding="stochastic"``; ``docs/memory.md``)
``"float16"``          float16 moments
``"float64"``          float64 moments (with ``jax_enable_x64``)
``"int8"``             8-bit block-wise quantized moments (:class:`BlockwiseInt8Storage`
                       with its defaults: blocks of 256, tensors under 4096 elements in
                       float32)
a storage object       any :class:`MomentStorage`, e.g.
                       ``BlockwiseInt8Storage(block_size=2048, min_size=0)`` or
                       ``FloatStorage(jnp.bfloat16, "bfloat16", cpu_kernel=False)``
=====================  ==========================================================

``jnp.float32``, ``jnp.bfloat16`` and ``numpy.dtype`` objects are accepted too. Inside
``optax.inject_hyperparams`` pass a string or a storage object (``jnp.bfloat16`` is callable
and would be taken for a schedule).

**8-bit block-wise storage** (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
ICLR 2022). A moment of a parameter with at least ``min_size`` elements is kept as a
:class:`~optax_decoupled.quantization.QuantizedArray`: one uint8 code per element and one
float32 absmax per block of ``block_size`` consecutive (row-major) elements, i.e.
:math:`1 + 4/B` bytes per element (1.016 for :math:`B = 256`) instead of 4. Moments that can be
negative (:math:`\\mu`) use the signed dynamic map, non-negative ones (:math:`\\nu`,
:math:`\\nu_{max}`) the unsigned one, so :math:`\\nu` never reads back negative. Each step
dequantizes to float32, computes the update in float32 and requantizes the new moments, all
inside the (jitted) ``update``. Smaller tensors (biases, norms, the SSM's ``A_log``/``D``) stay
in float32, as in bitsandbytes (``min_8bit_size=4096``): they cost little memory and are the
most sensitive to quantization. See :mod:`optax_decoupled.quantization` for the maps, the
rounding, extreme values and the block layout (and how it lines up with leading-axis
sharding).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from optax_decoupled import _validation as V
from optax_decoupled import quantization as quant_lib
from optax_decoupled.moment_updates import EmaMoments

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
    :func:`optax_decoupled.quantization.requantize`);
    for any other the result is exactly the read-compute-write above, which XLA fuses.

    A transform computes its output from ``read(stored)`` separately (through
    :func:`update_moments_and_output`): XLA fuses that into the rest of the step (e.g. the
    parameter update), and for float storage it is the same expression (computed once).
    With ``return_old`` the result is ``(new, old)``, and the
    transform reads ``old`` instead of ``stored``: the same values, which 8-bit storage's
    CPU kernel copies while it updates ``stored`` in place (XLA would otherwise copy
    ``stored`` before the kernel overwrites it); other storages return ``stored`` itself.

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


def _with_rounding_step(fn: Any, step: Any) -> Any:
    """``fn`` carrying the step count that seeds stochastic rounding, where it is an
    :class:`~optax_decoupled.moment_updates.EmaMoments` (the kernels' update)."""
    if isinstance(fn, EmaMoments):
        return dataclasses.replace(fn, rounding_step=jnp.asarray(step))
    return fn


def update_moments_and_output(
    store: MomentStorage,
    fn: Any,
    output: Any,
    stored: tuple[Any, ...],
    g: jax.Array,
    *,
    signed: tuple[bool, ...],
    step: jax.Array | None = None,
    order: KernelOrder | None = None,
) -> tuple[tuple[Any, ...], jax.Array]:
    """``(new stored moments, u)``: :func:`update_moments` of ``fn`` with the gradient ``g``
    as its operand, and the transform's output ``u = output(new, old, g)`` from the new
    moments' values ``new = fn(*old, g)`` before they are stored and the old ones ``old =
    read(stored)`` (e.g. :class:`~optax_decoupled.moment_updates.AdamDirection`).

    Where the storage's ``output_kernel(fn, output, stored, g)`` names a compiled CPU kernel
    (8-bit and bfloat16 storage, the latter also with stochastic rounding), that
    kernel computes both in one pass on CPU and writes ``u`` in ``g``'s buffer when ``g`` is
    a value the program computes, as in a training step, and where ``g`` is an argument of
    the jitted function to a buffer of its own up to :data:`OUTPUT_BUFFER_MAX_BYTES`
    (:func:`_kernel_with_output`).
    Otherwise ``u`` is computed in XLA, fused into the rest of the step, from the old
    moments that ``update_moments(..., return_old=True)`` returns. With ``order`` (one
    :class:`KernelOrder` for all leaves of an update) the kernel calls run one after another.
    """
    kernel_for = getattr(store, "output_kernel", None)
    if kernel_for is not None:
        if getattr(store, "needs_step", False):
            _require_step(store, step)
            fn = _with_rounding_step(fn, step)  # the kernel's seeds (stochastic rounding)
        kernel = kernel_for(fn, output, tuple(stored), g)
        if kernel is not None:
            after = None if order is None else order.last
            written, u = _kernel_with_output(
                store, kernel, fn, output, tuple(stored), g, signed, after
            )
            if order is not None:
                order.last = jax.tree.leaves(written)[-1]
            return written, u
    written, old = update_moments(
        store, fn, stored, (g,), like=g, signed=signed, return_old=True, step=step
    )
    return written, _output_from(store, fn, output, old, g)


class KernelOrder:
    """Makes the CPU kernel calls of one update run one after another, in the order they are
    traced: pass the same instance to :func:`update_moments_and_output` for every leaf.

    Each call takes a result of the previous one as an operand it does not read
    (``cpu_kernel.requantize_ema(..., after=)``). Without that, XLA:CPU's scheduler (by
    default the one that favours concurrency) runs all of a tree's independent kernel calls
    first and only then the fusions that read their results (the parameter updates), so the
    temporaries of every call (the copies of the old moments, or the outputs) are live at
    once: 39 MiB for 20 leaves of :math:`10^6` parameters with 8-bit state, a block that
    glibc maps afresh, page by page, on every step (``docs/memory_log.md``, eighteenth
    session). In order, XLA reuses one leaf's temporaries for the next. Calls that write the
    output in place of a gradient the program computes (a training step) have no such
    temporaries and are not ordered (:func:`optax_decoupled.cpu_kernel.dispatch`). The
    transforms of this package use one per update; ``last`` is the previous call's result
    (``None`` before the first).
    """

    def __init__(self) -> None:
        self.last: jax.Array | None = None


#: Where the gradient is an argument of the jitted function, the kernel writes the
#: transform's output to a buffer of its own (rather than a copy of the old moments, from
#: which XLA computes it) when that buffer has at most this many bytes, or no more than the
#: copy (:func:`_output_in_kernel`).
OUTPUT_BUFFER_MAX_BYTES = 16 * 2**20


def _output_in_kernel(stored: tuple[Any, ...], g: jax.Array) -> bool:
    r"""Whether the kernel should write the output to a buffer of its own where ``g`` is an
    argument of the jitted function, rather than a copy of the old moments ``stored``.

    The output replaces XLA's fusion that decodes the old moments again, but both are
    temporaries of the program: the output 4 bytes per parameter, the copy 2 for Adam's
    8-bit moments (1 for Lion's, 3 for AMSGrad's) and 4 for Adam's bfloat16 ones. XLA:CPU
    allocates a program's temporaries as one block per run, which glibc serves from its heap
    up to 32 MiB (its largest dynamic mmap threshold) and above that maps afresh on every
    run; the kernel asks Linux for huge pages for either buffer when it is that large
    (``AdviseHugePages``). Measured (``docs/memory_log.md``, eighteenth session): the output was
    faster up to :math:`10^6` parameters with 8-bit state, and at :math:`10^7` and
    :math:`5\cdot10^7` with bfloat16 state (the same bytes as the copy); the copy, half the
    bytes, at :math:`10^7` with 8-bit state (20 MB from the heap against 40 MB mapped
    afresh). So the output goes to a buffer of its own up to :data:`OUTPUT_BUFFER_MAX_BYTES`
    (16 MiB: with :class:`KernelOrder` one leaf's temporaries are live at a time, well
    within glibc's threshold), and above that where it is no larger than the copy."""
    out_bytes = 4 * int(np.prod(jnp.shape(g)))
    old_bytes = sum(
        int(np.prod(jnp.shape(x))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(stored)
    )
    return out_bytes <= max(OUTPUT_BUFFER_MAX_BYTES, old_bytes)


def _kernel_with_output(store, kernel, fn, output, stored, g, signed, after=None):
    """:func:`update_moments_and_output` where a CPU kernel (``cpu_kernel.requantize_ema``
    or ``ema_bf16``) applies: in programs for one CPU device the kernel computes the moments
    and the output in one pass, writing the output in place of the gradient. Where the
    gradient is an argument of the jitted function (or eagerly), XLA would have to copy it
    for the kernel to overwrite, so the kernel writes the output to a buffer of its own where
    :func:`_output_in_kernel`, and otherwise a copy of the old moments, from which XLA
    computes the output, fused into the parameter update (``docs/memory.md``, Speed);
    elsewhere ``store``'s XLA program. ``after``: see :class:`KernelOrder`."""
    from optax_decoupled import cpu_kernel

    def other(u, ms, ops, o):
        xla_store = dataclasses.replace(store, cpu_kernel=False)
        seeded = {"step": u.rounding_step} if getattr(store, "needs_step", False) else {}
        written, old = xla_store.update(u, ms, ops, ops[0], signed, return_old=True, **seeded)
        return written, _output_from(xla_store, u, o, old, ops[0])

    def on_argument(u, ms, ops, o, after=None):
        if _output_in_kernel(ms, ops[0]):
            return kernel(u, ms, ops[0], output=o, output_in_place=False, after=after)
        written, old = kernel(u, ms, ops[0], emit_old=True, after=after)
        return written, _output_from(store, u, o, old, ops[0])

    return cpu_kernel.dispatch(
        fn,
        tuple(stored),
        (g,),
        kernel=kernel,
        cpu_other=other,
        other=other,
        output=output,
        argument_kernel=on_argument,
        after=after,
    )


def _output_from(store, fn, output, old, g):
    """``output(fn(*old_values, g), old_values, g)`` for the stored moments ``old``."""
    old_values = tuple(store.read(s, g) for s in old)
    return output(fn(*old_values, g), old_values, g)


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
    and ``jit``'s cache need)."""

    name: str = "param"

    def init(self, param: jax.Array, signed: bool) -> jax.Array:
        del signed
        return jnp.zeros_like(param)

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
    (the bfloat16 kernel takes these seeds, one per moment, and hashes the index as it does)."""
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
      cpu_kernel: for bfloat16 moments of float32 parameters on CPU, update the moments of
        Adam, AMSGrad and Lion with the compiled kernel when it is built
        (:func:`optax_decoupled.cpu_kernel.ema_bf16`; default ``True``): one pass that reads
        each stored moment once and writes the new one in place, where XLA:CPU's own
        program copies the old moments and makes two passes. The same values, except where
        XLA's program contracts a multiply-add (a few moments in a million, one bfloat16
        step apart; ``tests/test_cpu_kernel_bf16.py``). Other dtypes and platforms ignore
        it.
      rounding: how the new moments are rounded to ``dtype``: ``"nearest"`` (to nearest,
        ties to even; the default) or, for bfloat16, ``"stochastic"``
        (:func:`stochastic_round_bfloat16`: up or down with probabilities that make the
        stored value unbiased, seeded by the step count, so that a moment can drift by
        less than half an ulp per step, as ν with ``b2 = 0.999`` does; see
        ``docs/memory.md``). On CPU the bfloat16 kernel rounds stochastically too, with
        the same bits.
    """

    dtype: Any
    name: str = "float"
    cpu_kernel: bool = True
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
        if not isinstance(self.cpu_kernel, bool):
            raise ValueError(f"`cpu_kernel` must be True or False, got {self.cpu_kernel!r}.")
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
        """:func:`update_moments`: the read-compute-write, or on CPU, for bfloat16 moments
        of a moving-average update, the compiled kernel (in programs compiled for one
        device, like 8-bit storage's; see :mod:`optax_decoupled.cpu_kernel`). With
        stochastic rounding, moment ``k`` of the update is rounded with stream ``k`` of
        ``step`` (by the kernel too, which gives the same bits)."""
        if self.needs_step:
            fn = _with_rounding_step(fn, step)

            def xla(u, ms, ops):
                values = u(*(self.read(s, like) for s in ms), *ops)
                seed_step = u.rounding_step if isinstance(u, EmaMoments) else step
                new = tuple(
                    stochastic_round_bfloat16(v, seed_step, stream=k) for k, v in enumerate(values)
                )
                return (new, tuple(ms)) if return_old else new

        else:
            plain = functools.partial(_read_compute_write, self, like=like, signed=signed)

            def xla(u, ms, ops):
                return plain(u, ms, ops, return_old=return_old)

        if not self._kernel_applies(fn, stored, operands, like):
            return xla(fn, stored, operands)
        from optax_decoupled import cpu_kernel

        return cpu_kernel.dispatch(
            fn,
            tuple(stored),
            tuple(operands),
            kernel=cpu_kernel.ema_bf16,
            cpu_other=xla,
            other=xla,
            return_old=return_old,
        )

    def output_kernel(self, fn: Any, output: Any, stored: tuple[Any, ...], g: jax.Array) -> Any:
        """For :func:`update_moments_and_output`: ``cpu_kernel.ema_bf16`` where it applies to
        the update and the output (bfloat16 moments computed in float32), else ``None``."""
        from optax_decoupled import cpu_kernel

        applies = self._kernel_applies(fn, stored, (g,), g)
        return cpu_kernel.ema_bf16 if applies and cpu_kernel.applies_output(output, fn) else None

    def _kernel_applies(self, fn, stored, operands, like) -> bool:
        """Whether ``cpu_kernel.ema_bf16`` can run ``fn`` (:func:`cpu_kernel.applies_bf16`):
        bfloat16 moments, computed in float32, the kernel not turned off."""
        from optax_decoupled import cpu_kernel  # imports quantization, which imports nothing here

        return (
            self.cpu_kernel
            and jnp.dtype(self.dtype) == jnp.bfloat16
            and self.compute_dtype(like) == jnp.float32
            and cpu_kernel.applies_bf16(fn, tuple(stored), tuple(operands))
        )


@dataclasses.dataclass(frozen=True)
class BlockwiseInt8Storage:
    """8-bit block-wise quantized moments (``state_dtype="int8"``); see the module docstring.

    Attributes:
      block_size: elements per block :math:`B` (one float32 absmax each). 256 (default, as
        bitsandbytes' optimizers) costs 1.016 bytes per element, 2048 (the paper's) 1.002.
      min_size: parameters with fewer elements keep float32 moments (bitsandbytes'
        ``min_8bit_size``, default 4096). ``0`` quantizes everything.
      cpu_kernel: on CPU, update the moments of Adam, AMSGrad and Lion with the compiled
        multi-threaded kernel when it is built (:mod:`optax_decoupled.cpu_kernel`; default
        ``True``). ``False`` keeps XLA's chunk loop. Either gives the same result up to
        float32 rounding; other platforms ignore it.
    """

    block_size: int = quant_lib.DEFAULT_BLOCK_SIZE
    min_size: int = 4096
    cpu_kernel: bool = True
    name: str = "int8"

    def __post_init__(self):
        quant_lib._check_block_size(self.block_size)
        if not V.is_int(self.min_size) or self.min_size < 0:
            raise ValueError(f"`min_size` must be a non-negative int, got {self.min_size!r}.")
        if not isinstance(self.cpu_kernel, bool):
            raise ValueError(f"`cpu_kernel` must be True or False, got {self.cpu_kernel!r}.")

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

        Quantized moments go through :func:`optax_decoupled.quantization.requantize`
        (on CPU the compiled kernel or a chunk loop; on a mesh with Explicit axes, whole
        arrays). Float32 moments of small parameters take the plain read-compute-write.
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
            kernel=self.cpu_kernel,
            return_old=return_old,
        )

    def output_kernel(self, fn: Any, output: Any, stored: tuple[Any, ...], g: jax.Array) -> Any:
        """For :func:`update_moments_and_output`: ``cpu_kernel.requantize_ema`` where it
        applies to the update and the output (:func:`optax_decoupled.cpu_kernel.applies`,
        :func:`~optax_decoupled.cpu_kernel.applies_output`), else ``None``."""
        from optax_decoupled import cpu_kernel  # imports quantization, which imports nothing here

        applies = (
            self.cpu_kernel
            and all(isinstance(s, quant_lib.QuantizedArray) for s in stored)
            and cpu_kernel.applies(fn, stored, (g,), self.compute_dtype(g))
            and cpu_kernel.applies_output(output, fn)
        )
        return cpu_kernel.requantize_ema if applies else None


def _quantized_zeros(param: jax.Array, *, signed: bool, block_size: int) -> Any:
    """:func:`~optax_decoupled.quantization.quantize` of float32 zeros shaped like ``param``
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
    :class:`~optax_decoupled.quantization.QuantizedArray` gets its codes ``(n_blocks, B)`` and
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


def storage_tree_map(fn, params: Any, *stored_trees: Any) -> Any:
    """Maps ``fn(param_leaf, *stored_subtrees)`` with ``params`` giving the structure.

    Stored moments may be pytrees of their own (quantized storage keeps codes and scales), so
    the parameter tree is the prefix every other tree is matched against.
    """
    return jax.tree.map(fn, params, *stored_trees)
