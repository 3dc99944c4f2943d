"""Optimizer factories for the trainer: warmup + cosine schedules from a traced peak.

:func:`scheduled` turns any Optax-style ``optimizer(learning_rate, **kw)`` into the
``make_tx(learning_rate=peak, **hparams)`` the trainer calls inside its traced step, with a
warmup + cosine schedule (:func:`warmup_cosine`) built from the (possibly traced) peak
learning rate and global-norm clipping in front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from optax_decoupled.experiments.training_step import MakeTx


def warmup_cosine(
    peak: jax.typing.ArrayLike,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    init_fraction: float = 0.0,
    end_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from ``init_fraction * peak`` to ``peak``, then cosine decay to
    ``end_fraction * peak`` at ``total_steps``: ``peak * unit_schedule(count)``.

    ``peak`` may be a tracer (a vmapped learning rate); the unit schedule is Optax's
    ``warmup_cosine_decay_schedule`` with peak 1, whose construction needs concrete values.

    Raises:
      ValueError: unless ``total_steps >= 1`` and ``0 <= warmup_steps < total_steps``.
    """
    _check_schedule_steps(total_steps, warmup_steps)
    if warmup_steps > 0:
        unit = optax.warmup_cosine_decay_schedule(
            init_fraction, 1.0, warmup_steps, total_steps, end_value=end_fraction
        )
    else:
        unit = optax.cosine_decay_schedule(1.0, total_steps, alpha=end_fraction)
    return lambda count: peak * unit(count)


def _check_schedule_steps(total_steps: Any, warmup_steps: Any) -> None:
    if not _is_int(total_steps) or total_steps < 1:
        raise ValueError(f"`total_steps` must be an int >= 1, got {total_steps!r}.")
    if not _is_int(warmup_steps) or not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"`warmup_steps` must be an int with 0 <= warmup_steps < total_steps "
            f"({total_steps}), got {warmup_steps!r}."
        )


def scheduled(
    optimizer: Callable[..., optax.GradientTransformation],
    *,
    total_steps: int,
    warmup_steps: int = 0,
    clip_norm: float | None = 1.0,
    end_fraction: float = 0.0,
    lr_name: str = "learning_rate",
    peak_name: str | None = None,
    **fixed: Any,
) -> MakeTx:
    """Turn ``optimizer(learning_rate, **kw)`` into a ``make_tx(learning_rate, **hparams)``.

    The returned factory builds :func:`warmup_cosine` from the (peak) ``learning_rate`` it is
    given, calls ``optimizer(schedule, **fixed, **hparams)`` and, if ``clip_norm`` is set,
    chains ``optax.clip_by_global_norm(clip_norm)`` in front. ``peak_name`` passes the peak
    learning rate under that keyword too (e.g. ``peak_learning_rate`` for
    ``optax_decoupled.adamw(..., decay_convention="schedule")``).

    Example::

        make_tx = scheduled(optax.adamw, total_steps=600, warmup_steps=50, clip_norm=1.0)
        tx = make_tx(learning_rate=3e-3, weight_decay=0.1)

    Raises:
      ValueError: for step counts :func:`warmup_cosine` refuses, or a ``clip_norm`` that is
        not ``None`` or a finite number > 0 (a negative one would turn descent into ascent).
    """
    _check_schedule_steps(total_steps, warmup_steps)
    if clip_norm is not None:
        _check_clip_norm(clip_norm)

    def make_tx(**hparams: Any) -> optax.GradientTransformation:
        if lr_name not in hparams:
            raise TypeError(f"make_tx needs the peak learning rate as {lr_name}=...")
        peak = hparams.pop(lr_name)
        schedule = warmup_cosine(
            peak, total_steps=total_steps, warmup_steps=warmup_steps, end_fraction=end_fraction
        )
        kwargs = {**fixed, **hparams}
        if peak_name is not None:
            kwargs[peak_name] = peak
        tx = optimizer(schedule, **kwargs)
        if clip_norm is not None:
            tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
        return tx

    return make_tx


def _is_int(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy integer (a bool is not)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_clip_norm(clip_norm: Any) -> None:
    """Raises ``ValueError`` unless ``clip_norm`` is a finite number > 0 (or an array of
    them); a schedule, a bool or a non-numeric value is refused. A traced value passes."""
    if isinstance(clip_norm, jax.core.Tracer):
        return
    if callable(clip_norm) and not isinstance(clip_norm, jax.Array):
        raise ValueError(
            f"`clip_norm` must be a number or an array, not a schedule, got {clip_norm!r}."
        )
    value = np.asarray(clip_norm) if not isinstance(clip_norm, bool) else None
    real = value is not None and (
        np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)
    )
    if not real or not np.all(np.isfinite(value) & (value > 0)):
        raise ValueError(f"`clip_norm` must be None or a finite number > 0, got {clip_norm!r}.")
