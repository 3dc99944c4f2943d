"""Argument checks shared by the transforms and aliases.

Only concrete values are checked; traced values (under ``jit``, ``vmap`` or a jitted
``inject_hyperparams``) pass through, so hyperparameters can be injected and batched.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def concrete_number(value: Any) -> float | None:
    """Returns ``value`` as a float if it is a concrete real number, else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray | np.generic) and np.ndim(value) == 0:
        if _is_real_dtype(np.asarray(value).dtype):
            return float(value)
    return None


def _is_real_dtype(dtype: Any) -> bool:
    """Floating (bfloat16 included, which NumPy does not count) or integer; not complex."""
    return bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))


def is_int(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy integer (a bool is not)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_schedule(value: Any) -> bool:
    return callable(value) and not isinstance(value, jax.Array)


def concrete_values(name: str, value: Any) -> np.ndarray | None:
    """``value``'s elements as a float64 array if it is concrete (a number, or a NumPy or
    untraced JAX array); ``None`` for traced values and schedules. Raises ``ValueError`` for
    values that are none of these (a bool, a string, a non-numeric array)."""
    if _is_schedule(value):
        return None
    if isinstance(value, bool):
        raise ValueError(
            f"`{name}` must be a number, a schedule or an array, got the bool {value}."
        )
    x = concrete_number(value)
    if x is not None:
        return np.asarray(x, np.float64)
    if isinstance(value, jax.Array):
        try:
            value = np.asarray(value)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return None  # traced: checked by nothing, used as given
    if isinstance(value, np.ndarray | np.generic) and _is_real_dtype(value.dtype):
        return np.asarray(value, np.float64)
    raise ValueError(
        f"`{name}` must be a number, a schedule or an array of numbers, got {value!r}."
    )


def _fail(name: str, value: Any, requirement: str) -> None:
    what = "every element of " if np.ndim(value) else ""
    raise ValueError(f"{what}`{name}` must {requirement}, got {value!r}.")


def check_non_negative(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete ``value`` is negative or not finite."""
    x = concrete_values(name, value)
    if x is not None and not np.all(np.isfinite(x) & (x >= 0.0)):
        _fail(name, value, "be a finite number >= 0")


def check_positive(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete ``value`` is not > 0 or not finite."""
    x = concrete_values(name, value)
    if x is not None and not np.all(np.isfinite(x) & (x > 0.0)):
        _fail(name, value, "be a finite number > 0")


def check_schedule_value(name: str, value: Any, count: Any, check=check_non_negative) -> None:
    """Runs ``check`` on ``value``, what the schedule given as ``name`` returned at step
    ``count``; the message names the argument and says that its schedule gave the value (and
    at which step, when ``count`` is concrete). Traced values pass, as everywhere, so under
    ``jit`` a schedule's values are not checked. A callable value is refused (it would fail
    later, in arithmetic)."""
    if _is_schedule(value):
        raise ValueError(f"`{name}` is a schedule that returned a callable, {value!r}.")
    try:
        check(name, value)
    except ValueError as err:
        try:
            at = f" at step {int(np.asarray(count))}"
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            at = ""
        message = str(err).removesuffix(".")
        raise ValueError(f"{message} from its schedule{at}.") from None


def check_not_schedule(name: str, value: Any) -> None:
    """Raises ``ValueError`` for a schedule where only numbers and arrays are accepted."""
    if _is_schedule(value):
        raise ValueError(
            f"`{name}` must be a number or an array, not a schedule; only the learning rate "
            "and the weight decay take schedules (optax.inject_hyperparams changes the others "
            "during training)."
        )


def check_beta(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete decay rate lies outside ``[0, 1)``."""
    check_not_schedule(name, value)
    x = concrete_values(name, value)
    if x is not None and not np.all((x >= 0.0) & (x < 1.0)):
        dtype = getattr(value, "dtype", None)
        low = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        if low and jnp.finfo(dtype).bits < 32 and np.any(x == 1.0):
            raise ValueError(
                f"`{name}` must lie in [0, 1), got {value!r}: in {jnp.dtype(dtype).name} it "
                "rounds to 1. optax.inject_hyperparams casts hyperparameters to the "
                "parameters' dtype; pass hyperparam_dtype=jnp.float32."
            )
        _fail(name, value, "lie in [0, 1)")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raises ``ValueError`` if ``value`` is not one of ``choices`` (strings, and ``None``
    where it is one). Anything else, e.g. a bool or a NumPy array of strings, is refused
    before it is compared (an array would compare element-wise)."""
    choices = tuple(choices)
    if not (value is None or isinstance(value, str)) or value not in choices:
        raise ValueError(f"`{name}` must be one of {choices!r}, got {value!r}.")


def check_update_dtypes(updates: Any, transform: str) -> None:
    """Rejects integer and boolean gradient leaves, naming the leaf (the update would be cast
    to the gradient's integer dtype, i.e. truncated)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(updates)
    for path, leaf in leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{transform}: gradient {jax.tree_util.keystr(path)!s} has dtype {dtype}; "
                "gradients must be floating point or complex (cast them, e.g. "
                "g.astype(jnp.float32))."
            )


def check_param_dtypes(params: Any, transform: str) -> None:
    """Rejects integer and boolean parameter leaves with a message naming the leaf (an
    integer parameter cannot take a fractional step). Complex parameters are accepted."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{transform}: parameter {jax.tree_util.keystr(path)!s} has dtype {dtype}; "
                "optimizers update floating-point parameters only (exclude integer/bool "
                "leaves from the trainable pytree, e.g. with nnx.Param filters or "
                "optax.masked)."
            )
