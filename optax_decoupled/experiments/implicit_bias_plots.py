"""Figures of :mod:`~optax_decoupled.experiments.implicit_bias` (matplotlib, Agg, no pyplot).

:func:`figures` draws, from the arrays of :func:`~optax_decoupled.experiments.implicit_bias.
study` per problem:

* ``implicit_bias_distance.png``: the ∞-norm distance of Adam + L2 to the ridge solution and
  of AdamW (each peak learning rate) to the box-constrained minimiser, against the step, with
  the distance Adam's ε leaves on the most weakly binding coordinate;
* ``implicit_bias_paths.png``: AdamW at the three learning rates: λ‖θ_t‖∞ against the step,
  and the path in the plane of two coordinates whose paths bend most (a binding and a free
  one): different paths, one limit;
* ``implicit_bias_coefficients.png``: the ridge and box solutions with the box ±1/λ, and the
  final iterates of Adam + L2 and AdamW on them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from optax_decoupled.experiments.plots import FONT_SIZE, finish_axes, new_figure, save

#: Colours of the three AdamW learning rates (Okabe-Ito) and of Adam + L2.
LR_COLORS = ("#56B4E9", "#0072B2", "#000000")
L2_COLOR = "#D55E00"
TITLES = {"least_squares": "least squares (diabetes)", "logistic": "logistic (breast cancer)"}


def distance_figure(arrays: dict[str, dict[str, Any]], steps: np.ndarray, lrs: Sequence[float]):
    """Distance to each reference limit against the step, one panel per problem."""
    fig, axes = new_figure(1, len(arrays), width=5.0, height=3.6)
    for ax, (name, a) in zip(axes[0], arrays.items(), strict=True):
        floor = 1e-9  # a log axis cannot show an exact zero
        ax.plot(steps, np.maximum(np.max(np.abs(a["l2_path"] - a["ridge"]), -1), floor),
                color=L2_COLOR, lw=2, label=f"Adam + L2 → ridge (η={lrs[1]:g})")  # fmt: skip
        for lr, path, c in zip(lrs, a["w_path"], LR_COLORS, strict=True):
            d = np.maximum(np.max(np.abs(path - a["box"]), -1), floor)
            ax.plot(steps, d, color=c, lw=1.5, label=f"AdamW → box (η={lr:g})")
        if a.get("epsilon_floor"):
            ax.axhline(a["epsilon_floor"], color="#999999", ls=":", lw=1,
                       label="ε floor (1/λ)·ε/(min|g_i|+ε)")  # fmt: skip
        ax.set_yscale("log")
        finish_axes(ax, TITLES.get(name, name), "step", "‖θ_t − θ*‖∞")
        ax.legend(fontsize=FONT_SIZE - 2)
    return fig


def paths_figure(arrays: dict[str, dict[str, Any]], steps: np.ndarray, lrs: Sequence[float]):
    """AdamW at each learning rate: λ‖θ_t‖∞ against the step (left) and the path in the plane
    of two coordinates (right, :func:`_plane`)."""
    fig, axes = new_figure(len(arrays), 2, width=4.6, height=3.6)
    for row, (name, a) in zip(axes, arrays.items(), strict=True):
        lam = 1.0 / a["bound"]
        for lr, path, c in zip(lrs, a["w_path"], LR_COLORS, strict=True):
            row[0].plot(steps, lam * np.max(np.abs(path), -1), color=c, label=f"η={lr:g}")
        row[0].axhline(1.0, color="#999999", ls=":", lw=1)
        row[0].set_xscale("log")
        finish_axes(row[0], TITLES.get(name, name), "step", "λ‖θ_t‖∞")
        row[0].legend(fontsize=FONT_SIZE - 2)
        i, j = _plane(a)
        for lr, path, c in zip(lrs, a["w_path"], LR_COLORS, strict=True):
            xs, ys = np.concatenate([[0.0], path[:, i]]), np.concatenate([[0.0], path[:, j]])
            row[1].plot(xs, ys, color=c, lw=1.2, label=f"η={lr:g}")
        row[1].plot(a["box"][i], a["box"][j], "*", color=L2_COLOR, ms=12, label="box minimiser")
        for edge in (-a["bound"], a["bound"]):
            row[1].axvline(edge, color="#999999", ls=":", lw=1)
        kind = {True: "binding", False: "free"}
        title = "AdamW paths from θ = 0"
        finish_axes(row[1], title, f"θ[{i}] ({kind[i in a['binding']]})",
                    f"θ[{j}] ({kind[j in a['binding']]})")  # fmt: skip
        row[1].legend(fontsize=FONT_SIZE - 2)
    return fig


def _plane(a: dict[str, Any]) -> tuple[int, int]:
    """Two coordinates whose paths bend most (largest overshoot of their limit at the largest
    learning rate): a binding one and a free one where both kinds exist."""
    overshoot = np.max(np.abs(a["w_path"][-1]), 0) - np.abs(a["box"])
    order = [int(k) for k in np.argsort(-overshoot)]
    binding = [k for k in order if k in a["binding"]]
    free = [k for k in order if k not in a["binding"]]
    if binding and free:
        return binding[0], free[0]
    return order[0], order[1]


def coefficients_figure(arrays: dict[str, dict[str, Any]], lrs: Sequence[float]):
    """Ridge and box solutions per coordinate, the box ±1/λ, and the runs' final iterates."""
    fig, axes = new_figure(len(arrays), 1, width=10.0, height=3.4)
    for ax, (name, a) in zip(axes[:, 0], arrays.items(), strict=True):
        k = np.arange(len(a["box"]))
        ax.bar(k - 0.2, a["ridge"], 0.4, color=L2_COLOR, alpha=0.45, label="ridge (reference)")
        ax.bar(k + 0.2, a["box"], 0.4, color=LR_COLORS[1], alpha=0.45, label="box (reference)")
        ax.plot(k - 0.2, a["l2_final"], "o", color=L2_COLOR, ms=4, label="Adam + L2, final")
        ax.plot(k + 0.2, a["w_final"][1], "x", color="#000000", ms=5,
                label=f"AdamW (η={lrs[1]:g}), final")  # fmt: skip
        for edge in (-a["bound"], a["bound"]):
            ax.axhline(edge, color="#999999", ls="--", lw=1)
        ax.axhline(0.0, color="#000000", lw=0.5)
        finish_axes(ax, f"{TITLES.get(name, name)}: λ = {1 / a['bound']:g}, box ±{a['bound']:g}",
                    "coordinate", "θ_i")  # fmt: skip
        ax.legend(fontsize=FONT_SIZE - 2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def figures(
    arrays: dict[str, dict[str, Any]],
    steps: np.ndarray,
    lrs: Sequence[float],
    out: str | os.PathLike,
) -> list[str]:
    """Writes the three figures into ``out``; returns their file names (basenames)."""
    os.makedirs(out, exist_ok=True)
    made = {
        "implicit_bias_distance.png": distance_figure(arrays, steps, lrs),
        "implicit_bias_paths.png": paths_figure(arrays, steps, lrs),
        "implicit_bias_coefficients.png": coefficients_figure(arrays, lrs),
    }
    for name, fig in made.items():
        save(fig, os.path.join(out, name))
    return list(made)
