"""The benchmark scripts at toy size: they run, and what they record is consistent.

``benchmarks/`` is not a package; a script is loaded from its file (with ``benchmarks/`` on
``sys.path`` for its ``import _common``) or run as a process. Speed itself is measured by the
benchmarks and written up in ``docs/``, never asserted here.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@contextlib.contextmanager
def _benchmarks_on_path():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield
    finally:
        sys.path.remove(str(BENCHMARKS))


def _load(name: str):
    """The benchmark ``benchmarks/{name}.py`` as a module."""
    with _benchmarks_on_path():
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


@pytest.fixture(scope="module")
def state_memory():
    with _benchmarks_on_path():  # the script imports _common when it runs, too
        yield _load("state_memory")


def test_there_are_scripts():
    assert {"state_memory.py", "step_overhead.py", "update_step.py"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_script_has_a_help(script):
    """Each script imports (with the core and its own optional dependencies) and parses its
    options: ``--help`` exits 0 with a usage line."""
    proc = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


def test_state_memory_times_each_dtype_against_float32(state_memory):
    out = state_memory.bench((8, 1024), repeats=2, block=3)
    assert out["num_params"] == 8 * 1024 and out["leaves"] == 1
    for sd in state_memory.STATE_DTYPES:
        r = out[sd]
        assert r["step_ms"] > 0 and r["compile_s"] > 0 and r["temp_bytes"] >= 0
        if sd == "float32":
            continue
        assert r["time_ratio"] == pytest.approx(r["step_ms"] / r["float32_step_ms"])
        assert 0.25 < r["state_ratio"] < 0.6  # int8 about 0.254, bfloat16 0.5
    assert (
        out["int8"]["state_bytes"] < out["bfloat16"]["state_bytes"] < out["float32"]["state_bytes"]
    )
    with pytest.raises(ValueError, match="block"):
        state_memory.bench((8, 1024), repeats=1, block=1)


@pytest.mark.parametrize("optimizer, moments", [("adamw", 2), ("amsgrad", 3), ("lion", 1)])
@pytest.mark.parametrize("kind", ["update", "train"])
def test_state_memory_steps_hold_the_optimizers_moments(state_memory, optimizer, moments, kind):
    """Every program runs the optimizer asked for; its float32 state holds that optimizer's
    moments and the 8-bit state about a quarter of it."""
    out = state_memory.bench(
        (8, 1024), dtypes=("int8",), kind=kind, optimizer=optimizer, repeats=1, block=2
    )
    assert out["optimizer"] == optimizer and out["step"] == kind
    f32 = out["float32"]["state_bytes"]
    assert moments * 4 * 8 * 1024 <= f32 < (moments + 1) * 4 * 8 * 1024
    assert out["int8"]["state_ratio"] < 0.27
    with pytest.raises(ValueError, match="optimizer"):
        state_memory.make_step("int8", kind, optimizer="sgd")
    with pytest.raises(ValueError, match="kind"):
        state_memory.make_step("int8", "eval", optimizer=optimizer)


def test_state_memory_splits_the_parameters_into_leaves(state_memory):
    out = state_memory.bench((8, 1024), leaves=3, dtypes=("int8",), repeats=1, block=2)
    assert out["leaves"] == 3 and out["num_params"] == 3 * 8 * 1024
    assert out["int8"]["state_bytes"] < out["float32"]["state_bytes"] / 3
    assert "| adamw | update | 24,576 (3 leaves) |" in state_memory.markdown([out])


def test_state_memory_main_writes_its_results(state_memory, tmp_path, capsys):
    out_json = tmp_path / "state_memory.json"
    args = ["--sizes", "8192", "--optimizers", "adamw", "--steps", "update", "--dtypes", "int8"]
    results = state_memory.main([*args, "--repeats", "1", "--block", "2", "--out", str(out_json)])
    doc = json.loads(out_json.read_text())
    assert len(results) == len(doc["results"]) == 1
    assert doc["results"][0]["int8"]["state_bytes"] == results[0]["int8"]["state_bytes"]
    assert "| adamw | update | 8,192 |" in capsys.readouterr().out
    for bad, message in ((["--block", "1"], "--block must be at least 2"),
                         (["--leaves", "0"], "--leaves must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit):
            state_memory.main([*args, *bad, "--out", str(out_json)])
        assert message in capsys.readouterr().err


def test_step_overhead_at_toy_size(tmp_path):
    with _benchmarks_on_path():
        rows = _load("step_overhead").main(
            ["--sizes", "4096", "--leaves", "1", "5", "--loop-steps", "2", "--repeats", "1",
             "--out", str(tmp_path / "step_overhead.json")]
        )  # fmt: skip
    assert rows and json.loads((tmp_path / "step_overhead.json").read_text())["rows"] == rows


#: A toy-size run of each script that has one: its arguments, its output file option.
TOY_RUNS = {
    "compile_time": (["--leaves", "3", "--params", "1e4", "--repeats", "1"], "--out"),
    "excess_precision": (["--steps", "1"], "--json"),
    "update_step": (
        ["--sizes", "1e4", "--leaves", "1", "3", "--no-torch", "--repeats", "1"],
        "--out",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(TOY_RUNS))
def test_script_runs_at_toy_size(name, tmp_path):
    args, out_option = TOY_RUNS[name]
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args, out_option, str(out)],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()), "an empty results file"
