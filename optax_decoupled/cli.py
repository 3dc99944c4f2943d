"""The ``optax-decoupled`` command: one subcommand per experiment, plus ``report``.

This module owns the command line: the options of every subcommand and how they become calls
into :mod:`optax_decoupled.experiments`, which never import it. An experiment module is
imported by name when its subcommand is chosen, so ``optax-decoupled --help`` loads only the
core package (JAX and Optax), not Flax or matplotlib.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from optax_decoupled import __version__

#: (subcommand, the experiment module behind it, one-line description)
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    (
        "report",
        "optax_decoupled.experiments.report",
        "the main job: Reddi + SSM comparison + lr x wd grids + memory -> results/report.md",
    ),
    (
        "reddi",
        "optax_decoupled.experiments.reddi",
        "Reddi et al. counterexamples: Adam ends at the worst point, AMSGrad does not",
    ),
    (
        "compare",
        "optax_decoupled.experiments.compare",
        "coupled L2 vs AdamW vs AMSGrad vs Lion on the Flax SSM (tuned, several seeds)",
    ),
    (
        "grid",
        "optax_decoupled.experiments.grid",
        "learning-rate x weight-decay heatmaps for adam_l2 and adamw (Loshchilov-Hutter Fig. 2)",
    ),
    (
        "memory",
        "optax_decoupled.experiments.memory_report",
        "optimizer-state bytes per parameter (fp32 / bf16 / int8) and compiled step memory",
    ),
)

_REDDI = "optax_decoupled.experiments.reddi"
_REPORT = "optax_decoupled.experiments.report"
_ENVIRONMENT = "optax_decoupled.experiments.environment"
_XLA_SETUP = "optax_decoupled.experiments.xla_setup"


def _load(module: str) -> ModuleType:
    """``module``, imported; a missing ``experiments`` extra is a one-line exit, not a trace."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(
            f"optax-decoupled: {module} needs the experiments extra "
            f"(in the checkout: pip install -e '.[experiments]'): {e}"
        ) from e


# ---------------------------------------------------------------------------------------------
# reddi
# ---------------------------------------------------------------------------------------------

#: The reddi options that set sizes (``--scale`` and ``--smoke`` set them all); ``None`` when
#: not given (also when given their default value, they conflict with a scale).
_REDDI_SIZE_OPTIONS = ("steps", "seeds", "phase_steps", "phase_grid", "eps_steps", "optimizers")


def add_reddi_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``optax-decoupled reddi`` options to ``parser`` and returns it."""
    d = _load(_REDDI).Config()
    parser.add_argument(
        "--steps", type=int, default=None, help="steps T of the comparisons (default 10⁶)"
    )
    parser.add_argument("--out", default="reddi_out", help="output directory (default reddi_out)")
    parser.add_argument(
        "--seeds", type=int, default=None, help=f"seeds per stochastic problem (default {d.seeds})"
    )
    parser.add_argument(
        "--phase-steps",
        type=int,
        default=None,
        help="steps per phase-diagram run (default min(steps, 10⁵))",
    )
    parser.add_argument(
        "--phase-grid",
        type=int,
        default=None,
        help=f"phase diagram of N×N (β1, β2) (default {d.phase_grid})",
    )
    parser.add_argument(
        "--eps-steps", type=int, default=None, help="steps per ε-sweep run (default: steps)"
    )
    parser.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated subset of {','.join(d.optimizers)} for the comparisons "
        "(default all)",
    )
    parser.add_argument(
        "--scale",
        choices=("smoke", "quick", "full"),
        default=None,
        help="the report's sizes instead of the options above: smoke (seconds), quick (the "
        "defaults) or full (10⁷ steps, 48×48 phase diagram, 8 seeds)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="seconds-sized run for a quick check, --scale smoke (also OPTAX_DECOUPLED_SMOKE=1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-fast-loops",
        action="store_true",
        help="leave XLA:CPU's small-while-loop limit alone (see reddi.enable_fast_cpu_loops)",
    )
    return parser


def reddi_config(args: argparse.Namespace) -> Any:
    """The ``reddi.Config`` for parsed arguments: ``--scale`` (``--smoke`` is ``--scale
    smoke``) or the size options, not both; ``OPTAX_DECOUPLED_SMOKE=1`` (CI) runs the smoke
    size whatever they say, with a note on stderr.

    Raises:
      ValueError: for a scale together with size options, or sizes ``reddi.Config`` refuses.
    """
    reddi = _load(_REDDI)
    scale = getattr(args, "scale", None)
    if getattr(args, "smoke", False):
        if scale not in (None, "smoke"):
            raise ValueError(f"--smoke is --scale smoke; drop it or --scale {scale}.")
        scale = "smoke"
    explicit = [
        "--" + name.replace("_", "-")
        for name in _REDDI_SIZE_OPTIONS
        if getattr(args, name, None) is not None
    ]
    if _load(_ENVIRONMENT).smoke_requested():
        if explicit or scale not in (None, "smoke"):
            print(
                "optax-decoupled reddi: OPTAX_DECOUPLED_SMOKE=1: running the smoke size "
                f"(ignoring {', '.join(explicit) or '--scale ' + str(scale)})",
                file=sys.stderr,
            )
        return reddi.Config.smoke()
    if scale is not None:
        if explicit:
            raise ValueError(
                f"--scale {scale} (or --smoke) sets every size; drop {', '.join(explicit)} "
                "or the scale."
            )
        return reddi.Config.preset(scale)
    sizes: dict[str, Any] = {
        n: getattr(args, n)
        for n in ("steps", "seeds", "phase_grid")
        if getattr(args, n, None) is not None
    }
    if getattr(args, "optimizers", None):
        sizes["optimizers"] = tuple(o.strip() for o in args.optimizers.split(",") if o.strip())
    return reddi.Config(**sizes, phase_steps=args.phase_steps, eps_steps=args.eps_steps)


def run_reddi(args: argparse.Namespace) -> int:
    """``optax-decoupled reddi``: runs the experiment, prints a summary; the exit status."""
    try:
        config = reddi_config(args)
    except ValueError as e:
        print(f"optax-decoupled reddi: {e}", file=sys.stderr)
        return 2
    reddi = _load(_REDDI)
    if not getattr(args, "no_fast_loops", False):
        reddi.enable_fast_cpu_loops()
    doc = reddi.run_experiment(config, args.out, progress=not getattr(args, "no_progress", False))
    print(reddi.summary_table(doc))
    single = doc["single_run"]
    print(
        f"\none adam run of {single['steps']:,} steps: {single['run_s']:.3f} s "
        f"(+{single['compile_s']:.2f} s compilation); all groups {doc['total_s']:.1f} s"
    )
    print(f"wrote {os.path.join(args.out, 'results.json')} and {len(doc['figures'])} figures")
    return 0


# ---------------------------------------------------------------------------------------------
# report, and its parts as subcommands of their own (compare, grid, memory)
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


def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``optax-decoupled report`` options to ``parser`` and returns it."""
    report = _load(_REPORT)
    parser.add_argument(
        "--scale", choices=report.SCALES, default="quick",
        help="quick: 9-10 min on 2 CPU cores (default); full: sized for one GPU; "
        "smoke: about 2 min, for tests (also OPTAX_DECOUPLED_SMOKE=1)",
    )  # fmt: skip
    parser.add_argument("--out", default="results", help="output directory (default: results)")
    parser.add_argument(
        "--parts", nargs="+", choices=report.PARTS, default=list(report.PARTS), help="parts to run"
    )
    parser.add_argument("--force", action="store_true", help="rerun parts already completed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_config_chunk(parser)
    return parser


def add_part_arguments(parser: argparse.ArgumentParser, part: str) -> argparse.ArgumentParser:
    """Adds the options of a single-part subcommand (``compare``, ``grid``, ``memory``)."""
    report = _load(_REPORT)
    parser.add_argument(
        "--scale", choices=report.SCALES, default="quick",
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
    if part in report.GRID_PARTS:
        _add_config_chunk(parser)
    return parser


def _scale(command: str, args: argparse.Namespace) -> str:
    """``args.scale``, or ``"smoke"`` where ``OPTAX_DECOUPLED_SMOKE`` asks for it (said on
    stderr)."""
    if not _load(_ENVIRONMENT).smoke_requested() or args.scale == "smoke":
        return args.scale
    print(
        f"optax-decoupled {command}: OPTAX_DECOUPLED_SMOKE is set: running the smoke scale "
        f"(ignoring --scale {args.scale})",
        file=sys.stderr,
    )
    return "smoke"


def run_report(args: argparse.Namespace) -> int:
    """``optax-decoupled report``: every part asked for, then ``report.md``; the exit status."""
    report = _load(_REPORT)
    scale = _scale("report", args)
    try:
        path = report.run_report(
            args.out, scale=scale, parts=tuple(args.parts), force=args.force,
            progress=not args.no_progress, config_chunk=args.config_chunk,
        )  # fmt: skip
    except report.OutputConflict as e:
        print(f"optax-decoupled report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def run_part(part: str, args: argparse.Namespace) -> int:
    """``optax-decoupled <part>``: runs the part afresh into ``--out`` and prints its summary.
    A finished run at the same scale there is replaced; one at another scale (e.g. the
    report's) only with ``--force``. Returns the exit status."""
    report = _load(_REPORT)
    scale = _scale(part, args)
    _load(_XLA_SETUP).configure_cpu()  # before any JAX work: fast loops, a CPU device per core
    try:
        doc, wall, _ = report.run_part(
            part, scale, args.out, force=args.force, rerun=True, progress=not args.no_progress,
            config_chunk=getattr(args, "config_chunk", "auto"),
        )  # fmt: skip
    except report.OutputConflict as e:
        print(f"optax-decoupled {part}: error: {e}", file=sys.stderr)
        return 2
    print(report.SUMMARIES[part](doc))
    print(f"\n{wall:.1f} s; results in {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------
# The command.
# ---------------------------------------------------------------------------------------------

#: subcommand -> (add its options to a parser, run it for parsed arguments -> exit status)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], Any], Callable[..., int]]] = {
    "report": (add_report_arguments, run_report),
    "reddi": (add_reddi_arguments, run_reddi),
    **{
        part: (functools.partial(add_part_arguments, part=part), functools.partial(run_part, part))
        for part in ("compare", "grid", "memory")
    },
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's options are added (which imports its
    experiment module), so the top-level help imports no experiment."""
    parser = argparse.ArgumentParser(
        prog="optax-decoupled",
        description="Coupled L2 vs decoupled weight decay, AMSGrad and Lion: the experiments.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    #: each subcommand's parser (argparse's own map), to report its own usage errors
    parser.subcommand_parsers = sub.choices
    for name, _module, description in SUBCOMMANDS:
        p = sub.add_parser(name, help=description, description=description)
        if name == selected:
            COMMANDS[name][0](p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``optax-decoupled`` with ``argv`` (default ``sys.argv[1:]``); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(selected)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the parser they were given to, with its usage (status 2)
        position = argv.index(args.command) if args.command in argv else len(argv)
        if any(u in argv[:position] for u in unknown):  # before the subcommand
            culprit = parser
        else:
            culprit = parser.subcommand_parsers.get(args.command, parser)
        culprit.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # a usage error, as argparse treats one: help on stderr, status 2
        parser.print_help(sys.stderr)
        print("\noptax-decoupled: error: choose a COMMAND (e.g. report)", file=sys.stderr)
        return 2
    try:
        return int(COMMANDS[args.command][1](args) or 0)
    except OSError as e:  # e.g. an output directory that cannot be created: say so, briefly
        print(f"optax-decoupled {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
