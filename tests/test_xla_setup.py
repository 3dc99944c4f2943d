"""The experiments' XLA flag helpers (``optax_decoupled.experiments.xla_setup``), checked in
fresh processes because XLA reads its flags once, when the first backend starts."""

import json
import os
import subprocess
import sys

import jax
import pytest

from optax_decoupled.experiments import xla_setup

PROBE = """
import json, os
from optax_decoupled.experiments import xla_setup
added = xla_setup.configure_cpu(devices={devices})
import jax
print(json.dumps({{"added": added, "devices": len(jax.devices("cpu")),
                  "flags": os.environ.get("XLA_FLAGS", "")}}))
"""


def probe(devices, xla_flags=""):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(devices=devices)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_configure_cpu_exposes_the_requested_devices():
    out = probe(3)
    assert out["devices"] == 3
    assert xla_setup.FAST_LOOPS_FLAG in out["added"]
    assert xla_setup.cpu_devices_flag(3) in out["flags"]


def test_a_users_own_flags_win():
    out = probe(3, xla_flags=xla_setup.cpu_devices_flag(2))
    assert out["devices"] == 2
    assert xla_setup.cpu_devices_flag(3) not in out["flags"]


def test_one_device_adds_no_device_flag():
    out = probe(1)
    assert out["devices"] == 1 and out["added"] == [xla_setup.FAST_LOOPS_FLAG]


def test_no_effect_once_jax_runs(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.numpy.zeros(1).block_until_ready()  # a backend is running in this process
    assert xla_setup.configure_cpu() == []
    assert os.environ["XLA_FLAGS"] == ""


def test_bad_device_count():
    with pytest.raises(ValueError, match="devices"):
        xla_setup.configure_cpu(devices=-1)
