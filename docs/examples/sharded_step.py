"""A data- and FSDP-parallel AdamW step whose optimizer state is sharded like the parameters.

Run it on any number of devices; on a CPU, simulate 8 with::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python docs/examples/sharded_step.py

It is shown in docs/devices.md and run by tests/test_docs_examples.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_decoupled as od
from optax_decoupled.contrib import jit_init, state_shardings

# One mesh axis used for both the batch (data parallel) and the weights' leading axis (FSDP).
n = jax.device_count()
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
fsdp = NamedSharding(mesh, P("fsdp"))  # split the leading axis over the devices
replicated = NamedSharding(mesh, P())  # a full copy on every device

d_in, d_hidden, batch = 16 * n, 32 * n, 8 * n  # leading axes divisible by the device count
k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {
    "dense1": {"kernel": jax.random.normal(k1, (d_in, d_hidden)) / d_in**0.5,
               "bias": jnp.zeros((d_hidden,))},
    "norm": {"scale": jnp.ones((d_hidden,))},
    "dense2": {"kernel": jax.random.normal(k2, (d_hidden, 1)) / d_hidden**0.5,
               "bias": jnp.zeros((1,))},
}  # fmt: skip
# Matrices FSDP-sharded, vectors replicated.
param_shardings = jax.tree.map(lambda p: fsdp if p.ndim >= 2 else replicated, params)
params = jax.device_put(params, param_shardings)


def loss_fn(params, x, y):
    h = x @ params["dense1"]["kernel"] + params["dense1"]["bias"]
    h = jax.nn.gelu(h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6))
    h = h * params["norm"]["scale"]
    pred = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return jnp.mean((pred - y) ** 2)


schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=5, decay_steps=50)
tx = od.adamw(schedule, weight_decay=0.1, decay_convention="schedule", peak_learning_rate=1e-3)

# Every moment (mu, nu) is created on its parameter's sharding; step counts are replicated.
opt_state = jit_init(tx, params)


@jax.jit
def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


x = jax.device_put(jax.random.normal(k3, (batch, d_in)), fsdp)  # batch split over devices
y = jax.device_put(jnp.sum(x[:, :4], axis=1, keepdims=True), fsdp)
losses = []
for _ in range(20):
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss))

# After the jitted steps, each moment still has its parameter's sharding.
expected = state_shardings(tx, params)
for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected), strict=True):
    assert got.sharding.is_equivalent_to(want, got.ndim), (got.shape, got.sharding, want)
adam_state = opt_state[0]
assert adam_state.mu["dense1"]["kernel"].sharding.is_equivalent_to(fsdp, 2)
assert losses[-1] < losses[0], losses
print(f"{n} devices; mu of dense1/kernel: {adam_state.mu['dense1']['kernel'].sharding.spec}; "
      f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")  # fmt: skip
