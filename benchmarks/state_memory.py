"""Optimizer state in float32, bfloat16 and 8 bits: bytes per parameter and step time.

For each optimizer (``--optimizers``), step kind (``--steps``) and size N (``--sizes``), the
parameters are ``--leaves`` float32 matrices of shape ``(N / leaves / 1024, 1024)`` and every
state dtype gets its own jitted step with the parameters and the state donated, as in a
training loop:

* ``update``: ``update`` + ``apply_updates``, the gradient an argument of the step;
* ``train``: the same after the gradient of ``sum(tanh(x @ w))`` for a batch of 4 rows,
  computed in the step (the gradient is then a temporary of the program, as in training).

The state dtypes are the float32 anchor, ``bfloat16`` (rounded to nearest), ``bfloat16-sr``
(stochastic rounding) and ``int8`` (block-wise 8-bit, blocks of 256). Each is timed in turns
with float32: ``--repeats`` blocks of ``--block`` steps of one program (the first step of each
block not counted), so that load on a shared machine slows both alike while each program runs
step after step as in training. Its time ratio is against the float32 steps of its own turns.

    python benchmarks/state_memory.py                    # 1e6 and 1e7; AdamW and Lion
    python benchmarks/state_memory.py --sizes 1e6 --optimizers adamw --steps update
    python benchmarks/state_memory.py --sizes 2e7 --leaves 20   # 20 matrices of 1e6

Prints a Markdown table and writes ``benchmarks/results/state_memory.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

#: The state dtypes (the float32 anchor first) and the storage each one names.
STORAGES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "bfloat16-sr": od.FloatStorage(jnp.bfloat16, "bfloat16", rounding="stochastic"),
    "int8": "int8",
}
STATE_DTYPES = tuple(STORAGES)

#: The optimizers, each built for a state dtype. Every parameter is decayed (``mask=None``).
OPTIMIZERS = {
    "adamw": lambda sd: od.adamw(1e-3, weight_decay=0.1, mask=None, state_dtype=sd),
    "amsgrad": lambda sd: od.amsgrad(1e-3, weight_decay=0.1, mask=None, state_dtype=sd),
    "lion": lambda sd: od.lion(1e-4, weight_decay=1.0, mask=None, state_dtype=sd),
}
STEPS = ("update", "train")
TRAIN_BATCH = 4


def make_step(state_dtype: str, kind: str = "update", optimizer: str = "adamw"):
    """``(tx, step)``: ``step(params, state, data)`` jitted with params and state donated;
    ``data`` is the gradient (``kind="update"``) or a ``(TRAIN_BATCH, rows)`` batch
    (``kind="train"``)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: one of {tuple(OPTIMIZERS)}, got {optimizer!r}")
    if kind not in STEPS:
        raise ValueError(f"kind: one of {STEPS}, got {kind!r}")
    tx = OPTIMIZERS[optimizer](STORAGES[state_dtype])

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def train(params, state, x):
        def loss(p):
            return sum(jnp.sum(jnp.tanh(x @ w)) for w in jax.tree.leaves(p))

        return update(params, state, jax.grad(loss)(params))

    return tx, jax.jit(update if kind == "update" else train, donate_argnums=(0, 1))


def bench(
    shape: tuple[int, int],
    *,
    leaves: int = 1,
    dtypes: tuple[str, ...] = STATE_DTYPES,
    kind: str = "update",
    optimizer: str = "adamw",
    repeats: int = 5,
    block: int = 5,
) -> dict:
    """Times each of ``dtypes`` against float32 (see the module docstring); returns, per
    dtype, state bytes, XLA's temporaries of the compiled step, the median step and (for
    the others) the ratios to float32."""
    if block < 2:
        raise ValueError(f"block: at least 2 steps (the first is not counted), got {block}")
    dtypes = ("float32", *(d for d in dtypes if d != "float32"))
    keys = iter(jax.random.split(jax.random.key(0), 2 * leaves + 1))
    params0 = {f"w{i}": jax.random.normal(next(keys), shape) for i in range(leaves)}
    if kind == "update":
        data = {name: 0.01 * jax.random.normal(next(keys), shape) for name in params0}
    else:
        data = jax.random.normal(next(keys), (TRAIN_BATCH, shape[0]))
    runs = {}
    for sd in dtypes:
        tx, step = make_step(sd, kind, optimizer)
        params = jax.tree.map(jnp.copy, params0)
        state = tx.init(params)
        t0 = time.perf_counter()
        compiled = step.lower(params, state, data).compile()
        compile_s = time.perf_counter() - t0
        runs[sd] = {
            "fn": compiled,
            "state_bytes": od.contrib.state_bytes(state, params),
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "compile_s": compile_s,
            "carry": compiled(params, state, data),  # the first step (donates), not timed
        }
    times: dict[str, list[float]] = {sd: [] for sd in dtypes}
    anchor: dict[str, list[float]] = {}  # the float32 steps of each dtype's turns
    for sd in dtypes[1:]:
        anchor[sd] = []
        for _ in range(repeats):
            for name, out in (("float32", anchor[sd]), (sd, times[sd])):
                r = runs[name]
                for k in range(block):
                    t0 = time.perf_counter()
                    r["carry"] = r["fn"](*r["carry"], data)
                    jax.block_until_ready(r["carry"])
                    if k:
                        out.append(time.perf_counter() - t0)
        times["float32"] += anchor[sd]
    result = {
        "optimizer": optimizer,
        "step": kind,
        "num_params": leaves * int(np.prod(shape)),
        "shape": list(shape),
        "leaves": leaves,
    }
    f32_bytes = runs["float32"]["state_bytes"].total
    for sd in dtypes:
        r, ms = runs[sd], 1e3 * float(np.median(times[sd] or [np.nan]))
        result[sd] = {
            "state_bytes": r["state_bytes"].total,
            "bytes_per_param": r["state_bytes"].per_param,
            "temp_bytes": r["temp_bytes"],
            "step_ms": ms,
            "compile_s": r["compile_s"],
        }
        if sd != "float32":
            f32_ms = 1e3 * float(np.median(anchor[sd]))
            result[sd]["float32_step_ms"] = f32_ms
            result[sd]["time_ratio"] = ms / f32_ms
            result[sd]["state_ratio"] = r["state_bytes"].total / f32_bytes
    return result


def markdown(results: list[dict]) -> str:
    """One row per optimizer, step and size: state bytes per parameter, float32's median
    step, and each other dtype's step time as a ratio to float32's."""
    dtypes = [sd for sd in STATE_DTYPES if sd in results[0]]
    head = ["optimizer", "step", "parameters"]
    head += [f"state B/param {sd}" for sd in dtypes if sd != "bfloat16-sr"]
    head += ["float32 step (ms)", *(f"{sd} / float32 time" for sd in dtypes[1:])]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in results:
        n = f"{r['num_params']:,}" + (f" ({r['leaves']} leaves)" if r["leaves"] > 1 else "")
        cells = [r["optimizer"], r["step"], n]
        cells += [f"{r[sd]['bytes_per_param']:.2f}" for sd in dtypes if sd != "bfloat16-sr"]
        cells += [f"{r['float32']['step_ms']:.2f}"]
        cells += [f"{r[sd]['time_ratio']:.2f}x" for sd in dtypes[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7])
    ap.add_argument("--leaves", type=int, default=1, help="matrices per size (default 1)")
    ap.add_argument("--optimizers", nargs="+", choices=tuple(OPTIMIZERS), default=["adamw", "lion"])
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument(
        "--dtypes", nargs="+", choices=STATE_DTYPES[1:], default=list(STATE_DTYPES[1:]),
        help="state dtypes to time against float32 (default: all)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=5, help="turns per dtype (default 5)")
    ap.add_argument("--block", type=int, default=5, help="steps per turn, the first not counted")
    ap.add_argument("--out", default="benchmarks/results/state_memory.json")
    args = ap.parse_args(argv)
    if args.block < 2:
        ap.error("--block must be at least 2 (the first step of each block is not counted)")
    if args.leaves < 1:
        ap.error("--leaves must be at least 1")
    info = C.machine_info()
    print(f"# state memory: jax {info['jax']} on {info['backend']} x{info['cpu_count']}, "
          f"load {info['load_average_at_start']}", flush=True)  # fmt: skip
    results = []
    for optimizer in args.optimizers:
        for kind in args.steps:
            for n in args.sizes:
                shape = (max(1, round(n / args.leaves / 1024)), 1024)
                results.append(
                    bench(shape, leaves=args.leaves, dtypes=tuple(args.dtypes), kind=kind,
                          optimizer=optimizer, repeats=args.repeats, block=args.block)
                )  # fmt: skip
                print(markdown(results[-1:]).splitlines()[-1], flush=True)
                # After every row: a run stopped by a time limit keeps what it measured.
                C.write_json(args.out, {"machine": info, "args": vars(args), "results": results})
    info["load_average_at_end"] = C.load_average()
    print(markdown(results))
    C.write_json(args.out, {"machine": info, "args": vars(args), "results": results})
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
