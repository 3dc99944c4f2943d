r"""The element-wise moment updates of the transforms, as data.

Adam, AMSGrad and Lion update their moments with exponential moving averages of the
gradient (or its square) and, for AMSGrad, a running maximum. :class:`EmaMoments` describes
such an update by its coefficients. Calling it computes the update with ``jax.numpy``
and a storage may evaluate it block by block (8-bit storage's chunked requantization, which
also needs to lift array coefficients into operands: ``split_dynamic``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def abs_sq(x: jax.Array) -> jax.Array:
    """:math:`|x|^2`, real: ``x * x`` for a real ``x``, ``(conj(x) x).real`` for a complex one
    (the second moment of a complex gradient, as Optax defines it)."""
    if jnp.iscomplexobj(x):
        return (x.conj() * x).real
    return x * x


def bias_correction(moment: jax.Array, decay: Any, count: Any) -> jax.Array:
    r""":math:`m / (1 - \beta^t)`, computed in ``moment``'s dtype: Optax's own
    ``optax.tree.bias_correction`` (one compiled function), so that an update computed eagerly
    matches Optax's to the bit."""
    return optax.tree.bias_correction(moment, decay, count)


@dataclasses.dataclass(frozen=True, eq=False)
class EmaMoments:
    r"""``(m_1, ..., m_n[, m_max]), g -> (m'_1, ..., m'_n[, m'_max])``, element-wise:

    .. math::

        m'_k = (1 - \beta_k)\, s_k(g) + \beta_k\, m_k, \qquad
        m'_{max} = \max\!\big(m_{max},\; c(m'_n)\big)

    with :math:`s_k(g) = g` (power 1) or :math:`|g|^2` (power 2), and the running maximum
    (AMSGrad's :math:`\nu^{max}`) over the last averaged moment, bias-corrected first
    (:math:`c(m) = m/(1-\beta^t)`) when ``max_correction = (β, t)`` is given. Adam:
    ``EmaMoments((b1, b2), (1, 2))``; AMSGrad adds ``running_max=True``; Lion:
    ``EmaMoments((b2,), (1,))``. Coefficients may be Python floats or (traced) arrays.

    Attributes:
      decays: :math:`\beta_k`, one per averaged moment (one or two).
      powers: :math:`p_k`, ``1`` (the gradient) or ``2`` (its squared modulus), one per decay.
      running_max: whether a last moment keeps the running maximum of :math:`m'_n`.
      max_correction: ``(decay, count)`` of the bias correction applied before the maximum,
        or ``None``.
    """

    decays: tuple[Any, ...]
    powers: tuple[int, ...]
    running_max: bool = False
    max_correction: tuple[Any, Any] | None = None

    def __post_init__(self):
        if len(self.decays) != len(self.powers) or not 1 <= len(self.decays) <= 2:
            raise ValueError("`decays` and `powers` must have one or two entries each.")
        if any(p not in (1, 2) for p in self.powers):
            raise ValueError(f"`powers` must be 1 or 2, got {self.powers!r}.")

    def split_dynamic(self) -> tuple[tuple[jax.Array, ...], Any]:
        """``(arrays, rebuild)``: the coefficients that are arrays (traced or not), and a
        function that returns this update with them replaced by the given values. Python
        numbers stay in place (so ``1 - beta`` is still computed in Python)."""
        n = len(self.decays)
        values = (*self.decays, *(self.max_correction or ()))

        def rebuild(v):
            correction = tuple(v[n:]) if self.max_correction is not None else None
            return dataclasses.replace(self, decays=tuple(v[:n]), max_correction=correction)

        return _split(values, rebuild)

    @property
    def num_stored(self) -> int:
        """How many stored moments the update reads and writes."""
        return len(self.decays) + int(self.running_max)

    def __call__(self, *args: jax.Array) -> tuple[jax.Array, ...]:
        *stored, g = args
        if len(stored) != self.num_stored:
            raise ValueError(f"expected {self.num_stored} moments and a gradient.")
        # In the promoted dtype, as jnp promotes (bfloat16 moments of bfloat16 parameters
        # under float32 gradients: float32 arithmetic); the storage casts back when writing.
        dtype = jnp.promote_types(stored[0].dtype, g.dtype)
        gc = g.astype(dtype)
        new = []
        for beta, power, m in zip(self.decays, self.powers, stored, strict=False):
            source = gc if power == 1 else abs_sq(gc)
            new.append((1 - beta) * source + beta * m.astype(dtype))
        if self.running_max:
            seen = new[-1]
            if self.max_correction is not None:
                seen = bias_correction(seen, *self.max_correction)
            new.append(jnp.maximum(stored[-1].astype(dtype), seen))
        return tuple(new)


def _is_number(x: Any) -> bool:
    """A Python or NumPy scalar (kept as it is: jnp computes with it as the transforms did)."""
    return isinstance(x, int | float | np.number) and not isinstance(x, bool)


def _split(values: tuple[Any, ...], rebuild_from: Any) -> tuple[tuple[jax.Array, ...], Any]:
    """``split_dynamic`` for a dataclass whose fields are ``values`` (in field order):
    the array values, and a function that puts new ones in their place."""
    where = [i for i, v in enumerate(values) if v is not None and not _is_number(v)]
    arrays = tuple(jnp.asarray(values[i]) for i in where)

    def rebuild(new_arrays):
        new = list(values)
        for i, a in zip(where, new_arrays, strict=True):
            new[i] = a
        return rebuild_from(new)

    return arrays, rebuild


#: Lion's update modes (``optax.scale_by_lion``'s ``mode``).
LION_MODES = ("hard", "smooth", "refined")


def lion_direction(g: jax.Array, mu: jax.Array, b1: Any, mode: str, smooth_beta: Any) -> jax.Array:
    r"""Lion's output from the gradient and the *old* momentum, element-wise, with
    :math:`x = (1-\beta_1) g + \beta_1 \mu_{t-1}`: ``"hard"`` :math:`\operatorname{sign}(x)`
    (Chen et al. 2023), ``"smooth"`` :math:`\tanh(\beta_s x)`, ``"refined"`` :math:`x` where
    :math:`|x| < 1`, else :math:`\operatorname{sign}(x)`; in the promoted dtype, returned in
    the gradient's (``optax.scale_by_lion``'s modes and operations)."""
    dt = jnp.promote_types(mu.dtype, jnp.result_type(g))  # bf16 momentum, f32 gradient: f32
    x = (1.0 - b1) * jnp.asarray(g).astype(dt) + b1 * mu.astype(dt)
    if mode == "smooth":
        u = jnp.tanh(smooth_beta * x)
    elif mode == "refined":
        u = jnp.where(jnp.abs(x) < 1.0, x, jnp.sign(x))
    else:
        u = jnp.sign(x)
    return u.astype(jnp.result_type(g))
