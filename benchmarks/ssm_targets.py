"""Measure the SSM test bed's targets at CPU scale and the two scan backends' step times.

Targets:
  * induction heads: >= 99% validation accuracy within 600 steps (d_model 32-64);
  * selective copying (L = 32, 4 tokens): >= 99% per-token validation accuracy within 1000 steps;
  * sequential digits: >= 93% test accuracy;
  * train-step time of the chunked SSD backend vs the sequential scan backend, and tokens/s.

Usage::

    python benchmarks/ssm_targets.py                      # everything (several CPU minutes)
    python benchmarks/ssm_targets.py --only induction copying
    python benchmarks/ssm_targets.py --progress       # writes benchmarks/results/ssm_targets.json

Prints one line per result and a Markdown summary, and writes all numbers (including each
evaluation) as JSON. docs/ssm.md records a run of this script. The two backends' step times
come from one training run each, one after the other, not from steps taken in turns: their
ratio carries any change of the machine's load between the two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np
import optax

from optax_decoupled.experiments import schedules, ssm, tasks
from optax_decoupled.experiments import train as train_lib

TARGETS = {
    "induction": dict(
        task=lambda: tasks.induction_heads(seq_len=64, vocab_size=16, batch_size=64),
        model=dict(d_model=64, n_layers=2, d_state=16, headdim=16, chunk_size=16),
        steps=600,
        warmup=50,
        lr=3e-3,
        weight_decay=0.01,
        eval_every=50,
        metric="val_accuracy",
        threshold=0.99,
    ),
    "copying": dict(
        task=lambda: tasks.selective_copying(
            seq_len=32, num_tokens=4, vocab_size=16, batch_size=64
        ),
        model=dict(d_model=64, n_layers=2, d_state=16, headdim=16, chunk_size=12),
        steps=1000,
        warmup=50,
        lr=3e-3,
        weight_decay=0.01,
        eval_every=50,
        metric="val_accuracy",
        threshold=0.99,
    ),
    "digits": dict(
        task=lambda: tasks.sequential_digits(batch_size=64),
        model=dict(d_model=64, n_layers=2, d_state=16, headdim=16, chunk_size=16, pool="mean"),
        steps=1600,
        warmup=80,
        lr=3e-3,
        weight_decay=0.1,
        eval_every=100,
        metric="test_accuracy",
        threshold=0.93,
    ),
}


def run_target(name: str, seed: int, progress: bool) -> dict:
    spec = TARGETS[name]
    task = spec["task"]()
    config = ssm.SSMConfig(**spec["model"], **task.model_kwargs())
    make_tx = schedules.scheduled(
        optax.adamw,
        total_steps=spec["steps"],
        warmup_steps=spec["warmup"],
        clip_norm=1.0,
    )
    loop = train_lib.TrainConfig(
        steps=spec["steps"], eval_every=spec["eval_every"], progress=progress
    )
    hp = {"learning_rate": spec["lr"], "weight_decay": spec["weight_decay"]}
    t0 = time.perf_counter()
    grid = train_lib.train_grid(task, config, make_tx, hp, seed, loop, keep_params=False)
    wall = time.perf_counter() - t0
    run = grid.runs[0]
    threshold = spec["threshold"]
    first = next((e["step"] for e in run.evals if e["val_accuracy"] >= threshold), None)
    return {
        "target": name,
        "seed": seed,
        "task": task.name,
        "task_info": {k: v for k, v in task.info.items() if k != "sizes"}
        | {"seq_len": task.seq_len},
        "model": spec["model"],
        "steps": spec["steps"],
        "batch_size": task.batch_size,
        "optimizer": f"adamw(lr={spec['lr']}, wd={spec['weight_decay']}), warmup "
        f"{spec['warmup']} + cosine, clip 1.0",
        "metric": spec["metric"],
        "threshold": threshold,
        "value": run.final[spec["metric"]],
        "reached": run.final[spec["metric"]] >= threshold,
        "first_step_val_at_threshold": first,
        "best_val_accuracy": max(e["val_accuracy"] for e in run.evals),
        "final": run.final,
        "evals": run.evals,
        "wall_time_s": wall,
        "compile_time_s": grid.compile_time_s,
        "step_time_s": grid.step_time_s,
        "tokens_per_s": grid.tokens_per_s,
    }


def run_timing(seq_len: int, batch_size: int, steps: int, progress: bool) -> list[dict]:
    """Train-step time of both backends on the same model and induction-heads batches."""
    task = tasks.induction_heads(seq_len=seq_len, vocab_size=16, batch_size=batch_size, num_eval=8)
    out = []
    for backend in ("ssd", "scan"):
        config = ssm.SSMConfig(
            d_model=64,
            n_layers=2,
            d_state=16,
            headdim=16,
            chunk_size=16,
            backend=backend,
            **task.model_kwargs(),
        )
        loop = train_lib.TrainConfig(
            steps=steps, eval_every=steps, eval_splits=(), final_splits=(), progress=progress
        )
        grid = train_lib.train_grid(
            task, config, optax.adam(1e-3), None, 0, loop, keep_params=False
        )
        out.append(
            {
                "backend": backend,
                "seq_len": seq_len,
                "batch_size": batch_size,
                "step_time_ms": 1e3 * grid.step_time_s,
                "tokens_per_s": grid.tokens_per_s,
                "compile_time_s": grid.compile_time_s,
                "timed_steps": steps - 1,
            }
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="*",
        default=["induction", "copying", "digits", "timing"],
        choices=["induction", "copying", "digits", "timing"],
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-lengths", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--timing-batch", type=int, default=32)
    parser.add_argument("--timing-steps", type=int, default=21)
    parser.add_argument("--out", default="benchmarks/results/ssm_targets.json")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)

    report = {
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        "targets": [],
        "timing": [],
    }
    for name in [n for n in args.only if n != "timing"]:
        res = run_target(name, args.seed, args.progress)
        report["targets"].append(res)
        print(
            f"{name}: {res['metric']} = {res['value']:.4f} (target {res['threshold']}, "
            f"{'reached' if res['reached'] else 'NOT reached'}); val >= target first at step "
            f"{res['first_step_val_at_threshold']}; {res['step_time_s'] * 1e3:.1f} ms/step, "
            f"{res['tokens_per_s']:.0f} tokens/s, wall {res['wall_time_s']:.0f} s",
            flush=True,
        )
    if "timing" in args.only:
        for seq_len in args.timing_lengths:
            rows = run_timing(seq_len, args.timing_batch, args.timing_steps, args.progress)
            report["timing"].extend(rows)
            ssd, scan = rows
            print(
                f"timing L={seq_len} B={args.timing_batch}: ssd {ssd['step_time_ms']:.1f} ms/step "
                f"({ssd['tokens_per_s']:.0f} tok/s), scan {scan['step_time_ms']:.1f} ms/step "
                f"({scan['tokens_per_s']:.0f} tok/s), scan/ssd = "
                f"{scan['step_time_ms'] / ssd['step_time_ms']:.2f}",
                flush=True,
            )
    report["machine"]["loadavg_end"] = os.getloadavg()

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=lambda o: np.asarray(o).tolist())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
