"""The benchmarks' timing protocols (what is timed and how often), not their timings.

``benchmarks/`` is not a package; the module is loaded from its file. Speed itself is
measured by the benchmarks and written up in ``docs/``, never asserted here.
"""

import importlib.util
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def state_memory():
    sys.path.insert(0, str(BENCHMARKS))  # for its `import _common`
    try:
        spec = importlib.util.spec_from_file_location(
            "state_memory_bench", BENCHMARKS / "state_memory.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


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
    import os
    import shutil

    from optax_decoupled import cpu_kernel

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the encoders with")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "encoder_speed_bench", BENCHMARKS / "encoder_speed.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        results = module.main(["--repeats", "1"])
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert [r["map"] for r in results] == ["signed", "unsigned"]
    for r in results:
        assert r["same_codes"] is True
        if cpu_kernel.available():  # the kernel's own choice, from the same CPU checks
            assert ("avx512_ns" in r) == cpu_kernel.uses_avx512()
            assert ("vbmi_ns" in r) == cpu_kernel.uses_avx512_vbmi()
