r"""The compiled CPU kernels for 8-bit and bfloat16 moment updates (XLA FFI custom calls).

On CPU, :func:`optax_decoupled.quantization.requantize` runs the moment update of Adam,
AMSGrad and Lion (an :class:`~optax_decoupled.moment_updates.EmaMoments`) on 8-bit state as
one call of a C++ kernel, ``csrc/requantize_cpu.cc``, built with the package (a setuptools
extension compiled against the XLA FFI headers that jaxlib ships). Per block of :math:`B`
elements it decodes the stored codes, applies the moving averages, takes the new absmax and
encodes the new values, reading and writing each block once, with the blocks spread over
XLA's intra-op threads. XLA's own program for this runs as a loop on one core
(``docs/memory.md``, Speed). On x86-64 CPUs with AVX-512 the kernel decodes the codes with
register permutes, chosen at run time: byte permutes where the CPU has AVX-512 VBMI and
VBMI2 (the map as four planes of bytes, :func:`uses_avx512_vbmi`), else 32-bit permutes (the
256-entry map held in 16 registers, :func:`uses_avx512`); on those with AVX2 but not
AVX-512, with 256-bit vectors filled by scalar loads (:func:`uses_avx2`; not on AMD Zen 1);
elsewhere, loops the compiler vectorized, with the same values. The encoder's table lookup
is an AVX-512 gather, or with AVX-512 VBMI byte permutes of a table of at most 256 entries
derived from the same one (``EncodeBlockVbmi``, the same codes; 15-30% faster 8-bit update
steps on a Zen 4 EPYC, whose gather is slow, ``docs/memory_log.md``; its arithmetic on 16-bit
halves of the values since 2026-12-06, the encoder alone 1.3-1.4x faster again there), or
with AVX2 scalar loads (``EncodeBlockAvx2``; about 12% faster update steps than the
compiler's loops on a Zen 3 EPYC).

The kernel computes what :func:`~optax_decoupled.quantization.dequantize`, the update and
:func:`~optax_decoupled.quantization.quantize` compute, in float32, in the order ``jnp``
writes it with every multiply and add rounded (no fused multiply-adds), and finds the codes
with the lookup table of :func:`~optax_decoupled.quantization.quantize_normalized`, packed
(:func:`encoder_table`): the exact nearest codes. ``tests/test_cpu_kernel.py`` checks the
whole update bit for bit against a NumPy float32 reference, and the encoder against XLA's
on every float32 within 4096 ulps of every decision point of both maps.

The transforms' output (Adam's :math:`\hat\mu/(\sqrt{\hat\nu}+\epsilon)`, AMSGrad's, Lion's
sign; :class:`~optax_decoupled.moment_updates.AdamDirection`,
:class:`~optax_decoupled.moment_updates.LionDirection`) is computed from the float32 moments
before they are quantized, as bitsandbytes does. Where the gradient is computed in the same
program (a training step) the kernel computes it in its pass too and writes it in the
gradient's buffer (``requantize_ema(..., output=...)``); where the gradient is an argument
of the jitted function (an update step of its own), XLA would have to copy it first, so the
kernel writes it to a buffer of its own (``output_in_place=False``) up to 16 MiB
(:data:`optax_decoupled.storage.OUTPUT_BUFFER_MAX_BYTES`) or where it is no larger than a copy
of the old moments (bfloat16 Adam), and otherwise such a copy, from which XLA computes the
output, fused into the parameter update (``emit_old``).
:func:`single_device_or` tells the two apart when the program is lowered. The calls for the
leaves of one update run one after another (``after=``,
:class:`optax_decoupled.storage.KernelOrder`), so that their temporaries are not all live
at once. The kernel's output rounds each operation as XLA:CPU's program of the
formula does (the bias corrections as multiplications by their reciprocals); XLA, fusing the
output into the rest of a step, may contract a multiply-add, so the two can differ by an ulp.

Only programs compiled for one device call the kernel: XLA cannot partition a custom call,
so :func:`single_device_or` chooses when the program is lowered, and sharded programs (and
``shard_map`` bodies, :func:`in_manual_context`) keep XLA's loop. So do programs serialized
with ``jax.export``, which may run where the kernel is not registered (and which
``jax.export`` would refuse: the call has no compatibility guarantees).

The same library has a second handler, :func:`ema_bf16`, for moments stored in bfloat16
(``state_dtype="bfloat16"`` of float32 parameters): one pass that widens each stored moment,
applies the moving averages in float32 and writes the new moments, rounded to nearest-even,
in place, with a copy of the old ones for the transform's output, where XLA:CPU's own
program copies the old moments and makes two passes (``docs/memory.md``, *bfloat16 state*);
like the 8-bit kernel it computes the transform's output in its pass where the gradient is
computed in the program (``ema_bf16(..., output=...)``).
It is chosen as the 8-bit kernel is (:func:`applies_bf16`, :func:`single_device_or`), and
``FloatStorage(jnp.bfloat16, "bfloat16", cpu_kernel=False)`` turns it off.

If the extension was not built (no C++ compiler at install time) or cannot be loaded,
:func:`available` is ``False``, 8-bit storage uses XLA's chunk loop and bfloat16 storage
XLA's own program (the same results up to float32 rounding; 8-bit AdamW steps measured
about 1.5-4x slower, bfloat16 ones up to about 1.8x, depending on the CPU,
``docs/memory.md``): the first such update traced with the CPU as the default backend says
so with a :class:`RuntimeWarning` that gives :func:`unavailable_reason`. In a checkout or an
editable install a library compiled from another version of ``csrc/requantize_cpu.cc`` than
the one next to it (a rebuild that failed to compile leaves the previous library, since the
extension is optional) still loads, with a :class:`RuntimeWarning`
(:func:`source_matches_build`).
``cpu_kernel=False`` on the storage chooses XLA's program explicitly (no warning). GPUs and
TPUs never use the kernels. A program that differentiates through the update (e.g. a
meta-gradient w.r.t. the learning rate) takes the derivative of XLA's program; the kernel
still computes the values.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import pathlib
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from optax_decoupled import moment_updates
from optax_decoupled import quantization as quant_lib

#: Name of the FFI target (registered for the CPU platform on first use).
TARGET = "optax_decoupled_requantize_ema"
_LIBRARY = "_requantize_cpu"
_SYMBOL = "OdRequantizeEma"
#: Name of the FFI target for bfloat16 moments (:func:`ema_bf16`).
BF16_TARGET = "optax_decoupled_ema_bf16"
_BF16_SYMBOL = "OdEmaBf16"

#: Header length of an encoder table (csrc/requantize_cpu.cc).
_HEADER = 8

_load_error: str | None = None
_lib: ctypes.CDLL | None = None

#: Which decode and encoder 8-bit kernel calls traced from now on may use (for tests: all
#: give the same values): ``"best"``, what the kernel picks at run time (AVX-512 VBMI byte
#: permutes, else AVX-512F register permutes, else AVX2 gathers, else the portable loops;
#: the AVX-512 encoder, an explicit gather, with either AVX-512 decode, the AVX2 encoder
#: with the AVX2 decode); ``"avx512f"``, no VBMI; ``"avx2"``, no AVX-512; or
#: ``"portable"``, the compiler-vectorized loops only.
DECODE = "best"
_DECODE_LIMITS = {"best": 0, "avx512f": 1, "avx2": 2, "portable": 3}


def _library_path() -> pathlib.Path | None:
    here = pathlib.Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{_LIBRARY}{suffix}"
        if path.exists():
            return path
    return None


@functools.lru_cache(maxsize=1)
def _register() -> bool:
    """Loads the compiled library and registers its FFI target for the CPU (once)."""
    global _load_error, _lib
    ffi = getattr(jax, "ffi", None)
    if ffi is None or not hasattr(ffi, "ffi_call"):
        _load_error = f"jax {jax.__version__} has no jax.ffi.ffi_call"
        return False
    path = _library_path()
    if path is None:
        _load_error = f"the extension {_LIBRARY} was not built (no C++ compiler at install?)"
        return False
    try:
        lib = ctypes.CDLL(str(path))
        built, running = _ffi_api_version(lib), _jaxlib_ffi_api_version()
        if not ffi_api_compatible(built, running):
            _load_error = (
                f"{path.name} was compiled against XLA FFI API {built[0]}.{built[1]}, which "
                f"the installed jaxlib's FFI API {running[0]}.{running[1]} cannot load (jax "
                f"{jax.__version__}; pip builds in an isolated environment with the newest "
                "jax): reinstall it against "
                "the installed jax, e.g. pip install --no-build-isolation --force-reinstall "
                "--no-deps optax-decoupled (from a checkout: -e .)"
            )
            return False
        ffi.register_ffi_target(TARGET, ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
        ffi.register_ffi_target(
            BF16_TARGET, ffi.pycapsule(getattr(lib, _BF16_SYMBOL)), platform="cpu"
        )
    except Exception as e:  # noqa: BLE001 - any failure means: use the XLA path
        _load_error = f"loading {path.name} failed: {e!r}"
        return False
    _lib = lib
    if source_matches_build() is False:
        warnings.warn(
            f"{path.name} was built from another version of csrc/requantize_cpu.cc than the "
            "one next to it (the extension is optional: a change that does not compile keeps "
            "the previous library). Rebuild it, e.g. pip install --no-deps -e ., and read "
            "the compiler's output.",
            RuntimeWarning,
            stacklevel=2,
        )
    return True


#: The kernel's source, where the package is a checkout or an editable install (a wheel
#: carries only the compiled library).
SOURCE = pathlib.Path(__file__).parent / "csrc" / "requantize_cpu.cc"


def built_source_sha256() -> str | None:
    """The SHA-256 of ``csrc/requantize_cpu.cc`` that the loaded library was compiled from
    (``setup.py`` compiles it in), or ``None`` where no library is loaded or it predates the
    record. Loads the library if it is not loaded yet."""
    if _lib is None and not _register():  # (_register sets _lib before it asks)
        return None
    if not hasattr(_lib, "OdSourceSha256"):
        return None
    fn = _lib.OdSourceSha256
    fn.restype = ctypes.c_char_p
    return fn().decode()


def source_matches_build(source: pathlib.Path | None = None) -> bool | None:
    """Whether the loaded library was compiled from ``source`` (default :data:`SOURCE`) as
    it is now. ``None`` where that cannot be told: no library loaded, a library without the
    record, or no source file (a wheel install). A ``False`` means a stale build: the
    extension is optional, so a rebuild that failed to compile left the previous library in
    place (:func:`available` then warns once)."""
    source = SOURCE if source is None else pathlib.Path(source)
    built = built_source_sha256()
    if built is None or built == "unknown" or not source.is_file():
        return None
    return hashlib.sha256(source.read_bytes()).hexdigest() == built


def _ffi_api_version(lib: ctypes.CDLL) -> tuple[int, int]:
    """The XLA FFI API version (major, minor) the library was compiled against."""
    major, minor = divmod(int(lib.OdFfiApiVersion()), 1000)
    return major, minor


def _jaxlib_ffi_api_version() -> tuple[int, int] | None:
    """The XLA FFI API version (major, minor) of the running jaxlib, from the FFI header it
    ships (``jax.ffi.include_dir()``; ``None`` if that cannot be read)."""
    try:
        header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
        text = header.read_text()
        major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.MULTILINE)
        minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.MULTILINE)
        return int(major.group(1)), int(minor.group(1))
    except (AttributeError, OSError, ValueError):
        return None


def ffi_api_compatible(built: tuple[int, int], running: tuple[int, int] | None) -> bool:
    """Whether a handler compiled against XLA FFI API ``built`` can be registered with a
    jaxlib of API ``running``: the same major version and a minor version no newer than
    the jaxlib's (XLA keeps accepting older minor versions; a newer one makes the CPU backend
    fail to start). Unknown (``None``): assumed compatible."""
    if running is None:
        return True
    return built[0] == running[0] and built[1] <= running[1]


def available() -> bool:
    """Whether the compiled CPU kernel is built and registered with XLA."""
    return _register()


_calls_compiled = 0


def calls_compiled() -> int:
    """How many kernel calls (either kernel) this process has lowered into compiled programs:
    a count of the choices :func:`single_device_or` made for the kernel. What tells whether
    a run used the kernels (the report records it): programs inside ``shard_map``, sharded
    ones and those for other platforms never call them."""
    return _calls_compiled


def uses_avx512() -> bool:
    """Whether the kernel decodes the stored codes with AVX-512 register permutes and
    encodes the new ones with AVX-512 gathers on this CPU (an x86-64 CPU with AVX-512F;
    elsewhere the compiler-vectorized loops, with the same values). ``False`` when the
    kernel is not available."""
    if not _register():
        return False
    return bool(_lib.OdUsesAvx512())


def uses_avx512_vbmi() -> bool:
    """Whether the kernel decodes the stored codes with AVX-512 VBMI byte permutes on this
    CPU (AVX-512F, BW, VBMI and VBMI2: Intel Ice Lake and later, AMD Zen 4 and later), which
    is faster than the register permutes of :func:`uses_avx512` (the same values), and
    encodes them with byte permutes of a table of at most 256 entries, on 16-bit halves of
    the values, instead of an AVX-512 gather (the same codes)."""
    if not _register():
        return False
    return bool(_lib.OdUsesAvx512Vbmi())


def uses_avx2() -> bool:
    """Whether the kernel decodes the stored codes and encodes the new ones with AVX2
    loads on this CPU (an x86-64 CPU with AVX2 but not AVX-512, e.g. AMD Zen 2 and 3,
    Intel Haswell to Alder Lake), which is faster than the compiler-vectorized loops (the
    same values). ``False`` when the kernel is not available; on CPUs with AVX-512, whose
    own decodes run instead; and on AMD Zen 1, which splits 256-bit operations in two and
    where the compiler's 128-bit loops measured faster (``docs/memory_log.md``)."""
    if not _register():
        return False
    return bool(_lib.OdUsesAvx2())


def decode_paths() -> tuple[str, ...]:
    """The values of :data:`DECODE` that run different code on this CPU, best first: of
    ``"best"`` (here the AVX-512 VBMI code), ``"avx512f"``, ``"avx2"`` and ``"portable"``,
    those the CPU has, each once (a value whose instruction set the CPU lacks runs the
    next one down, which is listed already). For tests, which run each of them."""
    paths = []
    if uses_avx512_vbmi():
        paths.append("best")
    if uses_avx512():
        paths.append("avx512f")
    if uses_avx512() or uses_avx2():  # every CPU with AVX-512 has AVX2
        paths.append("avx2")
    return (*paths, "portable")


def unavailable_reason() -> str | None:
    """Why :func:`available` is ``False`` (``None`` when it is ``True``)."""
    return None if _register() else _load_error


@functools.lru_cache(maxsize=2)
def encoder_table(signed: bool) -> np.ndarray:
    r"""The lookup table of :func:`~optax_decoupled.quantization.quantize_normalized`,
    packed for the kernel (int32).

    Layout (``csrc/requantize_cpu.cc``): a header ``[shift, first, n, signed]`` padded to 8,
    then ``n`` entries for :math:`y \ge 0` and ``n`` for :math:`y < 0`. Entry ``i`` covers
    the float32 bits of :math:`|y|` in ``[(first + i) << shift, (first + i + 1) << shift)``
    (the first entry also everything below, the last everything above) and holds
    ``(low << 8) | below``: the code below the one decision point the interval may contain,
    and that point's bits under ``shift`` (``2**shift``, never exceeded, when there is none).
    The code is ``below`` plus one step away from zero when :math:`|y|`'s low bits exceed
    ``low``: the comparison ``|y| > threshold`` of the XLA path, as the high bits are equal.

    Entries below ``first`` of the full table are dropped: they all equal entry ``first``
    (checked), since the map has no value that small.
    """
    t = quant_lib._tables(bool(signed))
    n_full = t.code_pair.shape[1]
    index = np.arange(n_full, dtype=np.int64)
    never = 1 << t.shift
    sides = []
    first = n_full - 1
    for side in range(2):
        below = (t.code_pair[side] & 0xFF).astype(np.int64)
        thr = t.threshold[side]
        finite = np.isfinite(thr)
        low = np.full(n_full, never, np.int64)
        low[finite] = thr[finite].view(np.uint32).astype(np.int64) - (index[finite] << t.shift)
        assert np.all((low[finite] >= 0) & (low[finite] < never))  # the point is in its entry
        packed = (low << 8) | below
        differs = np.nonzero(packed != packed[0])[0]
        if len(differs):
            first = min(first, int(differs[0]) - 1)
        sides.append(packed)
    first = max(first, 0)
    assert all(np.all(p[: first + 1] == p[first]) for p in sides)
    n = n_full - first
    header = [t.shift, first, n, int(bool(signed))] + [0] * (_HEADER - 4)
    table = np.concatenate([np.asarray(header, np.int64)] + [p[first:] for p in sides])
    assert table.max() < 2**31
    return table.astype(np.int32)


def _f32_coefficient(x: Any) -> jax.Array | None:
    """``x`` as a float32 scalar exactly as ``jnp`` would multiply it into a float32 array
    (a Python number is rounded to float32), or ``None`` if it is not a float32 scalar."""
    if isinstance(x, int | float):
        return jnp.asarray(np.float32(x))
    x = jnp.asarray(x)
    if x.dtype != jnp.float32 or x.ndim != 0:
        return None
    return x


def _kernel_may_take(
    update: Any, stored: tuple[Any, ...], operands: tuple[Any, ...], arrays: tuple[Any, ...]
) -> bool:
    """What both kernels need: an :class:`~optax_decoupled.moment_updates.EmaMoments` on its
    stored moments and one float32 operand (the gradient), with float32 coefficients, the
    library built (else the warning of :func:`_warn_unavailable`), and not inside
    ``shard_map`` (``arrays``: the traced arrays, see :func:`in_manual_context`)."""
    if not isinstance(update, moment_updates.EmaMoments):
        return False
    if not available():
        _warn_unavailable()
        return False
    if in_manual_context(*arrays):
        return False  # inside shard_map: XLA's program (see in_manual_context)
    if len(stored) != update.num_stored or len(operands) != 1:
        return False
    if jnp.result_type(operands[0]) != jnp.float32:
        return False
    coefficients = [*update.decays]
    if update.max_divisor is not None:
        coefficients.append(update.max_divisor)
    return all(_f32_coefficient(c) is not None for c in coefficients)


def applies(update: Any, stored: tuple[Any, ...], operands: tuple[Any, ...], dtype: Any) -> bool:
    """Whether :func:`requantize_ema` can compute ``update`` on these arguments: an
    :class:`~optax_decoupled.moment_updates.EmaMoments` with float32 coefficients, float32
    arithmetic and gradient, and 2-D codes (inside ``vmap`` the batch is unstacked), not on
    a mesh with Explicit axes (whose sharded types only XLA's whole-array program keeps)."""
    arrays = (*operands, *(q.codes for q in stored))
    if any(quant_lib._explicit_sharding(x) is not None for x in arrays):
        return False
    if not _kernel_may_take(update, stored, operands, arrays):
        return False
    if jnp.dtype(dtype) != jnp.float32:
        return False
    return all(q.codes.ndim == 2 and q.codes.dtype == jnp.uint8 for q in stored)


_warned = False


def _warn_unavailable() -> None:
    """Warns once per process that CPU programs take XLA's slower loop (see the module
    docstring); silent where the CPU is not the default backend."""
    global _warned
    if _warned or jax.default_backend() != "cpu":
        return
    _warned = True
    warnings.warn(
        f"optax_decoupled: the compiled CPU kernel for 8-bit and bfloat16 optimizer state is "
        f"unavailable ({unavailable_reason()}); their updates use XLA's own programs, with the "
        "same results but slower steps (about 1.5-4x for 8-bit, up to 1.8x for bfloat16 state). "
        "Reinstall with a C++ compiler present to build it, or pass "
        "state_dtype=optax_decoupled.BlockwiseInt8Storage(cpu_kernel=False) (or "
        "FloatStorage(jnp.bfloat16, 'bfloat16', cpu_kernel=False)) to choose XLA's program.",
        RuntimeWarning,
        stacklevel=2,
    )


def applies_output(output: Any, update: Any) -> bool:
    """Whether :func:`requantize_ema` can compute the transform's ``output`` with ``update``
    (an :class:`~optax_decoupled.moment_updates.AdamDirection` after Adam's or AMSGrad's
    moments, a :class:`~optax_decoupled.moment_updates.LionDirection` after Lion's), all
    its coefficients float32 scalars."""
    if isinstance(output, moment_updates.AdamDirection):
        if len(update.decays) != 2 or update.running_max != (output.amsgrad is not None):
            return False
    elif isinstance(output, moment_updates.LionDirection):
        if len(update.decays) != 1 or update.running_max:
            return False
    else:
        return False
    return all(_f32_coefficient(v) is not None for v in _output_values(output))


def _output_values(output: Any) -> tuple[Any, ...]:
    """The kernel's four output coefficients: Adam's ``(1 - b1^t, 1 - b2^t, eps, eps_root)``
    (the kernel multiplies by the reciprocals of the first two, as XLA:CPU compiles a
    division by a scalar), Lion's ``(1 - b1, b1, 0, 0)``, or zeros for no output."""
    if isinstance(output, moment_updates.AdamDirection):
        return (output.bc1, output.bc2, output.eps, output.eps_root)
    if isinstance(output, moment_updates.LionDirection):
        return (1 - output.b1, output.b1, 0.0, 0.0)  # as jnp computes `1 - b1`
    return (0.0,) * 4


def _output_coefficients(output: Any) -> jax.Array:
    """:func:`_output_values` as the kernel's float32 operand."""
    return jnp.stack([_f32_coefficient(v) for v in _output_values(output)])


def _output_layout(output: Any) -> dict[str, np.int64]:
    """The kernel's attributes that describe ``output``."""
    adam = isinstance(output, moment_updates.AdamDirection)
    mode = 1 if adam else 2 if isinstance(output, moment_updates.LionDirection) else 0
    return dict(
        out_mode=np.int64(mode),
        out_den=np.int64(output.denominator if adam else 0),
        out_scale_num=np.int64(adam and output.scales_numerator),
        out_scale_den=np.int64(adam and output.scales_denominator),
    )


def requantize_ema(
    update: moment_updates.EmaMoments,
    stored: tuple[quant_lib.QuantizedArray, ...],
    g: jax.Array,
    *,
    emit_old: bool = False,
    output: Any = None,
    output_in_place: bool = True,
    after: jax.Array | None = None,
) -> Any:
    """``quantize(update(*dequantize(stored), g))`` per moment, by the compiled kernel.

    Call only where :func:`applies` is true and on the CPU (``quantization.requantize``
    dispatches with :func:`platform_dependent`).

    With ``emit_old`` (what the transforms use where the gradient is an argument of the
    jitted function, through :func:`optax_decoupled.storage.update_moments_and_output`, and
    ``storage.update_moments(..., return_old=True)``) the result is ``(new, old)``: ``old``
    is a copy of ``stored`` that the kernel writes as it reads each block, for XLA to
    compute the output from, fused into the parameter update, and the new codes and scales
    are written in place of ``stored``. The
    kernel is then the only reader of ``stored``, and with the state donated XLA copies
    nothing. Without it the kernel writes the new moments to buffers of their own, and a
    caller that still reads ``stored`` afterwards makes XLA copy it first (measured:
    ``docs/memory.md``, Speed).

    With ``output`` (where :func:`applies_output`; what the transforms use, through
    :func:`optax_decoupled.storage.update_moments_and_output`) the result is ``(new, u)``:
    the kernel also computes the transform's output ``u = output(new moments, old moments,
    g)`` in the same pass, from the float32 moments before they are quantized, and writes it
    in place of ``g`` (XLA copies ``g`` first when the program still needs it, or when it is
    an argument of the jitted function, donated or not), or with ``output_in_place=False``
    to a buffer of its own. The new codes are written in place of ``stored``.

    ``after``, any array, is passed to the call as an operand it does not read: the call
    then runs after the computation of ``after``. The transforms pass a result of the
    previous leaf's call (:class:`optax_decoupled.storage.KernelOrder`).
    """
    if not available():
        raise RuntimeError(f"the CPU kernel is not available: {unavailable_reason()}")
    args = [g, _coefficients(update), _output_coefficients(output)]
    new_types, in_place = [], {}
    for k, q in enumerate(stored):
        qmap = jnp.asarray(quant_lib._dynamic_map(q.signed))
        args += [qmap, jnp.asarray(encoder_table(q.signed)), q.codes, q.absmax]
        new_types += [
            jax.ShapeDtypeStruct(q.codes.shape, jnp.uint8),
            jax.ShapeDtypeStruct(q.absmax.shape, jnp.float32),
        ]
        in_place |= {3 + 4 * k + 2: 2 * k, 3 + 4 * k + 3: 2 * k + 1}  # codes, absmax
    out_types, aliases = _results(
        new_types, in_place, g, emit_old=emit_old, output=output, in_g=output_in_place
    )
    call = jax.ffi.ffi_call(
        TARGET, out_types, vmap_method="sequential", input_output_aliases=aliases
    )
    outs = call(
        *args,
        *(() if after is None else (after,)),
        **_layout(update),
        **_output_layout(output),
        decode_limit=np.int64(_DECODE_LIMITS[DECODE]),
        emit_old=np.int64(emit_old),
        n_after=np.int64(after is not None),
    )
    groups = [
        tuple(
            quant_lib.QuantizedArray(outs[o + 2 * k], outs[o + 2 * k + 1], q.signed)
            for k, q in enumerate(stored)
        )
        for o in range(0, len(outs) - (output is not None), len(new_types))
    ]
    if output is not None:
        return groups[0], outs[-1]
    return tuple(groups) if emit_old else groups[0]


def _results(
    new_types: list[Any],
    in_place: dict[int, int],
    g: jax.Array,
    *,
    emit_old: bool,
    output: Any,
    in_g: bool = True,
) -> tuple[list[Any], dict[int, int]]:
    """Both kernels' results and aliases: the new moments (``new_types``), then with
    ``emit_old`` a copy of the old ones, or with ``output`` the transform's output, in
    ``g``'s buffer (operand 0) if ``in_g``. ``in_place`` maps the stored moments' operands to
    their new moments' results, which are written in place when the caller no longer reads
    the old ones (``emit_old`` or ``output``)."""
    if output is not None and emit_old:
        raise ValueError("`emit_old` and `output` are exclusive.")
    aliases = dict(in_place) if emit_old or output is not None else {}
    out_types = list(new_types) * (2 if emit_old else 1)
    if output is not None:
        if in_g:
            aliases[0] = len(out_types)
        out_types.append(jax.ShapeDtypeStruct(g.shape, jnp.float32))
    return out_types, aliases


def _coefficients(update: moment_updates.EmaMoments) -> jax.Array:
    """The kernels' float32 coefficients ``[1 - b1, b1, 1 - b2, b2, divisor]`` (zeros for
    a missing second average, 1 for no divisor)."""
    coef = []
    for k in range(2):
        if k < len(update.decays):
            beta = update.decays[k]
            one_minus = 1 - beta  # as jnp computes it: in Python for floats, else float32
            coef += [_f32_coefficient(one_minus), _f32_coefficient(beta)]
        else:
            coef += [jnp.float32(0), jnp.float32(0)]
    divisor = update.max_divisor
    coef.append(jnp.float32(1) if divisor is None else _f32_coefficient(divisor))
    return jnp.stack(coef)


def _layout(update: moment_updates.EmaMoments) -> dict[str, np.int64]:
    """The kernels' attributes that describe ``update``'s moments."""
    powers = list(update.powers) + [1] * (2 - len(update.powers))
    return dict(
        n_ema=np.int64(len(update.decays)),
        has_max=np.int64(update.running_max),
        max_divide=np.int64(update.max_divisor is not None),
        power0=np.int64(powers[0]),
        power1=np.int64(powers[1]),
    )


def applies_bf16(update: Any, stored: tuple[Any, ...], operands: tuple[Any, ...]) -> bool:
    """Whether :func:`ema_bf16` can compute ``update`` on these arguments: an
    :class:`~optax_decoupled.moment_updates.EmaMoments` with float32 coefficients on
    bfloat16 moments and a float32 gradient of the same shape, outside ``shard_map``."""
    if not _kernel_may_take(update, stored, operands, (*operands, *stored)):
        return False
    shape = jnp.shape(operands[0])
    return all(jnp.result_type(m) == jnp.bfloat16 and jnp.shape(m) == shape for m in stored)


def ema_bf16(
    update: moment_updates.EmaMoments,
    stored: tuple[jax.Array, ...],
    g: jax.Array,
    *,
    emit_old: bool = False,
    output: Any = None,
    output_in_place: bool = True,
    after: jax.Array | None = None,
) -> Any:
    """``update(*stored (as float32), g)`` rounded to bfloat16, by the compiled kernel.

    Call only where :func:`applies_bf16` is true and on the CPU. The new moments equal
    ``update``'s float32 values (each multiply and add rounded, denormals flushed to zero as
    XLA:CPU computes) rounded to nearest-even, as ``jnp``'s ``astype`` rounds them. With
    ``emit_old`` the result is ``(new, old)`` and the new moments are written in
    place of ``stored``, as :func:`requantize_ema` does for 8-bit moments. With ``output``
    (where :func:`applies_output`) the result is ``(new, u)``, the transform's output from
    the new float32 moments before they are rounded, written in place of ``g`` (or with
    ``output_in_place=False`` to a buffer of its own), as :func:`requantize_ema` computes it;
    the new moments are written in place of ``stored``. ``after`` as for
    :func:`requantize_ema`. Where ``update.rounding_step`` is set, the new moments are
    rounded stochastically instead, moment ``k`` with stream ``k`` of that step, with the
    bits of :func:`optax_decoupled.storage.stochastic_round_bfloat16`.
    """
    if not available():
        raise RuntimeError(f"the CPU kernel is not available: {unavailable_reason()}")
    seeds = ()
    if update.rounding_step is not None:
        from optax_decoupled.storage import _stochastic_seed

        step = update.rounding_step
        seeds = (jnp.stack([_stochastic_seed(step, k) for k in range(len(stored))]),)
    out_types, aliases = _results(
        [jax.ShapeDtypeStruct(m.shape, jnp.bfloat16) for m in stored],
        {3 + k: k for k in range(len(stored))},
        g,
        emit_old=emit_old,
        output=output,
        in_g=output_in_place,
    )
    call = jax.ffi.ffi_call(
        BF16_TARGET, out_types, vmap_method="sequential", input_output_aliases=aliases
    )
    outs = call(
        g,
        _coefficients(update),
        _output_coefficients(output),
        *stored,
        *seeds,
        *(() if after is None else (after,)),
        **_layout(update),
        **_output_layout(output),
        emit_old=np.int64(emit_old),
        n_after=np.int64(after is not None),
        stochastic=np.int64(bool(seeds)),
    )
    n = len(stored)
    if output is not None:
        return tuple(outs[:n]), outs[-1]
    return (tuple(outs[:n]), tuple(outs[n:])) if emit_old else tuple(outs)


def dispatch(
    update: moment_updates.EmaMoments,
    stored: tuple[Any, ...],
    operands: tuple[jax.Array, ...],
    *,
    kernel: Any,
    cpu_other: Any,
    other: Any,
    return_old: bool = False,
    output: Any = None,
    argument_kernel: Any = None,
    after: jax.Array | None = None,
) -> Any:
    """How the storages run a moment update that a kernel :func:`applies` to:
    ``kernel(update, stored, g, emit_old=return_old)`` (:func:`requantize_ema` or
    :func:`ema_bf16`) in programs compiled for one CPU device, ``cpu_other(update, stored,
    operands)`` in other CPU programs (sharded, or for ``jax.export``; see
    :func:`single_device_or`) and ``other(update, stored, operands)`` on other platforms
    (:func:`platform_dependent`). All return the new moments shaped like ``stored``,
    with ``return_old`` as ``(new, old)``. ``update``'s traced coefficients (e.g. from
    ``optax.inject_hyperparams``) are passed as arguments: the branches are lowered apart
    from the surrounding trace.

    With ``output`` (the transform's output, e.g. a
    :class:`~optax_decoupled.moment_updates.AdamDirection`) every branch gets it as a fourth
    argument and returns ``(new, u)``, ``u`` shaped like the first operand; the kernel is
    called with ``output=``, which writes ``u`` in place of that operand. Where the operand
    is an argument of the function being lowered (e.g. the gradient passed to a jitted
    update), XLA would have to copy it first, and ``argument_kernel(update, stored,
    operands, output, after=after)`` runs instead (see :func:`single_device_or`).

    ``after`` (an array, or ``None``) is passed to the kernels' calls (``after=``), which
    then run after its computation, except where the kernel writes the output in place of
    the operand (a training step's gradient): those calls have no temporaries to keep apart,
    and in order they could not overlap the rest of the step (a layer's update could not
    start before the previous leaf's, which backpropagation computes later). The other
    branches do not use it."""
    n_stored, n_in = len(stored), len(stored) + len(operands)
    dynamic, rebuild = update.split_dynamic()
    out_dynamic, out_rebuild = output.split_dynamic() if output is not None else ((), None)
    n_dyn = len(dynamic)
    if output is not None:
        out_like = (stored, jax.ShapeDtypeStruct(jnp.shape(operands[0]), jnp.float32))
    else:
        out_like = (stored, stored) if return_old else stored

    n_after = int(after is not None)

    def branch(fn, ordered=False):
        def run(*args):
            last = args[-1] if n_after else None
            args = args[: len(args) - n_after]
            parts = (rebuild(args[n_in : n_in + n_dyn]), args[:n_stored], args[n_stored:n_in])
            if output is not None:
                parts += (out_rebuild(args[n_in + n_dyn :]),)
            return fn(*parts, after=last) if ordered else fn(*parts)

        return run

    if output is not None:  # the output in place of the operand: no temporaries to order
        single = branch(lambda u, s, ops, o: kernel(u, s, ops[0], output=o))
    else:
        single = branch(
            lambda u, s, ops, after: kernel(u, s, ops[0], emit_old=return_old, after=after),
            True,
        )
    on_argument = None if argument_kernel is None else branch(argument_kernel, True)
    operand_leaf = len(jax.tree.leaves(stored))  # the first operand's index among the leaves

    def on_cpu(*args, non_cpu=None):
        return single_device_or(
            single,
            branch(cpu_other),
            *args,
            out_like=out_like,
            single_for_argument=on_argument,
            argument_leaf=operand_leaf,
            non_cpu=non_cpu,
        )

    args = (*stored, *operands, *dynamic, *out_dynamic, *(() if after is None else (after,)))
    if _TRACE_STATE_CLEAN is not None and _TRACE_STATE_CLEAN():  # eagerly
        return platform_dependent(*args, cpu=on_cpu, default=branch(other))
    # Traced, the primitive of single_device_or also chooses by platform: where it is not
    # nested in jax.lax.platform_dependent's branch (a function of its own), its lowering
    # sees whether the gradient is an argument of the jitted function (argument_kernel).
    return on_cpu(*args, non_cpu=branch(other))


def _trace_state_clean_or_none() -> Any:
    """JAX's ``trace_state_clean`` (private: ``None`` where this JAX lacks it)."""
    try:
        from jax._src import core as jax_core
    except ImportError:  # pragma: no cover - private module; every tested JAX has it
        return None
    return getattr(jax_core, "trace_state_clean", None)


#: False inside any trace (``jit``, ``vmap``, ``grad``, ...), even where every argument at hand
#: is a concrete array (closed over by a jitted function), so traced arguments need no scan.
_TRACE_STATE_CLEAN = _trace_state_clean_or_none()


def _eager_platform(args: tuple[Any, ...]) -> str | None:
    """The platform an eager operation on ``args`` runs on, where JAX decides it from them:
    that of the committed arrays (uncommitted ones follow them), outside any trace and when
    the committed ones are on one platform; else ``None`` (also where this JAX cannot say
    whether it is tracing: then :func:`jax.lax.platform_dependent` decides). Inside a trace,
    concrete arrays a jitted function closes over say nothing about the platform it is
    lowered for."""
    if _TRACE_STATE_CLEAN is None or not _TRACE_STATE_CLEAN():
        return None
    platforms = {
        d.platform
        for x in jax.tree.leaves(args)
        if isinstance(x, jax.Array) and x.committed
        for d in x.devices()
    }
    return platforms.pop() if len(platforms) == 1 else None


def platform_dependent(*args: Any, cpu: Any, default: Any) -> Any:
    """``cpu(*args)`` on a CPU, ``default(*args)`` elsewhere, like
    :func:`jax.lax.platform_dependent`, which this is under a trace (the choice is made when
    the program is lowered for its platform).

    Outside a trace :func:`jax.lax.platform_dependent` chooses by the *default* device, but an
    eager operation runs where its committed arguments are: parameters put on a GPU while the
    default device is a CPU (``jax.default_device``, ``JAX_PLATFORMS=cpu,cuda``) must not reach
    the CPU kernel, nor parameters on a CPU device miss it on a GPU host. So eagerly the
    committed arguments' platform decides, and the default device only where none is
    committed.
    """
    platform = _eager_platform(args)
    if platform is not None:
        return (cpu if platform == "cpu" else default)(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


# --- Choosing the kernel per compiled program -------------------------------------------------
#
# The kernel is a custom call that XLA cannot partition: in a program compiled for several
# devices (parameters sharded with jax.sharding) XLA would gather its operands onto every
# device. So the choice between the kernel and XLA's own program is made when the program is
# lowered, from the number of devices it is compiled for, like jax.lax.platform_dependent
# chooses by platform: a primitive whose lowering lowers one of two functions.

_dispatch_p = jex_core.Primitive("optax_decoupled_single_device_or")
_dispatch_p.multiple_results = True


def single_device_or(
    single: Any,
    partitioned: Any,
    *args: Any,
    out_like: Any = None,
    single_for_argument: Any = None,
    argument_leaf: int = 0,
    non_cpu: Any = None,
) -> Any:
    """``single(*args)`` in a program compiled for one device, else ``partitioned(*args)``
    (also in programs lowered for ``jax.export``, which may run where the kernel is not
    registered).

    With ``single_for_argument``, that runs instead of ``single`` on one device where leaf
    ``argument_leaf`` of ``args`` is an argument of the function (or region) being lowered
    rather than computed in it, and in eager calls: ``single`` may then write in place of
    that leaf, which XLA can do without a copy only for a value the program computes (e.g. a
    gradient computed in the same training step; a donated argument of the jitted function
    does not count, as donation only aliases the function's outputs).

    With ``non_cpu``, that runs instead in programs for other platforms (in programs for
    several platforms, including the CPU, chosen at run time against ``partitioned``, as
    :func:`jax.lax.platform_dependent` does); without it, the caller runs this on CPUs only.

    All must return the same pytree of arrays: shaped like ``out_like`` (a pytree of arrays
    or ``jax.ShapeDtypeStruct``) when it is given, else found by tracing ``partitioned``. The
    choice is made when the surrounding ``jit`` is lowered (eagerly, by the arguments'
    devices).
    """
    leaves, in_tree = jax.tree.flatten(args)
    out = jax.eval_shape(partitioned, *args) if out_like is None else out_like
    out_leaves, out_tree = jax.tree.flatten(out)
    out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_leaves)

    def flat(fn):
        return None if fn is None else _flat(fn, in_tree)

    outs = _dispatch_p.bind(
        *leaves,
        single=flat(single),
        partitioned=flat(partitioned),
        single_for_argument=flat(single_for_argument),
        argument_leaf=argument_leaf,
        non_cpu=flat(non_cpu),
        out_avals=out_avals,
    )
    return jax.tree.unflatten(out_tree, outs)


def _flat(fn, in_tree):
    def run(*leaves):
        return jax.tree.leaves(fn(*jax.tree.unflatten(in_tree, list(leaves))))

    return run


def _dispatch_abstract_eval(*avals, out_avals, **_):
    del avals
    return list(out_avals)


def in_manual_context(*arrays: Any) -> bool:
    """Whether this is traced inside ``shard_map`` (manual mesh axes), where
    :func:`single_device_or` is not used (its results would lack the manual-axis types that
    ``shard_map`` tracks): the abstract mesh has manual axes, or an argument varies over one.
    """
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is not None and getattr(get_mesh(), "manual_axes", ()):
        return True
    for x in arrays:
        aval = jax.typeof(x) if hasattr(jax, "typeof") else None
        varying = getattr(aval, "vma", None)
        if varying is None:
            varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
        if varying:
            return True
    return False


def _dispatch_impl(
    *args, single, partitioned, single_for_argument, argument_leaf, non_cpu, out_avals
):
    """Eager evaluation: ``single`` where the arguments are on one device (what a ``jit`` on
    them would lower), else ``partitioned``, called directly. (A ``jit`` of a new lambda here
    recompiled on every eager call, and under ``jax.disable_jit`` re-entered this rule
    without end.)"""
    del out_avals, argument_leaf
    if single_for_argument is not None:
        single = single_for_argument  # every argument here is the caller's array
    # Uncommitted arrays (e.g. injected hyperparameters, created on the default device) go
    # where the committed ones are, so only those count.
    devices = set()
    for a in args:
        if isinstance(a, jax.Array) and a.committed:
            devices |= set(a.sharding.device_set)
    platforms = {d.platform for d in devices} or {jax.default_backend()}
    if non_cpu is not None and "cpu" not in platforms:
        return non_cpu(*args)
    on_one_cpu = len(devices) <= 1 and platforms == {"cpu"}
    return (single if on_one_cpu else partitioned)(*args)


def _lowering_for_export(ctx: Any) -> bool:
    """Whether ``ctx`` (a lowering rule's context) lowers a program for ``jax.export`` or for
    several platforms at once (``lower(lowering_platforms=...)``): a program that may be
    compiled where the kernel is not registered."""
    params = getattr(ctx.module_context, "lowering_parameters", None)
    platforms = getattr(ctx.module_context, "platforms", ())
    return bool(getattr(params, "for_export", False)) or len(platforms) > 1


def _is_argument(value: Any) -> bool:
    """Whether an MLIR value is an argument of its block (a function's, or a region's such
    as a loop body's or a branch's), not the result of an operation."""
    return isinstance(value, mlir.ir.BlockArgument)


def _dispatch_lowering(
    ctx, *args, single, partitioned, single_for_argument, argument_leaf, non_cpu, out_avals
):
    del out_avals
    platforms = tuple(getattr(ctx.module_context, "platforms", ()) or ())
    if non_cpu is not None and platforms and "cpu" not in platforms:
        return mlir.lower_fun(non_cpu, multiple_results=True)(ctx, *args)
    if non_cpu is not None and len(platforms) > 1:

        def by_platform(*a):
            return jax.lax.platform_dependent(*a, cpu=partitioned, default=non_cpu)

        return mlir.lower_fun(by_platform, multiple_results=True)(ctx, *args)
    # jit's context is a ShardingContext with the program's number of devices; other
    # contexts (e.g. inside shard_map) take the partitionable path. So do exported programs
    # (jax.export): they may be run where this package's kernel is not registered, and
    # jax.export refuses custom calls without compatibility guarantees.
    global _calls_compiled
    num_devices = getattr(ctx.module_context.axis_context, "num_devices", None)
    single_device = num_devices == 1 and not _lowering_for_export(ctx)
    _calls_compiled += single_device
    fn = single if single_device else partitioned
    if single_device and single_for_argument is not None and _is_argument(args[argument_leaf]):
        fn = single_for_argument
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _dispatch_batching(args, dims, *, single, partitioned, single_for_argument, **params):
    unmapped = (None, getattr(batching, "not_mapped", None))
    in_axes = [None if d in unmapped else d for d in dims]
    vmapped = [
        None if f is None else jax.vmap(f, in_axes=in_axes)
        for f in (single, partitioned, single_for_argument, params["non_cpu"])
    ]
    out = jax.eval_shape(vmapped[1], *args)
    out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out)
    outs = _dispatch_p.bind(
        *args,
        single=vmapped[0],
        partitioned=vmapped[1],
        single_for_argument=vmapped[2],
        argument_leaf=params["argument_leaf"],
        non_cpu=vmapped[3],
        out_avals=out_avals,
    )
    return outs, [0] * len(outs)


def _dispatch_jvp(primals, tangents, *, partitioned, **params):
    """Differentiates through the partitionable function (XLA's program: the kernel is a
    custom call without derivatives; both compute the same function). The primal outputs
    are still the primitive's: the kernel computes the values of a differentiated step."""
    outs = _dispatch_p.bind(*primals, partitioned=partitioned, **params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    _, out_tangents = jax.jvp(partitioned, list(primals), tangents)
    return outs, out_tangents


_dispatch_p.def_abstract_eval(_dispatch_abstract_eval)
_dispatch_p.def_impl(_dispatch_impl)
mlir.register_lowering(_dispatch_p, _dispatch_lowering, cacheable=False)
batching.primitive_batchers[_dispatch_p] = _dispatch_batching
ad.primitive_jvps[_dispatch_p] = _dispatch_jvp
