r"""Where Adam + coupled L2 and AdamW converge on small convex problems (implicit bias).

Full batch, float32, every coordinate regularised (``mask=None``), a cosine step size
:math:`\eta_t = \eta\,\tfrac12(1 + \cos(\pi t/T))`, on scikit-learn's bundled data:
``least_squares`` :math:`L(\theta) = \lVert X\theta - y\rVert^2/(2n)` on ``load_diabetes``
(442 × 10, standardised) and ``logistic`` :math:`L(\theta) = \frac1n\sum_i
\log(1 + e^{z_i}) - y_i z_i`, :math:`z = X\theta`, on ``load_breast_cancer`` (569 × 30
standardised and a constant column, labels 0/1). Both are strictly convex.

1. **Adam + L2** (``od.adam_l2``) stops where its input :math:`\nabla L + \lambda\theta`
   vanishes: the **ridge** solution :math:`\arg\min L(\theta) +
   \tfrac\lambda2\lVert\theta\rVert^2` (closed form :math:`(X^\top X/n + \lambda I)^{-1}
   X^\top y/n`, or L-BFGS-B in float64).
2. **AdamW** (``"lr"`` convention, :math:`\theta \leftarrow \theta - \eta_t(\hat\mu/
   (\sqrt{\hat\nu}+\epsilon) + \lambda\theta)`) stops where :math:`\lambda\theta_i =
   -\hat\mu_i/(\sqrt{\hat\nu_i}+\epsilon)`. Once the iterates settle the gradient is
   constant and the ratio is :math:`\mathrm{sign}(g_i)` wherever :math:`g_i \ne 0`: so
   :math:`\lambda|\theta_i| = 1` or :math:`g_i = 0`, the KKT conditions of
   :math:`\min L(\theta)` s.t. :math:`\lVert\theta\rVert_\infty \le 1/\lambda` (Xie & Li
   2024), whose unique solution is computed by ``scipy.optimize.lsq_linear`` / L-BFGS-B with
   bounds; :func:`kkt_residual` is zero exactly there.
3. That fixed point does not involve :math:`\eta`: the limit is the same for every peak
   learning rate while the path is not (:func:`path_distance`, independent of speed along
   the path). The ``"schedule"`` convention decays by :math:`\lambda\eta_t/\eta_{peak}`, i.e.
   :math:`\lambda/\eta_{peak}` per unit of learning rate: its box is
   :math:`\eta_{peak}/\lambda` and its limit moves with :math:`\eta_{peak}`.

**Floors.** Settled (:math:`\hat\mu_i = g_i`, :math:`\hat\nu_i = g_i^2`), AdamW sits at
:math:`\lambda\theta_i = -g_i/(|g_i| + \epsilon)`: binding coordinates stay
:math:`\epsilon/(|g_i| + \epsilon)` inside the box (``epsilon_floor``, for the smallest
multiplier :math:`|g_i|`), which also bounds :func:`kkt_residual` from below; Adam + L2 has no
such floor. Float32 resolves gradients to about :math:`10^{-7}`; the rest is how far the
decaying step size carries the iterates (more steps, or a shorter memory :math:`\beta_2`, go
further). :class:`Config`'s tolerances carry a margin over what each preset measures.

References:
  Xie & Li, `Implicit Bias of AdamW: ℓ∞-Norm Constrained Optimization
  <https://arxiv.org/abs/2404.04454>`_, ICML 2024.

  Loshchilov & Hutter, `Decoupled Weight Decay Regularization
  <https://arxiv.org/abs/1711.05101>`_, ICLR 2019.

  Kingma & Ba, `Adam: A Method for Stochastic Optimization
  <https://arxiv.org/abs/1412.6980>`_, ICLR 2015.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.optimize
from sklearn.datasets import load_breast_cancer, load_diabetes

import optax_decoupled as od
from optax_decoupled.experiments import implicit_bias_plots
from optax_decoupled.experiments.formatting import markdown_table


@dataclasses.dataclass(frozen=True)
class Problem:
    """A full-batch convex problem: ``X`` (n, d) and ``y`` (n,) in float64, the loss ``kind``
    (``"squared"`` or ``"logistic"``) and the weight decay λ of every run on it."""

    name: str
    X: np.ndarray
    y: np.ndarray
    kind: str
    weight_decay: float
    features: tuple[str, ...]

    def __post_init__(self):
        if self.kind not in ("squared", "logistic"):
            raise ValueError(f"`kind` must be 'squared' or 'logistic', got {self.kind!r}.")
        if self.weight_decay <= 0:
            raise ValueError(f"`weight_decay` must be > 0, got {self.weight_decay}.")


def least_squares_problem(weight_decay: float = 4.0) -> Problem:
    """``load_diabetes``, features and target standardised (no intercept: both are centred).
    With λ = 4 the box :math:`|\\theta_i| \\le 0.25` binds on 2 of the 10 coefficients."""
    data = load_diabetes()
    X, y = (data.data - data.data.mean(0)) / data.data.std(0), data.target
    y = (y - y.mean()) / y.std()
    return Problem("least_squares", X, y, "squared", weight_decay, tuple(data.feature_names))


def logistic_problem(weight_decay: float = 2.0) -> Problem:
    """``load_breast_cancer``, features standardised, plus a constant column (decayed like the
    rest); labels 0/1. With λ = 2 the box :math:`|\\theta_i| \\le 0.5` binds on 24 of 31."""
    data = load_breast_cancer()
    X = (data.data - data.data.mean(0)) / data.data.std(0)
    X = np.hstack([X, np.ones((len(X), 1))])
    names = (*data.feature_names, "intercept")
    return Problem("logistic", X, data.target.astype(np.float64), "logistic", weight_decay, names)


def problems() -> dict[str, Problem]:
    """Both problems, by name."""
    return {"least_squares": least_squares_problem(), "logistic": logistic_problem()}


def loss_and_grad(problem: Problem, theta: np.ndarray) -> tuple[float, np.ndarray]:
    """:math:`L(\\theta)` and :math:`\\nabla L(\\theta)` in float64 NumPy."""
    X, y, n = problem.X, problem.y, len(problem.y)
    z = X @ theta
    if problem.kind == "squared":
        r = z - y
        return 0.5 * float(r @ r) / n, X.T @ r / n
    p = 0.5 * (1.0 + np.tanh(0.5 * z))  # the sigmoid, without overflow
    return float(np.mean(np.logaddexp(0.0, z) - y * z)), X.T @ (p - y) / n


def jax_loss(problem: Problem) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """:math:`L(\\theta; X, y)` as a JAX function (the data are arguments, not constants).
    Products at full float32 precision (on GPUs XLA would otherwise use TF32, about
    :math:`10^{-3}` relative, far above the floors measured here)."""

    def loss(theta, X, y):
        z = jnp.dot(X, theta, precision=jax.lax.Precision.HIGHEST)  # (n,)
        if problem.kind == "squared":
            return 0.5 * jnp.mean((z - y) ** 2)
        return jnp.mean(jax.nn.softplus(z) - y * z)

    return loss


def ridge_closed_form(X: np.ndarray, y: np.ndarray, weight_decay: float) -> np.ndarray:
    """:math:`(X^\\top X/n + \\lambda I)^{-1} X^\\top y/n`, the minimiser of
    :math:`\\lVert X\\theta - y\\rVert^2/(2n) + \\tfrac\\lambda2\\lVert\\theta\\rVert^2`."""
    n, d = X.shape
    return np.linalg.solve(X.T @ X / n + weight_decay * np.eye(d), X.T @ y / n)


def minimize_reference(
    problem: Problem, *, l2: float = 0.0, bound: float | None = None
) -> np.ndarray:
    """:math:`\\arg\\min L(\\theta) + \\tfrac{l_2}2\\lVert\\theta\\rVert^2` s.t.
    :math:`\\lVert\\theta\\rVert_\\infty \\le` ``bound`` (``None``: unconstrained), by
    L-BFGS-B in float64 with its tolerances at zero (it stops when no step decreases the
    objective: projected gradients of about :math:`10^{-10}` here)."""

    def fun(theta):
        value, grad = loss_and_grad(problem, theta)
        return value + 0.5 * l2 * theta @ theta, grad + l2 * theta

    d = problem.X.shape[1]
    bounds = None if bound is None else [(-bound, bound)] * d
    options = {"ftol": 0.0, "gtol": 0.0, "maxiter": 100_000, "maxcor": 50}
    res = scipy.optimize.minimize(
        fun, np.zeros(d), jac=True, method="L-BFGS-B", bounds=bounds, options=options
    )
    return res.x


def box_least_squares(X: np.ndarray, y: np.ndarray, bound: float) -> np.ndarray:
    """:math:`\\arg\\min \\lVert X\\theta - y\\rVert^2/(2n)` s.t.
    :math:`\\lVert\\theta\\rVert_\\infty \\le` ``bound``: ``scipy.optimize.lsq_linear``'s
    bounded-variable least squares (an active-set method, exact up to rounding)."""
    n = len(y)
    res = scipy.optimize.lsq_linear(
        X / np.sqrt(n), y / np.sqrt(n), bounds=(-bound, bound), method="bvls", tol=1e-14
    )
    return res.x


def ridge_reference(problem: Problem) -> np.ndarray:
    """The ridge solution for λ = ``problem.weight_decay``: closed form for least squares,
    :func:`minimize_reference` for logistic regression."""
    if problem.kind == "squared":
        return ridge_closed_form(problem.X, problem.y, problem.weight_decay)
    return minimize_reference(problem, l2=problem.weight_decay)


def box_reference(problem: Problem, bound: float) -> np.ndarray:
    """The minimiser of :math:`L` on :math:`[-\\text{bound}, \\text{bound}]^d`."""
    if problem.kind == "squared":
        return box_least_squares(problem.X, problem.y, bound)
    return minimize_reference(problem, bound=bound)


def kkt_residual(problem: Problem, theta: np.ndarray, bound: float) -> float:
    """:math:`\\lVert\\theta - \\Pi_{[-b, b]^d}(\\theta - \\nabla L(\\theta))\\rVert_\\infty`:
    zero exactly at a KKT point of :math:`\\min L` s.t. :math:`\\lVert\\theta\\rVert_\\infty
    \\le b` (the minimiser, :math:`L` convex), positive elsewhere (also outside the box)."""
    grad = loss_and_grad(problem, theta)[1]
    return float(np.max(np.abs(theta - np.clip(theta - grad, -bound, bound))))


def binding_coordinates(problem: Problem, theta: np.ndarray, bound: float) -> np.ndarray:
    """Indices where the box binds at ``theta`` (a box KKT point): at the bound, with the
    gradient pointing out of the box (a multiplier :math:`|g_i| > 10^{-6}`)."""
    grad = loss_and_grad(problem, theta)[1]
    at_bound = np.abs(theta) >= bound * (1 - 1e-9)
    return np.flatnonzero(at_bound & (np.abs(grad) > 1e-6) & (np.sign(grad) == -np.sign(theta)))


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes and tolerances of :func:`run`.

    ``learning_rates`` are the peak η of the three AdamW runs (Adam + L2 uses the middle one);
    the ``"schedule"`` runs use :math:`\\lambda_s = \\lambda\\,\\eta_{max}`, so their boxes
    are :math:`(\\eta_{peak}/\\eta_{max})/\\lambda`, the largest the ``"lr"`` box.
    Iterates are recorded every ``early_every`` steps for the first ``early_steps`` (where
    the paths part and join), then every ``late_every`` steps (:meth:`record_steps`).
    Tolerances are in coefficient units (∞-norm): ``distance_tol`` for a limit against its
    reference and between limits, ``kkt_tol`` for :func:`kkt_residual`, ``binding_tol`` for
    :math:`|\\lambda|\\theta_i| - 1|` on binding coordinates; ``path_min`` is the least
    :func:`path_distance` (in units of the box 1/λ) between two ``"lr"`` runs' paths that
    counts as different paths.
    """

    steps: int = 20_000
    early_steps: int = 2_000
    early_every: int = 2
    late_every: int = 40
    learning_rates: tuple[float, float, float] = (0.003, 0.01, 0.03)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    distance_tol: float = 5e-4
    kkt_tol: float = 2e-4
    binding_tol: float = 1e-3
    path_min: float = 0.05

    def __post_init__(self):
        e, ee, le = self.early_steps, self.early_every, self.late_every
        if min(e, ee, le) < 1 or self.steps <= e or e % ee or (self.steps - e) % le:
            raise ValueError(
                f"need steps > early_steps, early_steps a multiple of early_every and "
                f"steps - early_steps one of late_every; got {self.steps}, {e}, {ee}, {le}."
            )
        lrs = list(self.learning_rates)
        if len(lrs) != 3 or sorted(lrs) != lrs:
            raise ValueError(f"`learning_rates` must be 3 increasing values: {lrs}")

    @classmethod
    def preset(cls, scale: str) -> Config:
        """``"smoke"`` (4000 steps, looser tolerances: seconds, for CI), ``"quick"`` (the
        defaults: 20,000 steps) or ``"full"`` (100,000 steps, tighter distance tolerance; the
        KKT residual's is the ε floor's, which more steps do not lower)."""
        if scale == "smoke":
            loose = {"distance_tol": 5e-3, "kkt_tol": 2e-3, "binding_tol": 1e-2}
            return cls(steps=4_000, late_every=20, **loose)
        if scale == "quick":
            return cls()
        if scale == "full":
            return cls(steps=100_000, late_every=200, distance_tol=2e-4)
        raise ValueError(f"scale must be 'smoke', 'quick' or 'full', got {scale!r}.")

    def record_steps(self) -> np.ndarray:
        """The steps after which :func:`trajectories` records the iterates."""
        early = np.arange(self.early_every, self.early_steps + 1, self.early_every)
        return np.concatenate([early, np.arange(self.early_steps, self.steps, self.late_every)
                               + self.late_every])  # fmt: skip


def make_optimizer(
    method: str, learning_rate: Any, weight_decay: float, config: Config
) -> optax.GradientTransformation:
    """``"adam_l2"``, ``"adamw_lr"`` or ``"adamw_schedule"`` with the cosine decay from
    ``learning_rate`` (a float or a traced scalar) to 0 over ``config.steps``, every
    coordinate regularised (``mask=None``)."""
    schedule = optax.cosine_decay_schedule(learning_rate, config.steps, alpha=0.0)
    adam = {"b1": config.b1, "b2": config.b2, "eps": config.eps, "mask": None}
    if method == "adam_l2":
        return od.adam_l2(schedule, weight_decay=weight_decay, **adam)
    if method == "adamw_lr":
        return od.adamw(schedule, weight_decay=weight_decay, decay_convention="lr", **adam)
    if method == "adamw_schedule":
        return od.adamw(schedule, weight_decay=weight_decay, decay_convention="schedule",
                        peak_learning_rate=learning_rate, **adam)  # fmt: skip
    raise ValueError(f"unknown method {method!r}.")


def trajectories(
    problem: Problem, method: str, learning_rates: Sequence[float], weight_decay: float,
    config: Config,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Runs ``method`` from :math:`\\theta_0 = 0` at each peak learning rate (one jitted
    ``vmap`` of a ``lax.scan``, float32). Returns the final iterates ``(len(lrs), d)`` and the
    recorded ones ``(len(lrs), records, d)`` after the steps :meth:`Config.record_steps`."""
    loss = jax_loss(problem)

    def one(lr, X, y):
        tx = make_optimizer(method, lr, weight_decay, config)
        theta = jnp.zeros(X.shape[1], jnp.float32)

        def step(carry, _):
            theta, state = carry
            updates, state = tx.update(jax.grad(loss)(theta, X, y), state, theta)
            return (optax.apply_updates(theta, updates), state), None

        def record(every):
            def steps(carry, _):
                carry, _ = jax.lax.scan(step, carry, None, length=every)
                return carry, carry[0]

            return steps

        c = config
        carry, early = jax.lax.scan(record(c.early_every), (theta, tx.init(theta)), None,
                                    c.early_steps // c.early_every)  # fmt: skip
        late_records = (c.steps - c.early_steps) // c.late_every
        (theta, _), late = jax.lax.scan(record(c.late_every), carry, None, late_records)
        return theta, jnp.concatenate([early, late])

    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    run_all = jax.jit(jax.vmap(one, in_axes=(0, None, None)))
    final, path = run_all(f32(learning_rates), f32(problem.X), f32(problem.y))
    return np.asarray(final, np.float64), np.asarray(path, np.float64)


def _linf(a: np.ndarray, b: np.ndarray | float = 0.0) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)))


def path_distance(a: np.ndarray, b: np.ndarray, resolution: float = 1e-3) -> float:
    """The Hausdorff distance (Euclidean) between two recorded paths ``(records, d)`` drawn as
    polylines from :math:`\\theta_0 = 0`: the farthest a vertex of either is from the other
    polyline. It does not depend on how fast, or how densely recorded, a path is travelled.
    Vertices closer than ``resolution`` × the path's extent to the last one kept are left out
    (the settled tail), which changes the result by at most that much."""
    a, b = (_thin(np.vstack([np.zeros((1, p.shape[1])), p]), resolution) for p in (a, b))
    return max(_to_polyline(a, b), _to_polyline(b, a))


def _thin(path: np.ndarray, resolution: float) -> np.ndarray:
    step = resolution * float(np.max(np.linalg.norm(path - path[0], axis=-1)))
    kept = [path[0]]
    for p in path[1:]:
        if np.linalg.norm(p - kept[-1]) > step:
            kept.append(p)
    return np.array(kept + [path[-1]])


def _to_polyline(points: np.ndarray, line: np.ndarray) -> float:
    """The largest distance of ``points`` (m, d) to the polyline through ``line`` (k, d)."""
    start, seg = line[:-1], np.diff(line, axis=0)  # (k-1, d)
    seg2 = np.maximum(np.sum(seg * seg, -1), 1e-300)
    worst = 0.0
    for chunk in np.array_split(points, max(1, len(points) // 64)):
        rel = chunk[:, None, :] - start[None]  # (c, k-1, d)
        s = np.clip(np.sum(rel * seg[None], -1) / seg2, 0.0, 1.0)  # the nearest point's place
        dist = np.linalg.norm(rel - s[..., None] * seg[None], axis=-1).min(1)
        worst = max(worst, float(dist.max()))
    return worst


def _check(problem: str, name: str, value: float, tol: float, passed: bool, note: str) -> dict:
    return {"problem": problem, "check": name, "value": value, "tolerance": tol,
            "passed": bool(passed), "note": note}  # fmt: skip


def study(problem: Problem, config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every run and reference on one problem: the JSON-ready results (with their
    ``checks``) and the arrays the figures draw."""
    lam, lrs = problem.weight_decay, config.learning_rates
    bound = 1.0 / lam
    ridge, box = ridge_reference(problem), box_reference(problem, bound)
    binding = binding_coordinates(problem, box, bound)
    l2_final, l2_path = trajectories(problem, "adam_l2", lrs[1:2], lam, config)
    w_final, w_path = trajectories(problem, "adamw_lr", lrs, lam, config)
    lam_s = lam * lrs[-1]
    s_final, _ = trajectories(problem, "adamw_schedule", lrs, lam_s, config)
    s_bounds = [lr / lam_s for lr in lrs]
    s_refs = [box_reference(problem, b) for b in s_bounds]

    l2_grad = loss_and_grad(problem, l2_final[0])[1] + lam * l2_final[0]
    adamw = [
        {"learning_rate": lr, "final": theta.tolist(), "distance_to_box": _linf(theta, box),
         "kkt_residual": kkt_residual(problem, theta, bound), "lambda_linf": lam * _linf(theta),
         "binding_gap": _linf(lam * np.abs(theta[binding]), 1.0) if binding.size else 0.0}
        for lr, theta in zip(lrs, w_final, strict=True)
    ]  # fmt: skip
    pairs = list(itertools.combinations(range(3), 2))
    limit_gap = max(_linf(w_final[i], w_final[j]) for i, j in pairs)
    step_gap = max(_linf(w_path[i], w_path[j]) for i, j in pairs)
    path_gap = min(path_distance(w_path[i], w_path[j]) for i, j in pairs)
    grad_box = loss_and_grad(problem, box)[1]
    multiplier = float(np.min(np.abs(grad_box[binding]))) if binding.size else np.inf
    eps_floor = config.eps / (multiplier + config.eps)
    multiplier = multiplier if binding.size else None  # (JSON has no infinity)
    schedule = [
        {"learning_rate": lr, "bound": b, "final": theta.tolist(), "linf": _linf(theta),
         "distance_to_reference": _linf(theta, ref), "reference_linf": _linf(ref)}
        for lr, b, theta, ref in zip(lrs, s_bounds, s_final, s_refs, strict=True)
    ]  # fmt: skip
    s_gap = min(_linf(s_final[i], s_final[j]) for i, j in pairs)
    s_dist = max(r["distance_to_reference"] for r in schedule)

    p, tol = problem.name, config.distance_tol
    d_l2 = _linf(l2_final[0], ridge)
    d_w = max(r["distance_to_box"] for r in adamw)
    kkt = max(r["kkt_residual"] for r in adamw)
    bind = max(r["binding_gap"] for r in adamw)
    checks = [
        _check(p, "Adam + L2: ‖θ_T − θ_ridge‖∞", d_l2, tol, d_l2 <= tol,
               f"‖∇L + λθ_T‖∞ = {_linf(l2_grad):.1e}"),
        _check(p, "AdamW: box binds on some, not all, coordinates", float(binding.size),
               float(len(box)), 0 < binding.size < len(box),
               f"{binding.size} of {len(box)} at ±1/λ = ±{bound:g} (0 < value < d)"),
        _check(p, "AdamW: max |λ|θ_i| − 1| on binding coordinates", bind, config.binding_tol,
               binding.size > 0 and bind <= config.binding_tol,
               f"λ‖θ_T‖∞ = {max(r['lambda_linf'] for r in adamw):.6f}; ε floor "
               f"ε/(min|g_i| + ε) = {eps_floor:.1e}"),
        _check(p, "AdamW: KKT residual ‖θ − Π(θ − ∇L)‖∞", kkt, config.kkt_tol,
               kkt <= config.kkt_tol, "max over the 3 learning rates"),
        _check(p, "AdamW: ‖θ_T − θ_box‖∞", d_w, tol, d_w <= tol,
               "max over the 3 learning rates"),
        _check(p, "AdamW: limits agree across η", limit_gap, tol, limit_gap <= tol,
               f"η ∈ {list(lrs)}; max over pairs"),
        _check(p, "AdamW: paths differ across η (Hausdorff)", path_gap,
               config.path_min * bound, path_gap >= config.path_min * bound,
               f"min over pairs (a least value); at equal steps up to {step_gap:.3f} apart"),
        _check(p, "schedule convention: limits move with η_peak", s_gap, 10 * tol,
               s_gap >= 10 * tol and s_dist <= tol,
               f"min gap between limits (a least value); each within {s_dist:.1e} of "
               f"its own box η_peak/λ_s ∈ {[round(b, 4) for b in s_bounds]}"),
    ]  # fmt: skip
    result = {
        "n": int(problem.X.shape[0]), "d": int(problem.X.shape[1]), "weight_decay": lam,
        "bound": bound, "features": list(problem.features), "ridge": ridge.tolist(),
        "box": box.tolist(), "binding": binding.tolist(),
        "adam_l2": {"learning_rate": lrs[1], "final": l2_final[0].tolist(),
                    "distance_to_ridge": d_l2, "gradient_residual": _linf(l2_grad)},
        "adamw_lr": adamw, "limit_gap": limit_gap, "path_gap": path_gap, "step_gap": step_gap,
        "min_multiplier": multiplier, "epsilon_floor": eps_floor,
        "schedule_weight_decay": lam_s, "adamw_schedule": schedule,
        "schedule_limit_gap": s_gap, "checks": checks,
    }  # fmt: skip
    arrays = {"ridge": ridge, "box": box, "bound": bound, "l2_path": l2_path[0],
              "w_path": w_path, "binding": binding, "l2_final": l2_final[0],
              "w_final": w_final, "epsilon_floor": bound * eps_floor}  # fmt: skip
    return result, arrays


def run(scale: str, out: str | os.PathLike | None = None, progress: bool = True) -> dict:
    """Both problems at ``scale`` (:meth:`Config.preset`); writes the figures into ``out``
    (if given) and returns the JSON-ready document: ``config``, ``problems[name]`` (see
    :func:`study`), ``checks`` (every check: ``problem``, ``check``, ``value``,
    ``tolerance``, ``passed``, ``note``), ``all_passed``, ``figures`` and ``wall_time_s``."""
    t0 = time.perf_counter()
    config = Config.preset(scale)
    doc: dict[str, Any] = {"config": dataclasses.asdict(config), "problems": {}, "checks": []}
    arrays = {}
    for name, problem in problems().items():
        if progress:
            print(f"[implicit_bias] {name} ({config.steps} steps) ...", flush=True)
        doc["problems"][name], arrays[name] = study(problem, config)
        doc["checks"] += doc["problems"][name]["checks"]
    doc["all_passed"] = all(c["passed"] for c in doc["checks"])
    steps = config.record_steps()
    lrs = config.learning_rates
    doc["figures"] = [] if out is None else implicit_bias_plots.figures(arrays, steps, lrs, out)
    doc["wall_time_s"] = time.perf_counter() - t0
    return doc


def checks_table(doc: dict[str, Any]) -> str:
    """The checks as a Markdown table: measured value, tolerance, pass/fail (``|`` in a cell
    escaped)."""

    def row(c):
        text = {k: c[k].replace("|", "\\|") for k in ("check", "note")}
        return c | text | {"result": "pass" if c["passed"] else "**FAIL**"}

    cols = ["problem", "check", "value", "tolerance", "result", "note"]
    return markdown_table(
        [row(c) for c in doc["checks"]], cols, {"value": ".3g", "tolerance": ".3g"}
    )


def markdown(doc: dict[str, Any], rel: str = "implicit_bias") -> str:
    """The report's section: what is shown, the checks and the figures."""
    cfg = doc["config"]
    setup = markdown_table(
        [{"problem": name, "n × d": f"{p['n']} × {p['d']}", "λ": p["weight_decay"],
          "box 1/λ": p["bound"], "binding": f"{len(p['binding'])} of {p['d']}",
          "λ_s (schedule)": p["schedule_weight_decay"]}
         for name, p in doc["problems"].items()],
        formats={"λ": "g", "box 1/λ": "g", "λ_s (schedule)": "g"},
    )  # fmt: skip
    figures = "\n".join(f"![{f}]({rel}/{os.path.basename(f)})" for f in doc.get("figures", []))
    verdict = "every check passes" if doc["all_passed"] else "**some checks fail**"
    return (
        "## Implicit bias: where Adam + L2 and AdamW converge\n\n"
        "The same λ, two problems: Adam + coupled L2 stops where ∇L + λθ = 0 (the **ridge** "
        "solution); AdamW (decay η_t·λ) where λθ_i = −μ̂_i/(√ν̂_i + ε), a KKT point of **min L(θ) "
        "s.t. ‖θ‖∞ ≤ 1/λ** (Xie & Li, ICML 2024) whatever η. `load_diabetes` (least squares) "
        "and `load_breast_cancer` (logistic), full batch, float32, all coordinates decayed, "
        f"{cfg['steps']} steps of cosine decay to 0, β = ({cfg['b1']}, {cfg['b2']}), "
        f"ε = {cfg['eps']:g}, peak η ∈ {list(cfg['learning_rates'])} (Adam + L2: the middle "
        'one); float64 references. `"schedule"` (decay λ_s·η_t/η_peak) has the box '
        "η_peak/λ_s: its limit moves with η_peak.\n\n"
        f"{setup}\n\nChecks ({verdict}; for the *least values* the measured value must be at "
        f"least the tolerance):\n\n{checks_table(doc)}\n\n{figures}\n"
    )
