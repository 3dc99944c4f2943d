"""Sharded optimizer state on 8 simulated CPU devices.

The device count is fixed when JAX starts, so each check runs in a process of its own
(``tests/programs/``) with ``--xla_force_host_platform_device_count=8``.
"""

import json
import os
import pathlib
import subprocess
import sys

PROGRAMS = pathlib.Path(__file__).parent / "programs"


def run_program(name, *args, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / name), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


STATE_DTYPES = ["None", "bfloat16", "int8"]


def test_every_state_leaf_has_its_parameters_sharding():
    results = run_program("sharding_check.py", *STATE_DTYPES)
    # (explicit, auto) meshes x aliases x dtypes, int8 included on both kinds of mesh,
    # parameters on one device next to sharded ones, and decay masks given as pytrees
    assert len(results) == 2 * 4 * len(STATE_DTYPES) + 2
    failures = {case: problems for case, problems in results.items() if problems}
    assert not failures, failures


def test_state_and_kernel_follow_parameters_off_the_default_device():
    results = run_program("placement_check.py")
    available = results.pop("kernel_available")
    assert available or os.environ.get("OPTAX_DECOUPLED_NO_KERNEL") == "1"
    failures = {check: problems for check, problems in results.items() if problems}
    assert not failures, failures
