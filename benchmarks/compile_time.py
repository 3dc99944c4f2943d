"""Compile time of one jitted, donated optimizer step: ours vs Optax, 100 and 1000 leaves.

Measures, for each contender, the time to trace and lower the step (``jit(...).lower``) and the
time XLA takes to compile it (``.compile()``), on a fresh function each time (no cache hits).
Contenders alternate, and the table reports medians and the ratio to ``optax.adamw``.

    python benchmarks/compile_time.py            # 100 and 1000 leaves, ~3-6 minutes on 2 cores
    python benchmarks/compile_time.py --quick    # 100 leaves, one repeat
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

CONTENDERS = [
    "optax.adamw",
    "od.adamw",
    "od.contrib.packed(adamw)",
    "od.contrib.packed(adamw) flat",
    "optax.flatten(adamw)",
]


def _contender(name: str, params, grads) -> C.JaxStep:
    if name == "optax.flatten(adamw)":
        tx = optax.flatten(optax.adamw(C.LR, weight_decay=C.WD))
        n = C.num_params(params)
        return C.JaxStep(name, C.make_step(tx), params, tx.init(params), grads, n)
    return C.jax_contender(name, params, grads)


def measure(name: str, params, grads) -> dict[str, float]:
    step = _contender(name, params, grads)
    t0 = time.perf_counter()
    lowered = step.fn.lower(step.params, step.state, step.grads)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 leaves only, one repeat")
    ap.add_argument("--leaves", type=int, nargs="*", default=None)
    ap.add_argument("--params", type=float, default=1e6, help="total parameters (default 1e6)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--contenders", nargs="*", default=CONTENDERS)
    ap.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = ap.parse_args(argv)
    leaves = args.leaves or ([100] if args.quick else [100, 1000])
    repeats = args.repeats or (1 if args.quick else 2)

    info = C.machine_info()
    print(f"# compile time, {info.get('cpu')} x{info['cpu_count']}, jax {info['jax']}, "
          f"load {info['load_average_at_start']}")  # fmt: skip
    rows = []
    for n_leaves in leaves:
        params = C.make_params(n_leaves, int(args.params))
        grads = C.grads_like(params)
        times: dict[str, list[dict]] = {c: [] for c in args.contenders}
        for _ in range(repeats):
            for c in args.contenders:
                times[c].append(measure(c, params, grads))
                total = times[c][-1]["total_s"]
                print(f"  {n_leaves:5d} leaves  {c:24s} {total:7.2f} s", flush=True)
        ref = None
        if "optax.adamw" in times:
            ref = C.median([t["total_s"] for t in times["optax.adamw"]])
        for c, ts in times.items():
            row = {
                "leaves": n_leaves,
                "contender": c,
                "lower_s": C.median([t["lower_s"] for t in ts]),
                "compile_s": C.median([t["compile_s"] for t in ts]),
                "total_s": C.median([t["total_s"] for t in ts]),
                "repeats": len(ts),
            }
            row["ratio_vs_optax"] = row["total_s"] / ref if ref else None
            rows.append(row)
    info["load_average_at_end"] = C.load_average()
    table = markdown(rows)
    print(table)
    payload = {"machine": info, "rows": rows, "markdown": table}
    C.write_json(args.out, payload)
    print(f"wrote {args.out}")
    return payload


def markdown(rows) -> str:
    lines = [
        "| leaves | contender | trace+lower (s) | XLA compile (s) | total (s) | vs optax.adamw |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['ratio_vs_optax']:.2f}x" if r["ratio_vs_optax"] is not None else "-"
        lines.append(
            f"| {r['leaves']} | `{r['contender']}` | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
            f"{r['total_s']:.2f} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
