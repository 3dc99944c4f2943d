r"""The comparison: coupled L2 vs AdamW (two conventions) vs AMSGrad vs Lion on the Flax SSM.

Protocol (the same for every optimizer; written into the report):

1. **Selection.** For each optimizer, a learning-rate × weight-decay × seeds grid
   (``eval_seeds``; :func:`sweep`) trains as one compiled program on sequential digits read
   row by row from a small training set (``train_size`` images, which the model overfits);
   the cell with the lowest final *validation* loss, averaged over the seeds, is chosen. Every
   weight-decay axis includes λ = 0, the reference for what the decay does. Lion's grid is
   centred per its paper: learning rates ``lion_lr_factor`` (default 1/5) times AdamW's,
   weight decays ``lion_wd_factor`` (default 5) times. Weight-decay axes are per convention
   (:data:`WD_RANGES`), since the same number means a different decay per step.
2. **Evaluation.** The chosen cell's runs (one per seed) are scored on the *test* split,
   which played no part in the choice: accuracy, loss, and the train/test gap (mean ± std
   over seeds); the same for λ = 0 at the chosen learning rate.
3. **Verdicts** (:mod:`~optax_decoupled.experiments.verdicts`): the chosen λ against λ = 0,
   and the pairs the report contrasts (:data:`~optax_decoupled.experiments.verdicts.PAIRS`),
   as differences of test loss paired by seed with their confidence intervals.
4. **Optimisation speed.** On selective copying, each optimizer with its chosen weight decay
   and a small learning-rate grid (the chosen digits learning rate × ``copy_lr_factors``);
   reported: the first evaluation step at which per-token validation accuracy reaches
   ``copy_target`` (best learning rate, each seed), or "not reached" within the budget.
5. **Diagnostics** on the chosen cell's first seed: per-element effective decay per step at the
   peak learning rate with the end-of-training moments (coupled:
   :math:`\eta\lambda/(\sqrt{\hat\nu}+\epsilon)`; decoupled: :math:`s`),
   weight-norm trajectories per parameter group, and update/parameter norm ratios.

The sweeps of the optimizers tuned over every learning rate are the lr × wd grids that
:mod:`~optax_decoupled.experiments.grid` analyses for separability.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled import diagnostics
from optax_decoupled.experiments import schedules, train_results, training_step, verdicts
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments import train as train_lib
from optax_decoupled.experiments.ssm import SSMConfig

# ---------------------------------------------------------------------------------------------
# The optimizers compared.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer of the comparison, with its grid.

    Attributes:
      name: key in results (``adam_l2``, ``adamw``, ``adamw_schedule``, ``amsgrad``, ``lion``).
      label: legend text.
      coupled: whether the weight decay is coupled L2.
      factory: ``factory(learning_rate, weight_decay=..., **fixed)`` from this package.
      fixed: fixed keyword arguments (convention, variant).
      peak_name: keyword through which the peak learning rate is passed too, if needed.
      lrs, wds: the grid's peak learning rates and weight decays.
    """

    name: str
    label: str
    coupled: bool
    factory: Callable[..., optax.GradientTransformation]
    fixed: tuple[tuple[str, Any], ...]
    peak_name: str | None
    lrs: tuple[float, ...]
    wds: tuple[float, ...]

    @property
    def convention(self) -> str:
        return dict(self.fixed).get("decay_convention", "lr")

    @property
    def amsgrad(self) -> str | None:
        fixed = dict(self.fixed)
        return fixed.get("variant") if self.name.startswith("amsgrad") else fixed.get("amsgrad")


@functools.lru_cache(maxsize=64)
def make_tx_factory(
    spec: OptimizerSpec, total_steps: int, warmup_steps: int, clip_norm: float | None
) -> training_step.MakeTx:
    """``make_tx(learning_rate=peak, weight_decay=λ)`` with warmup + cosine and clipping.

    Cached so that repeated calls return the same object (the trainer caches compiled
    programs by it).
    """
    return schedules.scheduled(
        spec.factory,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        clip_norm=clip_norm,
        peak_name=spec.peak_name,
        **dict(spec.fixed),
    )


def _geom(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(float(f"{v:.3g}") for v in np.geomspace(lo, hi, n))


#: Each convention's weight-decay range (the axis is ``n_wd`` log-spaced values in it, and 0):
#: coupled λ enters the gradient and is divided by :math:`\sqrt{\hat\nu}`; ``"lr"`` decays by
#: :math:`\eta\lambda` per step; ``"schedule"`` by λ per step at the peak.
WD_RANGES = {"coupled": (3.16e-4, 3.16e-2), "lr": (0.1, 10.0), "schedule": (1e-3, 0.1)}


def default_specs(
    lrs: Sequence[float],
    n_wd: int,
    *,
    lion_lr_factor: float = 0.2,
    lion_wd_factor: float = 5.0,
    zero: bool = True,
) -> dict[str, OptimizerSpec]:
    """The compared optimizers with grids around AdamW's learning rates ``lrs``.

    Weight-decay axes: ``n_wd`` log-spaced values in each convention's :data:`WD_RANGES`,
    preceded by 0 if ``zero``; Lion's learning rates are ``lrs × lion_lr_factor`` and its
    weight decays AdamW's × ``lion_wd_factor`` (the same decay per step, ηλ).
    """
    lrs = tuple(float(v) for v in lrs)
    head = (0.0,) if zero else ()
    coupled_wd, lr_wd, sched_wd = (head + _geom(*WD_RANGES[c], n_wd)
                                   for c in ("coupled", "lr", "schedule"))  # fmt: skip
    lion_lrs = tuple(float(f"{v * lion_lr_factor:.3g}") for v in lrs)
    lion_wds = tuple(float(f"{v * lion_wd_factor:.3g}") for v in lr_wd)
    specs = [
        OptimizerSpec("adam_l2", "Adam + L2 (coupled)", True, od.adam_l2, (), None, lrs,
                      coupled_wd),
        OptimizerSpec("adamw", "AdamW, decay ηλ (PyTorch)", False, od.adamw,
                      (("decay_convention", "lr"),), None, lrs, lr_wd),
        OptimizerSpec("adamw_schedule", "AdamW, decay λη/η_peak (L-H)", False, od.adamw,
                      (("decay_convention", "schedule"),), "peak_learning_rate", lrs, sched_wd),
        OptimizerSpec("amsgrad", "AMSGrad (pytorch), decoupled", False, od.amsgrad,
                      (("variant", "pytorch"),), None, lrs, lr_wd),
        OptimizerSpec("lion", "Lion, decoupled", False, od.lion, (), None, lion_lrs, lion_wds),
    ]  # fmt: skip
    return {s.name: s for s in specs}


# ---------------------------------------------------------------------------------------------
# Sizes.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """Sizes and settings of the comparison (``quick`` fits 2 CPU cores).

    ``row_length`` and ``train_size`` shape the digits task
    (:func:`~optax_decoupled.experiments.tasks.sequential_digits`); ``lr_sweep`` names the
    optimizers tuned over every learning rate of ``lrs`` (their sweeps are the lr × wd grids
    of :mod:`~optax_decoupled.experiments.grid`); the others are tuned over the weight decay
    at the middle learning rate, ``lrs[len(lrs) // 2]`` (× ``lion_lr_factor`` for Lion).
    """

    d_model: int = 32
    n_layers: int = 2
    d_state: int = 16
    headdim: int = 16
    chunk_size: int = 8
    batch_size: int = 32
    row_length: int = 8
    train_size: int | None = 360
    steps: int = 500
    warmup_steps: int = 50
    clip_norm: float | None = 1.0
    eval_every: int = 200
    lrs: tuple[float, ...] = (3.16e-3, 1e-2, 3.16e-2)
    n_wd: int = 5
    eval_seeds: tuple[int, ...] = (1, 2, 3)
    optimizers: tuple[str, ...] = ("adam_l2", "adamw", "adamw_schedule", "amsgrad", "lion")
    lr_sweep: tuple[str, ...] = ("adam_l2", "adamw", "adamw_schedule")
    copy_steps: int = 300
    copy_eval_every: int = 50
    copy_seq_len: int = 16
    copy_tokens: int = 2
    copy_lr_factors: tuple[float, ...] = (1.0,)
    copy_target: float = 0.99
    lion_lr_factor: float = 0.2
    lion_wd_factor: float = 5.0
    #: ``TrainConfig.config_chunk`` of every grid trained here (e.g. an int to bound the
    #: memory of the ``full`` preset's wide grids on a smaller GPU).
    config_chunk: int | str | None = "auto"

    @classmethod
    def preset(cls, scale: str) -> CompareConfig:
        """``"smoke"`` (seconds, for tests/CI), ``"quick"`` (CPU default), ``"full"`` (GPU)."""
        if scale == "smoke":
            return cls(d_model=16, n_layers=1, batch_size=16, train_size=64, steps=6,
                       warmup_steps=2, eval_every=3, lrs=(1e-3, 3e-3), n_wd=2, eval_seeds=(1, 2),
                       copy_steps=6, copy_eval_every=3, copy_seq_len=8,
                       optimizers=("adam_l2", "adamw", "lion"),
                       lr_sweep=("adam_l2", "adamw"))  # fmt: skip
        if scale == "quick":
            return cls()
        if scale == "full":
            return cls(d_model=64, steps=2000, warmup_steps=200, eval_every=200,
                       lrs=_geom(1e-3, 3.16e-2, 4), n_wd=7, eval_seeds=(1, 2, 3, 4, 5),
                       lr_sweep=("adam_l2", "adamw", "adamw_schedule", "amsgrad", "lion"),
                       copy_steps=2000, copy_seq_len=32, copy_tokens=4,
                       copy_lr_factors=(0.5, 1.0, 2.0))  # fmt: skip
        raise ValueError(f"scale must be 'smoke', 'quick' or 'full', got {scale!r}.")

    def specs(self) -> dict[str, OptimizerSpec]:
        """The compared optimizers with their grids (see the class docstring)."""
        all_specs = default_specs(
            self.lrs, self.n_wd, lion_lr_factor=self.lion_lr_factor,
            lion_wd_factor=self.lion_wd_factor,
        )  # fmt: skip
        unknown = set(self.optimizers) - set(all_specs)
        if unknown:
            raise ValueError(f"unknown optimizers {sorted(unknown)}; choose from {list(all_specs)}")
        return {
            n: all_specs[n]
            if n in self.lr_sweep
            else dataclasses.replace(all_specs[n], lrs=(all_specs[n].lrs[len(self.lrs) // 2],))
            for n in self.optimizers
        }

    def digits(self) -> tasks_lib.Task:
        """The sequential-digits task of this configuration."""
        return tasks_lib.sequential_digits(
            batch_size=self.batch_size, row_length=self.row_length, train_size=self.train_size
        )

    def model_config(self, task: tasks_lib.Task) -> SSMConfig:
        return SSMConfig(
            **task.model_kwargs(), d_model=self.d_model, n_layers=self.n_layers,
            d_state=self.d_state, headdim=self.headdim, chunk_size=self.chunk_size,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The experiment.
# ---------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, np.float64)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if arr.size > 1 else 0.0,
            "values": [float(v) for v in arr]}  # fmt: skip


#: The final metrics a sweep keeps for every run.
SWEEP_METRICS = ("train_loss", "val_loss", "test_loss", "train_accuracy", "test_accuracy")


def sweep(
    spec: OptimizerSpec,
    task: tasks_lib.Task,
    cfg: CompareConfig,
    *,
    progress: bool = True,
    param_metrics: Callable[[Any], dict[str, jax.Array]] | None = None,
) -> tuple[train_results.GridResult, dict[str, Any]]:
    """Trains ``spec``'s lr × wd × ``cfg.eval_seeds`` grid as one compiled program.

    Returns the trainer's result and the sweep: its axes and, for each of
    :data:`SWEEP_METRICS`, the final values as a ``(lrs, wds, seeds)`` nested list.
    """
    seeds = list(cfg.eval_seeds)
    hp, seed_arr = train_lib.product_grid(
        {"learning_rate": spec.lrs, "weight_decay": spec.wds}, seeds=seeds
    )
    make_tx = make_tx_factory(spec, cfg.steps, cfg.warmup_steps, cfg.clip_norm)
    res = train_lib.train_grid(
        task, cfg.model_config(task), make_tx, hp, seed_arr,
        train_lib.TrainConfig(steps=cfg.steps, eval_every=cfg.eval_every, progress=progress,
                              eval_splits=("val",), final_splits=("train", "val", "test"),
                              config_chunk=cfg.config_chunk),
        keep_params=False, desc=f"{spec.name} ({len(seed_arr)} runs)",
        param_metrics=param_metrics,
    )  # fmt: skip
    shape = (len(spec.lrs), len(spec.wds), len(seeds))  # the seed varies fastest
    out = {"learning_rate": list(spec.lrs), "weight_decay": list(spec.wds), "seeds": seeds}
    for key in SWEEP_METRICS:
        out[key] = np.array([r.final[key] for r in res.runs], np.float64).reshape(shape).tolist()
    return res, out


def select_and_evaluate(
    spec: OptimizerSpec, task: tasks_lib.Task, cfg: CompareConfig, *, progress: bool = True
) -> dict[str, Any]:
    """Steps 1, 2 and 5 from one :func:`sweep`: the choice by mean final validation loss over
    seeds, the chosen cell's test metrics (and λ = 0's at the chosen learning rate, where the
    axis has 0), and the chosen cell's diagnostics."""
    res, grid = sweep(spec, task, cfg, progress=progress, param_metrics=param_group_norm_metrics)
    n_seeds = len(grid["seeds"])
    cells = [res.runs[i : i + n_seeds] for i in range(0, len(res.runs), n_seeds)]
    mean_val = np.mean(np.asarray(grid["val_loss"]), axis=2).ravel()
    mean_val = np.where(np.isfinite(mean_val), mean_val, np.inf)
    best = int(np.argmin(mean_val))
    chosen = cells[best]
    out = {
        "grid": [
            {
                **c[0].hparams,
                "val_loss": float(m),
                "val_accuracy": float(np.mean([r.final["val_accuracy"] for r in c])),
            }
            for c, m in zip(cells, mean_val, strict=True)
        ],  # fmt: skip
        "sweep": grid,
        "hparams": chosen[0].hparams,
        "seeds": grid["seeds"],
        **cell_summary(chosen),
        "train_loss_curve": [float(v) for v in np.nanmean([r.train_loss for r in chosen], 0)],
        "evals": chosen[0].evals,
        "runs": len(res.runs),
        "wall_time_s": res.wall_time_s,
        "compile_time_s": res.compile_time_s,
        "step_time_s": res.step_time_s,
        "diagnostics": run_diagnostics(spec, chosen[0], chosen[0].index, task, cfg, res),
    }
    if 0.0 in spec.wds:  # λ = 0 at the chosen learning rate: the cell in the same row
        row = best // len(spec.wds)
        out["at_zero"] = cell_summary(cells[row * len(spec.wds) + spec.wds.index(0.0)])
    return out


def cell_summary(runs: Sequence[train_results.RunResult]) -> dict[str, Any]:
    """Mean ± std over a cell's seeds of the test metrics, the losses and the train−test gaps."""
    finals = [r.final for r in runs]
    return {
        "test_accuracy": _mean_std([f["test_accuracy"] for f in finals]),
        "test_loss": _mean_std([f["test_loss"] for f in finals]),
        "val_loss": _mean_std([f["val_loss"] for f in finals]),
        "train_loss": _mean_std([f["train_loss"] for f in finals]),
        "train_accuracy": _mean_std([f["train_accuracy"] for f in finals]),
        "gap_accuracy": _mean_std([f["train_accuracy"] - f["test_accuracy"] for f in finals]),
        "gap_loss": _mean_std([f["test_loss"] - f["train_loss"] for f in finals]),
    }


def param_group_norm_metrics(params: Any) -> dict[str, jax.Array]:
    """Weight norms per group (for the trainer's ``param_metrics`` hook)."""
    return {f"norm/{k}": v for k, v in diagnostics.group_norms(params).items()}


def run_diagnostics(
    spec: OptimizerSpec,
    run: train_results.RunResult,
    index: int,
    task: tasks_lib.Task,
    cfg: CompareConfig,
    res: train_results.GridResult,
) -> dict[str, Any]:
    """Effective decay per element and update/param ratios of configuration ``index``."""
    params = jax.tree.map(lambda v: v[index], res.params)
    rest = jax.tree.map(lambda v: v[index], res.rest)
    opt_state = jax.tree.map(lambda v: v[index], res.opt_state)
    best = run.hparams
    # The decay per step is compared at the *peak* learning rate (at the end of a cosine
    # schedule every decay is ~0); coupled L2 uses the end-of-training second moment.
    lr_peak = float(best["learning_rate"])
    kind = dict(
        learning_rate=lr_peak, weight_decay=best["weight_decay"], coupled=spec.coupled,
        convention=spec.convention, peak_learning_rate=best["learning_rate"],
    )  # fmt: skip
    if spec.name == "lion":
        eff = diagnostics.effective_decay(None, params, **kind)
    else:
        eff = diagnostics.effective_decay(opt_state, params, amsgrad=spec.amsgrad, **kind)
    decayed = od.resolve_mask("auto", params)
    values = np.concatenate(
        [np.ravel(np.asarray(e)) for e, m in zip(jax.tree.leaves(eff), jax.tree.leaves(decayed),
                                                 strict=True) if m]
    )  # fmt: skip
    # One more step's update (not applied) for the update/parameter ratios, at the peak
    # learning rate as the decay above: at the end of the cosine schedule (the state's step
    # count) the learning rate is exactly 0, and so was every ratio.
    make_tx = schedules.scheduled(
        spec.factory, total_steps=cfg.steps, warmup_steps=0, clip_norm=cfg.clip_norm,
        end_fraction=1.0, peak_name=spec.peak_name, **dict(spec.fixed),
    )  # fmt: skip
    batch = task.train_batch(jax.random.key(12345), jnp.asarray(0))
    grads = jax.grad(
        lambda p: training_step.loss_fn(p, batch, graphdef=res.graphdef, rest=rest)[0]
    )(params)
    hp = {n: jnp.asarray(v, jnp.float32) for n, v in best.items()}
    updates, _ = make_tx(**hp).update(grads, opt_state, params)
    ratios = {k: float(v) for k, v in diagnostics.update_ratios(updates, params).items()}
    log_values = np.log10(np.maximum(values, 1e-30))
    return {
        "effective_decay": {
            "learning_rate": lr_peak,
            "quantiles": {
                str(q): float(np.quantile(values, q)) for q in (0.01, 0.1, 0.5, 0.9, 0.99)
            },
            # Values outside [1e-12, 1] go to the end bins (counted apart too), so the
            # histogram holds every element and the figure's fractions are of all of them.
            "log10_histogram": np.histogram(np.clip(log_values, -12, 0), bins=40, range=(-12, 0))[
                0
            ].tolist(),
            "log10_bins": [-12, 0, 40],
            "below_1e-12": int(np.sum(log_values < -12)),
            "above_1": int(np.sum(log_values > 0)),
            "n": int(values.size),
        },
        "update_ratios": ratios,
        "group_norms": {
            k: [e.get(k) for e in run.evals] for k in run.evals[-1] if k.startswith("norm/")
        },  # fmt: skip
        "group_norm_steps": [e["step"] for e in run.evals],
    }


def copy_speed(
    spec: OptimizerSpec,
    best: dict[str, float],
    cfg: CompareConfig,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Step 3: steps to ``copy_target`` per-token accuracy on selective copying."""
    task = tasks_lib.selective_copying(
        seq_len=cfg.copy_seq_len, num_tokens=cfg.copy_tokens, batch_size=cfg.batch_size
    )
    lrs = [best["learning_rate"] * f for f in cfg.copy_lr_factors]
    hp, seeds = train_lib.product_grid(
        {"learning_rate": lrs, "weight_decay": [best["weight_decay"]]}, seeds=cfg.eval_seeds
    )
    make_tx = make_tx_factory(spec, cfg.copy_steps, cfg.warmup_steps, cfg.clip_norm)
    res = train_lib.train_grid(
        task, cfg.model_config(task), make_tx, hp, seeds,
        train_lib.TrainConfig(steps=cfg.copy_steps, eval_every=cfg.copy_eval_every,
                              progress=progress, final_splits=("val",),
                              config_chunk=cfg.config_chunk),
        keep_params=False, desc=f"copying {spec.name}",
    )  # fmt: skip

    def first_hit(run) -> int | None:
        for e in run.evals:
            if e["val_accuracy"] >= cfg.copy_target:
                return int(e["step"])
        return None

    per_lr = {}
    for lr in lrs:
        runs = [r for r in res.runs if math.isclose(r.hparams["learning_rate"], lr, rel_tol=1e-6)]
        hits = [first_hit(r) for r in runs]
        label = f"{lr:.3g}" if f"{lr:.3g}" not in per_lr else repr(float(lr))  # a display key
        per_lr[label] = {
            "learning_rate": float(lr),  # the value trained, unrounded
            "steps_to_target": hits,
            "final_val_accuracy": [r.final["val_accuracy"] for r in runs],
        }

    def score(item):
        hits = item[1]["steps_to_target"]
        reached = [h for h in hits if h is not None]
        return (-len(reached), np.mean(reached) if reached else np.inf)

    _, best_item = min(per_lr.items(), key=score)
    return {
        "target": cfg.copy_target,
        "steps_budget": cfg.copy_steps,
        "per_learning_rate": per_lr,
        "best_learning_rate": best_item["learning_rate"],
        "steps_to_target": best_item["steps_to_target"],
        "wall_time_s": res.wall_time_s,
    }


def run_comparison(
    cfg: CompareConfig, *, progress: bool = True, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """All four steps for every optimizer; a JSON-ready dict."""
    t0 = time.perf_counter()
    digits = cfg.digits()
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "optimizers": {}}
    for name, spec in cfg.specs().items():
        log(f"[compare] {name}: {len(spec.lrs)} lr x {len(spec.wds)} wd x "
            f"{len(cfg.eval_seeds)} seeds as one program")  # fmt: skip
        ev = select_and_evaluate(spec, digits, cfg, progress=progress)
        val, test = ev["val_loss"]["mean"], ev["test_accuracy"]["mean"]
        log(f"[compare] {name}: chose {ev['hparams']}, val loss {val:.4f}, test acc {test:.4f}")
        cp = copy_speed(spec, ev["hparams"], cfg, progress=progress)
        out["optimizers"][name] = {
            "label": spec.label, "coupled": spec.coupled, "convention": spec.convention,
            "grid": {"learning_rate": list(spec.lrs), "weight_decay": list(spec.wds)},
            "evaluation": ev, "copying": cp,
        }  # fmt: skip
    out["verdicts"] = verdicts.comparison_verdicts(out)
    out["wall_time_s"] = time.perf_counter() - t0
    return out
