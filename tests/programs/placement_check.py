"""Run in its own process with 4 simulated CPU devices (see tests/test_sharding.py).

Where state and computation go when the parameters are not on the default device:

* ``sharding.jit_init`` puts NumPy (and uncommitted) parameters' moments where ``jit`` puts
  those parameters: on the committed parameters' device, or on ``jax.default_device``'s;
* an eager 8-bit update of parameters committed to another device, also with
  ``optax.inject_hyperparams`` (whose hyperparameters are uncommitted, on the default
  device), stays on that device and equals the update on the default device.

Prints one JSON object {check: [problems]}.
"""

import json
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_decoupled as od  # noqa: E402
from optax_decoupled.contrib import jit_init  # noqa: E402


def devices_of(tree):
    return sorted({d.id for x in jax.tree.leaves(tree) for d in x.devices()})


def jit_init_placement(problems):
    dev = jax.devices()
    tx = od.adamw(1e-3, weight_decay=0.1)
    # A parameter committed to device 1 next to a NumPy one: jit puts both on device 1.
    params = {"a": jax.device_put(jnp.ones((8, 8)), dev[1]), "b": np.ones((8,), np.float32)}
    try:
        state = jit_init(tx, params)
        if devices_of(state) != [1]:
            problems.append(f"committed to 1 + NumPy: state on {devices_of(state)}")
        updates, _ = jax.jit(tx.update)(params, state, params)
        if devices_of(updates) != [1]:
            problems.append(f"committed to 1 + NumPy: updates on {devices_of(updates)}")
    except ValueError as e:
        problems.append(f"committed to 1 + NumPy: {str(e).splitlines()[0]}")
    # Only NumPy parameters, under jax.default_device(device 2): like eager tx.init.
    numpy_params = {"a": np.ones((8, 8), np.float32), "b": np.ones((8,), np.float32)}
    with jax.default_device(dev[2]):
        eager, jitted = tx.init(numpy_params), jit_init(tx, numpy_params)
    if devices_of(jitted) != devices_of(eager) or devices_of(jitted) != [2]:
        problems.append(
            f"default device 2: jit_init {devices_of(jitted)}, eager {devices_of(eager)}"
        )


def eager_int8_off_the_default_device(problems):
    tx = optax.inject_hyperparams(od.adamw)(
        learning_rate=1e-3, state_dtype=od.BlockwiseInt8Storage(min_size=0)
    )
    w = jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128)
    results = {}
    for device in jax.devices()[:2]:
        params = jax.device_put({"w": w}, device)
        grads = jax.device_put({"w": jnp.cos(5.0 * w)}, device)
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        updates, state = tx.update(grads, state, params)
        # The update and the moments (leaves with the parameters' layout; scalar counts
        # may stay on the default device).
        per_param = [x for x in jax.tree.leaves((updates, state.inner_state)) if x.ndim]
        if devices_of(per_param) != [device.id]:
            where = devices_of(per_param)
            problems.append(f"parameters on device {device.id}: update and moments on {where}")
        results[device.id] = jax.device_get((updates, state))
    if not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True)
    ):
        problems.append("the update on device 1 differs from the one on device 0")


if __name__ == "__main__":
    assert jax.device_count() == 4
    results = {}
    for check in (jit_init_placement, eager_int8_off_the_default_device):
        results[check.__name__] = []
        check(results[check.__name__])
    print(json.dumps(results))
