r"""The Reddi et al. experiment as a whole: every group, its ``results.json``, tables, figures.

:func:`run_experiment` runs, at the sizes of a :class:`Config`, the comparison of every
optimizer on the four problems of :mod:`~optax_decoupled.experiments.reddi_problems`, the
(β1, β2) phase diagrams and ε sweeps of :mod:`~optax_decoupled.experiments.reddi_sweeps` and
a single-run timing, and writes ``results.json`` with the figures of
:func:`~optax_decoupled.experiments.plots.reddi_figures`. :func:`summary_table` and
:func:`timing_table` render the document as Markdown.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from optax_decoupled.experiments import environment, plots, xla_setup
from optax_decoupled.experiments.formatting import number
from optax_decoupled.experiments.reddi_problems import (
    UPPER,
    X_STAR,
    Problem,
    figure1_online_problem,
    figure1_stochastic_problem,
    theorem1_problem,
    theorem3_problem,
)
from optax_decoupled.experiments.reddi_simulation import (
    OPTIMIZERS,
    SimResult,
    classify,
    phase_aligned,
    settle_step,
    simulate,
    simulation_device,
)
from optax_decoupled.experiments.reddi_sweeps import (
    PHASE_B2_SCALE,
    comparison_runs,
    eps_sweep,
    phase_diagram,
    phase_grid,
    time_single_run,
)
from optax_decoupled.experiments.xla_setup import FAST_LOOPS_FLAG


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
        "versions": environment.versions(),
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
