"""Does a jitted program that runs several optimizer steps round low-precision state between
them? (docs/devices.md, *On a GPU*.)

XLA's simplifier may rewrite ``convert(convert(x, bf16), f32)`` to ``x``
(``--xla_allow_excess_precision``, on by default; XLA:GPU does, XLA:CPU keeps the pair). The
storages round through ``optax_decoupled._src.storage.narrow``, which that rewrite cannot
undo. This script runs ``--steps`` AdamW steps with bfloat16 / float16 state and with
bfloat16 parameters, once as one jitted program and once as jitted single steps, and prints
the largest difference of the final state and parameters, with ``narrow`` as shipped and
with ``narrow`` replaced by a plain ``astype``. The gradients do not depend on the
parameters, so the moments of the two runs differ only if a rounding is skipped (0
everywhere with ``narrow``).

    python benchmarks/excess_precision.py [--steps 3]  # writes benchmarks/results/*.json
    XLA_FLAGS=--xla_allow_excess_precision=false python benchmarks/excess_precision.py
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled._src import storage as S  # to swap its private narrow()

CASES = {
    "bfloat16 state": (lambda: od.FloatStorage(jnp.bfloat16, "bfloat16"), "f32"),
    "float16 state": (lambda: od.FloatStorage(jnp.float16, "float16"), "f32"),
    "bfloat16 params": (lambda: None, "bf16"),
}


def _differences(state_dtype, param_dtype, steps: int) -> dict[str, float]:
    tx = od.adamw(1e-2, weight_decay=0.1, mask=None, state_dtype=state_dtype)
    w = jnp.linspace(-1.0, 1.0, 64 * 512, dtype=jnp.float32).reshape(64, 512)
    params = {"w": w.astype(param_dtype)}
    grads = [{"w": jnp.sin(w * (3.0 * i + 1.0)) * 3.0} for i in range(steps)]

    def one(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(one)
    p, s = params, tx.init(params)
    for g in grads:
        p, s = step(p, s, g)

    @jax.jit
    def many(p, s, gs):
        for g in gs:
            p, s = one(p, s, g)
        return p, s

    mp, ms = many(params, tx.init(params), grads)
    out = {}
    pairs = zip(jax.tree_util.tree_leaves_with_path((p, s)), jax.tree.leaves((mp, ms)), strict=True)
    for (path, a), b in pairs:
        if jnp.issubdtype(a.dtype, jnp.floating):
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            name = jax.tree_util.keystr(path)
            out[name] = float(np.max(np.abs(a32 - b32)))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/excess_precision.json")
    args = parser.parse_args(argv)
    shipped = S.narrow
    results = {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "steps": args.steps,
        "cases": {},
    }
    print(f"backend {results['backend']}, XLA_FLAGS={results['xla_flags']!r}")
    print("| case | cast | largest difference per leaf (one program vs single steps) |")
    print("|---|---|---|")
    for case, (make, pdt) in CASES.items():
        for cast in ("narrow", "astype"):
            S.narrow = shipped if cast == "narrow" else (lambda v, d: v.astype(d))
            try:
                param_dtype = jnp.bfloat16 if pdt == "bf16" else jnp.float32
                d = _differences(make(), param_dtype, args.steps)
            finally:
                S.narrow = shipped
            results["cases"][f"{case}, {cast}"] = d
            cells = ", ".join(f"{k} {v:.3g}" for k, v in d.items())
            print(f"| {case} | {cast} | {cells} |")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
