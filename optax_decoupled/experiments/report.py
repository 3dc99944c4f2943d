"""The main job: every experiment at one scale, and ``results/report.md`` with all figures.

``optax-decoupled report [--scale quick|full|smoke] [--out results]`` runs, in order:

=========  ==================================================================================
reddi      Reddi et al. counterexamples (:mod:`~optax_decoupled.experiments.reddi`)
compare    the tuned SSM comparison (:mod:`~optax_decoupled.experiments.compare`)
grid       lr × wd heatmaps (:mod:`~optax_decoupled.experiments.grid`)
memory     optimizer-state memory (:mod:`~optax_decoupled.experiments.memory_report`)
=========  ==================================================================================

Each part writes ``<out>/<part>/results.json`` and its PNG figures, then a completion marker
``<out>/<part>/complete.json`` (scale, wall time). A report that is interrupted and started
again skips the parts whose marker matches the scale (``--force`` reruns them), so finished
work is never lost. ``report.md`` records the package/JAX versions, the device and the wall
time of every part, and has a section for every part finished at the scale in ``<out>``,
including those of earlier invocations (``--parts grid``, then ``--parts memory``, build up
one report); each part's ``results.json`` keeps the environment it ran in.

``--config-chunk`` (``compare`` and ``grid``) sets how many configurations of a grid one device
trains at a time (:class:`~optax_decoupled.experiments.train.TrainConfig`'s ``config_chunk``):
``auto`` (default: one at a time on CPU, all at once on accelerators), ``none`` (all at once)
or an int. The ``full`` preset's widest grid needs about 23 GiB at once; ``--config-chunk 45``
divides that by about four on a smaller GPU. Results do not depend on it beyond float rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from optax_decoupled.experiments import xla_setup

SCALES = ("smoke", "quick", "full")
PARTS = ("reddi", "compare", "grid", "memory")
#: The parts that train grids of configurations and take ``config_chunk``.
GRID_PARTS = ("compare", "grid")


def environment() -> dict[str, Any]:
    """Versions, device and host, for the report's header and every results file."""
    import jax
    import jaxlib
    import optax

    import optax_decoupled

    devices = jax.devices()
    return {
        "optax_decoupled": optax_decoupled.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: pathlib.Path, doc: Any) -> None:
    """Writes JSON atomically (a temporary file renamed), so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.ndarray | np.generic):
        return obj.tolist()
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return str(obj)


# ---------------------------------------------------------------------------------------------
# The parts: each runs at a scale into a directory and returns (doc, markdown section).
# ---------------------------------------------------------------------------------------------


def _figure_links(doc: dict[str, Any], rel: str) -> str:
    """Markdown image links, relative to the report, of the figures a part wrote."""
    return "\n".join(f"![{f}]({rel}/{os.path.basename(f)})" for f in doc.get("figures", []))


def _run_reddi(scale: str, out: pathlib.Path, progress: bool) -> dict[str, Any]:
    from optax_decoupled.experiments import reddi

    config = reddi.Config.preset(scale)
    doc = reddi.run_experiment(config, str(out), progress=progress)
    doc.pop("_sim", None)  # the simulations themselves (not results: run_experiment's own JSON
    return doc  # leaves them out too)


def _section_reddi(doc: dict[str, Any], rel: str) -> str:
    from optax_decoupled.experiments import reddi

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
    from optax_decoupled.experiments import compare, plots

    cfg = dataclasses.replace(compare.CompareConfig.preset(scale), config_chunk=config_chunk)
    doc = compare.run_comparison(cfg, progress=progress)
    doc["figures"] = plots.comparison_figures(doc, out)
    return doc


def _section_compare(doc: dict[str, Any], rel: str) -> str:
    from optax_decoupled.experiments import compare

    figures = _figure_links(doc, rel)
    return (
        "## Coupled L2 vs AdamW vs AMSGrad vs Lion on the Flax SSM\n\n"
        f"{compare.protocol_text(doc)}\n\n{compare.summary_table(doc)}\n\n{figures}\n"
    )


def _run_grid(
    scale: str, out: pathlib.Path, progress: bool, config_chunk: int | str | None = "auto"
) -> dict[str, Any]:
    from optax_decoupled.experiments import grid, plots

    cfg = dataclasses.replace(grid.GridConfig.preset(scale), config_chunk=config_chunk)
    doc = grid.run_grid(cfg, progress=progress)
    doc["figures"] = plots.grid_figures(doc, out)
    return doc


def _section_grid(doc: dict[str, Any], rel: str) -> str:
    from optax_decoupled.experiments import grid

    figures = _figure_links(doc, rel)
    return (
        "## Learning rate × weight decay (Loshchilov & Hutter 2019, Fig. 2)\n\n"
        f"{grid.summary_table(doc)}\n\n{figures}\n"
    )


def _run_memory(scale: str, out: pathlib.Path, progress: bool) -> dict[str, Any]:
    from optax_decoupled.experiments import memory_report

    return memory_report.run(scale, out, progress=progress)


def _section_memory(doc: dict[str, Any], rel: str) -> str:
    from optax_decoupled.experiments import memory_report

    return memory_report.markdown(doc, rel)


RUNNERS: dict[str, tuple[Callable[..., dict], Callable[[dict, str], str]]] = {
    "reddi": (_run_reddi, _section_reddi),
    "compare": (_run_compare, _section_compare),
    "grid": (_run_grid, _section_grid),
    "memory": (_run_memory, _section_memory),
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
    doc = {**doc, "scale": scale, "environment": environment()}
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
    report. A part named twice runs once."""
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
    env = environment()
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


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------


def config_chunk_arg(text: str) -> int | str | None:
    """The ``--config-chunk`` option's value: ``auto``, ``none`` or an int >= 1."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or an int >= 1, got {text!r}")
    return value


def _add_config_chunk(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-chunk", type=config_chunk_arg, default="auto", metavar="{auto,none,N}",
        help="configurations of a grid one device trains at a time (auto: one on CPU, all on "
        "accelerators; none: all; N: at most N, to bound a GPU's memory)",
    )  # fmt: skip


def add_part_arguments(parser: argparse.ArgumentParser, part: str) -> argparse.ArgumentParser:
    """The options of a single-part subcommand (``compare``, ``grid``, ``memory``)."""
    parser.add_argument(
        "--scale", choices=SCALES, default="quick",
        help="quick (default), full or smoke, as for the report (OPTAX_DECOUPLED_SMOKE=1: smoke)",
    )  # fmt: skip
    parser.add_argument(
        "--out", default=f"results/{part}",
        help=f"output directory (default: results/{part}, the report's, which includes it)",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true",
        help="replace a finished run at another scale in --out (one at this scale is replaced "
        "anyway)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    if part in GRID_PARTS:
        _add_config_chunk(parser)
    return parser


def _cli_scale(command: str, args: argparse.Namespace) -> str:
    """``args.scale``, or ``"smoke"`` where ``OPTAX_DECOUPLED_SMOKE`` asks for it (said on
    stderr)."""
    from optax_decoupled.experiments.reddi import smoke_requested

    if not smoke_requested() or args.scale == "smoke":
        return args.scale
    print(
        f"optax-decoupled {command}: OPTAX_DECOUPLED_SMOKE is set: running the smoke scale "
        f"(ignoring --scale {args.scale})",
        file=sys.stderr,
    )
    return "smoke"


def run_part_cli(part: str, args: argparse.Namespace, summary: Callable[[dict], str]) -> int:
    """Runs one part afresh for a subcommand and prints its summary. A finished run at the
    same scale in ``--out`` is replaced; one at another scale (e.g. the report's) only with
    ``--force``."""
    scale = _cli_scale(part, args)
    xla_setup.configure_cpu()  # before any JAX work: fast loops, a CPU device per core
    try:
        doc, wall, _ = run_part(
            part, scale, args.out, force=args.force, rerun=True, progress=not args.no_progress,
            config_chunk=getattr(args, "config_chunk", "auto"),
        )  # fmt: skip
    except OutputConflict as e:
        print(f"optax-decoupled {part}: error: {e}", file=sys.stderr)
        return 2
    print(summary(doc))
    print(f"\n{wall:.1f} s; results in {args.out}")
    return 0


def part_subcommand(
    part: str, summary: Callable[[dict], str]
) -> tuple[Callable[[argparse.ArgumentParser], argparse.ArgumentParser], Callable[..., int]]:
    """``(add_arguments, run_cli)`` of the single-part subcommand ``part`` (what
    :mod:`optax_decoupled.cli` calls), printing ``summary(results)`` at the end."""

    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_part_arguments(parser, part)

    def run_cli(args: argparse.Namespace) -> int:
        return run_part_cli(part, args, summary)

    return add_arguments, run_cli


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--scale", choices=SCALES, default="quick",
        help="quick: 11-30 min on 2 CPU cores, by CPU (default); full: sized for one GPU; "
        "smoke: several minutes, for tests (also OPTAX_DECOUPLED_SMOKE=1)",
    )  # fmt: skip
    parser.add_argument("--out", default="results", help="output directory (default: results)")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run"
    )
    parser.add_argument("--force", action="store_true", help="rerun parts already completed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_config_chunk(parser)
    return parser


def run_cli(args: argparse.Namespace) -> int:
    scale = _cli_scale("report", args)
    try:
        path = run_report(
            args.out, scale=scale, parts=tuple(args.parts), force=args.force,
            progress=not args.no_progress, config_chunk=args.config_chunk,
        )  # fmt: skip
    except OutputConflict as e:
        print(f"optax-decoupled report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    parser = add_arguments(argparse.ArgumentParser(prog="optax-decoupled report"))
    sys.exit(run_cli(parser.parse_args()))
