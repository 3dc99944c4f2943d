r"""The counterexamples of Reddi, Kale & Kumar to Adam: sequences of linear losses on [-1, 1].

Reference: S. J. Reddi, S. Kale and S. Kumar, "On the Convergence of Adam and Beyond",
ICLR 2018.

Every problem is a sequence of *linear* losses :math:`f_t(x) = g_t\,x` on the domain
:math:`\mathcal F = [-1, 1]`, whose optimum is :math:`x^\star = -1`:

======================  =========================================================================
``theorem1``            online, :math:`g_t = C` if :math:`t \bmod 3 = 1` else :math:`-1`
                        (Theorem 1, :math:`C = 3`)
``figure1_online``      online, :math:`g_t = 1010` if :math:`t \bmod 101 = 1` else :math:`-10`
                        (Section 5, Figure 1)
``theorem3``            stochastic, :math:`g_t = C` with probability :math:`p = (1+\delta)/(C+1)`,
                        else :math:`-1` (Theorem 3), so :math:`\mathbb E g_t = \delta > 0`
``figure1_stochastic``  stochastic, :math:`g_t = 1010` with probability 0.01, else :math:`-10`
                        (Figure 1), :math:`\mathbb E g_t = 0.2`
======================  =========================================================================

Steps are :math:`t = 1, \dots, T`; :func:`gradient` is :math:`g_t`. The runs themselves are in
:mod:`~optax_decoupled.experiments.reddi_simulation`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: The optimum of every problem.
X_STAR = -1.0
#: The domain's bounds.
LOWER, UPPER = -1.0, 1.0


@dataclasses.dataclass(frozen=True)
class Problem:
    r"""A sequence of linear losses :math:`f_t(x) = g_t x` on :math:`[-1, 1]`.

    Attributes:
      name: short identifier (a key in ``results.json``).
      kind: ``"online"`` (deterministic, periodic) or ``"stochastic"`` (i.i.d., seeded).
      big: the rare, large gradient (:math:`C` or 1010).
      small: magnitude of the common gradient, which is :math:`-\text{small}` (1 or 10).
      period: online only: :math:`g_t = \text{big}` iff :math:`t \bmod \text{period} = 1`.
      prob: stochastic only: :math:`P(g_t = \text{big})`.
      description: one line for tables and figure titles.
    """

    name: str
    kind: str
    big: float
    small: float
    period: int = 0
    prob: float = 0.0
    description: str = ""

    def __post_init__(self):
        if self.kind not in ("online", "stochastic"):
            raise ValueError(f"`kind` must be 'online' or 'stochastic', got {self.kind!r}.")
        if self.kind == "online" and self.period < 2:
            raise ValueError(f"an online problem needs `period` >= 2, got {self.period}.")
        if self.kind == "stochastic" and not 0.0 < self.prob < 1.0:
            raise ValueError(f"a stochastic problem needs 0 < `prob` < 1, got {self.prob}.")

    @property
    def mean_gradient(self) -> float:
        r""":math:`\mathbb E g_t` (online: the average over one period); positive here."""
        if self.kind == "online":
            return (self.big - (self.period - 1) * self.small) / self.period
        return self.prob * self.big - (1.0 - self.prob) * self.small

    @property
    def rms_gradient(self) -> float:
        r""":math:`\sqrt{\mathbb E g_t^2}` (online: over one period)."""
        if self.kind == "online":
            k = self.period
            return float(np.sqrt((self.big**2 + (k - 1) * self.small**2) / k))
        return float(np.sqrt(self.prob * self.big**2 + (1.0 - self.prob) * self.small**2))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(x_star=X_STAR, mean_gradient=self.mean_gradient, rms_gradient=self.rms_gradient)
        return d


def theorem1_problem(C: float = 3.0) -> Problem:
    r"""Theorem 1: :math:`f_t(x) = Cx` if :math:`t \bmod 3 = 1`, else :math:`-x` (C > 2)."""
    if not C > 2:
        raise ValueError(f"Theorem 1 needs C > 2 (so that x* = -1), got C={C}.")
    return Problem(
        "theorem1",
        "online",
        float(C),
        1.0,
        period=3,
        description=f"Theorem 1: f_t = {C:g}x if t mod 3 = 1 else -x",
    )


def figure1_online_problem() -> Problem:
    r"""Figure 1, online: :math:`f_t(x) = 1010x` if :math:`t \bmod 101 = 1`, else :math:`-10x`."""
    return Problem(
        "figure1_online",
        "online",
        1010.0,
        10.0,
        period=101,
        description="Figure 1 online: f_t = 1010x if t mod 101 = 1 else -10x",
    )


def theorem3_problem(C: float = 3.0, delta: float = 0.1) -> Problem:
    r"""Theorem 3: :math:`f = Cx` with probability :math:`(1+\delta)/(C+1)`, else :math:`-x`."""
    p = (1.0 + delta) / (C + 1.0)
    if not (delta > 0 and 0 < p < 1):
        raise ValueError(f"need delta > 0 and (1+delta)/(C+1) < 1, got C={C}, delta={delta}.")
    return Problem(
        "theorem3",
        "stochastic",
        float(C),
        1.0,
        prob=p,
        description=f"Theorem 3: f = {C:g}x w.p. {p:.3g} (δ={delta:g}) else -x",
    )


def figure1_stochastic_problem() -> Problem:
    r"""Figure 1, stochastic: :math:`f = 1010x` with probability 0.01, else :math:`-10x`."""
    return Problem(
        "figure1_stochastic",
        "stochastic",
        1010.0,
        10.0,
        prob=0.01,
        description="Figure 1 stochastic: f = 1010x w.p. 0.01 else -10x",
    )


def gradient(problem: Problem, t: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """:math:`g_t` at step ``t`` (1-based int32); a stochastic problem needs ``key``.

    The stochastic draw is ``uniform(fold_in(key, t)) < prob``: a run's gradients depend only on
    its seed and the step, so every optimizer given the same seed sees the same sequence.
    """
    big = jnp.float32(problem.big)
    small = jnp.float32(-problem.small)
    if problem.kind == "online":
        return jnp.where(t % problem.period == 1, big, small)
    if key is None:
        raise ValueError(f"problem {problem.name!r} is stochastic: pass a PRNG key.")
    u = jax.random.uniform(jax.random.fold_in(key, t), dtype=jnp.float32)
    return jnp.where(u < problem.prob, big, small)
