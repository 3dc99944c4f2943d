"""Tests of optax_decoupled.experiments.implicit_bias: the reference solvers, the limits of
Adam + L2 (ridge) and AdamW (the ℓ∞-box KKT point, Xie & Li 2024), and the report part.

The optimizer limits are read from one ``run("smoke")`` (4000 steps, a few seconds) and
compared with references computed here (closed forms, the other solver), not with the
module's own check flags. Measured at that size: Adam + L2 within 1e-7 of the ridge solution
on both problems; AdamW within 1.3e-4 (least squares) and 1.5e-3 (logistic) of the box
minimiser, binding coordinates at λ|θ_i| = 1 within 2.2e-4 and 2.9e-3, the three learning
rates' limits within 1.1e-4 and 7.9e-4 of each other, their paths at least 0.039 and 0.16
apart (Hausdorff, against 0.05/λ = 0.0125 and 0.025); the ``"schedule"`` limits at least 0.09
apart.
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import numpy as np
import pytest

from optax_decoupled.experiments import implicit_bias as ib

LS = ib.least_squares_problem()
LOGISTIC = ib.logistic_problem()


def tiny_problem(kind: str, seed: int = 0, n: int = 40, d: int = 4) -> ib.Problem:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.3 * rng.normal(size=n)
    if kind == "logistic":
        y = (y > 0).astype(np.float64)
    return ib.Problem(f"tiny_{kind}", X, y, kind, 0.7, tuple(f"x{i}" for i in range(d)))


def ridge_gradient(problem: ib.Problem, theta: np.ndarray) -> np.ndarray:
    return ib.loss_and_grad(problem, theta)[1] + problem.weight_decay * theta


# ---------------------------------------------------------------------------------------------
# Reference solvers
# ---------------------------------------------------------------------------------------------


def test_general_solver_reproduces_the_ridge_closed_form():
    p = tiny_problem("squared")
    closed = ib.ridge_closed_form(p.X, p.y, p.weight_decay)
    np.testing.assert_allclose(ib.minimize_reference(p, l2=p.weight_decay), closed, atol=1e-7)
    # and the closed form is the ridge solution: the penalised gradient vanishes there
    assert np.max(np.abs(ridge_gradient(p, closed))) < 1e-12
    assert np.max(np.abs(ridge_gradient(p, closed + 1e-3))) > 1e-4


def test_logistic_ridge_reference_matches_newton():
    p = tiny_problem("logistic")
    theta = np.zeros(p.X.shape[1])
    for _ in range(30):  # Newton on L + λ/2‖θ‖²: Hessian X^T diag(σ(1-σ)) X/n + λI
        s = 1 / (1 + np.exp(-p.X @ theta))
        hess = p.X.T @ (p.X * (s * (1 - s))[:, None]) / len(s) + p.weight_decay * np.eye(4)
        theta = theta - np.linalg.solve(hess, ridge_gradient(p, theta))
    np.testing.assert_allclose(ib.ridge_reference(p), theta, atol=1e-7)
    theta = ib.ridge_reference(LOGISTIC)
    assert np.max(np.abs(ridge_gradient(LOGISTIC, theta))) < 1e-7


def test_numpy_and_jax_losses_agree():
    rng = np.random.default_rng(1)
    for p in (LS, LOGISTIC):
        theta = rng.normal(scale=0.3, size=p.X.shape[1])
        value, grad = ib.loss_and_grad(p, theta)
        loss = ib.jax_loss(p)
        args = [np.asarray(a, np.float32) for a in (theta, p.X, p.y)]
        jv, jg = jax.value_and_grad(loss)(*args)
        np.testing.assert_allclose(float(jv), value, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(jg), grad, atol=1e-5)


def test_kkt_residual_is_zero_exactly_at_the_box_minimiser_of_a_separable_problem():
    # X = sqrt(n) I: L = ||θ - c||²/2 with c = y/sqrt(n), whose box minimiser is clip(c).
    c = np.array([0.9, -0.2, 0.4, -1.7])
    n = len(c)
    p = ib.Problem("separable", np.sqrt(n) * np.eye(n), np.sqrt(n) * c, "squared", 2.0,
                   tuple("abcd"))  # fmt: skip
    bound = 0.5
    star = np.clip(c, -bound, bound)
    np.testing.assert_allclose(ib.box_least_squares(p.X, p.y, bound), star, atol=1e-12)
    assert ib.kkt_residual(p, star, bound) < 1e-15
    assert list(ib.binding_coordinates(p, star, bound)) == [0, 3]
    assert ib.kkt_residual(p, star + np.array([0, 0.01, 0, 0]), bound) == pytest.approx(0.01)
    assert ib.kkt_residual(p, np.clip(star * 0.9, -bound, bound), bound) > 0.04  # inside
    assert ib.kkt_residual(p, np.array([0.6, -0.2, 0.4, -0.5]), bound) > 0.09  # outside


@pytest.mark.parametrize("problem", [LS, tiny_problem("squared")], ids=lambda p: p.name)
def test_box_least_squares_is_a_kkt_point_and_matches_lbfgsb(problem):
    bound = 1.0 / problem.weight_decay
    box = ib.box_least_squares(problem.X, problem.y, bound)
    assert np.max(np.abs(box)) <= bound + 1e-12
    assert ib.kkt_residual(problem, box, bound) < 1e-9
    np.testing.assert_allclose(ib.minimize_reference(problem, bound=bound), box, atol=1e-6)


def test_the_boxes_bind_on_some_but_not_all_coordinates():
    # Least squares: the box binds below the unregularised coefficients' largest magnitude.
    ols = np.linalg.lstsq(LS.X, LS.y, rcond=None)[0]
    assert 1 / LS.weight_decay < np.max(np.abs(ols))
    for p, expected in ((LS, 2), (LOGISTIC, 24)):
        bound = 1 / p.weight_decay
        box = ib.box_reference(p, bound)
        assert ib.kkt_residual(p, box, bound) < 1e-7
        assert len(ib.binding_coordinates(p, box, bound)) == expected


def test_config_validation():
    with pytest.raises(ValueError, match="multiple"):
        ib.Config(steps=3000, early_steps=1000, late_every=300)
    config = ib.Config(steps=100, early_steps=10, early_every=5, late_every=30)
    assert list(config.record_steps()) == [5, 10, 40, 70, 100]
    with pytest.raises(ValueError, match="increasing"):
        ib.Config(learning_rates=(0.03, 0.01, 0.003))
    with pytest.raises(ValueError, match="scale"):
        ib.Config.preset("huge")
    with pytest.raises(ValueError, match="kind"):
        ib.Problem("x", LS.X, LS.y, "hinge", 1.0, ())
    with pytest.raises(ValueError, match="method"):
        ib.make_optimizer("sgd", 0.1, 1.0, ib.Config())


# ---------------------------------------------------------------------------------------------
# The optimizers' limits (one smoke-size run of the whole part)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("implicit_bias")
    return ib.run("smoke", out, progress=False), out


def finals(doc, name, key):
    return np.array([r["final"] for r in doc["problems"][name][key]])


def test_adam_l2_converges_to_the_ridge_solution(smoke):
    doc, _ = smoke
    theta = np.array(doc["problems"]["least_squares"]["adam_l2"]["final"])
    closed = ib.ridge_closed_form(LS.X, LS.y, LS.weight_decay)
    assert np.max(np.abs(theta - closed)) < 1e-5
    theta = np.array(doc["problems"]["logistic"]["adam_l2"]["final"])
    assert np.max(np.abs(ridge_gradient(LOGISTIC, theta))) < 1e-5
    # ... which is not where AdamW goes
    box = ib.box_least_squares(LS.X, LS.y, 1 / LS.weight_decay)
    assert np.max(np.abs(theta - ib.ridge_reference(LOGISTIC))) < 1e-5
    assert np.max(np.abs(closed - box)) > 0.1


BOTH = pytest.mark.parametrize(
    "name,problem,tol", [("least_squares", LS, 1e-3), ("logistic", LOGISTIC, 5e-3)]
)


@BOTH
def test_adamw_converges_to_the_box_kkt_point(smoke, name, problem, tol):
    doc, _ = smoke
    lam = problem.weight_decay
    bound = 1 / lam
    box = ib.minimize_reference(problem, bound=bound)  # L-BFGS-B, not the module's choice
    binding = ib.binding_coordinates(problem, box, bound)
    ridge = ib.ridge_reference(problem)
    for theta in finals(doc, name, "adamw_lr"):
        assert np.max(np.abs(theta - box)) < tol
        assert np.max(np.abs(lam * np.abs(theta[binding]) - 1)) < 2 * tol
        assert np.max(lam * np.abs(theta)) < 1 + 2 * tol
        assert ib.kkt_residual(problem, theta, bound) < tol
        assert np.max(np.abs(theta - ridge)) > 0.1  # the ridge solution is elsewhere


@BOTH
def test_adamw_limit_does_not_depend_on_the_learning_rate_but_its_path_does(
    smoke, name, problem, tol
):
    doc, _ = smoke
    theta = finals(doc, name, "adamw_lr")
    for i, j in itertools.combinations(range(3), 2):
        assert np.max(np.abs(theta[i] - theta[j])) < tol
    bound = 1 / problem.weight_decay
    assert doc["problems"][name]["path_gap"] > 0.05 * bound
    assert doc["problems"][name]["step_gap"] >= doc["problems"][name]["path_gap"]


@BOTH
def test_schedule_convention_limit_moves_with_the_peak_learning_rate(smoke, name, problem, tol):
    doc, _ = smoke
    lrs = doc["config"]["learning_rates"]
    lam_s = problem.weight_decay * lrs[-1]
    theta = finals(doc, name, "adamw_schedule")
    for lr, th in zip(lrs, theta, strict=True):
        bound = lr / lam_s  # the box of decay λ_s·η_t/η_peak
        assert np.max(np.abs(th)) == pytest.approx(bound, rel=tol)
        assert ib.kkt_residual(problem, th, bound) < tol
    for i, j in itertools.combinations(range(3), 2):
        assert np.max(np.abs(theta[i] - theta[j])) > 0.05
    # at η_max the box is the "lr" convention's: the same limit
    assert np.max(np.abs(theta[-1] - finals(doc, name, "adamw_lr")[-1])) < tol


def test_path_distance_ignores_speed_but_not_shape():
    t = np.linspace(0, 1, 50)[:, None]
    line = t * np.array([[1.0, 1.0]])
    fast = np.vstack([line[1::3], np.repeat(line[-1:], 33, 0)])  # 3x as fast, sparser records
    bent = np.hstack([t, t**2])
    assert ib.path_distance(line, fast) < 1e-12
    assert ib.path_distance(line, bent) == pytest.approx(np.sqrt(2) / 8, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# The report part
# ---------------------------------------------------------------------------------------------


def test_run_writes_json_ready_results_and_figures(smoke):
    doc, out = smoke
    assert doc["all_passed"], [c for c in doc["checks"] if not c["passed"]]
    assert len(doc["checks"]) == 16
    assert {c["problem"] for c in doc["checks"]} == {"least_squares", "logistic"}
    for c in doc["checks"]:
        assert isinstance(c["passed"], bool) and np.isfinite(c["value"]), c
    json.loads(json.dumps(doc))  # plain JSON, no NumPy values
    assert sorted(doc["figures"]) == sorted(
        ["implicit_bias_distance.png", "implicit_bias_paths.png", "implicit_bias_coefficients.png"]
    )
    for f in doc["figures"]:
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["config"]["steps"] == ib.Config.preset("smoke").steps


def test_markdown_has_the_table_verdicts_and_figure_links(smoke):
    doc, _ = smoke
    text = ib.markdown(doc, "implicit_bias")
    assert text.startswith("## Implicit bias: where Adam + L2 and AdamW converge\n")
    assert "every check passes" in text and "**FAIL**" not in text
    assert text.count("| pass |") == len(doc["checks"])
    for f in doc["figures"]:
        assert f"![{f}](implicit_bias/{os.path.basename(f)})" in text
    broken = json.loads(json.dumps(doc))
    broken["checks"][3]["passed"] = False
    broken["all_passed"] = False
    text = ib.markdown(broken, "x")
    assert "**FAIL**" in text and "some checks fail" in text
