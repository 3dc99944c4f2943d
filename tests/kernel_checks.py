"""Shared by the tests of the compiled CPU kernels (``test_cpu_kernel.py`` for 8-bit state,
``test_cpu_kernel_bf16.py`` for bfloat16 state): the skip for builds without the kernel, and
what a compiled program copies, and the transforms' outputs the kernels are checked on
(with how a kernel call with an output is run)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_decoupled.moment_updates import AdamDirection, LionDirection

NO_KERNEL = os.environ.get("OPTAX_DECOUPLED_NO_KERNEL") == "1"
needs_kernel = pytest.mark.skipif(
    NO_KERNEL, reason="OPTAX_DECOUPLED_NO_KERNEL=1: package built without the CPU kernel"
)


def entry_copies(hlo_text: str, type_prefix: str) -> list[str]:
    """The `copy` instructions of the entry computation of a compiled HLO module whose
    result type starts with `type_prefix` (copies inside fusions are not buffers)."""
    entry = hlo_text[hlo_text.index("\nENTRY ") :]
    return [
        line.strip()
        for line in entry.splitlines()
        if " copy(" in line and line.split("=", 1)[-1].strip().startswith(type_prefix)
    ]


_BC1, _BC2 = np.float32(1 - 0.9**3), np.float32(1 - 0.999**3)
#: The outputs (``requantize_ema``/``ema_bf16``'s ``output=``), each with the name of the
#: moment update of the test files' ``UPDATES`` that it follows: Adam, with ``eps_root``,
#: the three AMSGrad conventions and Lion, with the bias corrections of step 3.
OUTPUTS = {
    "adam": ("adam", AdamDirection(_BC1, _BC2, 1e-8, 0.0)),
    "adam-eps-root": ("adam", AdamDirection(_BC1, _BC2, 1e-6, 1e-9)),
    "amsgrad-pytorch": ("amsgrad", AdamDirection(_BC1, _BC2, 1e-8, 0.0, "pytorch")),
    "amsgrad-optax": ("amsgrad-divided", AdamDirection(_BC1, _BC2, 1e-8, 0.0, "optax")),
    "amsgrad-paper": ("amsgrad", AdamDirection(_BC1, _BC2, 0.0, 0.0, "paper")),
    "lion": ("lion", LionDirection(0.9)),
}


def call_with_output(call, stored, g, donate):
    """``jax.jit(call)(stored, g)`` for a kernel call with ``output=``, the gradient donated
    (as a gradient computed in the step is) or not, then checked unchanged: ``(new, u)``."""
    g_before = np.array(g)
    got, u = jax.jit(call, donate_argnums=(1,) if donate else ())(stored, g)
    if not donate:
        np.testing.assert_array_equal(np.asarray(g), g_before)
    return got, u


def compiled_training_step(step, params, state):
    """``step(p, s, g)`` after the gradient ``g`` of ``sum(tanh(x @ p["w"]))`` for a fixed
    batch ``x`` of 8 rows, computed in the same program as a training step computes it,
    jitted with the parameters and the state donated: the compiled program."""
    x = jnp.linspace(-1.0, 1.0, 8 * params["w"].shape[0]).reshape(8, -1)

    def train_step(p, s):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(p)
        return step(p, s, g)

    return jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state).compile()
