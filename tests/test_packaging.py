"""Packaging: the core imports only jax/optax/chex, the CLI lists its subcommands, and the
built wheel installs and works in a fresh virtual environment with the core dependencies only.

The wheel test builds with ``pip wheel . --no-deps`` (setuptools and jax, for the XLA FFI
headers of the C++ CPU kernel, from PyPI in an isolated build environment) and installs into
a new venv with the versions of jax, jaxlib, optax, chex and numpy pinned to those of the
running environment, so it reuses pip's cache. It needs PyPI;
set ``OPTAX_DECOUPLED_OFFLINE=1`` to skip it where there is none.
"""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import optax_decoupled
from optax_decoupled.cli import SUBCOMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE_DEPS = {"jax", "optax", "chex"}
#: Modules the core must never import (they belong to the ``experiments`` extra).
HEAVY = ("flax", "matplotlib", "tqdm", "sklearn", "orbax")

CHECK_IMPORTS = f"""
import sys
import optax_decoupled
heavy = {HEAVY!r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
assert not loaded, f"importing optax_decoupled loaded {{loaded}}"
assert not any(m.startswith("optax_decoupled.experiments") for m in sys.modules)
# The public submodules are attributes after a plain import (the docstrings' `od.contrib...`
# and the README's `optax_decoupled.memory.state_bytes` raised AttributeError).
for name, attr in [("sharding", "jit_init"), ("memory", "state_bytes"),
                   ("diagnostics", "effective_decay"), ("cpu_kernel", "available"),
                   ("quantization", "quantize")]:
    assert callable(getattr(getattr(optax_decoupled, name), attr)), name
print(optax_decoupled.__version__)
"""

ONE_STEP = """
import jax.numpy as jnp, optax
import optax_decoupled as od
params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
tx = od.adamw(1e-1, weight_decay=0.5)
state = tx.init(params)
grads = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
updates, state = tx.update(grads, state, params)
new = optax.apply_updates(params, updates)
assert float(new["w"][0, 0]) < 1.0 and float(new["b"][0]) == 1.0  # mask="auto": w decays only
print("ok")
"""

KERNEL_STEP = """
import jax, jax.numpy as jnp, optax
import optax_decoupled as od
from optax_decoupled import cpu_kernel
assert cpu_kernel.available(), cpu_kernel.unavailable_reason()
params = {"w": jnp.ones((64, 128))}
tx = od.adamw(1e-2, weight_decay=0.1, state_dtype="int8")
state = tx.init(params)
step = jax.jit(lambda p, s: tx.update(jax.tree.map(jnp.sin, p), s, p))
assert cpu_kernel.TARGET in step.lower(params, state).as_text()
updates, state = step(params, state)
assert float(jnp.abs(updates["w"]).max()) > 0
print("kernel ok")
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


def test_import_loads_no_experiment_dependencies():
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


def _help_text() -> str:
    return run([sys.executable, "-m", "optax_decoupled.cli", "--help"])


def test_cli_help_lists_every_subcommand_with_its_description():
    help_text = " ".join(_help_text().split())  # argparse wraps long lines
    for name, _module, description in SUBCOMMANDS:
        assert re.search(rf"(^|\s){re.escape(name)}\s", help_text), name
        assert " ".join(description.split()) in help_text, description


@pytest.mark.parametrize("name, module", [(n, m) for n, m, _ in SUBCOMMANDS])
def test_every_experiment_module_runs_with_python_m(name, module):
    """``python -m <module> --help`` is the subcommand's help (compare, grid and memory printed
    nothing: their modules had no __main__ block)."""
    assert f"usage: optax-decoupled {name}" in run([sys.executable, "-m", module, "--help"])


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


def test_cli_help_does_not_import_experiments():
    code = (
        "import sys; from optax_decoupled import cli; cli.build_parser().format_help();"
        "assert not [m for m in sys.modules if m.startswith('optax_decoupled.experiments')"
        f" or m.split('.')[0] in {HEAVY!r}]"
    )
    run([sys.executable, "-c", code])


def test_console_script_help():
    script = shutil.which("optax-decoupled", path=str(pathlib.Path(sys.executable).parent))
    if script is None:
        pytest.skip("the optax-decoupled console script is not installed in this environment")
    out = run([script, "--help"])
    for name, _module, _description in SUBCOMMANDS:
        assert name in out


def _pins() -> list[str]:
    """``name==version`` of the core dependencies as installed here (reuses pip's cache)."""
    pins = []
    for name in ("jax", "jaxlib", "optax", "chex", "numpy", "ml_dtypes", "scipy", "opt_einsum"):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return pins


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("OPTAX_DECOUPLED_OFFLINE") == "1", reason="needs PyPI (OPTAX_DECOUPLED_OFFLINE)"
)
def test_wheel_installs_and_works_with_core_dependencies_only(tmp_path):
    wheels = tmp_path / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, ROOT],
        timeout=600,
    )
    (wheel,) = wheels.glob("optax_decoupled-*.whl")
    assert f"-{optax_decoupled.__version__}-" in wheel.name

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "optax_decoupled/py.typed" in names
    # The compiled CPU kernel (built with the machine's C++ compiler) is in the wheel, unless
    # the build was told to leave it out (pip passes the environment to setup.py).
    with_kernel = os.environ.get("OPTAX_DECOUPLED_NO_KERNEL") != "1"
    kernels = [n for n in names if re.fullmatch(r"optax_decoupled/_requantize_cpu\..*\.so", n)]
    assert bool(kernels) == with_kernel, kernels
    assert any(n.endswith("LICENSE") for n in names), "the wheel should carry the license"
    assert not [n for n in names if n.split("/")[0] in ("tests", "notebooks", "docs", "benchmarks")]
    assert any(n.endswith("entry_points.txt") for n in names)
    required = {
        re.split(r"[\s<>=!~;\[]", line.removeprefix("Requires-Dist:").strip())[0].lower()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert required == CORE_DEPS, required

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(_pins()) + "\n")
    run([python, "-m", "pip", "install", "-q", "-c", constraints, wheel], timeout=900)

    installed = {
        line.split("==")[0].lower().replace("_", "-")
        for line in run([python, "-m", "pip", "list", "--format=freeze"]).splitlines()
    }
    assert "optax-decoupled" in installed
    assert not installed & {"flax", "matplotlib", "tqdm", "scikit-learn", "orbax-checkpoint"}

    outside = tmp_path / "elsewhere"  # not the repository root, so the wheel is what imports
    outside.mkdir()
    assert run([python, "-c", CHECK_IMPORTS], cwd=outside).strip() == optax_decoupled.__version__
    assert run([python, "-c", ONE_STEP], cwd=outside).strip() == "ok"
    if with_kernel:
        assert run([python, "-c", KERNEL_STEP], cwd=outside).strip() == "kernel ok"
    where = run([python, "-c", "import optax_decoupled; print(optax_decoupled.__file__)"],
                cwd=outside)  # fmt: skip
    assert str(venv) in where, where
    help_text = run([bindir / "optax-decoupled", "--help"], cwd=outside)
    for name, _module, _description in SUBCOMMANDS:
        assert name in help_text
    version = run([bindir / "optax-decoupled", "--version"], cwd=outside)
    assert optax_decoupled.__version__ in version
