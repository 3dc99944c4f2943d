r"""Reddi, Kale & Kumar's counterexamples to Adam, run with this package's optimizers.

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

Steps are :math:`t = 1, \dots, T`. At step :math:`t` the optimizer sees :math:`g_t` (the
gradient of :math:`f_t` at :math:`x_t`) and :math:`x_{t+1} = \Pi_{\mathcal F}(x_t + u_t)`, the
projection being ``optax.projections.projection_box`` (in one dimension the paper's
:math:`\sqrt{\hat V_t}`-weighted projection is the same clipping). Step sizes are
:math:`\alpha_t = \alpha/\sqrt t` (``schedule="sqrt"``) or a constant :math:`\alpha`.

**Regret.** :math:`R_T = \sum_t f_t(x_t) - \min_{x\in\mathcal F}\sum_t f_t(x)`. For the online
problems every partial sum :math:`\sum_{s\le t} g_s` is positive, so the minimum is at
:math:`x^\star = -1` for every :math:`t` and :math:`R_t = \sum_{s\le t} g_s (x_s + 1)` exactly.
For the stochastic problems the same formula is used with the *realised* :math:`g_t` and
:math:`x^\star = -1`, the minimiser of the expected loss (the realised best point in hindsight
may differ early on, so :math:`R_t` can be negative there); ``expected_gap``
:math:`= \mathbb E[g]\,(x_T + 1)` is the final point's suboptimality in expected loss.
:math:`R_t` is summed in float32 with Kahan (compensated) summation: :math:`R_T/T` matches a
float64 NumPy sum to about 1e-8 after :math:`10^6` steps.

**Batching.** A run is one :func:`jax.lax.scan` over the recorded steps (log-spaced, see
:func:`log_steps`), each scan step a :func:`jax.lax.while_loop` over the optimizer steps up to
the next recorded one, so all :math:`T` steps run in one compiled loop and recording costs
nothing per step. Runs are :class:`Run` records (optimizer, :math:`\alpha`, :math:`\beta_1`,
:math:`\beta_2`, :math:`\epsilon`, weight decay, schedule, seed, :math:`x_1`); :func:`simulate`
batches any list of them with :func:`jax.vmap`. The hyperparameters are traced arrays handed to
the optimizer constructors (the core's validation skips traced values), so one compiled program
serves every setting; optimizers are batched either per optimizer (``dispatch="group"``) or as a
vmapped index into :func:`jax.lax.switch` (``"switch"``).

**Optimizers** (:data:`OPTIMIZERS`): ``adam`` (:func:`optax_decoupled.scale_by_adam`, *with*
the bias correction of Optax and PyTorch; the Adam of Theorem 1 has :math:`\beta_1 = 0` and no
correction, which changes only the first few steps since :math:`\beta_2^t \to 0` fast),
``optax_adam`` (``optax.adam``), ``amsgrad_paper`` / ``amsgrad_pytorch`` / ``amsgrad_optax``
(:func:`optax_decoupled.amsgrad` in its three conventions), ``sgd`` (``optax.sgd``) and
``adamw`` (:func:`optax_decoupled.adamw`, decoupled decay :math:`\lambda\alpha_t`, ``mask=None``
so that the scalar is decayed).

**Measured times** (2 shared CPU cores, jax 0.10.2; ``docs/reddi.md`` has the full table): one
optimizer's :math:`10^6`-step Theorem-1 run takes about 0.03 s after a 0.2-0.3 s compilation;
the 14-run Theorem-1 comparison (7 optimizers × 2 schedules, :math:`10^6` steps) 0.3 s; the
24×24 phase diagram (576 runs of :math:`10^5` steps, one vmapped program) about 1 s. XLA:CPU
compiles a while loop into a single kernel only while its state is under 1 kB (1-4 runs of a
batch); larger batches pay about 1.5 µs per step, which :func:`enable_fast_cpu_loops` (used by
the CLI and the notebook) removes. The CLI's defaults (the report's ``quick`` part) took 10 s
on the AMD machine and 28 s on the Intel Xeon (``docs/comparison.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled.experiments import xla_setup
from optax_decoupled.experiments.formatting import number
from optax_decoupled.experiments.xla_setup import FAST_LOOPS_FLAG

#: Optimizer names accepted by :class:`Run` (see the module docstring).
OPTIMIZERS = (
    "adam",
    "optax_adam",
    "amsgrad_paper",
    "amsgrad_pytorch",
    "amsgrad_optax",
    "sgd",
    "adamw",
)
#: Step-size schedules: ``"sqrt"`` is :math:`\alpha/\sqrt t`, ``"constant"`` is :math:`\alpha`.
SCHEDULES = ("sqrt", "constant")
#: How :func:`simulate` batches a mix of optimizers.
DISPATCHES = ("group", "switch")

X_STAR = -1.0
LOWER, UPPER = -1.0, 1.0


# ---------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------


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


def gradient_sequence(problem: Problem, steps: int, seed: int = 0) -> np.ndarray:
    r""":math:`(g_1, \dots, g_T)` (NumPy float32): exactly what a run with ``seed`` sees."""
    with jax.default_device(simulation_device()):
        if problem.kind == "online":
            t = jnp.arange(1, steps + 1, dtype=jnp.int32)
            return np.asarray(jax.vmap(lambda s: gradient(problem, s))(t))
        big = np.asarray(_draws(problem, [seed], steps))[:, 0]
    return np.where(big, problem.big, -problem.small).astype(np.float32)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draws_jit(problem: Problem, seeds: jax.Array, steps: int) -> jax.Array:
    t = jnp.arange(1, steps + 1, dtype=jnp.int32)
    big = jnp.float32(problem.big)
    one = lambda s: jax.vmap(lambda u: gradient(problem, u, jax.random.key(s)) == big)(t)
    return jax.vmap(one, out_axes=1)(seeds)


def _draws(problem: Problem, seeds: Sequence[int], steps: int) -> jax.Array:
    """``(T, len(seeds))`` bools, True where :math:`g_t` = big, for each seed.

    Runs with the same seed see the same gradients (common random numbers), so the draws are
    made once per seed with :func:`gradient` instead of inside every run's loop. Online problems
    need none and get a ``(1, 1)`` placeholder.
    """
    if problem.kind == "online":
        return jnp.zeros((1, 1), bool)
    return _draws_jit(problem, jnp.asarray(seeds, jnp.int32), steps)


# ---------------------------------------------------------------------------------------------
# Optimizers and runs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    r"""One run's settings; every numeric field may differ between the runs of a batch.

    Attributes:
      optimizer: one of :data:`OPTIMIZERS`.
      alpha: :math:`\alpha`, the step size at :math:`t = 1`.
      b1, b2, eps: Adam's :math:`\beta_1`, :math:`\beta_2`, :math:`\epsilon` (SGD ignores them).
      weight_decay: AdamW's :math:`\lambda` (decay :math:`\lambda\alpha_t` per step); only
        ``adamw`` uses it.
      schedule: ``"sqrt"`` (:math:`\alpha/\sqrt t`) or ``"constant"``.
      seed: the seed of a stochastic problem's draws.
      x0: the starting point :math:`x_1`.
    """

    optimizer: str
    alpha: float = 0.5
    b1: float = 0.0
    b2: float = 0.1
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "sqrt"
    seed: int = 0
    x0: float = 1.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"`optimizer` must be one of {OPTIMIZERS}, got {self.optimizer!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"`schedule` must be one of {SCHEDULES}, got {self.schedule!r}.")
        if not LOWER <= self.x0 <= UPPER:
            raise ValueError(f"`x0` must lie in [-1, 1], got {self.x0}.")

    def label(self) -> str:
        """The optimizer name, with λ for AdamW."""
        if self.optimizer == "adamw":
            return f"adamw (λ={self.weight_decay:g})"
        return self.optimizer


def step_size(alpha: jax.Array, sqrt_schedule: jax.Array) -> Callable[[jax.Array], jax.Array]:
    r""":math:`\alpha_t` as an Optax schedule of the 0-based ``count`` (:math:`t` = count + 1)."""

    def schedule(count):
        t = (count + 1).astype(jnp.float32)
        return alpha * jnp.where(sqrt_schedule, jax.lax.rsqrt(t), jnp.float32(1.0))

    return schedule


def make_optimizer(
    name: str,
    learning_rate: optax.ScalarOrSchedule,
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
) -> optax.GradientTransformation:
    """The optimizer ``name`` of :data:`OPTIMIZERS`; hyperparameters may be traced arrays."""
    if name == "adam":
        return optax.chain(
            od.scale_by_adam(b1, b2, eps), optax.scale_by_learning_rate(learning_rate)
        )
    if name == "optax_adam":
        return optax.adam(learning_rate, b1, b2, eps)
    if name.startswith("amsgrad_"):
        variant = name.removeprefix("amsgrad_")
        return od.amsgrad(learning_rate, b1, b2, eps, variant=variant, mask=None)
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "adamw":
        return od.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay, mask=None)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}.")


def log_steps(steps: int, num: int = 200, multiple: int = 1) -> np.ndarray:
    r"""About ``num`` log-spaced steps in ``[1, steps]``, always ending with ``steps``.

    With ``multiple=period`` the steps after the first period are rounded to whole periods, so
    an online run's plotted :math:`x` is the iterate at the start of a period and :math:`R_t/t`
    shows no in-period ripple.
    """
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    t = np.geomspace(1, steps, num)
    if multiple > 1:
        t = np.where(t < multiple, t, np.round(t / multiple) * multiple)
    t = np.unique(np.clip(np.round(t), 1, steps).astype(np.int64))
    if t[-1] != steps:
        t = np.append(t, steps)
    return t.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SimResult:
    r"""What :func:`simulate` returns (NumPy arrays; ``B`` runs, ``K`` recorded steps).

    Attributes:
      problem, runs, steps: the inputs.
      record_t: ``(K,)`` the recorded steps :math:`t`.
      x: ``(B, K)`` the iterate after :math:`t` updates, :math:`x_{t+1}`.
      avg_regret: ``(B, K)`` :math:`R_t/t`.
      x_final: ``(B,)`` the iterate after all :math:`T` updates (``x[:, -1]``).
      avg_regret_final: ``(B,)`` :math:`R_T/T`.
      x_tail_mean: ``(B,)`` the mean iterate over the last 10% of the steps (at least the
        last one; robust to the oscillation of constant step sizes).
      compile_s, run_s: compilation and execution wall time in seconds (``compile_s``
        includes drawing a stochastic problem's gradients, and is about that alone when the
        same program was compiled before in this process).
      device: the device the program ran on (:func:`simulation_device`).
    """

    problem: Problem
    runs: list[Run]
    steps: int
    record_t: np.ndarray
    x: np.ndarray
    avg_regret: np.ndarray
    x_final: np.ndarray
    avg_regret_final: np.ndarray
    x_tail_mean: np.ndarray
    compile_s: float
    run_s: float
    device: str = ""

    @property
    def expected_gap(self) -> np.ndarray:
        r""":math:`\mathbb E f(x_T) - \mathbb E f(x^\star) = \mathbb E[g]\,(x_T + 1)`."""
        return self.problem.mean_gradient * (self.x_final - X_STAR)


def _kahan(total: jax.Array, comp: jax.Array, value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One compensated-summation step; the running sum is ``total - comp``."""
    y = value - comp
    new = total + y
    return new, (new - total) - y


def _one_run(hp, rec, draws, *, problem, names, steps, tail_from):
    """One run. ``hp``: this run's scalars; ``rec``: (K,) steps; ``draws``: (T, seeds) bools."""
    lr = step_size(hp["alpha"], hp["sqrt"])
    txs = [make_optimizer(n, lr, hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"]) for n in names]
    x0 = hp["x0"]
    states = tuple(tx.init(x0) for tx in txs)
    zero = jnp.zeros((), jnp.float32)

    def update_with(i, g, x, states):
        u, s = txs[i].update(g, states[i], x)
        return u, states[:i] + (s,) + states[i + 1 :]

    branches = [lambda g, x, s, i=i: update_with(i, g, x, s) for i in range(len(txs))]

    def step(carry):
        t, x, states, reg, reg_c, tail, tail_c = carry
        if problem.kind == "online":
            g = gradient(problem, t)
        else:  # this run's seed's precomputed draw (see `_draws`)
            row = jax.lax.dynamic_index_in_dim(draws, t - 1, keepdims=False)  # (seeds,)
            g = jnp.where(row[hp["draw"]], jnp.float32(problem.big), jnp.float32(-problem.small))
        reg, reg_c = _kahan(reg, reg_c, g * (x - X_STAR))  # f_t(x_t) - f_t(x*)
        if len(txs) == 1:
            u, states = update_with(0, g, x, states)
        else:
            u, states = jax.lax.switch(hp["opt"], branches, g, x, states)
        x = optax.projections.projection_box(x + u, LOWER, UPPER)
        tail, tail_c = _kahan(tail, tail_c, jnp.where(t >= tail_from, x, zero))
        return t + 1, x, states, reg, reg_c, tail, tail_c

    def segment(carry, end):
        # All steps up to and including `end`, then record x_{end+1} and R_end / end.
        carry = jax.lax.while_loop(lambda c: c[0] <= end, step, carry)
        t, x, _, reg, reg_c, _, _ = carry
        return carry, (x, (reg - reg_c) / (t - 1).astype(jnp.float32))

    init = (jnp.int32(1), x0, states, zero, zero, zero, zero)
    carry, (xs, rs) = jax.lax.scan(segment, init, rec)
    _, x, _, reg, reg_c, tail, tail_c = carry
    return {
        "x_final": x,
        "avg_regret_final": (reg - reg_c) / jnp.float32(steps),
        "x_tail_mean": (tail - tail_c) / jnp.float32(steps - tail_from + 1),
        "x": xs,
        "avg_regret": rs,
    }


def _hyperparameters(runs: Sequence[Run], names: tuple[str, ...]) -> dict[str, jax.Array]:
    seeds = sorted({r.seed for r in runs})
    f32 = lambda field: jnp.asarray([getattr(r, field) for r in runs], jnp.float32)
    return {
        "alpha": f32("alpha"),
        "b1": f32("b1"),
        "b2": f32("b2"),
        "eps": f32("eps"),
        "weight_decay": f32("weight_decay"),
        "x0": f32("x0"),
        "sqrt": jnp.asarray([r.schedule == "sqrt" for r in runs]),
        "draw": jnp.asarray([seeds.index(r.seed) for r in runs], jnp.int32),
        "opt": jnp.asarray([names.index(r.optimizer) for r in runs], jnp.int32),
    }


def _program(problem: Problem, opts: tuple[str, ...], steps: int, tail_from: int, dispatch: str):
    """The jitted ``(hp, rec, draws) -> outputs`` for runs whose optimizers are ``opts``."""
    names = tuple(dict.fromkeys(opts))

    def batch(names_, hp, rec, draws):
        one = lambda h, r, d: _one_run(
            h, r, d, problem=problem, names=names_, steps=steps, tail_from=tail_from
        )
        return jax.vmap(one, in_axes=(0, None, None))(hp, rec, draws)

    if dispatch == "switch" or len(names) == 1:
        return jax.jit(lambda hp, rec, draws: batch(names, hp, rec, draws))

    groups = [np.array([i for i, o in enumerate(opts) if o == n]) for n in names]
    inverse = np.argsort(np.concatenate(groups))

    def grouped(hp, rec, draws):
        outs = [
            batch((n,), jax.tree.map(lambda a, g=g: a[g], hp), rec, draws)
            for n, g in zip(names, groups, strict=True)
        ]
        return jax.tree.map(lambda *a: jnp.concatenate(a)[inverse], *outs)

    return jax.jit(grouped)


_COMPILED: dict[Any, Any] = {}


def simulation_device(device: jax.Device | None = None) -> jax.Device:
    r"""Where :func:`simulate` runs: ``device`` if given, else the first CPU device (the
    default device where JAX has no CPU backend, e.g. under ``JAX_PLATFORMS=cuda``).

    A simulation is a sequential loop over scalars, :math:`10^5`-:math:`10^7` steps of a few
    flops per run. On a CPU a step costs nanoseconds; on a GPU each step is a kernel launch or
    more, so the same loop is one to two orders of magnitude slower there. Measured with the
    test suite (2026-11-30): ``test_regret_kahan_sum_is_accurate_over_many_steps`` 0.44 s on 2
    Intel Xeon cores, 48.7 s on an H200 (jax 0.11.2); the 14 runs of :math:`10^7` steps of
    ``test_reddi_theorem1_ten_million_float32_steps`` 3.1 s on the CPU, unfinished after
    230 s on the H200.
    """
    if device is not None:
        return device
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # no CPU backend in this process
        return jax.devices()[0]


def simulate(
    problem: Problem,
    runs: Sequence[Run],
    steps: int,
    *,
    record: Sequence[int] | np.ndarray | None = None,
    dispatch: str = "group",
    device: jax.Device | None = None,
) -> SimResult:
    r"""Runs every :class:`Run` on ``problem`` for ``steps`` steps in one compiled program.

    The runs are batched with :func:`jax.vmap`; their hyperparameters (:math:`\alpha`,
    :math:`\beta_1`, :math:`\beta_2`, :math:`\epsilon`, :math:`\lambda`, schedule, seed,
    :math:`x_1`) are traced arrays. A mix of optimizers is batched in one of two ways, which give
    the same numbers:

    * ``"group"`` (default): one vmapped loop per optimizer over that optimizer's runs, all in
      one jitted program.
    * ``"switch"``: one vmapped loop over all runs, the optimizer a batched index into
      :func:`jax.lax.switch` (under ``vmap`` every optimizer's update is computed for every run
      and the right one selected). About 15× slower on CPU for 7 optimizers.

    Args:
      problem: the loss sequence.
      runs: the runs (any mix of optimizers, hyperparameters, schedules and seeds).
      steps: :math:`T`.
      record: the steps :math:`t` at which :math:`x_{t+1}` and :math:`R_t/t` are kept (strictly
        increasing, in ``[1, T]``); default :func:`log_steps`, aligned to the period of an
        online problem.
      dispatch: ``"group"`` or ``"switch"``.
      device: where to run; default :func:`simulation_device`'s choice, the CPU, also on a
        machine with a GPU (a GPU runs these scalar loops far slower).

    Raises:
      ValueError: for no runs, ``steps < 1``, a bad ``record`` or an unknown ``dispatch``.
    """
    runs = list(runs)
    if not runs:
        raise ValueError("`runs` is empty.")
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    if dispatch not in DISPATCHES:
        raise ValueError(f"`dispatch` must be one of {DISPATCHES}, got {dispatch!r}.")
    if record is None:
        record = log_steps(steps, multiple=problem.period if problem.kind == "online" else 1)
    rec = np.asarray(record, np.int64)
    if rec.ndim != 1 or rec.size == 0 or rec[0] < 1 or rec[-1] > steps or np.any(np.diff(rec) <= 0):
        raise ValueError("`record` must be strictly increasing steps in [1, steps].")
    opts = tuple(r.optimizer for r in runs)
    tail_from = steps - max(1, steps // 10) + 1  # the last 10%, at least the last step
    dev = simulation_device(device)
    with jax.default_device(dev):  # the inputs, hence the compiled program, on `dev`
        hp = _hyperparameters(runs, tuple(dict.fromkeys(opts)))
        rec_j = jnp.asarray(rec, jnp.int32)
        t0 = time.perf_counter()
        draws = _draws(problem, sorted({r.seed for r in runs}), steps)
        key = (problem, opts, steps, rec.size, tail_from, dispatch, draws.shape, dev)
        compiled = _COMPILED.get(key)
        if compiled is None:
            program = _program(problem, opts, steps, tail_from, dispatch)
            compiled = _COMPILED[key] = program.lower(hp, rec_j, draws).compile()
        t1 = time.perf_counter()
        out = jax.block_until_ready(compiled(hp, rec_j, draws))
        t2 = time.perf_counter()
    out = {k: np.asarray(v, np.float64) for k, v in out.items()}
    return SimResult(
        problem=problem,
        runs=runs,
        steps=steps,
        record_t=rec,
        x=out["x"],
        avg_regret=out["avg_regret"],
        x_final=out["x_final"],
        avg_regret_final=out["avg_regret_final"],
        x_tail_mean=out["x_tail_mean"],
        compile_s=t1 - t0,
        run_s=t2 - t1,
        device=str(dev),
    )


def settle_step(
    record_t: np.ndarray, x: np.ndarray, target: float, tol: float = 0.05
) -> int | None:
    """The first recorded step from which every recorded iterate lies within ``tol`` of
    ``target``; ``None`` if the last one does not. "How fast", to the record's resolution."""
    inside = np.abs(np.asarray(x) - target) <= tol
    if not inside[-1]:
        return None
    outside = np.flatnonzero(~inside)
    return int(record_t[0] if outside.size == 0 else record_t[outside[-1] + 1])


def phase_aligned(record_t: np.ndarray, problem: Problem) -> np.ndarray:
    """Which records to show and judge convergence on: for an online problem the steps
    before its first period and those at whole periods (the iterate at a period's start),
    which :func:`log_steps` aligns all but the last one to. The last is :math:`T` itself,
    which need not be a multiple of the period (:math:`10^6` is one of neither 3 nor 101):
    a run oscillating within each period would seem to settle on that one record (Theorem
    1's constant-step SGD, at -0.948 at every period's start, is at -1.000 at :math:`T`).
    :math:`x_T` is reported apart (``x_final``). Every record for a stochastic problem."""
    t = np.asarray(record_t)
    if problem.kind != "online" or problem.period <= 1:
        return np.ones(t.shape, bool)
    return (t < problem.period) | (t % problem.period == 0)


def classify(x_final: float, tol: float = 0.1) -> str:
    """``"-1"`` (the optimum), ``"+1"`` (the worst point) or ``"neither"``, within ``tol``."""
    if x_final <= X_STAR + tol:
        return "-1"
    if x_final >= UPPER - tol:
        return "+1"
    return "neither"


# ---------------------------------------------------------------------------------------------
# Experiment groups
# ---------------------------------------------------------------------------------------------

#: AdamW's λ in the comparisons (decoupled decay λα_t per step).
ADAMW_WEIGHT_DECAY = 0.1


def default_hyperparameters(problem: Problem) -> dict[str, float]:
    r"""The settings of the comparisons on ``problem``.

    Theorems 1 and 3 use the theorems' :math:`\beta_1 = 0`, :math:`\beta_2 = 1/(1+C^2)`; the
    Figure-1 problems the paper's :math:`\beta_1 = 0.9`, :math:`\beta_2 = 0.99`. The step size
    is :math:`0.5/\sqrt t` or the constant 0.05 (a constant 0.5 keeps every method bouncing
    across the domain).
    """
    if problem.small == 1.0:  # Theorems 1 and 3
        b1, b2 = 0.0, 1.0 / (1.0 + problem.big**2)
    else:
        b1, b2 = 0.9, 0.99
    return {"alpha": 0.5, "alpha_constant": 0.05, "b1": b1, "b2": b2}


def comparison_runs(
    problem: Problem,
    *,
    seeds: int = 1,
    optimizers: Sequence[str] = OPTIMIZERS,
    schedules: Sequence[str] = SCHEDULES,
    eps: float = 1e-8,
) -> list[Run]:
    r"""Every optimizer × schedule (× seed, for stochastic problems) at the default settings.

    SGD's step size is divided by the RMS gradient :math:`\sqrt{\mathbb E g^2}` (1.9 on
    Theorem 1, 101 on Figure 1), the scale the Adam-type methods divide by, so that its steps
    are as large as theirs; with the raw :math:`\alpha` it bounces between the bounds on the
    Figure-1 problems.
    """
    hp = default_hyperparameters(problem)
    n_seeds = seeds if problem.kind == "stochastic" else 1
    runs = []
    for schedule in schedules:
        alpha = hp["alpha"] if schedule == "sqrt" else hp["alpha_constant"]
        for seed in range(n_seeds):
            for opt in optimizers:
                runs.append(
                    Run(
                        opt,
                        alpha / problem.rms_gradient if opt == "sgd" else alpha,
                        hp["b1"],
                        hp["b2"],
                        eps,
                        weight_decay=ADAMW_WEIGHT_DECAY if opt == "adamw" else 0.0,
                        schedule=schedule,
                        seed=seed,
                    )
                )
    return runs


def phase_grid(n: int, b2_scale: str = "log") -> tuple[np.ndarray, np.ndarray]:
    """An ``n × n`` grid: β1 linear in [0, 0.95]; β2 linear in [0, 0.95] (``"linear"``) or
    with 1 − β2 log-spaced in [1e-4, 1] (``"log"``: β2 from 0 to 0.9999)."""
    b1 = np.linspace(0.0, 0.95, n)
    if b2_scale == "linear":
        return b1, np.linspace(0.0, 0.95, n)
    if b2_scale == "log":
        return b1, 1.0 - np.geomspace(1.0, 1e-4, n)
    raise ValueError(f"`b2_scale` must be 'linear' or 'log', got {b2_scale!r}.")


#: The β2 axis of each problem's phase diagram: Theorem 1's failures lie at β2 < 0.5 (seen on
#: a linear axis), Figure 1's successes at β2 > 0.999 (seen on a log(1 − β2) axis).
PHASE_B2_SCALE = {"theorem1": "linear", "figure1_online": "log"}


def phase_diagram(
    problem: Problem,
    b1_values: Sequence[float],
    b2_values: Sequence[float],
    steps: int,
    *,
    optimizer: str = "adam",
    alpha: float = 0.5,
    eps: float = 1e-8,
    schedule: str = "sqrt",
) -> dict[str, Any]:
    """Where ``optimizer`` ends (:math:`x_T`) for every (β1, β2) pair: one vmapped program.

    Returns:
      A dict with ``b1``, ``b2`` (lists), ``x_final``, ``avg_regret`` and ``x_tail_mean``
      (arrays ``[len(b1), len(b2)]``), the settings, ``compile_s`` and ``run_s``.
    """
    b1_values = [float(b) for b in b1_values]
    b2_values = [float(b) for b in b2_values]
    runs = [
        Run(optimizer, alpha, b1, b2, eps, schedule=schedule)
        for b1 in b1_values
        for b2 in b2_values
    ]
    res = simulate(problem, runs, steps, record=[steps])
    shape = (len(b1_values), len(b2_values))
    return {
        "problem": problem.name,
        "optimizer": optimizer,
        "alpha": alpha,
        "eps": eps,
        "schedule": schedule,
        "steps": steps,
        "b1": b1_values,
        "b2": b2_values,
        "x_final": res.x_final.reshape(shape),
        "avg_regret": res.avg_regret_final.reshape(shape),
        "x_tail_mean": res.x_tail_mean.reshape(shape),
        "compile_s": res.compile_s,
        "run_s": res.run_s,
    }


def eps_sweep(
    problem: Problem,
    eps_values: Sequence[float],
    steps: int,
    *,
    optimizers: Sequence[str] = ("adam", "amsgrad_pytorch"),
) -> dict[str, Any]:
    r""":math:`x_T` and :math:`R_T/T` against :math:`\epsilon`, other settings the defaults.

    Returns:
      A dict with ``eps``, ``optimizers``, ``x_final`` and ``avg_regret`` (arrays
      ``[optimizer, eps]``), ``alpha``, ``b1``, ``b2``, ``steps``, ``compile_s``, ``run_s``.
    """
    hp = default_hyperparameters(problem)
    eps_values = [float(e) for e in eps_values]
    runs = [Run(opt, hp["alpha"], hp["b1"], hp["b2"], e) for opt in optimizers for e in eps_values]
    res = simulate(problem, runs, steps, record=[steps])
    shape = (len(optimizers), len(eps_values))
    return {
        "problem": problem.name,
        "steps": steps,
        "optimizers": list(optimizers),
        "eps": eps_values,
        "alpha": hp["alpha"],
        "b1": hp["b1"],
        "b2": hp["b2"],
        "x_final": res.x_final.reshape(shape),
        "avg_regret": res.avg_regret_final.reshape(shape),
        "compile_s": res.compile_s,
        "run_s": res.run_s,
    }


def time_single_run(problem: Problem, steps: int, optimizer: str = "adam") -> dict[str, Any]:
    """Compile and run time of one optimizer's run (a batch of one) at the default settings."""
    hp = default_hyperparameters(problem)
    run = Run(optimizer, hp["alpha"], hp["b1"], hp["b2"])
    first = simulate(problem, [run], steps)
    second = simulate(problem, [run], steps)  # the compiled program is reused
    return {
        "optimizer": optimizer,
        "problem": problem.name,
        "steps": steps,
        "compile_s": round(first.compile_s, 4),
        "run_s": round(second.run_s, 4),
        "x_final": float(second.x_final[0]),
        "avg_regret": float(second.avg_regret_final[0]),
    }


# ---------------------------------------------------------------------------------------------
# The whole experiment (CLI and notebook)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of :func:`run_experiment`; the defaults take 10-30 s on 2 CPU cores.

    ``phase_steps`` defaults to ``min(steps, 100_000)`` and ``eps_steps`` to ``steps``.
    """

    steps: int = 1_000_000
    seeds: int = 3
    phase_steps: int | None = None
    phase_grid: int = 24
    eps_steps: int | None = None
    eps_values: tuple[float, ...] = tuple(float(10.0**k) for k in range(-8, 5))
    theorem3_C: float = 3.0
    theorem3_delta: float = 0.1
    optimizers: tuple[str, ...] = OPTIMIZERS

    def __post_init__(self):
        for name in ("steps", "seeds", "phase_grid", "phase_steps", "eps_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}.")
        unknown = [o for o in self.optimizers if o not in OPTIMIZERS]
        if unknown or not self.optimizers:
            raise ValueError(f"`optimizers` must be a non-empty subset of {OPTIMIZERS}.")
        if self.phase_steps is None:
            object.__setattr__(self, "phase_steps", min(self.steps, 100_000))
        if self.eps_steps is None:
            object.__setattr__(self, "eps_steps", self.steps)

    @classmethod
    def smoke(cls) -> Config:
        """A seconds-sized configuration for CI (``OPTAX_DECOUPLED_SMOKE=1``)."""
        return cls(steps=3_000, seeds=2, phase_steps=1_000, phase_grid=6, eps_steps=1_000)

    @classmethod
    def preset(cls, scale: str) -> Config:
        """The report's sizes: ``"smoke"`` (:meth:`smoke`), ``"quick"`` (the defaults, 10-30 s
        on 2 CPU cores) or ``"full"`` (10⁷ steps, a 48×48 phase diagram, 8 seeds)."""
        if scale == "smoke":
            return cls.smoke()
        if scale == "quick":
            return cls()
        if scale == "full":
            return cls(steps=10_000_000, phase_steps=1_000_000, phase_grid=48, seeds=8)
        raise ValueError(f"scale must be 'smoke', 'quick' or 'full', got {scale!r}.")


def smoke_requested() -> bool:
    """True if the environment variable ``OPTAX_DECOUPLED_SMOKE`` is 1, true or yes."""
    return os.environ.get("OPTAX_DECOUPLED_SMOKE", "").strip().lower() in ("1", "true", "yes")


def problems(config: Config | None = None) -> dict[str, Problem]:
    """The four problems of the comparison, by name."""
    config = config or Config()
    ps = [
        theorem1_problem(),
        figure1_online_problem(),
        theorem3_problem(config.theorem3_C, config.theorem3_delta),
        figure1_stochastic_problem(),
    ]
    return {p.name: p for p in ps}


def versions() -> dict[str, str]:
    """Versions of Python, jax, jaxlib, optax, numpy and this package."""
    import jaxlib

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "optax_decoupled": od.__version__,
    }


def _f(x: Any, digits: int = 7) -> Any:
    """JSON-friendly floats (non-finite → None), recursively through arrays and lists."""
    if isinstance(x, np.ndarray | list | tuple):
        return [_f(v, digits) for v in x]
    v = float(x)
    return float(f"{v:.{digits}g}") if np.isfinite(v) else None


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (_f(v) if isinstance(v, np.ndarray) else v) for k, v in d.items()}


def _comparison_json(res: SimResult) -> dict[str, Any]:
    aligned = phase_aligned(res.record_t, res.problem)
    record_t = res.record_t[aligned]
    runs = []
    for i, r in enumerate(res.runs):
        item = dataclasses.asdict(r)
        item.update(
            label=r.label(),
            x_final=_f(res.x_final[i]),
            x_tail_mean=_f(res.x_tail_mean[i]),
            avg_regret=_f(res.avg_regret_final[i]),
            ends_at=classify(res.x_final[i]),
            settled_at_minus1=settle_step(record_t, res.x[i][aligned], X_STAR),
            settled_at_plus1=settle_step(record_t, res.x[i][aligned], UPPER),
        )
        if res.problem.kind == "stochastic":
            item["expected_gap"] = _f(res.expected_gap[i])
        runs.append(item)
    return {
        "problem": res.problem.to_dict(),
        "steps": res.steps,
        "compile_s": round(res.compile_s, 3),
        "run_s": round(res.run_s, 3),
        "runs": runs,
        "record_t": record_t.tolist(),
        "x": _f(res.x[:, aligned], 6),
        "avg_regret_t": _f(res.avg_regret[:, aligned], 6),
    }


def run_experiment(
    config: Config | None = None,
    out: str | os.PathLike | None = None,
    *,
    progress: bool = True,
    figures: bool = True,
) -> dict[str, Any]:
    """Runs every group: the four comparisons, two phase diagrams, two ε sweeps, a timing.

    Writes ``results.json`` and the PNG figures (:func:`optax_decoupled.experiments.plots.
    reddi_figures`) into ``out`` if it is given. Returns the JSON document, plus the
    comparisons' :class:`SimResult` objects under ``"_sim"`` (not written).

    ``results.json`` (``"schema": "optax_decoupled.reddi/1"``):

    * ``settings`` (the :class:`Config`), ``versions`` (python, jax, jaxlib, optax, numpy,
      optax_decoupled), ``device`` (where the simulations ran, :func:`simulation_device`),
      ``platform``, ``cpu_count``, ``xla_flags``.
    * ``comparisons[problem]``: ``problem`` (its definition, ``x_star``, ``mean_gradient``,
      ``rms_gradient``), ``steps``, ``compile_s``, ``run_s``; ``runs``, one per run: the
      :class:`Run` fields, ``label``, ``x_final``, ``x_tail_mean``, ``avg_regret``
      (:math:`R_T/T`), ``ends_at`` (``"-1"``, ``"+1"`` or ``"neither"``, within 0.1),
      ``settled_at_minus1`` / ``settled_at_plus1`` (the first recorded step after which x stays
      within 0.05 of the point, or null) and, for stochastic problems, ``expected_gap``;
      ``record_t`` and, per run (same order), ``x`` (:math:`x_{t+1}`) and ``avg_regret_t``
      (:math:`R_t/t`) at those steps (for an online problem the records at whole periods,
      :func:`phase_aligned`).
    * ``phase_diagrams[problem]``: Adam's ``x_final``, ``x_tail_mean`` and ``avg_regret``
      (``[len(b1)][len(b2)]``) over the lists ``b1``, ``b2``; ``b2_scale``, ``steps``,
      ``alpha``, ``eps``, ``compile_s``, ``run_s``.
    * ``eps_sweeps[problem]``: ``eps``, ``optimizers``, ``x_final`` and ``avg_regret``
      (``[optimizer][eps]``), ``alpha``, ``b1``, ``b2``, ``steps``, ``compile_s``, ``run_s``.
    * ``single_run``: compile and run seconds of one ``adam`` run of ``steps`` steps on
      Theorem 1 (a batch of one).
    * ``total_s`` (all groups, without figures) and ``figures`` (the PNG file names).
    """
    from tqdm.auto import tqdm

    config = config or Config()
    if out is not None:  # now, not after the simulations (an unusable `out` fails at once)
        os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    probs = problems(config)
    device = simulation_device()
    sims: dict[str, SimResult] = {}
    doc: dict[str, Any] = {
        "schema": "optax_decoupled.reddi/1",
        "settings": dataclasses.asdict(config),
        "versions": versions(),
        "device": str(device),
        "platform": device.platform,
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "comparisons": {},
        "phase_diagrams": {},
        "eps_sweeps": {},
    }

    def compare(name):
        prob = probs[name]
        runs = comparison_runs(prob, seeds=config.seeds, optimizers=config.optimizers)
        res = simulate(prob, runs, config.steps)
        sims[name] = res
        doc["comparisons"][name] = _comparison_json(res)

    def phase(name):
        b1s, b2s = phase_grid(config.phase_grid, PHASE_B2_SCALE[name])
        d = phase_diagram(probs[name], b1s, b2s, config.phase_steps)
        doc["phase_diagrams"][name] = {**_jsonable(d), "b2_scale": PHASE_B2_SCALE[name]}

    def sweep(name):
        d = eps_sweep(probs[name], config.eps_values, config.eps_steps)
        doc["eps_sweeps"][name] = _jsonable(d)

    def single(name):
        doc["single_run"] = time_single_run(probs[name], config.steps)

    groups = [(f"compare {n}", compare, n) for n in probs]
    groups += [(f"phase diagram {n}", phase, n) for n in PHASE_B2_SCALE]
    groups += [(f"eps sweep {n}", sweep, n) for n in PHASE_B2_SCALE]
    groups += [("single-run timing", single, "theorem1")]

    bar = tqdm(groups, desc="reddi", unit="group", disable=not progress, file=sys.stderr)
    for label, fn, name in bar:
        bar.set_postfix_str(label)
        fn(name)
    bar.close()
    doc["total_s"] = round(time.perf_counter() - t_start, 2)
    doc["figures"] = []

    if out is not None:
        if figures:
            from optax_decoupled.experiments import plots

            doc["figures"] = plots.reddi_figures(doc, out)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(doc, f, indent=1)
    doc["_sim"] = sims
    return doc


def summary_table(
    doc: dict[str, Any],
    problems: Sequence[str] | None = None,
    schedules: Sequence[str] | None = None,
) -> str:
    """A Markdown table of the comparisons: x_T, R_T/T, where each run ends and from when.

    ``problems`` and ``schedules`` restrict the rows (default: all).
    """
    lines = [
        "| problem | schedule | optimizer | seed | x_T | mean x, last 10% | R_T/T | ends at "
        "| within 0.05 of -1 from t = |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, comp in doc["comparisons"].items():
        if problems is not None and name not in problems:
            continue
        for r in comp["runs"]:
            if schedules is not None and r["schedule"] not in schedules:
                continue
            seed = r["seed"] if comp["problem"]["kind"] == "stochastic" else "-"
            settled = r["settled_at_minus1"] if r["settled_at_minus1"] is not None else "-"
            x_final, x_tail = number(r["x_final"], "+.4f"), number(r["x_tail_mean"], "+.4f")
            lines.append(
                f"| {name} | {r['schedule']} | {r['label']} | {seed} | {x_final} | {x_tail} | "
                f"{r['avg_regret']:.4g} | {r['ends_at']} | {settled} |"
            )
    return "\n".join(lines)


def timing_table(doc: dict[str, Any]) -> str:
    """A Markdown table of each group's size, compilation and run time."""
    lines = ["| group | runs × steps | compile (s) | run (s) |", "|---|---|---|---|"]
    for name, c in doc["comparisons"].items():
        lines.append(
            f"| compare {name} | {len(c['runs'])} × {c['steps']:,} | {c['compile_s']:.2f} "
            f"| {c['run_s']:.2f} |"
        )
    for name, d in doc["phase_diagrams"].items():
        n = len(d["b1"]) * len(d["b2"])
        lines.append(
            f"| phase diagram {name} | {n} × {d['steps']:,} | {d['compile_s']:.2f} "
            f"| {d['run_s']:.2f} |"
        )
    for name, d in doc["eps_sweeps"].items():
        n = len(d["eps"]) * len(d["optimizers"])
        lines.append(
            f"| ε sweep {name} | {n} × {d['steps']:,} | {d['compile_s']:.2f} | {d['run_s']:.2f} |"
        )
    if "single_run" in doc:
        s = doc["single_run"]
        lines.append(
            f"| one {s['optimizer']} run, {s['problem']} | 1 × {s['steps']:,} "
            f"| {s['compile_s']:.2f} | {s['run_s']:.3f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def enable_fast_cpu_loops() -> bool:
    """Adds :data:`FAST_LOOPS_FLAG` to ``XLA_FLAGS`` if no JAX backend has started yet.

    On CPU a batch of runs then costs about 0.1 µs instead of 1.5 µs per step (the stochastic
    comparisons, 42 runs of 10⁶ steps, take 1.2 s instead of 10 s); the results are the same to
    float rounding. Returns whether the flag was added: not if ``XLA_FLAGS`` already sets
    ``xla_backend_extra_options``, nor once a backend is initialised (XLA reads its flags once,
    when the first backend starts), so call it before any JAX computation. The CLI calls it
    unless ``--no-fast-loops``; the notebook calls it in its first cell. See also
    :func:`optax_decoupled.experiments.xla_setup.configure_cpu`.
    """
    return bool(xla_setup.add_xla_flags(FAST_LOOPS_FLAG))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``optax-decoupled reddi`` options to ``parser`` and returns it."""
    d = Config()
    parser.add_argument(
        "--steps", type=int, default=None, help="steps T of the comparisons (default 10⁶)"
    )
    parser.add_argument("--out", default="reddi_out", help="output directory (default reddi_out)")
    parser.add_argument(
        "--seeds", type=int, default=None, help=f"seeds per stochastic problem (default {d.seeds})"
    )
    parser.add_argument(
        "--phase-steps",
        type=int,
        default=None,
        help="steps per phase-diagram run (default min(steps, 10⁵))",
    )
    parser.add_argument(
        "--phase-grid",
        type=int,
        default=None,
        help=f"phase diagram of N×N (β1, β2) (default {d.phase_grid})",
    )
    parser.add_argument(
        "--eps-steps", type=int, default=None, help="steps per ε-sweep run (default: steps)"
    )
    parser.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated subset of {','.join(OPTIMIZERS)} for the comparisons (default all)",
    )
    parser.add_argument(
        "--scale",
        choices=("smoke", "quick", "full"),
        default=None,
        help="the report's sizes instead of the options above: smoke (seconds), quick (the "
        "defaults) or full (10⁷ steps, 48×48 phase diagram, 8 seeds)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-sized run for a quick check, --scale smoke (also OPTAX_DECOUPLED_SMOKE=1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-fast-loops",
        action="store_true",
        help="leave XLA:CPU's small-while-loop limit alone (see enable_fast_cpu_loops)",
    )
    return parser


#: The options that set sizes (``--scale`` and ``--smoke`` set them all); ``None`` when not
#: given (also when given their default value, they conflict with a scale).
_SIZE_OPTIONS = ("steps", "seeds", "phase_steps", "phase_grid", "eps_steps", "optimizers")


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` for parsed arguments: ``--scale`` (``--smoke`` is ``--scale
    smoke``) or the size options, not both; ``OPTAX_DECOUPLED_SMOKE=1`` (CI) runs the smoke
    size whatever they say, with a note on stderr."""
    scale = getattr(args, "scale", None)
    if getattr(args, "smoke", False):
        if scale not in (None, "smoke"):
            raise ValueError(f"--smoke is --scale smoke; drop it or --scale {scale}.")
        scale = "smoke"
    explicit = [
        "--" + name.replace("_", "-")
        for name in _SIZE_OPTIONS
        if getattr(args, name, None) is not None
    ]
    if smoke_requested():
        if explicit or scale not in (None, "smoke"):
            print(
                "optax-decoupled reddi: OPTAX_DECOUPLED_SMOKE=1: running the smoke size "
                f"(ignoring {', '.join(explicit) or '--scale ' + str(scale)})",
                file=sys.stderr,
            )
        return Config.smoke()
    if scale is not None:
        if explicit:
            raise ValueError(
                f"--scale {scale} (or --smoke) sets every size; drop {', '.join(explicit)} "
                "or the scale."
            )
        return Config.preset(scale)
    optimizers = OPTIMIZERS
    if getattr(args, "optimizers", None):
        optimizers = tuple(o.strip() for o in args.optimizers.split(",") if o.strip())
    given = {
        n: getattr(args, n)
        for n in ("steps", "seeds", "phase_grid")
        if getattr(args, n, None) is not None
    }
    return Config(
        **given, phase_steps=args.phase_steps, eps_steps=args.eps_steps, optimizers=optimizers
    )


def run_cli(args: argparse.Namespace) -> int:
    """Runs the experiment for parsed ``args``, prints a summary; returns the exit status."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"optax-decoupled reddi: {e}", file=sys.stderr)
        return 2
    if not getattr(args, "no_fast_loops", False):
        enable_fast_cpu_loops()
    doc = run_experiment(config, args.out, progress=not getattr(args, "no_progress", False))
    print(summary_table(doc))
    single = doc["single_run"]
    print(
        f"\none adam run of {single['steps']:,} steps: {single['run_s']:.3f} s "
        f"(+{single['compile_s']:.2f} s compilation); all groups {doc['total_s']:.1f} s"
    )
    print(f"wrote {os.path.join(args.out, 'results.json')} and {len(doc['figures'])} figures")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m optax_decoupled.experiments.reddi [--steps N] [--out DIR] ...``."""
    parser = argparse.ArgumentParser(
        prog="optax-decoupled reddi",
        description="Reddi et al. (ICLR 2018) counterexamples: Adam vs AMSGrad, SGD and AdamW.",
    )
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
