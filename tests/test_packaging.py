"""Packaging: importing the package loads no experiment dependency, the public submodules
are attributes, the metadata is consistent and the CLI lists its subcommands.

The built wheel in a fresh virtual environment: ``tests/integration/test_wheel.py``.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import optax_decoupled
from optax_decoupled.cli import SUBCOMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Modules the core must never import (they belong to the ``experiments`` extra).
HEAVY = ("flax", "matplotlib", "tqdm", "sklearn", "orbax")

CHECK_IMPORTS = f"""
import sys
import optax_decoupled
heavy = {HEAVY!r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not loaded, f"importing optax_decoupled loaded {{loaded}}"
assert not any(m.startswith("optax_decoupled.experiments") for m in sys.modules)
# The public submodules are attributes after a plain import (the docstrings' `od.contrib...`).
for name, attr in [("contrib", "jit_init"), ("contrib", "state_bytes"), ("contrib", "packed"),
                   ("contrib", "quantize"), ("diagnostics", "effective_decay")]:
    assert callable(getattr(getattr(optax_decoupled, name), attr)), (name, attr)
# Nor does the command line's parser, whose help lists the subcommands.
from optax_decoupled import cli
cli.build_parser().format_help()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not loaded, f"the CLI's help loaded {{loaded}}"
assert not any(m.startswith("optax_decoupled.experiments") for m in sys.modules)
print(optax_decoupled.__version__)
"""


def run(args, *, timeout=300, **kwargs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env,
        **kwargs,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def test_build_requirements_can_read_the_license_expression():
    """``license = "Apache-2.0"`` (an SPDX expression, PEP 639) is an error to setuptools
    before 77, which an isolated build never meets (it takes the newest) but a build with
    ``--no-build-isolation`` does: the declared minimum must be one that reads the file."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license\s*=\s*"', text, re.M), "the license is no longer an expression"
    minimum = re.search(r'"setuptools>=(\d+)', text)
    assert minimum and int(minimum.group(1)) >= 77, minimum


def test_import_and_cli_help_load_no_experiment_dependencies():
    out = run([sys.executable, "-c", CHECK_IMPORTS])
    assert out.strip() == optax_decoupled.__version__


def test_version_is_pep440():
    # The wheel test checks that the built distribution carries this version.
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", optax_decoupled.__version__)


def test_py_typed_marker_and_license_and_changelog_exist():
    assert (ROOT / "optax_decoupled" / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert f"## [{optax_decoupled.__version__}]" in (ROOT / "CHANGELOG.md").read_text(
        encoding="utf-8"
    )


def test_cli_help_lists_every_subcommand_with_its_description(capsys):
    from optax_decoupled import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for name, _module, description in SUBCOMMANDS:
        assert re.search(rf"(^|\s){re.escape(name)}\s", help_text), name
        assert " ".join(description.split()) in help_text, description


@pytest.mark.parametrize("name", [n for n, _, _ in SUBCOMMANDS])
def test_every_subcommand_has_its_help(name, capsys):
    """``optax-decoupled <name> --help`` prints that subcommand's usage and exits 0."""
    from optax_decoupled import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: optax-decoupled {name}" in capsys.readouterr().out


def test_cli_without_a_command_is_a_usage_error(capsys):
    """``optax-decoupled`` alone ran nothing and exited 0, so a script that forgot the
    subcommand "succeeded"; like argparse's own usage errors it now exits 2, help on stderr."""
    from optax_decoupled import cli

    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: optax-decoupled" in captured.err and "choose a COMMAND" in captured.err


def test_cli_unknown_option_is_named_by_its_subcommand(capsys):
    """An option the subcommand does not have is a usage error of that subcommand: its own
    usage line and name, not the top-level one's."""
    from optax_decoupled import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["memory", "--config-chunk", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: optax-decoupled memory" in err
    assert "optax-decoupled memory: error: unrecognized arguments: --config-chunk 2" in err
    # Before the subcommand, an option is the top-level parser's.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--bogus", "memory"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "optax-decoupled: error: unrecognized arguments: --bogus" in err
    assert "optax-decoupled memory:" not in err
