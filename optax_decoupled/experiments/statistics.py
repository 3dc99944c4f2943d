"""Verdicts with their uncertainty: paired differences over seeds, the slope of λ*(η).

The comparison contrasts optimizers trained on the same seeds, so their test metrics are
compared pairwise (:func:`paired_difference`); the learning-rate × weight-decay grid asks
whether the best weight decay moves with the learning rate (:func:`valley_slope`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = 0.95,
    lower_is_better: bool = True,
    names: tuple[str, str] = ("a", "b"),
) -> dict[str, Any]:
    r"""The mean of :math:`a_i - b_i` over seeds :math:`i` with its Student-t interval.

    .. math::

        \bar d \pm t_{(1+c)/2,\,n-1}\, s_d / \sqrt{n}

    and a verdict that follows from the interval: ``"a better"``/``"b better"`` when it
    excludes 0 (by ``lower_is_better``), ``"not distinguishable"`` otherwise (also for fewer
    than two seeds, where no interval exists).

    Args:
      a, b: the metric of each seed, paired by position.
      confidence: the interval's coverage :math:`c`.
      lower_is_better: whether a lower metric (a loss) is better.
      names: how the verdict names ``a`` and ``b``.

    Returns:
      ``{"mean", "low", "high", "n", "verdict", "line"}``; ``line`` says it in words.

    Raises:
      ValueError: if ``a`` and ``b`` differ in length, are empty or not finite.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"`a` and `b` must be paired 1-D sequences, got {a.shape} and {b.shape}.")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("`a` and `b` must be finite (a diverged run has no paired difference).")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}.")
    d = a - b
    n, mean = d.size, float(np.mean(d))
    if n < 2:
        low = high = float("nan")
        verdict = "not distinguishable"
    else:
        half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * np.std(d, ddof=1) / np.sqrt(n))
        low, high = mean - half, mean + half
        if low > 0 or high < 0:
            a_lower = high < 0
            verdict = f"{names[0] if a_lower == lower_is_better else names[1]} better"
        else:
            verdict = "not distinguishable"
    interval = "" if n < 2 else f" [{low:+.4f}, {high:+.4f}]"
    said = verdict if verdict != "not distinguishable" else f"{verdict} at this budget"
    line = (
        f"{names[0]} − {names[1]}: {mean:+.4f}{interval} ({confidence:.0%} interval, "
        f"{n} paired seeds): {said}"
    )
    return {"mean": mean, "low": low, "high": high, "n": n, "verdict": verdict, "line": line}


def valley_minimum(log_wds: np.ndarray, losses: np.ndarray) -> float:
    """The log weight decay at the bottom of one learning rate's loss curve: the vertex of
    the parabola through the best cell and its two neighbours (the best cell itself at the
    edge of the grid, or where the three points do not curve upward). Non-finite losses
    count as the worst."""
    losses = np.where(np.isfinite(losses), losses, np.inf)
    j = int(np.argmin(losses))
    if j == 0 or j == len(losses) - 1 or not np.all(np.isfinite(losses[j - 1 : j + 2])):
        return float(log_wds[j])
    x, y = log_wds[j - 1 : j + 2], losses[j - 1 : j + 2]
    a, b, _ = np.polyfit(x, y, 2)
    if a <= 0:
        return float(log_wds[j])
    return float(np.clip(-b / (2 * a), x[0], x[-1]))


def _slope(lrs: np.ndarray, wds: np.ndarray, loss: np.ndarray) -> float:
    log_lr, log_wd = np.log10(lrs), np.log10(wds)
    rows = np.isfinite(np.min(np.where(np.isfinite(loss), loss, np.inf), axis=1))
    if rows.sum() < 2:
        return float("nan")
    minima = np.array([valley_minimum(log_wd, loss[i]) for i in np.nonzero(rows)[0]])
    return float(np.polyfit(log_lr[rows], minima, 1)[0])


def valley_slope(
    lrs: Sequence[float],
    wds: Sequence[float],
    losses: np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    separable_within: float = 0.25,
) -> dict[str, Any]:
    r"""The slope :math:`s` of :math:`\log\lambda^*(\eta)` against :math:`\log\eta` over a
    learning-rate × weight-decay grid, with a bootstrap interval over seeds, and a verdict.

    :math:`\lambda^*(\eta)` is the bottom of each learning rate's valley
    (:func:`valley_minimum`) in the seed-averaged losses. Seeds are resampled with
    replacement ``n_boot`` times; the interval is the percentile interval of the slopes.
    Loshchilov & Hutter's separability means :math:`s = 0` (the best λ does not move with η);
    PyTorch's and Optax's decay :math:`\eta\lambda` makes the product act, :math:`s = -1`.

    Verdicts: ``"separable"`` when the interval lies within ``±separable_within`` of 0,
    ``"coupled"`` when it excludes 0, ``"inconclusive"`` otherwise -- and whenever the
    seed-averaged valley of some learning rate bottoms out at the first or last weight decay
    of the grid, where :math:`\lambda^*` is not located (``"edge"`` lists those learning rates).

    Args:
      lrs, wds: the grid's axes (increasing).
      losses: ``(seeds, len(lrs), len(wds))`` validation losses (``inf``/NaN for diverged).

    Returns:
      ``{"slope", "low", "high", "verdict", "line", "n_seeds", "edge"}``.
    """
    lrs, wds = np.asarray(lrs, np.float64), np.asarray(wds, np.float64)
    losses = np.asarray(losses, np.float64)
    if losses.ndim != 3 or losses.shape[1:] != (lrs.size, wds.size):
        raise ValueError(
            f"`losses` must have shape (seeds, {lrs.size}, {wds.size}), got {losses.shape}."
        )
    clean = np.where(np.isfinite(losses), losses, np.inf)
    mean = np.mean(clean, axis=0)
    slope = _slope(lrs, wds, mean)
    at = np.argmin(mean, axis=1)
    edge = [float(lr) for lr, j, row in zip(lrs, at, mean, strict=True)
            if np.isfinite(row).any() and j in (0, wds.size - 1)]  # fmt: skip
    rng = np.random.default_rng(seed)
    n = losses.shape[0]
    boots = np.array(
        [_slope(lrs, wds, np.mean(clean[rng.integers(0, n, n)], axis=0)) for _ in range(n_boot)]
    )
    boots = boots[np.isfinite(boots)]
    if n < 2 or boots.size == 0 or not np.isfinite(slope):
        low = high = float("nan")
        verdict = "inconclusive"
    else:
        low, high = (
            float(q) for q in np.quantile(boots, [(1 - confidence) / 2, (1 + confidence) / 2])
        )
        if edge:
            verdict = "inconclusive"
        elif -separable_within <= low and high <= separable_within:
            verdict = "separable"
        elif low > 0 or high < 0:
            verdict = "coupled"
        else:
            verdict = "inconclusive"
    detail = f"slope {slope:+.2f}" + ("" if np.isnan(low) else f" [{low:+.2f}, {high:+.2f}]")
    line = f"{verdict}: {detail} ({confidence:.0%} bootstrap interval over {n} seeds)"
    if edge:
        where = ", ".join(f"{v:.3g}" for v in edge)
        line += f"; the best λ is at the edge of the grid for η = {where}"
    return {
        "slope": slope,
        "low": low,
        "high": high,
        "verdict": verdict,
        "line": line,
        "n_seeds": n,
        "edge": edge,
    }
