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


@dataclasses.dataclass(frozen=True, eq=False)
class EmaMoments:
    r"""``(m_1, ..., m_n[, m_max]), g -> (m'_1, ..., m'_n[, m'_max])``, element-wise:

    .. math::

        m'_k = (1 - \beta_k)\, g^{p_k} + \beta_k\, m_k, \qquad
        m'_{max} = \max\!\big(m_{max},\; m'_2 / d\big)

    with :math:`p_k \in \{1, 2\}` and the running maximum (AMSGrad's :math:`\nu^{max}`) over
    the second moment divided by ``max_divisor`` :math:`d` (``None``: no division). Adam:
    ``EmaMoments((b1, b2), (1, 2))``; AMSGrad adds ``running_max=True``; Lion:
    ``EmaMoments((b2,), (1,))``. Coefficients may be Python floats or traced scalars
    (``optax.inject_hyperparams``).

    Attributes:
      decays: :math:`\beta_k`, one per averaged moment (one or two).
      powers: :math:`p_k`, ``1`` (the gradient) or ``2`` (its square), one per decay.
      running_max: whether a last moment keeps the running maximum of :math:`m'_2`.
      max_divisor: :math:`d` (e.g. the bias correction :math:`1-\beta_2^t`), or ``None``.
    """

    decays: tuple[Any, ...]
    powers: tuple[int, ...]
    running_max: bool = False
    max_divisor: Any = None

    def __post_init__(self):
        if len(self.decays) != len(self.powers) or not 1 <= len(self.decays) <= 2:
            raise ValueError("`decays` and `powers` must have one or two entries each.")
        if any(p not in (1, 2) for p in self.powers):
            raise ValueError(f"`powers` must be 1 or 2, got {self.powers!r}.")
        if self.running_max and len(self.decays) != 2:
            raise ValueError("`running_max` needs two averaged moments (it follows the second).")

    def split_dynamic(self) -> tuple[tuple[jax.Array, ...], Any]:
        """``(arrays, rebuild)``: the coefficients that are arrays (traced or not), and a
        function that returns this update with them replaced by the given values. Python
        numbers stay in place (so ``1 - beta`` is still computed in Python, as before)."""
        values = (*self.decays, self.max_divisor)
        return _split(
            values,
            lambda v: dataclasses.replace(self, decays=tuple(v[:-1]), max_divisor=v[-1]),
        )

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
        stored = [m.astype(dtype) for m in stored]
        new = []
        for beta, power, m in zip(self.decays, self.powers, stored, strict=False):
            source = gc if power == 1 else gc * gc
            new.append((1 - beta) * source + beta * m)
        if self.running_max:
            seen = new[1]
            if self.max_divisor is not None:
                seen = seen / jnp.asarray(self.max_divisor).astype(seen.dtype)
            new.append(jnp.maximum(stored[-1], seen))
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


@dataclasses.dataclass(frozen=True, eq=False)
class AdamDirection:
    r"""Adam's output from its new moments, ``(new, old, g) -> u``, element-wise:

    .. math::

        u = \frac{n}{\sqrt{d + \epsilon_{root}} + \epsilon}, \qquad
        n = \mu_t \text{ or } \mu_t / (1-\beta_1^t), \qquad
        d = \nu_t / (1-\beta_2^t),\ \nu^{max}_t / (1-\beta_2^t) \text{ or } \nu^{max}_t

    by ``amsgrad`` convention, as :func:`optax_decoupled.scale_by_adam` documents (``None``,
    ``"pytorch"``, ``"optax"``, ``"paper"``). ``bc1``, ``bc2`` are the bias corrections
    :math:`1-\beta_k^t`. A storage may compute it in the same pass as the moments
    (:func:`optax_decoupled._src.storage.update_moments_and_output`).
    """

    bc1: Any
    bc2: Any
    eps: Any
    eps_root: Any
    amsgrad: str | None = None

    @property
    def scales_numerator(self) -> bool:
        return self.amsgrad != "paper"

    @property
    def denominator(self) -> int:
        """Which new moment the denominator is: 1 (:math:`\\nu`) or 2 (:math:`\\nu^{max}`)."""
        return 1 if self.amsgrad is None else 2

    @property
    def scales_denominator(self) -> bool:
        return self.amsgrad in (None, "pytorch")

    def split_dynamic(self) -> tuple[tuple[jax.Array, ...], Any]:
        """As :meth:`EmaMoments.split_dynamic`."""
        values = (self.bc1, self.bc2, self.eps, self.eps_root)
        names = ("bc1", "bc2", "eps", "eps_root")
        return _split(
            values, lambda v: dataclasses.replace(self, **dict(zip(names, v, strict=True)))
        )

    def __call__(self, new: tuple[jax.Array, ...], old: tuple[jax.Array, ...], g: jax.Array):
        mu, den = new[0], new[self.denominator]
        if self.scales_denominator:
            den = den / jnp.asarray(self.bc2).astype(den.dtype)
        numer = mu / jnp.asarray(self.bc1).astype(mu.dtype) if self.scales_numerator else mu
        return (numer / (jnp.sqrt(den + self.eps_root) + self.eps)).astype(g.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class LionDirection:
    r"""Lion's output from its old momentum, ``(new, old, g) -> u``, element-wise:
    :math:`u = \operatorname{sign}((1-\beta_1) g + \beta_1 \mu_{t-1})`
    (:func:`optax_decoupled.scale_by_lion`)."""

    b1: Any

    def split_dynamic(self) -> tuple[tuple[jax.Array, ...], Any]:
        """As :meth:`EmaMoments.split_dynamic`."""
        return _split((self.b1,), lambda v: LionDirection(v[0]))

    def __call__(self, new: tuple[jax.Array, ...], old: tuple[jax.Array, ...], g: jax.Array):
        mu = old[0]
        dt = jnp.promote_types(mu.dtype, g.dtype)  # bf16 momentum, f32 gradient: f32
        b1 = self.b1
        return jnp.sign((1 - b1) * g.astype(dt) + b1 * mu.astype(dt)).astype(g.dtype)
