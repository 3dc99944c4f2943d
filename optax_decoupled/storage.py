"""How optimizer moments are stored between steps.

Every moment (Adam's :math:`\\mu`, :math:`\\nu`, AMSGrad's :math:`\\nu_{\\max}`, Lion's
:math:`\\mu`) goes through one small interface, :class:`MomentStorage`:

* ``init(param, signed)`` returns the stored zeros for a parameter leaf;
* ``read(stored, like)`` returns the moment as an array in the *compute* dtype;
* ``write(value, like, signed)`` encodes an updated moment for storage.

``signed`` says whether the moment can be negative (:math:`\\mu`) or not (:math:`\\nu`), which
matters to quantized storage. The update itself is always computed in the compute dtype
(``promote_types(storage dtype, parameter dtype)``), so low-precision storage changes only what
is kept between steps, never the arithmetic of one step.

Accepted ``state_dtype`` values:

=====================  ==========================================================
``None``               the parameter's own dtype, no casts (what Optax does)
``"float32"``          float32 moments (e.g. for bfloat16/float16 parameters)
``"bfloat16"``         bfloat16 moments, round-to-nearest-even on write
``"float16"``          float16 moments
=====================  ==========================================================

``jnp.float32``, ``jnp.bfloat16`` and ``numpy.dtype`` objects are accepted too. Inside
``optax.inject_hyperparams`` pass a string (``jnp.bfloat16`` is callable and would be taken for a
schedule).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

StateDtype = Any  # None | str | jnp dtype

_FLOAT_NAMES = ("float32", "bfloat16", "float16", "float64")


class MomentStorage(Protocol):
    """The storage interface every moment goes through (see the module docstring)."""

    name: str

    def init(self, param: jax.Array, signed: bool) -> Any: ...

    def read(self, stored: Any, like: jax.Array) -> jax.Array: ...

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ParamDtypeStorage:
    """Moments stored in the parameter's own dtype (``state_dtype=None``)."""

    name: str = "param"

    def init(self, param: jax.Array, signed: bool) -> jax.Array:
        del signed
        return jnp.zeros_like(param)

    def read(self, stored: jax.Array, like: jax.Array) -> jax.Array:
        del like
        return stored

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> jax.Array:
        del signed
        return value.astype(jnp.result_type(like))


@dataclasses.dataclass(frozen=True)
class FloatStorage:
    """Moments stored in a fixed floating dtype, computed in the promoted dtype."""

    dtype: Any
    name: str = "float"

    def init(self, param: jax.Array, signed: bool) -> jax.Array:
        del signed
        return jnp.zeros_like(param, dtype=self.dtype)  # keeps a concrete param's sharding

    def read(self, stored: jax.Array, like: jax.Array) -> jax.Array:
        return stored.astype(jnp.promote_types(self.dtype, jnp.result_type(like)))

    def write(self, value: jax.Array, like: jax.Array, signed: bool) -> jax.Array:
        del like, signed
        return value.astype(self.dtype)


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
    name = _as_float_name(state_dtype)
    if name is None:
        raise ValueError(
            f"`{argument}` must be None (the parameter dtype), 'float32', 'bfloat16' or "
            f"'float16' (or the matching jnp dtype), got {state_dtype!r}."
        )
    return FloatStorage(dtype=jnp.dtype(name), name=name)


def storage_tree_map(fn, params: Any, *stored_trees: Any) -> Any:
    """Maps ``fn(param_leaf, *stored_subtrees)`` with ``params`` giving the structure.

    Stored moments may be pytrees of their own (quantized storage keeps codes and scales), so
    the parameter tree is the prefix every other tree is matched against.
    """
    return jax.tree.map(fn, params, *stored_trees)
