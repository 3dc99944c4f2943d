"""Device memory of a grid's compiled training step, by ``config_chunk``.

Compiles (does not run) the step that ``train.train_grid`` runs for ``K`` configurations of
the comparison's SSM on the sequential-digits task, at a preset's model and batch size, and
prints XLA's memory analysis: arguments (the K models' parameters and optimizer states, the
data keys), outputs, and temporaries (activations and gradients of the configurations computed
at once). ``config_chunk=None`` computes all K at once (what ``"auto"`` means on a GPU);
an int ``c`` maps over chunks of ``c`` (``--config-chunk`` of the CLI). Compiled for the
default backend, without sharding over devices; on a CPU host the numbers estimate what a GPU
needs (XLA's GPU backend plans its buffers differently, so treat them as estimates).

    python benchmarks/grid_memory.py                       # full preset, K = 160, chunks
    python benchmarks/grid_memory.py --k 8 --chunks none   # one small vmap
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from optax_decoupled.experiments import compare, programs, training_step


def step_memory(cfg: compare.CompareConfig, k: int, chunk: int | None) -> dict:
    task = cfg.digits()
    model_config = cfg.model_config(task)
    spec = cfg.specs()["adamw"]
    make_tx = compare.make_tx_factory(spec, cfg.steps, cfg.warmup_steps, cfg.clip_norm)
    graphdef = training_step.model_graphdef(model_config)
    opt_init, step_fn = programs.step_programs(graphdef, task, make_tx, chunk, None)
    hp = {
        "learning_rate": jnp.full((k,), 1e-3, jnp.float32),
        "weight_decay": jnp.full((k,), 0.1, jnp.float32),
    }
    keys = jnp.stack([training_step.seed_keys(i)[0] for i in range(k)])

    def init(keys, hp):
        _, params, rest = training_step.init_models(model_config, keys)
        return params, rest, opt_init(params, hp)

    params, rest, opt_state = jax.eval_shape(init, keys, hp)
    data_key = jax.ShapeDtypeStruct((k, 2), jnp.uint32)
    state = programs.TrainState(
        jax.ShapeDtypeStruct((), jnp.int32), params, rest, opt_state, data_key
    )
    t0 = time.perf_counter()
    mem = step_fn.lower(state, hp).compile().memory_analysis()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) // k
    return {
        "k": k,
        "config_chunk": chunk,
        "params_per_config": n_params,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "compile_s": time.perf_counter() - t0,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--scale", default="full", choices=("smoke", "quick", "full"))
    ap.add_argument(
        "--k", type=int, default=None, help="configurations (default: one sweep of the preset)"
    )
    ap.add_argument(
        "--chunks", nargs="+", default=["none", "45", "8"], help="config_chunk values ('none': all)"
    )
    args = ap.parse_args(argv)
    cfg = compare.CompareConfig.preset(args.scale)
    if args.k is None:
        spec = cfg.specs()["adamw"]
        args.k = len(spec.lrs) * len(spec.wds) * len(cfg.eval_seeds)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.scale} preset, "
          f"d_model {cfg.d_model}, batch {cfg.batch_size}, K = {args.k}")  # fmt: skip
    print("| config_chunk | arguments | temporaries | output (aliased) | compile |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    gib = 2.0**30
    for c in args.chunks:
        chunk = None if c == "none" else int(c)
        r = step_memory(cfg, args.k, chunk)
        rows.append(r)
        print(
            f"| {c} | {r['argument_bytes'] / gib:.2f} GiB | {r['temp_bytes'] / gib:.2f} GiB | "
            f"{r['output_bytes'] / gib:.2f} GiB ({r['alias_bytes'] / gib:.2f}) | "
            f"{r['compile_s']:.0f} s |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
