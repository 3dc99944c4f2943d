r"""The experiment groups on the Reddi counterexamples, each one compiled simulation.

* :func:`comparison_runs` -- every optimizer × step-size schedule (× seed) at the settings of
  :func:`default_hyperparameters`;
* :func:`phase_diagram` -- where Adam ends for every (β1, β2) of a grid (:func:`phase_grid`);
* :func:`eps_sweep` -- the final point and regret against :math:`\epsilon`;
* :func:`time_single_run` -- compile and run time of one optimizer's run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from optax_decoupled.experiments.reddi_problems import Problem
from optax_decoupled.experiments.reddi_simulation import OPTIMIZERS, SCHEDULES, Run, simulate

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
