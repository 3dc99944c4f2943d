"""Where an update step's time goes: per-call host overhead vs the device's work.

``benchmarks/update_step.py`` times one jitted call per step, as a training loop runs it. With
many leaves that call carries a host cost per buffer (each parameter, gradient and moment is
an argument, donated and replaced), and the device a launch per kernel. This script times,
for the same parameters and the same step:

* ``call``: one jitted, donated call per step (``update_step.py``'s measure);
* ``loop``: ``--loop-steps`` steps inside one jitted ``lax.fori_loop`` (one call for all of
  them): the per-call host cost is gone, per-kernel launches stay;

for ``optax.adamw``, ``od.adamw``, and ``od.adamw`` on flat parameters packed into one
buffer per decay group (``packed_layout(..., max_leaf_size=None)``: a handful of kernels).
``GB/s`` counts the 28 B/parameter an fp32 AdamW step must move.

    python benchmarks/step_overhead.py --sizes 1e6 --leaves 1 200      # CPU, ~1 minute
    python benchmarks/step_overhead.py --sizes 1e8 --leaves 1 200      # a GPU

Writes ``benchmarks/results/step_overhead.json`` (``--out``). Each contender is timed in a
block of its own (not in turns with the others) and no ratios are printed: the numbers are
absolute, for an idle device.
"""

from __future__ import annotations

import argparse
import time

import _common as C
import jax
import optax

import optax_decoupled as od
from optax_decoupled.contrib import packed_layout


def _contenders(params, grads):
    """name -> (tx, params, grads) with copies the steps may donate."""
    layout = packed_layout(params, "auto", max_leaf_size=None)
    flat_tx = od.adamw(C.LR, weight_decay=C.WD, mask=layout.mask)
    return {
        "optax.adamw": (optax.adamw(C.LR, weight_decay=C.WD), params, grads),
        "od.adamw": (od.adamw(C.LR, weight_decay=C.WD), params, grads),
        "od.adamw, flat packed": (flat_tx, layout.pack(params), layout.pack(grads)),
    }


def _loop_step(tx, k):
    def body(_, carry):
        p, s, g = carry
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, g

    def loop(p, s, g):
        p, s, _ = jax.lax.fori_loop(0, k, body, (p, s, g))
        return p, s

    return jax.jit(loop, donate_argnums=(0, 1))


def _time(fn, p, s, g, calls, repeats):
    """Median seconds per call of ``calls`` calls in a row (after one warm-up)."""
    p, s = fn(p, s, g)
    jax.block_until_ready((p, s))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            p, s = fn(p, s, g)
        jax.block_until_ready((p, s))
        samples.append((time.perf_counter() - t0) / calls)
    return C.median(samples)


def run(n_leaves: int, n: int, loop_steps: int, repeats: int) -> list[dict]:
    params = C.make_params(n_leaves, n)
    grads = C.grads_like(params)
    rows = []
    for name, (tx, p, g) in _contenders(params, grads).items():
        buffers = len(jax.tree.leaves(p))
        s = tx.init(p)
        per_call = _time(C.make_step(tx), C._fresh(p), C._fresh(s), g, loop_steps, repeats)
        per_loop = _time(_loop_step(tx, loop_steps), C._fresh(p), C._fresh(s), g, 1, repeats)
        per_step_loop = per_loop / loop_steps
        row = {
            "leaves": n_leaves,
            "params": n,
            "contender": name,
            "param_buffers": buffers,
            "call_ms": per_call * 1e3,
            "loop_ms": per_step_loop * 1e3,
            "call_GBps": 28 * n / per_call / 1e9,
            "loop_GBps": 28 * n / per_step_loop / 1e9,
        }
        rows.append(row)
        print(
            f"{n_leaves:4d} leaves N={n:.0e} {name:22s} buffers {buffers:4d}  "
            f"call {row['call_ms']:8.3f} ms ({row['call_GBps']:7.1f} GB/s)  "
            f"loop {row['loop_ms']:8.3f} ms ({row['loop_GBps']:7.1f} GB/s)",
            flush=True,
        )
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6])
    ap.add_argument("--leaves", nargs="+", type=int, default=[1, 200])
    ap.add_argument("--loop-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/step_overhead.json")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for n in args.sizes:
        for leaves in args.leaves:
            rows += run(leaves, int(n), args.loop_steps, args.repeats)
    if args.out:
        C.write_json(args.out, {"machine": C.machine_info(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
