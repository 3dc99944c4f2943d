"""Plotting helpers for the experiments (matplotlib, rendered with Agg, no pyplot state).

Figures are built from :class:`matplotlib.figure.Figure` directly, so nothing here touches
pyplot's backend or figure registry: importing this module never changes how a notebook shows
plots, and :func:`save` always renders with Agg. Each ``*_figure`` function returns the
:class:`~matplotlib.figure.Figure`.

The Reddi figures are drawn from the JSON document of
:func:`optax_decoupled.experiments.reddi.run_experiment` (the content of ``results.json``), so
they can be redrawn from a saved file without rerunning anything::

    import json
    from optax_decoupled.experiments import plots

    with open("reddi_out/results.json") as f:
        plots.reddi_figures(json.load(f), "reddi_out")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from optax_decoupled.experiments.formatting import number

#: Line style per optimizer name, shared by every figure (Okabe-Ito colour-blind-safe colours).
OPTIMIZER_STYLE: dict[str, dict[str, Any]] = {
    "adam": {"color": "#D55E00", "ls": "-", "lw": 2.0},
    "optax_adam": {"color": "#000000", "ls": ":", "lw": 1.5},
    "amsgrad_paper": {"color": "#0072B2", "ls": "-", "lw": 2.0},
    "amsgrad_pytorch": {"color": "#56B4E9", "ls": "--", "lw": 2.0},
    "amsgrad_optax": {"color": "#009E73", "ls": "-.", "lw": 2.0},
    "sgd": {"color": "#999999", "ls": "-", "lw": 1.5},
    "adamw": {"color": "#CC79A7", "ls": "--", "lw": 1.5},
}

FONT_SIZE = 10


def style_for(name: str) -> dict[str, Any]:
    """Line style (``color``, ``ls``, ``lw``) for an optimizer name; neutral for others."""
    return dict(OPTIMIZER_STYLE.get(name, {"color": "#444444", "ls": "-", "lw": 1.5}))


def new_figure(
    nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 4.0
) -> tuple[Figure, np.ndarray]:
    """A figure of ``nrows × ncols`` panels of ``width × height`` inches; axes as a 2-D array."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat:
        ax.tick_params(labelsize=FONT_SIZE - 1)
    return fig, axes


def save(fig: Figure, path: str | os.PathLike, dpi: int = 110) -> str:
    """Writes ``fig`` as a PNG (Agg) and returns the path."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")
    return os.fspath(path)


def finish_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    """Title, axis labels and a light grid, in the module's font size."""
    ax.set_title(title, fontsize=FONT_SIZE)
    ax.set_xlabel(xlabel, fontsize=FONT_SIZE)
    ax.set_ylabel(ylabel, fontsize=FONT_SIZE)
    ax.grid(True, which="major", alpha=0.3)


def cell_edges(centres: Any, log: bool = False) -> np.ndarray:
    """Cell edges around sorted cell centres (midpoints, in log space if ``log``)."""
    c = np.log10(np.asarray(centres, float)) if log else np.asarray(centres, float)
    if c.size == 1:
        e = np.array([c[0] - 0.5, c[0] + 0.5])
    else:
        mid = (c[1:] + c[:-1]) / 2
        e = np.concatenate([[2 * c[0] - mid[0]], mid, [2 * c[-1] - mid[-1]]])
    return 10**e if log else e


# ---------------------------------------------------------------------------------------------
# Reddi et al.
# ---------------------------------------------------------------------------------------------


def _runs_for(comp: dict[str, Any], schedule: str, seed: int = 0) -> list[int]:
    runs = comp["runs"]
    return [i for i, r in enumerate(runs) if r["schedule"] == schedule and r["seed"] == seed]


def _schedule_text(schedule: str) -> str:
    return "α/√t" if schedule == "sqrt" else "constant α"


def _panel_title(comp: dict[str, Any], idx: list[int]) -> str:
    problem = comp["problem"]
    title = problem["description"]
    if idx:
        r = comp["runs"][idx[0]]
        title += f"\nβ1={r['b1']:g}, β2={r['b2']:.3g}, α={r['alpha']:g}"
    if problem["kind"] == "stochastic":
        title += " (seed 0)"
    return title


def _panel_grid(n: int, height: float = 3.8) -> tuple[Figure, np.ndarray]:
    ncols = 2 if n > 1 else 1
    return new_figure(int(np.ceil(n / ncols)), ncols, width=6.0, height=height)


def _per_problem_figure(
    doc: dict[str, Any],
    schedule: str,
    series: Callable[[dict[str, Any], int], np.ndarray],
    *,
    ylabel: str,
    log_y: bool,
    legend_loc: str,
    suptitle: str,
    ylim: tuple[float, float] | None = None,
    optimum_line: bool = False,
) -> Figure:
    """One panel per problem of ``doc``: ``series(comp, i)`` against the recorded steps ``t``
    (log axis) for every run ``i`` with this step-size ``schedule``; unused panels hidden.
    ``optimum_line`` draws the optimum :math:`x^\\star = -1`."""
    comps = doc["comparisons"]
    fig, axes = _panel_grid(len(comps))
    for ax, comp in zip(axes.flat, comps.values(), strict=False):
        idx = _runs_for(comp, schedule)
        t = np.asarray(comp["record_t"], float)
        for i in idx:
            r = comp["runs"][i]
            ax.plot(t, series(comp, i), label=r["label"], **style_for(r["optimizer"]))
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        if ylim is not None:
            ax.set_ylim(*ylim)
        if optimum_line:  # x* = -1
            ax.axhline(-1.0, color="k", lw=0.8, alpha=0.5)
        finish_axes(ax, _panel_title(comp, idx), "step t", ylabel)
    for ax in list(axes.flat)[len(comps) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=FONT_SIZE - 2, loc=legend_loc)
    fig.suptitle(suptitle, fontsize=FONT_SIZE + 1)
    return fig


def reddi_trajectories_figure(doc: dict[str, Any], schedule: str = "sqrt") -> Figure:
    """:math:`x_t` against :math:`t` (log axis), one panel per problem (seed 0)."""
    return _per_problem_figure(
        doc,
        schedule,
        lambda comp, i: comp["x"][i],
        ylabel="x after t steps",
        log_y=False,
        legend_loc="best",
        suptitle=f"Iterates on F = [-1, 1] (optimum x* = -1), step size {_schedule_text(schedule)}",
        ylim=(-1.08, 1.08),
        optimum_line=True,
    )


def reddi_regret_figure(doc: dict[str, Any], schedule: str = "sqrt") -> Figure:
    r"""Average regret :math:`R_t/t` against :math:`t` on log-log axes, one panel per problem.

    Non-positive values (possible on the stochastic problems early on, where the regret is taken
    against :math:`x^\star = -1` with the realised losses) are not drawn.
    """

    def positive_regret(comp: dict[str, Any], i: int) -> np.ndarray:
        y = np.asarray(comp["avg_regret_t"][i], float)
        return np.where(y > 0, y, np.nan)

    return _per_problem_figure(
        doc,
        schedule,
        positive_regret,
        ylabel="average regret R_t / t",
        log_y=True,
        legend_loc="lower left",
        suptitle="Average regret against x* = -1 (→ 0 for a no-regret method), step size "
        f"{_schedule_text(schedule)}",
    )


def phase_diagram_panel(ax, d: dict[str, Any], *, title: str = "", value: str = "x_final"):
    """One (β1, β2) heat map of ``d[value]`` (−1 blue, +1 red) with the curve β1 = √β2.

    ``d["b2_scale"] == "log"`` spaces the β2 axis by log(1 − β2), so that β2 up to 0.9999 is
    readable; otherwise the axis is linear. Returns the ``QuadMesh`` (for a colour bar).
    """
    b1 = np.asarray(d["b1"], float)
    b2 = np.asarray(d["b2"], float)
    z = np.asarray(d[value], float).T  # rows: β2, columns: β1
    log = d.get("b2_scale", "linear") == "log"
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-1.0, vmax=1.0)
    curve_b1 = np.linspace(0.0, min(b1.max(), 0.9999), 200)
    curve = {"color": "k", "lw": 2, "ls": "--", "label": "β1 = √β2 (theory's boundary)"}
    if log:
        one_minus = 1.0 - b2
        mesh = ax.pcolormesh(
            cell_edges(b1), cell_edges(one_minus, log=True), z, cmap="RdBu_r", norm=norm
        )
        ax.set_yscale("log")
        ax.invert_yaxis()  # β2 grows upwards
        ticks = [v for v in (1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5) if one_minus.min() / 2 <= v <= 2]
        labels = [f"{1.0 - v:.{max(0, round(-np.log10(v)))}f}" for v in ticks]
        ax.set_yticks(ticks, labels=labels)
        ax.minorticks_off()
        ax.plot(curve_b1, 1.0 - curve_b1**2, **curve)
        ylabel = "β2 (axis spaced by log(1 − β2))"
    else:
        mesh = ax.pcolormesh(cell_edges(b1), cell_edges(b2), z, cmap="RdBu_r", norm=norm)
        ax.plot(curve_b1, curve_b1**2, **curve)
        ylabel = "β2"
    ax.text(
        0.03,
        0.97,
        "β1 < √β2 above the dashed line",
        transform=ax.transAxes,
        fontsize=FONT_SIZE - 2,
        va="top",
        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
    )
    finish_axes(ax, title, "β1", ylabel)
    return mesh


def reddi_phase_figure(doc: dict[str, Any]) -> Figure:
    """Where Adam ends (:math:`x_T`) over (β1, β2), one panel per online problem."""
    diagrams = doc["phase_diagrams"]
    fig, axes = new_figure(1, len(diagrams), width=5.6, height=4.9)
    mesh = None
    for ax, (name, d) in zip(axes.flat, diagrams.items(), strict=True):
        comp = doc["comparisons"].get(name, {})
        description = comp.get("problem", {}).get("description", name)
        mesh = phase_diagram_panel(
            ax,
            d,
            title=f"{description}\n{d['optimizer']}, α_t = {d['alpha']:g}/√t, "
            f"ε = {d['eps']:g}, T = {d['steps']:,}",
        )
        if comp.get("runs"):
            r = comp["runs"][0]
            y = 1.0 - r["b2"] if d.get("b2_scale") == "log" else r["b2"]
            ax.plot(
                [r["b1"]],
                [y],
                marker="*",
                ms=15,
                color="gold",
                mec="k",
                ls="none",
                label=f"comparison setting ({r['b1']:g}, {r['b2']:.3g})",
            )
        ax.legend(fontsize=FONT_SIZE - 2, loc="lower right")
    if mesh is not None:
        cb = fig.colorbar(mesh, ax=list(axes.flat), shrink=0.9)
        cb.set_label("x_T  (−1: the optimum, +1: the worst point)", fontsize=FONT_SIZE)
    fig.suptitle("Where Adam (bias-corrected) ends on the online problems", fontsize=FONT_SIZE + 1)
    return fig


def reddi_eps_figure(doc: dict[str, Any]) -> Figure:
    """:math:`x_T` and :math:`R_T/T` against ε (log axis), one column per problem."""
    sweeps = doc["eps_sweeps"]
    fig, axes = new_figure(2, len(sweeps), width=5.2, height=3.4)
    for j, (name, d) in enumerate(sweeps.items()):
        eps = np.asarray(d["eps"], float)
        description = doc["comparisons"].get(name, {}).get("problem", {}).get("description", name)
        for k, opt in enumerate(d["optimizers"]):
            st = style_for(opt)
            axes[0, j].plot(eps, d["x_final"][k], marker="o", label=opt, **st)
            y = np.asarray(d["avg_regret"][k], float)
            axes[1, j].plot(eps, np.where(y > 0, y, np.nan), marker="o", label=opt, **st)
        axes[0, j].set_ylim(-1.08, 1.08)
        axes[0, j].axhline(-1.0, color="k", lw=0.8, alpha=0.5)
        for ax in axes[:, j]:
            ax.set_xscale("log")
        axes[1, j].set_yscale("log")
        finish_axes(
            axes[0, j],
            f"{description}\nβ1={d['b1']:g}, β2={d['b2']:.3g}, α_t={d['alpha']:g}/√t, "
            f"T={d['steps']:,}",
            "ε",
            "x_T",
        )
        finish_axes(axes[1, j], "", "ε", "R_T / T")
        axes[0, j].legend(fontsize=FONT_SIZE - 2)
    fig.suptitle(
        "Effect of ε: a large ε turns Adam into SGD with step size α_t/ε", fontsize=FONT_SIZE + 1
    )
    return fig


def reddi_figures(doc: dict[str, Any], out: str | os.PathLike) -> list[str]:
    """Writes every Reddi figure that ``doc`` has data for into ``out``; returns the names.

    ``reddi_x_{sqrt,constant}.png`` (iterates), ``reddi_regret_{sqrt,constant}.png`` (average
    regret), ``reddi_phase.png`` (the (β1, β2) phase diagram), ``reddi_eps.png`` (ε sweep).
    """
    makers = {}
    if doc.get("comparisons"):
        for schedule in ("sqrt", "constant"):
            makers[f"reddi_x_{schedule}.png"] = lambda s=schedule: reddi_trajectories_figure(doc, s)
            makers[f"reddi_regret_{schedule}.png"] = lambda s=schedule: reddi_regret_figure(doc, s)
    if doc.get("phase_diagrams"):
        makers["reddi_phase.png"] = lambda: reddi_phase_figure(doc)
    if doc.get("eps_sweeps"):
        makers["reddi_eps.png"] = lambda: reddi_eps_figure(doc)
    for fname, make in makers.items():
        save(make(), os.path.join(out, fname))
    return list(makers)


# ---------------------------------------------------------------------------------------------
# The SSM comparison and the lr × wd grids.
# ---------------------------------------------------------------------------------------------

#: Colours of the SSM comparison's optimizers (Okabe-Ito, as above).
SSM_STYLE: dict[str, dict[str, Any]] = {
    "adam_l2": {"color": "#D55E00", "ls": "-", "lw": 2.0},
    "adamw": {"color": "#0072B2", "ls": "-", "lw": 2.0},
    "adamw_schedule": {"color": "#56B4E9", "ls": "--", "lw": 2.0},
    "amsgrad": {"color": "#009E73", "ls": "-.", "lw": 2.0},
    "lion": {"color": "#CC79A7", "ls": ":", "lw": 2.0},
}


def effective_decay_figure(doc: dict[str, Any]) -> Figure:
    """Histograms of the per-element effective decay per step at the end of training."""
    fig, axes = new_figure(1, 1, width=7.0, height=4.0)
    ax = axes[0, 0]
    for name, res in doc["optimizers"].items():
        eff = res["evaluation"]["diagnostics"]["effective_decay"]
        lo, hi, n = eff["log10_bins"]
        edges = np.linspace(lo, hi, n + 1)
        counts = np.asarray(eff["log10_histogram"], float)
        frac = counts / max(counts.sum(), 1.0)
        ax.stairs(frac, edges, label=res["label"], **SSM_STYLE.get(name, {}))
    finish_axes(
        ax,
        "Effective weight decay per step on decayed weights (peak η, end-of-training ν̂)",
        "log10 decay per step  (coupled: ηλ/(√ν̂+ε); decoupled: s_t)",
        "fraction of elements",
    )
    ax.legend(fontsize=FONT_SIZE - 2)
    return fig


def group_norm_figure(doc: dict[str, Any]) -> Figure:
    """Weight-norm trajectories per parameter group, one panel per optimizer."""
    names = list(doc["optimizers"])
    fig, axes = new_figure(1, len(names), width=3.6, height=3.4)
    for ax, name in zip(axes[0], names, strict=True):
        diag = doc["optimizers"][name]["evaluation"]["diagnostics"]
        steps = diag["group_norm_steps"]
        for group, values in sorted(diag["group_norms"].items()):
            ax.plot(steps, values, label=group.removeprefix("norm/"))
        ax.set_yscale("log")
        finish_axes(ax, doc["optimizers"][name]["label"], "step", "‖θ_group‖₂")
    axes[0, 0].legend(fontsize=FONT_SIZE - 3)
    fig.suptitle("Weight norms: decayed matrices vs excluded A_log / D / dt_bias / norms / biases",
                 fontsize=FONT_SIZE + 1)  # fmt: skip
    return fig


def comparison_bars_figure(doc: dict[str, Any]) -> Figure:
    """Test accuracy, test loss and train/test gap (mean ± std over seeds) per optimizer."""
    names = list(doc["optimizers"])
    fig, axes = new_figure(1, 3, width=3.8, height=3.6)
    panels = [("test_accuracy", "test accuracy"), ("test_loss", "test loss"),
              ("gap_accuracy", "train − test accuracy")]  # fmt: skip
    x = np.arange(len(names))
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        means = [doc["optimizers"][n]["evaluation"][key]["mean"] for n in names]
        stds = [doc["optimizers"][n]["evaluation"][key]["std"] for n in names]
        colors = [SSM_STYLE.get(n, {}).get("color", "#444444") for n in names]
        ax.bar(x, means, yerr=stds, color=colors, capsize=4)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=FONT_SIZE - 2)
        finish_axes(ax, title, "", "")
        if key == "test_accuracy":
            lo = min(m - s for m, s in zip(means, stds, strict=True))
            ax.set_ylim(max(0.0, lo - 0.05), 1.0)
    fig.suptitle("Sequential digits, tuned on validation, tested over seeds (mean ± std)",
                 fontsize=FONT_SIZE + 1)  # fmt: skip
    return fig


def training_curves_figure(doc: dict[str, Any]) -> Figure:
    """Mean training loss per step of the evaluation runs."""
    fig, axes = new_figure(1, 1, width=7.0, height=4.0)
    ax = axes[0, 0]
    for name, res in doc["optimizers"].items():
        curve = np.asarray(res["evaluation"]["train_loss_curve"], float)
        ax.plot(np.arange(1, curve.size + 1), curve, label=res["label"], **SSM_STYLE.get(name, {}))
    ax.set_yscale("log")
    finish_axes(ax, "Training loss (mean over evaluation seeds)", "step", "cross-entropy")
    ax.legend(fontsize=FONT_SIZE - 2)
    return fig


def comparison_figures(doc: dict[str, Any], out: str | os.PathLike) -> list[str]:
    """Writes the comparison's figures into ``out``; returns the file names."""
    makers = {
        "compare_test.png": comparison_bars_figure,
        "compare_train_loss.png": training_curves_figure,
        "compare_effective_decay.png": effective_decay_figure,
        "compare_weight_norms.png": group_norm_figure,
    }
    for fname, make in makers.items():
        save(make(doc), os.path.join(out, fname))
    return list(makers)


def grid_figure(doc: dict[str, Any], value: str = "val_loss") -> Figure:
    """Heatmaps of ``value`` (mean over seeds) on the lr × wd grid, optimizers side by side."""
    names = list(doc["optimizers"])
    fig, axes = new_figure(1, len(names), width=4.6, height=4.0)
    for ax, name in zip(axes[0], names, strict=True):
        res = doc["optimizers"][name]
        lrs, wds = np.asarray(res["learning_rates"]), np.asarray(res["weight_decays"])
        # The mean over seeds, as the analysis takes it: a cell where a seed diverged is left
        # blank (non-finite), not shown as the mean of the seeds that did not.
        z = np.mean(np.asarray(res[value], float), axis=2)  # (lr, wd)
        z = np.where(np.isfinite(z), z, np.nan)
        mesh = ax.pcolormesh(cell_edges(wds, log=True), cell_edges(lrs, log=True), z,
                             cmap="viridis_r" if value == "val_loss" else "viridis",
                             shading="flat")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.minorticks_off()
        ax.set_xticks(wds, [f"{v:.2g}" for v in wds], rotation=45, fontsize=FONT_SIZE - 2)
        ax.set_yticks(lrs, [f"{v:.2g}" for v in lrs], fontsize=FONT_SIZE - 2)
        # None: every cell of that learning rate diverged (a gap in the line)
        best_wd = [np.nan if v is None else v for v in res["analysis"]["best_wd_per_lr"]]
        ax.plot(best_wd, lrs, "w.-", lw=1, ms=6, label="best λ per η")
        b = res["analysis"]["best"]
        ax.plot([b["weight_decay"]], [b["learning_rate"]], "r*", ms=12, label="best")
        fig.colorbar(mesh, ax=ax, shrink=0.85)
        sep = res.get("separability")
        title = res["label"] + (
            f"\nslope of log λ* vs log η: {number(sep['slope'], '+.2f')} ({sep['verdict']})"
            if sep is not None
            else ""
        )
        finish_axes(ax, title, "weight decay λ", "peak learning rate η")
    axes[0, 0].legend(fontsize=FONT_SIZE - 2, loc="lower left")
    label = "final validation loss" if value == "val_loss" else "test accuracy"
    fig.suptitle(
        f"{label} (mean over seeds; blank: diverged), sequential digits", fontsize=FONT_SIZE + 1
    )
    return fig


def grid_figures(doc: dict[str, Any], out: str | os.PathLike) -> list[str]:
    """Writes the validation-loss and test-accuracy heatmaps; returns the file names."""
    files = {"grid_val_loss.png": "val_loss", "grid_test_accuracy.png": "test_accuracy"}
    for fname, value in files.items():
        save(grid_figure(doc, value), os.path.join(out, fname))
    return list(files)
