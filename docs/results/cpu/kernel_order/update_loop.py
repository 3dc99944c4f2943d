"""The AdamW update step (gradient an argument; parameters and state donated) in a loop of
its own: median and 10th percentile of STEPS synchronised steps, for LEAVES matrices of
N / LEAVES parameters. MODE "output" or "copy" makes the kernel write the transform's
output to a buffer of its own, or the copy of the old moments, at every size (by replacing
storage._output_in_kernel); "auto" (default) keeps the package's choice. The eighteenth
session's runs
(docs/memory.md): `loops_1e6_f3b25ea_vs_2008e6a.txt` (2008e6a's lines marked "before",
PYTHONPATH pointing at a checkout of it with its extension built; written by this script's
first version, whose "max=-" is "mode=auto") and `loops_large.txt`.

    python update_loop.py {float32,int8,bfloat16} N STEPS [LEAVES] [MODE]
"""

import pathlib
import sys

import jax

import optax_decoupled as od
from optax_decoupled import storage

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from step_loop import donated_update_step, time_steps  # noqa: E402

dtype, n, steps = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3])
leaves = int(sys.argv[4]) if len(sys.argv) > 4 else 1
mode = sys.argv[5] if len(sys.argv) > 5 else "auto"
if mode != "auto":
    storage._output_in_kernel = lambda stored, g: mode == "output"
shape = (n // leaves // 1024, 1024)
state_dtype = None if dtype == "float32" else dtype
tx = od.adamw(1e-3, weight_decay=0.1, state_dtype=state_dtype, mask=None)
p = {f"w{i}": jax.random.normal(jax.random.key(i), shape) for i in range(leaves)}
g = {k: v * 1e-2 for k, v in p.items()}
s = tx.init(p)

step = donated_update_step(tx)
median, p10 = time_steps(step, p, s, g, warmup=10, steps=steps)
print(f"{dtype} N={n} leaves={leaves} mode={mode} median {median:.3f} ms p10 {p10:.3f}")
