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

``--floor`` (Linux) adds what splitting the runs over the cores can give at best: one
process per core, each pinned to its core with one XLA device, trains its share of the K
configurations one at a time; the processes compile, wait for each other, then run side by
side ``--repeats`` times. Its time is the slowest process's median, against the same
``sequential`` median.

    python benchmarks/grid_vmap.py [--k 16] [--steps 100] [--floor]   # benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
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
    parser.add_argument("--out", default="benchmarks/results/grid_vmap.json")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="CPU devices to expose (0: one per core, the CLI's default; 1: a single device)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also time one pinned process per core (Linux)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "CPU:FIRST:STOP", for --floor
    args = parser.parse_args()

    from optax_decoupled.experiments import xla_setup

    if args.child:
        cpu = int(args.child.split(":")[0])
        os.sched_setaffinity(0, {cpu})  # before JAX starts: its thread pool sizes to this
        args.cpu_devices = 1
    xla_setup.configure_cpu(devices=args.cpu_devices)
    import jax

    from optax_decoupled.experiments import programs
    from optax_decoupled.experiments import train as train_lib

    task, model, make_tx, hp, seeds, base = _grid_setup(args)
    k = len(seeds)
    if args.child:
        _child(args, task, model, make_tx, hp, seeds, base)
        return

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

    chunk = programs.resolve_config_chunk(base.config_chunk)
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
    floor = _floor(args, k) if args.floor else None
    if floor is not None:
        name = f"floor: {floor['processes']} pinned processes, side by side"
        times[name] = floor["times_s"]
    med = {n: statistics.median(v) for n, v in times.items()}
    ratios = {n: med[n] / med["sequential"] for n in med}
    load = os.getloadavg()
    mesh = programs.config_mesh(k)
    n_dev = 1 if mesh is None else mesh.size
    print(
        f"K = {k} configurations x {args.steps} steps (d_model {args.d_model}, "
        f"{args.n_layers} layers, batch {args.batch_size}); {len(jax.devices())} "
        f"{jax.default_backend()} devices, the default program uses {n_dev}, chunks of {chunk}; "
        f"load average {load[0]:.1f}"
    )
    for name in med:
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
                "floor": floor,
                "program_devices": n_dev,
                "config_chunk": chunk,
                "loadavg": load,
                "devices": [str(d) for d in jax.devices()],
            },
            f,
            indent=1,
        )


def _grid_setup(args):
    """The task, model, optimizer factory, K configurations and loop of every contender."""
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
    base = train_lib.TrainConfig(
        steps=args.steps, eval_every=args.steps, eval_splits=(), final_splits=(), progress=False
    )
    return task, model, make_tx, hp, seeds, base


def _floor(args, k: int) -> dict | None:
    """Times ``--floor``: one child process per core (``--child CPU:FIRST:STOP``), each
    pinned to its core, training configurations FIRST..STOP-1 one at a time. The children
    compile and print ``ready``; once all have, each is told ``go`` and times ``--repeats``
    runs, printing them as JSON."""
    if not hasattr(os, "sched_getaffinity"):
        print("  --floor: needs os.sched_setaffinity (Linux); skipped")
        return None
    cpus = sorted(os.sched_getaffinity(0))[:k]
    bounds = np.linspace(0, k, len(cpus) + 1).round().astype(int)
    argv = [a for a in sys.argv[1:] if a != "--floor"]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, *argv, "--child", f"{cpu}:{lo}:{hi}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for cpu, lo, hi in zip(cpus, bounds[:-1], bounds[1:], strict=True)
    ]
    for c in children:
        if c.stdout.readline().strip() != "ready":
            raise RuntimeError("a --floor child failed before timing")
    for c in children:
        c.stdin.write("go\n")
        c.stdin.flush()
    results = [json.loads(c.communicate()[0]) for c in children]
    medians = [statistics.median(r) for r in results]
    slowest = int(np.argmax(medians))
    return {
        "processes": len(children),
        "configs_per_process": np.diff(bounds).tolist(),
        "times_s": results[slowest],
        "process_medians_s": medians,
    }


def _child(args, task, model, make_tx, hp, seeds, base) -> None:
    """One ``--floor`` process: its configurations, one at a time, on its one core."""
    import jax

    from optax_decoupled.experiments import train as train_lib

    _, lo, hi = (int(v) for v in args.child.split(":"))
    loop = dataclasses.replace(base, shard_configs=False)

    def run() -> None:
        part = {n: v[lo:hi] for n, v in hp.items()}
        res = train_lib.train_grid(
            task, model, make_tx, part, seeds[lo:hi], loop, keep_params=False
        )
        jax.block_until_ready(res.params)

    run()
    print("ready", flush=True)
    sys.stdin.readline()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
