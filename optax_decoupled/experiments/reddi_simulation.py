r"""Simulating optimizers on the Reddi counterexamples: many runs as one compiled program.

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
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled.experiments.reddi_problems import LOWER, UPPER, X_STAR, Problem, gradient

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
    more, so the same loop is one to two orders of magnitude slower there.
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
