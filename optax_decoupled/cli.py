"""The ``optax-decoupled`` command: one subcommand per experiment, plus ``report``.

Each experiment module in :mod:`optax_decoupled.experiments` exposes
``add_arguments(parser)`` and ``run_cli(args) -> int``; this file only wires them up, so the
command line has no logic of its own. Experiment modules are imported when their subcommand
runs, so ``optax-decoupled --help`` loads only the core package (JAX and Optax, a few
seconds), not Flax or matplotlib, and the core package never imports the experiments.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

#: (subcommand, module, one-line description)
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


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``selected``'s module is imported to add its options."""
    parser = argparse.ArgumentParser(
        prog="optax-decoupled",
        description="Coupled L2 vs decoupled weight decay, AMSGrad and Lion: the experiments.",
    )
    from optax_decoupled import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    #: each subcommand's parser (argparse's own map), to report its own usage errors
    parser.subcommand_parsers = sub.choices
    for name, module, description in SUBCOMMANDS:
        p = sub.add_parser(name, help=description, description=description)
        p.set_defaults(_module=module)
        if name == selected:
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise SystemExit(
            f"optax-decoupled: {module} needs the experiments extra "
            f"(in the checkout: pip install -e '.[experiments]'): {e}"
        ) from e


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {name for name, _, _ in SUBCOMMANDS}
    selected = next((a for a in argv if a in names), None)
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
        return int(_load(args._module).run_cli(args) or 0)
    except OSError as e:  # e.g. an output directory that cannot be created: say so, briefly
        print(f"optax-decoupled {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
