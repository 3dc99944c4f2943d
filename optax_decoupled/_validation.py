"""Argument checks shared by the transforms and aliases (internal).

Only *concrete* Python/NumPy numbers are checked: traced values (inside ``jit``, ``vmap`` or
``optax.inject_hyperparams``), arrays and schedules pass through untouched, so hyperparameters
can still be injected and batched.
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
        if np.issubdtype(np.asarray(value).dtype, np.number):
            return float(value)
    return None


def _reject_bool(name: str, value: Any) -> None:
    if isinstance(value, bool):
        raise ValueError(
            f"`{name}` must be a number, a schedule or an array, got the bool {value}."
        )


def check_non_negative(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete ``value`` is negative or not finite."""
    _reject_bool(name, value)
    x = concrete_number(value)
    if x is not None and not (np.isfinite(x) and x >= 0.0):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")


def check_positive(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete ``value`` is not > 0 or not finite."""
    _reject_bool(name, value)
    x = concrete_number(value)
    if x is not None and not (np.isfinite(x) and x > 0.0):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")


def check_beta(name: str, value: Any) -> None:
    """Raises ``ValueError`` if a concrete decay rate lies outside ``[0, 1)``."""
    _reject_bool(name, value)
    if callable(value):
        raise ValueError(
            f"`{name}` must be a number in [0, 1) or an array, not a schedule; "
            "use optax.inject_hyperparams to change it during training."
        )
    x = concrete_number(value)
    if x is not None and not (0.0 <= x < 1.0):
        raise ValueError(f"`{name}` must lie in [0, 1), got {value!r}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raises ``ValueError`` if ``value`` is not one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices!r}, got {value!r}.")


def check_param_dtypes(params: Any, transform: str) -> None:
    """Rejects integer, boolean and complex parameter leaves with a message naming the leaf."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in leaves:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(
                f"{transform}: parameter {jax.tree_util.keystr(path)!s} has complex dtype "
                f"{dtype}; complex parameters are not supported (split them into real and "
                "imaginary parts)."
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{transform}: parameter {jax.tree_util.keystr(path)!s} has dtype {dtype}; "
                "optimizers update floating-point parameters only (exclude integer/bool "
                "leaves from the trainable pytree, e.g. with nnx.Param filters or "
                "optax.masked)."
            )
