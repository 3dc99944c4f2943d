"""The timing loop shared by the measurement scripts in the folders beside this file
(encoder_bound/loop.py, kernel_order/tree_step.py and kernel_order/update_loop.py; the step
alone by lion_order/barrier.py): an optimizer's update + apply_updates, jitted with the
parameters and the state donated, the gradient an argument, timed step by step in a loop of
its own."""

import time

import jax
import numpy as np
import optax


def donated_update_step(tx):
    """``step(params, state, grads)``: ``tx``'s update and ``apply_updates``, jitted with
    the parameters and the state donated."""

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step, donate_argnums=(0, 1))


def time_steps(step, p, s, g, *, warmup, steps):
    """Runs ``warmup`` steps, then times ``steps`` synchronised ones: (median, 10th
    percentile) in ms."""
    for _ in range(warmup):
        p, s = step(p, s, g)
    jax.block_until_ready(p)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        p, s = step(p, s, g)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - t)
    return 1e3 * np.median(times), 1e3 * np.percentile(times, 10)
