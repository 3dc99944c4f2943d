"""A K-configuration lr × wd grid trained as one vmapped program vs the same K runs in turn.

Both contenders use the trainer's compiled programs (``train.train_grid``); compilation is
done before timing (one warm-up run each), and the two are alternated ``--repeats`` times so
that load on a shared machine hits both alike. Prints the median wall times and the ratio
vmapped / sequential (target on CPU: <= 0.5), and writes JSON.

    python benchmarks/grid_vmap.py [--k 16] [--steps 100] [--out results/grid_vmap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=16, help="configurations (a 4x4 grid)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/grid_vmap.json")
    args = parser.parse_args()

    import jax

    import optax_decoupled as od
    from optax_decoupled.experiments import compare, tasks
    from optax_decoupled.experiments import train as train_lib

    task = tasks.sequential_digits(batch_size=args.batch_size)
    cfg = compare.CompareConfig(d_model=args.d_model, n_layers=args.n_layers)
    model = cfg.model_config(task)
    side = int(round(args.k**0.5))
    lrs = tuple(float(v) for v in np.geomspace(1e-3, 1e-2, side))
    wds = tuple(float(v) for v in np.geomspace(1e-2, 1.0, args.k // side))
    spec = compare.OptimizerSpec(
        "adamw", "AdamW", False, od.adamw, (("decay_convention", "lr"),), None, lrs, wds
    )
    make_tx = compare.make_tx_factory(spec, args.steps, args.steps // 10, 1.0)
    hp, seeds = train_lib.product_grid({"learning_rate": lrs, "weight_decay": wds}, [0])
    k = len(seeds)
    loop = train_lib.TrainConfig(
        steps=args.steps, eval_every=args.steps, eval_splits=(), final_splits=(), progress=False
    )

    def vmapped() -> None:
        res = train_lib.train_grid(task, model, make_tx, hp, seeds, loop, keep_params=False)
        jax.block_until_ready(res.params)

    def sequential() -> None:
        for i in range(k):
            res = train_lib.train_grid(
                task,
                model,
                make_tx,
                {n: v[i : i + 1] for n, v in hp.items()},
                seeds[i : i + 1],
                loop,
                keep_params=False,
            )
            jax.block_until_ready(res.params)

    for fn in (vmapped, sequential):  # compile both programs first
        fn()
    times: dict[str, list[float]] = {"vmapped": [], "sequential": []}
    for _ in range(args.repeats):
        for name, fn in (("vmapped", vmapped), ("sequential", sequential)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    ratio = med["vmapped"] / med["sequential"]
    load = os.getloadavg()
    print(
        f"K = {k} configurations x {args.steps} steps (d_model {args.d_model}, "
        f"{args.n_layers} layers, batch {args.batch_size}); load average {load[0]:.1f}"
    )
    print(
        f"  vmapped (one program): {med['vmapped']:.2f} s   sequential: "
        f"{med['sequential']:.2f} s   ratio vmapped/sequential: {ratio:.3f} (target <= 0.5)"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "times_s": times,
                "median_s": med,
                "ratio": ratio,
                "loadavg": load,
                "devices": [str(d) for d in jax.devices()],
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
