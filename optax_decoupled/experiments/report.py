"""The main job: every experiment at one scale, and ``results/report.md`` with all figures.

:func:`run_report` runs, in order (:data:`PARTS`):

=========  ==================================================================================
reddi      Reddi et al. counterexamples (:mod:`~optax_decoupled.experiments.reddi`)
implicit   where Adam + L2 and AdamW converge
           (:mod:`~optax_decoupled.experiments.implicit_bias`)
compare    the tuned SSM comparison (:mod:`~optax_decoupled.experiments.compare`)
grid       lr × wd heatmaps and separability (:mod:`~optax_decoupled.experiments.grid`), from
           the comparison's sweeps where that part has run
memory     optimizer-state memory (:mod:`~optax_decoupled.experiments.memory_report`)
=========  ==================================================================================

Each part (:func:`run_part`) writes ``<out>/<part>/results.json`` and its PNG figures, then a
completion marker ``<out>/<part>/complete.json`` (scale, wall time). A report that is
interrupted and started again skips the parts whose marker matches the scale (``force``
reruns them), so finished work is never lost. ``report.md`` records the package/JAX versions,
the device and the wall time of every part, and has a section for every part finished at the
scale in ``<out>``, including those of earlier invocations (the parts run one at a time build
up one report); each part's ``results.json`` keeps the environment it ran in.

``config_chunk`` (``compare`` and ``grid``) sets how many configurations of a grid one device
trains at a time (:class:`~optax_decoupled.experiments.train.TrainConfig`'s ``config_chunk``):
``"auto"`` (default: one at a time on CPU, all at once on accelerators), ``None`` (all at
once) or an int, which bounds a GPU's memory. Results do not depend on it beyond float
rounding.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_decoupled.experiments import (
    compare,
    environment,
    grid,
    implicit_bias,
    memory_report,
    plots,
    reddi,
    verdicts,
    xla_setup,
)

#: The sizes every part has presets for.
SCALES = ("smoke", "quick", "full")
#: The parts of the report, in its order.
PARTS = ("reddi", "implicit_bias", "compare", "grid", "memory")
#: The parts that train grids of configurations and take ``config_chunk``.
GRID_PARTS = ("compare", "grid")


def write_json(path: pathlib.Path, doc: Any) -> None:
    """Writes JSON atomically (a temporary file renamed), so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)


def _figure_links(doc: dict[str, Any], rel: str) -> str:
    """Markdown image links, relative to the report, of the figures a part wrote."""
    return "\n".join(f"![{f}]({rel}/{os.path.basename(f)})" for f in doc.get("figures", []))


def _run_reddi(scale: str, out: pathlib.Path, progress: bool) -> dict[str, Any]:
    config = reddi.Config.preset(scale)
    doc = reddi.run_experiment(config, str(out), progress=progress)
    doc.pop("_sim", None)  # the simulations themselves (not results: run_experiment's own JSON
    return doc  # leaves them out too)


def _section_reddi(doc: dict[str, Any], rel: str) -> str:
    figures = _figure_links(doc, rel)
    return (
        "## Reddi et al. counterexamples: Adam vs AMSGrad\n\n"
        "Linear losses on [-1, 1], optimum x* = -1 (Reddi, Kale & Kumar, ICLR 2018). Final point "
        "x_T and average regret R_T/T per optimizer and step-size schedule (sqrt: α_t = α/√t, "
        "constant: α_t = α):\n\n"
        f"{reddi.summary_table(doc)}\n\n{figures}\n"
    )


def _run_compare(
    scale: str, out: pathlib.Path, progress: bool, config_chunk: int | str | None = "auto"
) -> dict[str, Any]:
    cfg = dataclasses.replace(compare.CompareConfig.preset(scale), config_chunk=config_chunk)
    doc = compare.run_comparison(cfg, progress=progress)
    doc["figures"] = plots.comparison_figures(doc, out)
    return doc


def _section_compare(doc: dict[str, Any], rel: str) -> str:
    figures = _figure_links(doc, rel)
    return (
        "## Coupled L2 vs AdamW vs AMSGrad vs Lion on the Flax SSM\n\n"
        f"{verdicts.protocol_text(doc)}\n\n{verdicts.summary_table(doc)}\n\n{figures}\n"
    )


def _run_grid(
    scale: str, out: pathlib.Path, progress: bool, config_chunk: int | str | None = "auto"
) -> dict[str, Any]:
    """The grids of the comparison finished at ``scale`` beside ``out`` (``<out>/../compare``,
    as the report lays out its parts), or, where there is none, the sweeps trained here."""
    sibling = out.parent / "compare"
    doc = None
    try:
        done = _finished(sibling, "compare")
        if done is not None and done.get("scale") == scale:
            doc = grid.from_comparison(json.loads((sibling / "results.json").read_text()))
    except (OutputConflict, OSError, ValueError, KeyError):  # unreadable, or without sweeps
        doc = None
    if doc is None:
        cfg = dataclasses.replace(compare.CompareConfig.preset(scale), config_chunk=config_chunk)
        doc = grid.run_grid(cfg, progress=progress)
    doc["figures"] = plots.grid_figures(doc, out)
    return doc


def _section_grid(doc: dict[str, Any], rel: str) -> str:
    figures = _figure_links(doc, rel)
    return (
        "## Learning rate × weight decay (Loshchilov & Hutter 2019, Fig. 2)\n\n"
        + (
            "The comparison's own sweeps (above), analysed for separability.\n\n"
            if doc.get("source") == "compare"
            else ""
        )
        + f"{grid.summary_table(doc)}\n\n{figures}\n"
    )


def _run_memory(scale: str, out: pathlib.Path, progress: bool) -> dict[str, Any]:
    return memory_report.run(scale, out, progress=progress)


def _section_memory(doc: dict[str, Any], rel: str) -> str:
    return memory_report.markdown(doc, rel)


#: part -> (run it at a scale into a directory -> results, render its Markdown section)
RUNNERS: dict[str, tuple[Callable[..., dict], Callable[[dict, str], str]]] = {
    "reddi": (_run_reddi, _section_reddi),
    "implicit_bias": (implicit_bias.run, implicit_bias.markdown),
    "compare": (_run_compare, _section_compare),
    "grid": (_run_grid, _section_grid),
    "memory": (_run_memory, _section_memory),
}

#: What the single-part subcommands print at the end: part -> summary(results).
SUMMARIES: dict[str, Callable[[dict], str]] = {
    "compare": verdicts.summary_table,
    "grid": grid.summary_table,
    "memory": memory_report.markdown,
}


class OutputConflict(ValueError):
    """The output directory holds a finished run at another scale (replacing it needs
    ``force``)."""


def run_part(
    part: str,
    scale: str,
    directory: str | os.PathLike,
    *,
    force: bool = False,
    rerun: bool = False,
    progress: bool = True,
    config_chunk: int | str | None = "auto",
) -> tuple[dict[str, Any], float, bool]:
    """Runs one part into ``directory`` unless its completion marker says it is done at this
    scale (a finished run at another scale raises :class:`OutputConflict` unless ``force``;
    ``rerun`` replaces one at the same scale, as the single-part subcommands do). Returns
    ``(results, wall time in seconds, skipped)``. ``config_chunk`` goes to the parts that
    train grids (:data:`GRID_PARTS`)."""
    directory = pathlib.Path(directory)
    done = check_output(part, scale, directory, force=force)
    directory.mkdir(parents=True, exist_ok=True)
    marker, results = directory / "complete.json", directory / "results.json"
    if done is not None and not rerun:
        return json.loads(results.read_text()), float(done["wall_time_s"]), True
    marker.unlink(missing_ok=True)
    t0 = time.perf_counter()
    options = {"config_chunk": config_chunk} if part in GRID_PARTS else {}
    doc = RUNNERS[part][0](scale, directory, progress, **options)
    wall = time.perf_counter() - t0
    doc = {**doc, "scale": scale, "environment": environment.environment()}
    write_json(results, doc)
    write_json(marker, {"part": part, "scale": scale, "wall_time_s": wall})
    # What was written, read back: the report renders the same text from a fresh part as
    # from a resumed one (tuples of the configs are lists in JSON, NumPy values numbers).
    return json.loads(results.read_text()), wall, False


def check_output(
    part: str, scale: str, directory: pathlib.Path, *, force: bool = False
) -> dict[str, Any] | None:
    """The completion marker of a finished run of ``part`` at ``scale`` in ``directory``, or
    ``None`` if there is none (or ``force``). Raises :class:`OutputConflict` if the directory
    holds a finished run at another scale, of another part, or an unreadable marker: what
    :func:`run_part` would otherwise overwrite or fail on after running."""
    if force:
        return None
    done = _finished(directory, part)
    if done is not None and done.get("scale") != scale:
        raise OutputConflict(
            f"{directory} holds a finished {done.get('scale')!r} run of {part!r}; pass --force "
            f"(force=True) to replace it with a {scale!r} run, or choose another output "
            "directory."
        )
    return done


def _finished(directory: pathlib.Path, part: str) -> dict[str, Any] | None:
    """The completion marker of the run of ``part`` in ``directory`` (with its ``scale`` and
    ``wall_time_s``), or ``None`` if no finished run is there. Raises
    :class:`OutputConflict` for a marker that cannot be read or names another part."""
    marker, results = directory / "complete.json", directory / "results.json"
    if not (marker.exists() and results.exists()):
        return None
    try:
        done = json.loads(marker.read_text())
        if not isinstance(done, dict) or not isinstance(done.get("wall_time_s"), int | float):
            raise ValueError("no wall_time_s")
    except (OSError, ValueError) as e:
        raise OutputConflict(
            f"{marker} cannot be read as a completion marker ({e}); delete {directory} or "
            "pass --force (force=True) to run the part there again."
        ) from e
    if done.get("part", part) != part:  # (a marker that names no part is taken as this one)
        raise OutputConflict(
            f"{directory} holds a finished run of {done['part']!r}, not of {part!r}; choose "
            "another output directory, or pass --force (force=True) to replace it."
        )
    return done


def run_report(
    out: str | os.PathLike = "results",
    *,
    scale: str = "quick",
    parts: tuple[str, ...] = PARTS,
    force: bool = False,
    progress: bool = True,
    config_chunk: int | str | None = "auto",
    log: Callable[[str], None] = print,
) -> pathlib.Path:
    """Runs ``parts`` at ``scale`` into ``out`` and writes ``out/report.md``; returns its path.

    The report has a section for every part finished at ``scale`` in ``out``: those of
    ``parts`` (run now, or resumed) and those an earlier invocation finished there, so that
    running the parts one at a time (``--parts grid``, then ``--parts memory``) builds up one
    report. A part named twice runs once.

    Raises:
      ValueError: for an unknown scale or part.
      OutputConflict: where a part's directory holds a finished run at another scale (unless
        ``force``), before any part runs.
    """
    parts = tuple(dict.fromkeys(parts))
    if scale not in SCALES:
        raise ValueError(f"`scale` must be one of {SCALES}, got {scale!r}.")
    unknown = [p for p in parts if p not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; choose from {list(RUNNERS)}.")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:  # every conflict before any part runs (not after the earlier ones)
        check_output(part, scale, out / part, force=force)
    xla_setup.configure_cpu()  # before any JAX work: fast loops, a CPU device per core

    docs, walls = {}, {}
    t0 = time.perf_counter()
    for part in parts:
        log(f"[report] {part} ({scale}) ...")
        doc, wall, skipped = run_part(
            part, scale, out / part, force=force, progress=progress, config_chunk=config_chunk
        )
        docs[part], walls[part] = doc, (wall, skipped)
        log(f"[report] {part}: {'already done, skipped' if skipped else f'{wall:.1f} s'}")
    rendered = {p: RUNNERS[p][1](docs[p], p) for p in docs}
    for part in PARTS:  # parts not asked for that an earlier invocation finished here
        try:
            done = None if part in docs else _finished(out / part, part)
            if done is None or done.get("scale") != scale:
                continue
            doc = json.loads((out / part / "results.json").read_text())
            rendered[part] = RUNNERS[part][1](doc, part)
            walls[part] = (float(done["wall_time_s"]), True)
        except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable or another schema
            log(f"[report] {part}: an earlier run's results could not be included ({e!r})")
            continue
        log(f"[report] {part}: finished by an earlier run, included")
    ordered = [p for p in PARTS if p in rendered]
    sections = [rendered[p] for p in ordered]
    walls = {p: walls[p] for p in ordered}
    env = environment.environment()
    rows = "\n".join(
        f"| {p} | {w:.1f} s{' (from an earlier run)' if s else ''} |" for p, (w, s) in walls.items()
    )
    header = (
        f"# optax-decoupled report ({scale} scale)\n\n"
        f"optax-decoupled {env['optax_decoupled']}, JAX {env['jax']} (jaxlib {env['jaxlib']}), "
        f"Optax {env['optax']}, Python {env['python']}; device: {env['device_kind']} "
        f"({env['backend']}, {len(env['devices'])} device(s)), {env['cpu_count']} CPU cores, "
        f"generated {env['date']}.\n\n"
        "Every number and figure below was measured by this run (or, where marked, by an "
        "earlier run of the same scale that this one resumed or included; its environment is "
        "in its `results.json`). Machine-readable results: `<part>/results.json`.\n\n"
        f"| part | wall time |\n|---|---|\n{rows}\n"
        f"| total (this invocation) | {time.perf_counter() - t0:.1f} s |\n"
    )
    report = out / "report.md"
    report.write_text(header + "\n" + "\n".join(sections))
    write_json(out / "environment.json", env)
    return report
