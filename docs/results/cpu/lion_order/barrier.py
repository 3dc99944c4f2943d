"""Does `lax.optimization_barrier` stop XLA:CPU copying Lion's old momentum? (twenty-fourth
session, docs/memory_log.md)

Float32 Lion's output reads the old momentum, which the same step overwrites in place, and
XLA:CPU copies it first (memory.md, *AMSGrad and Lion*). Here the momentum's update is made
to wait for the sign through an optimization barrier, the sign kept as bfloat16 (exact for
-1, -0, 0, 1 and NaN). The script prints the `copy` instructions of each compiled step and
times the steps in turns (blocks of 5, the first of each not counted).

    python docs/results/cpu/lion_order/barrier.py 1e7
"""

import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from step_loop import donated_update_step  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10**7
LR, B1, B2 = 1e-4, 0.9, 0.99
SHAPE = (N // 1000, 1000)


def optax_step(tx):
    return donated_update_step(tx), tx.init


def barrier_step(sign_dtype):
    def step(p, m, g):
        sign = jnp.sign(B1 * m + (1 - B1) * g).astype(sign_dtype)
        m, sign = jax.lax.optimization_barrier((m, sign))
        return p - LR * sign.astype(p.dtype), B2 * m + (1 - B2) * g

    return jax.jit(step, donate_argnums=(0, 1)), jnp.zeros_like


steps = {
    "od.lion": optax_step(od.lion(LR, weight_decay=0.0, mask=None)),
    "optax.lion": optax_step(optax.lion(LR, weight_decay=0.0)),
    "barrier, bf16 sign": barrier_step(jnp.bfloat16),
    "barrier, f32 sign": barrier_step(jnp.float32),
}
g = jax.random.normal(jax.random.PRNGKey(0), SHAPE)
carry = {}
for name, (fn, init) in steps.items():
    p = jax.random.normal(jax.random.PRNGKey(1), SHAPE)
    carry[name] = (p, init(p))
    hlo = fn.lower(p, carry[name][1], g).compile().as_text()
    print(f"{name}: {sum(' copy(' in line for line in hlo.splitlines())} copy instruction(s)")
times = {name: [] for name in steps}
for _ in range(8):
    for name, (fn, _init) in steps.items():
        p, s = carry[name]
        for i in range(5):
            t0 = time.perf_counter()
            p, s = fn(p, s, g)
            jax.block_until_ready(p)
            if i:
                times[name].append(time.perf_counter() - t0)
        carry[name] = (p, s)
for name, t in times.items():
    print(f"{name:20s} median {1e3 * np.median(t):6.2f} ms, min {1e3 * np.min(t):6.2f} ms")
