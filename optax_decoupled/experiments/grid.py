r"""Learning-rate × weight-decay grids on the SSM (Loshchilov & Hutter 2019, Fig. 2).

For each optimizer a log grid of peak learning rates × weight decays, with several seeds,
trains as **one** compiled program (:func:`~optax_decoupled.experiments.compare.sweep`): the
comparison's own sweeps, so the report trains them once (:func:`from_comparison` reads them
from its results; :func:`run_grid` trains them for a configuration).

The paper's claim is that decoupling makes the two hyperparameters *separable*: with coupled
L2 the good region is a diagonal valley (changing η moves the best λ), with decoupled decay it
is closer to axis-aligned. We measure it:

* ``separability``: the slope of :math:`\log_{10}\lambda^*` against :math:`\log_{10}\eta`, where
  :math:`\lambda^*(\eta)` is the bottom of each learning rate's valley of mean validation loss,
  with a bootstrap interval over seeds and a verdict (separable / coupled / inconclusive;
  :func:`~optax_decoupled.experiments.verdicts.separability`). 0: the best λ does not move
  with η; −1: it moves inversely, i.e. only the product ηλ matters.
* ``analysis`` (:func:`analyse`): the best cell, the best λ per η on the grid, and the
  correlation of :math:`\log\eta` and :math:`\log\lambda` over the near-optimal cells (mean
  validation loss within ``tolerance`` of the best): close to 0 for an axis-aligned basin,
  close to ±1 for a diagonal one.

Note the conventions: PyTorch's ``"lr"`` AdamW decays by :math:`\eta\lambda` per step, so at a
fixed decay per step :math:`\lambda^* \propto 1/\eta` would *also* give slope −1; the paper's
own algorithm is the ``"schedule"`` convention (decay :math:`\lambda\eta_t/\eta_{peak}`),
included as ``adamw_schedule``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_decoupled.experiments import compare, verdicts
from optax_decoupled.experiments.formatting import number

#: The relative tolerance of the near-optimal basin.
TOLERANCE = 0.05


def analyse(
    val_loss: np.ndarray, lrs: np.ndarray, wds: np.ndarray, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Separability measures of a mean validation-loss grid ``val_loss[lr, wd]``.

    Non-finite cells (a run that diverged) count as the worst loss; a learning rate whose
    every cell diverged has no best weight decay (``None`` in ``best_wd_per_lr``) and is left
    out of the slope."""
    lrs, wds = np.asarray(lrs, np.float64), np.asarray(wds, np.float64)
    loss = np.where(np.isfinite(val_loss), val_loss, np.inf)
    best_idx = np.argmin(loss, axis=1)
    best_wd = wds[best_idx]
    finite_rows = np.isfinite(np.min(loss, axis=1))
    slope = None
    if finite_rows.sum() >= 2:
        slope = float(np.polyfit(np.log10(lrs[finite_rows]), np.log10(best_wd[finite_rows]), 1)[0])
    i, j = np.unravel_index(np.argmin(loss), loss.shape)
    best = float(loss[i, j])
    near = loss <= best * (1 + tolerance)
    li, wj = np.nonzero(near)
    corr = None
    if li.size >= 3 and np.std(li) > 0 and np.std(wj) > 0:
        corr = float(np.corrcoef(np.log10(lrs[li]), np.log10(wds[wj]))[0, 1])
    per_lr = [float(v) if ok else None for v, ok in zip(best_wd, finite_rows, strict=True)]
    return {
        "best": {"learning_rate": float(lrs[i]), "weight_decay": float(wds[j]), "val_loss": best},
        "best_wd_per_lr": per_lr,
        "log_slope": slope,
        "near_optimal_cells": int(near.sum()),
        "near_optimal_corr": corr,
        "tolerance": tolerance,
    }


def grid_entry(label: str, sweep: dict[str, Any], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """One optimizer's grid from its sweep (:func:`~optax_decoupled.experiments.compare.sweep`):
    the positive weight decays (a log axis has no 0), the analysis and the separability."""
    wds = np.asarray(sweep["weight_decay"], np.float64)
    keep = wds > 0
    val = np.asarray(sweep["val_loss"], np.float64)[:, keep]
    test_acc = np.asarray(sweep["test_accuracy"], np.float64)[:, keep]
    return {
        "label": label,
        "learning_rates": list(sweep["learning_rate"]),
        "weight_decays": wds[keep].tolist(),
        "seeds": list(sweep["seeds"]),
        "val_loss": val.tolist(),
        "test_accuracy": test_acc.tolist(),
        "analysis": analyse(np.mean(val, axis=2), sweep["learning_rate"], wds[keep], tolerance),
        "separability": verdicts.separability(sweep),
        "runs": int(val.shape[0] * len(wds) * val.shape[2]),
    }


def from_comparison(doc: dict[str, Any]) -> dict[str, Any]:
    """The grids of a comparison's results (the optimizers swept over several learning
    rates), without training anything."""
    out: dict[str, Any] = {"config": doc["config"], "source": "compare", "optimizers": {}}
    for name, res in doc["optimizers"].items():
        sweep = res["evaluation"]["sweep"]
        if len(sweep["learning_rate"]) >= 2:
            out["optimizers"][name] = grid_entry(res["label"], sweep)
    return out


def run_grid(
    cfg: compare.CompareConfig, *, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Trains the sweep of every optimizer in ``cfg.lr_sweep`` (one compiled program each);
    a JSON-ready dict."""
    t0 = time.perf_counter()
    task = cfg.digits()
    specs = cfg.specs()
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "source": "trained",
                           "optimizers": {}}  # fmt: skip
    for name in (n for n in cfg.optimizers if n in cfg.lr_sweep):
        spec = specs[name]
        runs = len(spec.lrs) * len(spec.wds) * len(cfg.eval_seeds)
        log(f"[grid] {name}: {len(spec.lrs)}x{len(spec.wds)} x {len(cfg.eval_seeds)} seeds "
            f"= {runs} runs as one program")  # fmt: skip
        res, sweep = compare.sweep(spec, task, cfg, progress=progress)
        out["optimizers"][name] = {
            **grid_entry(spec.label, sweep),
            "wall_time_s": res.wall_time_s,
            "step_time_s": res.step_time_s,
        }
    out["wall_time_s"] = time.perf_counter() - t0
    return out


def summary_table(doc: dict[str, Any]) -> str:
    """A Markdown table of the separability measures per optimizer, and the verdict lines."""

    def f(v, fmt=".2f"):
        return "—" if v is None else number(v, fmt)

    lines = [
        "| optimizer | runs | best η | best λ | best val. loss | slope of log λ* vs log η "
        "[interval] | verdict | corr(log η, log λ) near optimum | best λ per η (low → high η) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    said = []
    for res in doc["optimizers"].values():
        a, sep = res["analysis"], res.get("separability")
        slope = "—" if sep is None else f"{f(sep['slope'], '+.2f')} [{f(sep['low'], '+.2f')}, " \
            f"{f(sep['high'], '+.2f')}]"  # fmt: skip
        lines.append(
            f"| {res['label']} | {res['runs']} | {a['best']['learning_rate']:.3g} | "
            f"{a['best']['weight_decay']:.3g} | {a['best']['val_loss']:.4f} | {slope} | "
            f"{'—' if sep is None else sep['verdict']} | {f(a['near_optimal_corr'], '+.2f')} "
            f"({a['near_optimal_cells']} cells within {a['tolerance']:.0%}) | "
            + ", ".join(f(v, ".2g") for v in a["best_wd_per_lr"])
            + " |"
        )
        if sep is not None:
            said.append(f"- {res['label']}: {sep['line']}")
    if said:
        lines += [
            "",
            "λ*(η) is the bottom of each learning rate's valley of mean validation loss (the "
            "vertex of the parabola through the best cell and its neighbours); separable: the "
            "interval lies within ±0.25 of 0; coupled: it excludes 0.",
            "",
            *said,
        ]
    return "\n".join(lines)
