"""The command line as a user starts it: the ``optax-decoupled`` console script and
``python -m optax_decoupled.cli`` (the experiments end to end: test_experiments_end_to_end.py)."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import optax_decoupled
from optax_decoupled.cli import SUBCOMMANDS


def run(args):
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _console_script():
    script = shutil.which("optax-decoupled", path=str(pathlib.Path(sys.executable).parent))
    if script is None:
        pytest.skip("the optax-decoupled console script is not installed in this environment")
    return script


@pytest.mark.parametrize("command", ["console script", "python -m"])
def test_help_lists_every_subcommand(command):
    if command == "console script":
        argv = [_console_script()]
    else:
        argv = [sys.executable, "-m", "optax_decoupled.cli"]
    out = run([*argv, "--help"])
    for name, _module, _description in SUBCOMMANDS:
        assert name in out


def test_version():
    assert optax_decoupled.__version__ in run([_console_script(), "--version"])
