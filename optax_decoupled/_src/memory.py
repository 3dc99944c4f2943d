"""Memory accounting: optimizer-state bytes and the compiled memory of a training step.

Array bytes (``size * itemsize``) of real arrays or ``jax.ShapeDtypeStruct`` trees, so a model
that is never allocated can be measured; :func:`step_memory` reads XLA's buffer assignment of
a compiled step, per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from optax_decoupled._src import storage

#: Moments kept per parameter by each optimizer family (for large tensors).
MOMENTS_PER_PARAM = {"sgd_momentum": 1, "lion": 1, "adamw": 2, "adam_l2": 2, "amsgrad": 3}


def _is_prng_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def leaf_bytes(x: Any) -> int:
    """Bytes of one array-like leaf (``jax.Array``, ``np.ndarray``, ``ShapeDtypeStruct``; a
    typed PRNG key array counts its key data)."""
    if _is_prng_key(x):
        x = jax.eval_shape(jax.random.key_data, x)
    shape = np.shape(x) if not hasattr(x, "shape") else x.shape
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def num_params(params: Any) -> int:
    """Number of scalar parameters (elements) in a pytree."""
    return int(sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree.leaves(params)))


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of an optimizer state.

    Attributes:
      per_leaf: ``{key path: bytes}`` for every array leaf, e.g.
        ``"0/mu/dense/kernel/codes"``.
      total: sum of ``per_leaf``.
      num_params: number of parameters, when the parameters were given (else ``None``).
      by_dtype: bytes grouped by the leaves' dtype name (``"uint8"``, ``"float32"``, ...).
    """

    per_leaf: Mapping[str, int]
    total: int
    num_params: int | None = None
    by_dtype: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def per_param(self) -> float | None:
        """Bytes of state per parameter (``total / num_params``)."""
        return None if not self.num_params else self.total / self.num_params


def _path_str(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def state_bytes(opt_state: Any, params: Any = None) -> StateBytes:
    """Bytes of every array in ``opt_state``; per parameter when ``params`` is given.

    ``opt_state`` and ``params`` may hold arrays or ``jax.ShapeDtypeStruct`` s. Sharded
    arrays count whole (the bytes of all shards together, replicas once), as their shapes say.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((128, 256)), "b": jnp.zeros(256)}
      >>> for state_dtype in (None, "bfloat16", "int8"):
      ...     state = od.adamw(1e-3, state_dtype=state_dtype).init(params)
      ...     sb = od.contrib.state_bytes(state, params)
      ...     print(state_dtype, f"{sb.per_param:.2f}")
      None 8.00
      bfloat16 4.00
      int8 2.08
    """
    per_leaf: dict[str, int] = {}
    by_dtype: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if not hasattr(leaf, "dtype") and not isinstance(leaf, int | float | np.number):
            continue
        n = leaf_bytes(leaf)
        per_leaf[_path_str(path)] = n
        if _is_prng_key(leaf):
            name = str(leaf.dtype)  # e.g. "key<fry>"
        else:
            name = np.dtype(leaf.dtype).name if hasattr(leaf, "dtype") else type(leaf).__name__
        by_dtype[name] = by_dtype.get(name, 0) + n
    return StateBytes(
        per_leaf=per_leaf,
        total=int(sum(per_leaf.values())),
        num_params=None if params is None else num_params(params),
        by_dtype=by_dtype,
    )


def abstract_state(tx: Any, params: Any) -> Any:
    """``tx.init(params)`` as ``ShapeDtypeStruct`` s, without allocating anything."""
    return jax.eval_shape(tx.init, params)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's buffer assignment for one compiled call (bytes).

    Attributes:
      arguments: all argument buffers.
      outputs: all output buffers (including those that alias a donated argument).
      temporaries: scratch buffers live during the call (activations, gradients, ...).
      aliased: output bytes that reuse a donated argument's buffer.
      generated_code: size of the compiled code.
      peak: ``arguments + outputs - aliased + temporaries``: every buffer XLA assigned for
        the call, an upper bound of the bytes live at once (XLA packs the temporaries into
        one allocation of ``temporaries`` bytes, so the bound is tight for them).
      backend_peak: the backend's own ``peak_memory_in_bytes`` where it reports one (0
        otherwise; on CPU it does not include the temporaries).
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    generated_code: int
    peak: int
    backend_peak: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def step_memory(
    fn: Callable[..., Any],
    *args: Any,
    donate_argnums: int | tuple[int, ...] = (),
    static_argnums: int | tuple[int, ...] = (),
    **kwargs: Any,
) -> StepMemory:
    """Compile ``fn(*args, **kwargs)`` and return its :class:`StepMemory`.

    ``fn`` may be a plain function (it is wrapped in ``jax.jit`` with ``donate_argnums`` and
    ``static_argnums``) or an already jitted one (anything with ``.lower``), which carries
    its own (passing either here too is an error: it would be ignored). Arguments may be
    arrays or ``jax.ShapeDtypeStruct`` s; nothing runs. The numbers are XLA's for one device:
    for a program sharded over several, one device's buffers (its shards), unlike
    :func:`state_bytes`, which counts whole arrays.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import optax_decoupled as od
      >>> params = {"w": jnp.ones((128, 256))}
      >>> tx = od.adamw(1e-3)
      >>> def step(params, state, grads):
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> mem = od.contrib.step_memory(step, params, tx.init(params), params, donate_argnums=(0, 1))
      >>> # donated: the new parameters and moments reuse the old buffers
      >>> print(mem.outputs - mem.aliased < 1024 < mem.aliased)
      True
    """
    if hasattr(fn, "lower"):
        for name, value in (("donate_argnums", donate_argnums), ("static_argnums", static_argnums)):
            if value not in ((), None):
                raise ValueError(
                    f"`{name}` applies to a plain function; this one is already jitted: give "
                    f"it to jax.jit instead (jax.jit(fn, {name}=...))."
                )
    else:
        fn = jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums)
    compiled = fn.lower(*args, **kwargs).compile()
    stats = compiled.memory_analysis()
    if stats is None:  # pragma: no cover - backends without buffer assignment stats
        raise RuntimeError("this backend reports no memory analysis for compiled functions")
    arguments = int(stats.argument_size_in_bytes)
    outputs = int(stats.output_size_in_bytes)
    temporaries = int(stats.temp_size_in_bytes)
    aliased = int(stats.alias_size_in_bytes)
    return StepMemory(
        arguments=arguments,
        outputs=outputs,
        temporaries=temporaries,
        aliased=aliased,
        generated_code=int(stats.generated_code_size_in_bytes),
        peak=arguments + outputs - aliased + temporaries,
        backend_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
    )


def moment_bytes_per_element(state_dtype: Any) -> float:
    """Bytes per element of one stored moment of a large tensor: 4 (float32), 2 (bfloat16 /
    float16), ``1 + 4 / block_size`` (int8 block-wise: a code plus a share of the scale;
    ``"int8"`` has blocks of 256, ``BlockwiseInt8Storage(block_size=...)`` others)."""
    store = storage.resolve_storage(state_dtype)
    if isinstance(store, storage.BlockwiseInt8Storage):
        return 1.0 + 4.0 / store.block_size
    if isinstance(store, storage.FloatStorage):
        return float(np.dtype(store.dtype).itemsize)
    if state_dtype is None:
        return 4.0  # float32 parameters assumed
    raise ValueError(f"no theoretical size for state_dtype={state_dtype!r}")  # pragma: no cover


def theoretical_bytes_per_param(optimizer: str, state_dtype: Any) -> float:
    """Optimizer-state bytes per parameter for tensors large enough to be quantized, step
    counters ignored: moments (:data:`MOMENTS_PER_PARAM`) × :func:`moment_bytes_per_element`.

    ``state_dtype`` may be a :class:`~optax_decoupled.BlockwiseInt8Storage` to use
    its block size.
    """
    if optimizer not in MOMENTS_PER_PARAM:
        choices = sorted(MOMENTS_PER_PARAM)
        raise ValueError(f"`optimizer` must be one of {choices}, got {optimizer!r}.")
    return MOMENTS_PER_PARAM[optimizer] * moment_bytes_per_element(state_dtype)


def training_memory(
    params: Any,
    tx: Any = None,
    *,
    weights_dtype: Any = None,
    grads_dtype: Any = None,
) -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state of a model (nothing allocated).

    Args:
      params: the parameters, arrays or ``ShapeDtypeStruct`` s.
      tx: an optimizer; its state is measured with :func:`abstract_state`. ``None``: no state.
      weights_dtype: count the weights in this dtype instead of their own (e.g. bfloat16).
      grads_dtype: dtype of the gradients (default: the weights').

    Returns:
      ``{"weights", "gradients", "optimizer_state", "total", "num_params"}``.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)}  # never allocated
      >>> m = od.contrib.training_memory(params, od.adamw(1e-3, state_dtype="int8"))
      >>> m["num_params"], m["weights"], m["optimizer_state"]
      (16777216, 33554432, 34078724)
    """
    weights_dtype = None if weights_dtype is None else np.dtype(weights_dtype)
    grads_dtype = weights_dtype if grads_dtype is None else np.dtype(grads_dtype)

    def as_dtype(dtype):
        return lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype or x.dtype)

    weights = jax.tree.map(as_dtype(weights_dtype), params)
    grads = jax.tree.map(as_dtype(grads_dtype), params)
    w = sum(leaf_bytes(x) for x in jax.tree.leaves(weights))
    g = sum(leaf_bytes(x) for x in jax.tree.leaves(grads))
    s = 0 if tx is None else state_bytes(abstract_state(tx, weights)).total
    return {
        "weights": int(w),
        "gradients": int(g),
        "optimizer_state": int(s),
        "total": int(w + g + s),
        "num_params": num_params(params),
    }


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units up to TiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover
