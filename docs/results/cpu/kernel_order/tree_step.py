"""The AdamW update step of a tree of LEAVES matrices of N parameters each (the gradient an
argument; parameters and state donated) in a loop of its own: the compiled program's
temporaries (XLA's memory analysis) and the median and 10th percentile of STEPS synchronised
steps. The eighteenth session's measurement of the kernel calls' order (docs/memory_log.md);
`tree_step_20x1e6.txt` holds its output for f3b25ea and for 2008e6a (PYTHONPATH pointing at
a checkout of it with its extension built), with and without
XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false.

    python tree_step.py {float32,int8,bfloat16} LEAVES N STEPS
"""

import pathlib
import sys

import jax

import optax_decoupled as od

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from step_loop import donated_update_step, time_steps  # noqa: E402

dtype, leaves = sys.argv[1], int(sys.argv[2])
n, steps = int(float(sys.argv[3])), int(sys.argv[4])
shape = (n // 1024, 1024)
state_dtype = None if dtype == "float32" else dtype
tx = od.adamw(1e-3, weight_decay=0.1, state_dtype=state_dtype, mask=None)
p = {f"w{i}": jax.random.normal(jax.random.key(i), shape) for i in range(leaves)}
g = {k: v * 1e-2 for k, v in p.items()}
s = tx.init(p)

step = donated_update_step(tx)
temp = step.lower(p, s, g).compile().memory_analysis().temp_size_in_bytes
median, p10 = time_steps(step, p, s, g, warmup=5, steps=steps)
mib = temp / 2**20
print(f"{dtype} leaves={leaves} N={n} temp {mib:.1f} MiB median {median:.3f} ms p10 {p10:.3f}")
