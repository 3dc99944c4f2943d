r"""Learning-rate × weight-decay grids on the SSM (Loshchilov & Hutter 2019, Fig. 2).

For each optimizer a log grid of peak learning rates × weight decays, with several seeds,
trains as **one** compiled program (:func:`~optax_decoupled.experiments.train.train_grid`;
hyperparameters are traced arrays inside the step). The
final validation loss and test accuracy are kept per cell and seed.

The paper's claim is that decoupling makes the two hyperparameters *separable*: with coupled
L2 the good region is a diagonal valley (changing η moves the best λ), with decoupled decay it
is closer to axis-aligned. We quantify rather than eyeball it (:func:`analyse`):

* ``best_wd_per_lr``: for each learning rate, the weight decay with the lowest mean
  validation loss; ``log_slope`` is the least-squares slope of :math:`\log_{10}\lambda^*`
  against :math:`\log_{10}\eta` over the learning rates (0: the best λ does not move with η;
  −1: it moves inversely, i.e. only the product ηλ matters).
* ``near_optimal_corr``: the correlation of :math:`\log\eta` and :math:`\log\lambda` over the
  near-optimal cells (mean validation loss within ``tolerance`` of the best): close to 0 for an
  axis-aligned basin, close to ±1 for a diagonal one.

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

from optax_decoupled.experiments import compare
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments import train as train_lib
from optax_decoupled.experiments.formatting import number


def _half_decades(lo_exp: float, n: int) -> tuple[float, ...]:
    return tuple(float(f"{10.0 ** (lo_exp + 0.5 * i):.3g}") for i in range(n))


#: log10 of the smallest weight decay of each optimizer's axis (half-decade steps from there),
#: per what one unit means there: coupled λ is divided by sqrt(ν̂) (6 values: 3.2e-6 .. 1e-3);
#: "lr" decays by ηλ per step (1e-2 .. 3.2); "schedule" by λ per step at the peak.
WD_START = {"adam_l2": -5.5, "adamw": -2.0, "adamw_schedule": -5.5}


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """Sizes of the lr × wd grids (``quick`` fits 2 CPU cores)."""

    d_model: int = 16
    n_layers: int = 2
    d_state: int = 16
    headdim: int = 16
    chunk_size: int = 16
    batch_size: int = 16
    steps: int = 200
    warmup_steps: int = 20
    clip_norm: float | None = 1.0
    lrs: tuple[float, ...] = _half_decades(-4.0, 6)  # 1e-4 .. 3.2e-2
    n_wd: int = 6
    seeds: tuple[int, ...] = (0, 1)
    optimizers: tuple[str, ...] = ("adam_l2", "adamw")
    tolerance: float = 0.05  # relative, for the near-optimal basin
    #: ``TrainConfig.config_chunk`` of each grid (an int bounds the memory of a wide grid).
    config_chunk: int | str | None = "auto"

    @classmethod
    def preset(cls, scale: str) -> GridConfig:
        if scale == "smoke":
            return cls(d_model=16, n_layers=1, batch_size=8, steps=4, warmup_steps=1,
                       lrs=(1e-3, 1e-2), n_wd=2, seeds=(0,))  # fmt: skip
        if scale == "quick":
            return cls()
        if scale == "full":
            return cls(d_model=64, n_layers=2, batch_size=64, steps=2000, warmup_steps=200,
                       lrs=_half_decades(-4.5, 8), n_wd=8, seeds=(0, 1, 2),
                       optimizers=("adam_l2", "adamw", "adamw_schedule"))  # fmt: skip
        raise ValueError(f"scale must be 'smoke', 'quick' or 'full', got {scale!r}.")

    def wds(self, name: str) -> tuple[float, ...]:
        return _half_decades(WD_START[name], self.n_wd)


def analyse(
    val_loss: np.ndarray, lrs: np.ndarray, wds: np.ndarray, tolerance: float = 0.05
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


def run_grid(
    cfg: GridConfig, *, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Trains every optimizer's grid (one compiled program each); a JSON-ready dict."""
    t0 = time.perf_counter()
    task = tasks_lib.sequential_digits(batch_size=cfg.batch_size)
    model_config = compare.CompareConfig(
        d_model=cfg.d_model, n_layers=cfg.n_layers, d_state=cfg.d_state, headdim=cfg.headdim,
        chunk_size=cfg.chunk_size,
    ).model_config(task)  # fmt: skip
    specs = compare.default_specs(cfg.lrs, 6)
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "optimizers": {}}
    for name in cfg.optimizers:
        spec = dataclasses.replace(specs[name], lrs=tuple(cfg.lrs), wds=cfg.wds(name))
        hp, seeds = train_lib.product_grid(
            {"learning_rate": spec.lrs, "weight_decay": spec.wds}, seeds=cfg.seeds
        )
        log(f"[grid] {name}: {len(spec.lrs)}x{len(spec.wds)} x {len(cfg.seeds)} seeds "
            f"= {len(seeds)} runs as one program")  # fmt: skip
        make_tx = compare.make_tx_factory(spec, cfg.steps, cfg.warmup_steps, cfg.clip_norm)
        res = train_lib.train_grid(
            task, model_config, make_tx, hp, seeds,
            train_lib.TrainConfig(steps=cfg.steps, eval_every=cfg.steps, progress=progress,
                                  eval_splits=(), final_splits=("val", "test"),
                                  config_chunk=cfg.config_chunk),
            keep_params=False, desc=f"grid {name}",
        )  # fmt: skip
        shape = (len(spec.lrs), len(spec.wds), len(cfg.seeds))  # seed varies fastest
        val_loss = np.array([r.final["val_loss"] for r in res.runs]).reshape(shape)
        test_acc = np.array([r.final["test_accuracy"] for r in res.runs]).reshape(shape)
        mean_loss = np.mean(val_loss, axis=2)
        out["optimizers"][name] = {
            "label": spec.label,
            "learning_rates": list(spec.lrs),
            "weight_decays": list(spec.wds),
            "seeds": list(cfg.seeds),
            "val_loss": val_loss.tolist(),
            "test_accuracy": test_acc.tolist(),
            "analysis": analyse(mean_loss, spec.lrs, spec.wds, cfg.tolerance),
            "wall_time_s": res.wall_time_s,
            "step_time_s": res.step_time_s,
            "runs": len(seeds),
        }
    out["wall_time_s"] = time.perf_counter() - t0
    return out


def summary_table(doc: dict[str, Any]) -> str:
    """A Markdown table of the separability measures per optimizer."""

    def f(v, fmt=".2f"):
        return "—" if v is None else number(v, fmt)

    lines = [
        "| optimizer | runs | best η | best λ | best val. loss | slope log λ* vs log η "
        "| corr(log η, log λ) near optimum | best λ per η (low → high η) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in doc["optimizers"].values():
        a = res["analysis"]
        lines.append(
            f"| {res['label']} | {res['runs']} | {a['best']['learning_rate']:.3g} | "
            f"{a['best']['weight_decay']:.3g} | {a['best']['val_loss']:.4f} | "
            f"{f(a['log_slope'], '+.2f')} | {f(a['near_optimal_corr'], '+.2f')} "
            f"({a['near_optimal_cells']} cells within {a['tolerance']:.0%}) | "
            + ", ".join(f(v, ".2g") for v in a["best_wd_per_lr"])
            + " |"
        )
    return "\n".join(lines)
