"""The 8-bit AdamW update step in a loop of its own, against float32: medians and 10th
percentiles of single synchronised steps (the update + apply_updates of benchmarks/
state_memory.py, parameters and state donated, the gradient an argument). The seventeenth
session's measurement of what the encoders cost (docs/memory_log.md).

    python loop.py {float32,int8} N STEPS

With `experiment.patch` beside this script applied to ad8037e and the kernel rebuilt,
OD_EXP_OUT=1 makes the kernel write the transform's output to a new buffer (instead of the
copy of the old codes) and OD_EXP_NOENC=1 skips both encoders (the codes are not updated):
a lower bound of the step without the cost of encoding, not a correct optimizer. The rounds
run float32, then the int8 variants, each in a process of its own (loops_*.txt).
"""

import pathlib
import sys

import jax

import optax_decoupled as od

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from step_loop import donated_update_step, time_steps  # noqa: E402

dtype, n, steps = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3])
shape = (n // 1024, 1024)
state_dtype = None if dtype == "float32" else dtype
tx = od.adamw(1e-3, weight_decay=0.1, state_dtype=state_dtype, mask=None)
p = jax.random.normal(jax.random.key(0), shape)
g = jax.random.normal(jax.random.key(1), shape) * 1e-2
s = tx.init(p)

step = donated_update_step(tx)
median, p10 = time_steps(step, p, s, g, warmup=20, steps=steps)
print(f"{dtype} N={n} median {median:.3f} ms p10 {p10:.3f} ms")
