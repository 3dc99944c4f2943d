"""A K-configuration lr × wd grid trained as one compiled program vs the same K runs in turn.

All contenders use the trainer's compiled programs (``train.train_grid``):

* ``sequential``: the K configurations one after another (K programs runs of one config);
* ``one program (default)``: ``TrainConfig()`` defaults -- the K axis split over the CPU
  devices (one per core, set up by ``xla_setup.configure_cpu`` before JAX starts) and, on each
  device, ``lax.map`` over chunks of ``config_chunk`` vmapped configurations;
* ``one program, chunks, 1 device`` and ``one program, full vmap, 1 device``: the same with
  sharding off, and with all K configurations in one ``jax.vmap`` (the trainer's behaviour
  before the chunking), to show where the time goes.

Compilation is done before timing (one warm-up run each), and the contenders are alternated
``--repeats`` times so that load on a shared machine hits them alike. Prints median wall
times and each ratio to ``sequential`` (target on CPU: <= 0.5), and writes JSON.

    python benchmarks/grid_vmap.py [--k 16] [--steps 100] [--out results/grid_vmap.json]
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="CPU devices to expose (0: one per core, the CLI's default; 1: a single device)",
    )
    args = parser.parse_args()

    from optax_decoupled.experiments import xla_setup

    xla_setup.configure_cpu(devices=args.cpu_devices)
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
    base = train_lib.TrainConfig(
        steps=args.steps, eval_every=args.steps, eval_splits=(), final_splits=(), progress=False
    )

    def one_program(loop: train_lib.TrainConfig):
        def run() -> None:
            res = train_lib.train_grid(task, model, make_tx, hp, seeds, loop, keep_params=False)
            jax.block_until_ready(res.params)

        return run

    def sequential() -> None:
        for i in range(k):
            res = train_lib.train_grid(
                task,
                model,
                make_tx,
                {n: v[i : i + 1] for n, v in hp.items()},
                seeds[i : i + 1],
                base,
                keep_params=False,
            )
            jax.block_until_ready(res.params)

    chunk = train_lib.resolve_config_chunk(base.config_chunk)
    contenders = {
        "sequential": sequential,
        "one program (default)": one_program(base),
        f"one program, chunks of {chunk}, 1 device": one_program(
            dataclasses.replace(base, shard_configs=False)
        ),
        "one program, full vmap, 1 device": one_program(
            dataclasses.replace(base, shard_configs=False, config_chunk=None)
        ),
    }
    for fn in contenders.values():  # compile every program first
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    ratios = {n: med[n] / med["sequential"] for n in med}
    load = os.getloadavg()
    mesh = train_lib.config_mesh(k)
    n_dev = 1 if mesh is None else mesh.size
    print(
        f"K = {k} configurations x {args.steps} steps (d_model {args.d_model}, "
        f"{args.n_layers} layers, batch {args.batch_size}); {len(jax.devices())} "
        f"{jax.default_backend()} devices, the default program uses {n_dev}, chunks of {chunk}; "
        f"load average {load[0]:.1f}"
    )
    for name in contenders:
        print(f"  {name:40s} {med[name]:7.2f} s   ratio to sequential {ratios[name]:.3f}")
    print("  (target for the default one program on CPU: <= 0.5)")
    ratio = ratios["one program (default)"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "times_s": times,
                "median_s": med,
                "ratio": ratio,
                "ratios": ratios,
                "program_devices": n_dev,
                "config_chunk": chunk,
                "loadavg": load,
                "devices": [str(d) for d in jax.devices()],
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
