"""The benchmarks' timing protocols (what is timed and how often), not their timings.

``benchmarks/`` is not a package; the module is loaded from its file. Speed itself is
measured by the benchmarks and written up in ``docs/``, never asserted here.
"""

import contextlib
import importlib.util
import json
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def _benchmarks_on_path():
    """``benchmarks/`` on ``sys.path`` (for the scripts' ``import _common``)."""
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
    with _benchmarks_on_path():  # state_memory imports _common when it runs, too
        yield _load("state_memory")


def _needs_compiler():
    """Skips (named) where there is no C++ compiler, which the kernel needs too."""
    import os
    import shutil

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the kernel's harness with")


@pytest.mark.parametrize(
    "rotation, block, timed_per_turn",
    [("blocks", 3, 2), ("blocks", 2, 1), ("pairs", 5, 1), ("all", 5, 1)],
)
def test_state_memory_times_each_program_in_blocks(state_memory, rotation, block, timed_per_turn):
    repeats, dtypes = 2, ("float32", "bfloat16", "int8")
    out = state_memory.bench_size((8, 1024), repeats, rotation, dtypes, "update", block)
    assert out["block"] == (block if rotation == "blocks" else 1)
    per_dtype = repeats * timed_per_turn
    # float32 is timed in every turn: once per other dtype (blocks, pairs), or once (all).
    turns = 1 if rotation == "all" else len(dtypes) - 1
    assert out["timed_steps"] == per_dtype * turns
    for sd in dtypes[1:]:
        r = out[sd]
        assert r["time_ratio"] == pytest.approx(r["step_ms_median"] / r["float32_step_ms_median"])
        assert 0.25 < r["state_ratio"] < 0.6  # int8 about 0.254, bfloat16 0.5
        assert r["step_ms_min"] <= r["step_ms_median"]


@pytest.mark.parametrize("kind", ["update", "train"])
def test_state_memory_wraps_the_transform_in_apply_if_finite(state_memory, kind):
    """``--wrap apply_if_finite``: every program's transform is Optax's guard around AdamW
    (its state says so), and the run is timed and recorded like any other."""
    import jax.numpy as jnp
    import optax

    tx, _ = state_memory.make_step("int8", kind, "apply_if_finite")
    assert isinstance(tx.init({"w": jnp.zeros((8, 1024))}), optax.ApplyIfFiniteState)
    out = state_memory.bench_size(
        (8, 1024), 1, "blocks", ("float32", "int8"), kind, 2, "apply_if_finite"
    )
    assert out["wrap"] == "apply_if_finite" and out["timed_steps"] == 1
    assert out["int8"]["step_ms_median"] > 0
    with pytest.raises(ValueError, match="wrap"):
        state_memory.make_step("int8", kind, "apply_if_nan")


@pytest.mark.parametrize("kind", ["update", "train"])
def test_state_memory_splits_the_parameters_into_leaves(state_memory, kind, capsys):
    """``--leaves K``: K matrices of the given shape, timed and recorded as one tree."""
    out = state_memory.bench_size(
        (8, 1024), 1, "blocks", ("float32", "int8"), kind, 2, "none", leaves=3
    )
    assert out["leaves"] == 3 and out["num_params"] == 3 * 8 * 1024
    assert out["int8"]["state_bytes"] < out["float32"]["state_bytes"] / 3
    assert "| 24,576 | 3 x (8, 1024) |" in state_memory.markdown([out])
    with pytest.raises(SystemExit):
        state_memory.main(["--leaves", "0", "--sizes", "1e3"])
    assert "--leaves must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("optimizer", ["amsgrad", "lion"])
def test_state_memory_times_other_optimizers(state_memory, optimizer):
    """``--optimizer``: every program runs that optimizer, its float32 anchor included; the
    8-bit state holds its moments (AMSGrad three, Lion one) at about a quarter of float32's."""
    import jax.numpy as jnp

    from optax_decoupled._src import memory

    out = state_memory.bench_size(
        (8, 1024), 1, "blocks", ("float32", "int8"), "update", 2, optimizer=optimizer
    )
    assert out["optimizer"] == optimizer
    params = {"w": jnp.zeros((8, 1024), jnp.float32)}
    for sd in ("float32", "int8"):
        tx, _ = state_memory.make_step(sd, optimizer=optimizer)
        assert out[sd]["state_bytes"] == memory.state_bytes(tx.init(params), params).total
    moments = {"amsgrad": 3, "lion": 1}[optimizer]
    assert out["float32"]["state_bytes"] >= moments * 4 * 8 * 1024
    assert out["float32"]["state_bytes"] < (moments + 1) * 4 * 8 * 1024
    assert out["int8"]["state_ratio"] < 0.27
    with pytest.raises(ValueError, match="optimizer"):
        state_memory.make_step("int8", optimizer="sgd")


def test_state_memory_limits_the_kernel_path(state_memory, tmp_path, monkeypatch, capsys):
    """``--decode P`` times the 8-bit kernel's path ``P`` (``cpu_kernel.DECODE``, read when the
    programs are traced) and records it."""
    from optax_decoupled import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "DECODE", "best")  # restored after the test
    out_json = tmp_path / "out.json"
    args = ["--sizes", "8192", "--dtypes", "int8", "--repeats", "1", "--block", "2"]
    state_memory.main([*args, "--decode", "portable", "--json", str(out_json)])
    assert cpu_kernel.DECODE == "portable"
    assert json.loads(out_json.read_text())["env"]["decode"] == "portable"
    assert "8-bit kernel limited to its portable path" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        state_memory.main([*args, "--decode", "sse"])
    assert "invalid choice: 'sse'" in capsys.readouterr().err


def test_state_memory_refuses_blocks_of_one_step(state_memory, capsys):
    with pytest.raises(ValueError, match="block"):
        state_memory.bench_size((8, 1024), 1, "blocks", ("float32", "int8"), "update", 1)
    with pytest.raises(SystemExit):
        state_memory.main(["--block", "1", "--sizes", "1e3"])
    assert "--block must be at least 2" in capsys.readouterr().err


def test_encoder_speed_runs_every_encoder_the_cpu_has():
    """`benchmarks/encoder_speed.py` builds the kernel's encoders with the package's flags and
    times each one the CPU can run; it exits with an error if their codes differ (here at one
    pass over the inputs). Skipped without a C++ compiler, which the kernel needs too."""
    from optax_decoupled import cpu_kernel

    _needs_compiler()
    with _benchmarks_on_path():
        results = _load("encoder_speed").main(["--repeats", "1"])
    assert [r["map"] for r in results] == ["signed", "unsigned"]
    for r in results:
        assert r["same_codes"] is True
        if cpu_kernel.available():  # the kernel's own choice, from the same CPU checks
            assert ("avx512_ns" in r) == cpu_kernel.uses_avx512()
            assert ("vbmi_ns" in r) == cpu_kernel.uses_avx512_vbmi()


@pytest.mark.parametrize("path", ["vbmi", "avx512f", "avx2"])
def test_kernel_pipeline_times_both_ways_of_the_output(path, capsys):
    """`benchmarks/kernel_pipeline.py` builds the kernel's block functions with the package's
    flags and runs AdamW's per-block work on one of the kernel's paths both ways (Adam's
    output as a pass of its own, and inside the moments' passes) for 3 steps; it exits with
    an error if their codes, scales or outputs differ. Where the CPU cannot run the path it
    says so and times nothing. Skipped without a C++ compiler, which the kernel needs too."""
    from optax_decoupled import cpu_kernel

    _needs_compiler()
    module = _load("kernel_pipeline")
    with _benchmarks_on_path():
        result = module.main(["--path", path, "--repeats", "3"])
    out = capsys.readouterr().out
    if cpu_kernel.available():  # the kernel's own paths, from the same CPU checks
        paths = cpu_kernel.decode_paths()
        runs = {"vbmi": cpu_kernel.uses_avx512_vbmi(), "avx512f": "avx512f" in paths,
                "avx2": "avx2" in paths}  # fmt: skip
        assert result["available"] == runs[path]
    assert result["path"] == path
    if result["available"]:
        assert result["same_results"] is True and result["steps"] == 3
        assert result["separate_ns"] > 0 and result["in_passes_ns"] > 0
        assert "| output as a pass of its own (ns/element) |" in out
    else:
        assert "the kernel's" in out and "path does not run" in out
    with pytest.raises(SystemExit):
        module.main(["--repeats", "0"])
