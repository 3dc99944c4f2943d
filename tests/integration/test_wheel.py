"""The built wheel, installed in a fresh virtual environment with the core dependencies only.

``pip wheel . --no-deps`` builds it (setuptools from the package index, in an isolated build
environment); the new venv gets jax, optax and chex at the versions of the running environment
(so pip reuses its cache), then the wheel. It needs the package index; set
``OPTAX_DECOUPLED_OFFLINE=1`` to skip it where there is none.
"""

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

import optax_decoupled
from optax_decoupled.cli import SUBCOMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE_DEPS = {"jax", "optax", "chex"}
#: The ``experiments`` extra, which a core install must not pull in.
EXTRAS = {"flax", "matplotlib", "tqdm", "scikit-learn", "orbax-checkpoint"}
#: Files a pure-Python wheel never holds: compiled extensions and their sources.
COMPILED = re.compile(r"\.(so|pyd|dylib|dll|c|cc|cpp|cxx|h|hpp)$")

ONE_STEP = """
import sys
import jax.numpy as jnp, optax
import optax_decoupled as od
params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
tx = od.adamw(1e-1, weight_decay=0.5)
state = tx.init(params)
grads = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
updates, state = tx.update(grads, state, params)
new = optax.apply_updates(params, updates)
assert float(new["w"][0, 0]) < 1.0 and float(new["b"][0]) == 1.0  # mask="auto": w decays only
int8 = od.adamw(1e-1, state_dtype="int8")
updates, _ = int8.update(grads, int8.init(params), params)
assert od.contrib.state_bytes(int8.init(params), params).total > 0
assert callable(od.diagnostics.effective_decay)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "matplotlib", "tqdm",
                                                             "sklearn", "orbax"))
assert not heavy, heavy
print(od.__version__, od.__file__)
"""


def run(args, *, timeout=300, **kwargs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env,
        **kwargs,
    )  # fmt: skip
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _pins() -> list[str]:
    """``name==version`` of the core dependencies as installed here (reuses pip's cache)."""
    pins = []
    for name in ("jax", "jaxlib", "optax", "chex", "numpy", "ml_dtypes", "scipy", "opt_einsum"):
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return pins


@pytest.mark.skipif(
    os.environ.get("OPTAX_DECOUPLED_OFFLINE") == "1",
    reason="needs the package index (OPTAX_DECOUPLED_OFFLINE=1)",
)
def test_wheel_is_pure_python_and_works_with_core_dependencies_only(tmp_path):
    wheels = tmp_path / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, ROOT],
        timeout=600,
    )
    (wheel,) = wheels.glob("optax_decoupled-*.whl")
    assert wheel.name == f"optax_decoupled-{optax_decoupled.__version__}-py3-none-any.whl"

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Root-Is-Purelib: true" in info and "Tag: py3-none-any" in info, info
    assert not [n for n in names if COMPILED.search(n)]
    assert "optax_decoupled/py.typed" in names
    assert "optax_decoupled/_src/transforms.py" in names
    assert "optax_decoupled/contrib/__init__.py" in names
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
    run([python, "-m", "pip", "install", "-q", "-c", constraints, *sorted(CORE_DEPS)], timeout=900)
    run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], timeout=300)
    run([python, "-m", "pip", "check"])  # the core dependencies are all the wheel needs

    installed = {
        line.split("==")[0].lower().replace("_", "-")
        for line in run([python, "-m", "pip", "list", "--format=freeze"]).splitlines()
    }
    assert "optax-decoupled" in installed
    assert not installed & EXTRAS

    outside = tmp_path / "elsewhere"  # not the repository root, so the wheel is what imports
    outside.mkdir()
    version, where = run([python, "-c", ONE_STEP], cwd=outside).split()
    assert version == optax_decoupled.__version__
    assert str(venv) in where, where
    help_text = run([bindir / "optax-decoupled", "--help"], cwd=outside)
    for name, _module, _description in SUBCOMMANDS:
        assert name in help_text
    version = run([bindir / "optax-decoupled", "--version"], cwd=outside)
    assert optax_decoupled.__version__ in version
