"""Run in its own process with 4 simulated CPU devices (see tests/test_train.py).

A grid of K = 4 configurations trained by ``train.train_grid`` with its defaults -- the K axis
split over the 4 devices by ``jax.shard_map`` -- against the same grid on one device
(``shard_configs=False``), both with one full ``jax.vmap`` and with ``lax.map`` chunks; then a
sharded run stopped at step 3 and resumed from its checkpoint. Prints one JSON object: the
devices each program used, the largest loss / parameter differences to the one-device vmap,
whether the resumed run equals the uninterrupted one bit for bit, and the final state's
shardings; and that none of the programs compiled for it runs a collective.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

# Every compiled program's optimized HLO goes to DUMP, to check that none runs a collective.
DUMP = tempfile.mkdtemp(prefix="grid_over_devices_hlo_")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    f" --xla_force_host_platform_device_count=4 --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optax_decoupled as od  # noqa: E402
from optax_decoupled.experiments import programs, schedules, ssm, tasks  # noqa: E402
from optax_decoupled.experiments import train as train_lib  # noqa: E402

STEPS = 6
task = tasks.induction_heads(seq_len=16, vocab_size=8, batch_size=8, num_eval=32)
model = ssm.SSMConfig(
    d_model=16, n_layers=1, d_state=8, headdim=8, chunk_size=8, **task.model_kwargs()
)
make_tx = schedules.scheduled(optax.adamw, total_steps=STEPS, warmup_steps=2)
hparams = {"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.0, 0.1, 0.01, 0.3]}
seeds = [0, 1, 2, 3]
base = train_lib.TrainConfig(
    steps=STEPS, eval_every=3, eval_batch_size=32, progress=False, final_splits=("val",)
)


def run(config, **kwargs):
    return train_lib.train_grid(task, model, make_tx, hparams, seeds, config, **kwargs)


def max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


reference = run(dataclasses.replace(base, shard_configs=False, config_chunk=None))
variants = {
    "sharded, chunk auto": base,
    "sharded, chunk 1": dataclasses.replace(base, config_chunk=1),
    "one device, chunk 3": dataclasses.replace(base, shard_configs=False, config_chunk=3),
}
out = {"devices": len(jax.devices()), "mesh_size": programs.config_mesh(4).size, "variants": {}}
results = {}
for name, config in variants.items():
    res = results[name] = run(config)
    out["variants"][name] = {
        "devices": res.devices,
        "param_devices": len(jax.tree.leaves(res.params)[0].sharding.device_set),
        # Each configuration's leaves indexed right after training, as compare.run_diagnostics
        # does: on arrays split over CPU devices, a gather + all-reduce per leaf (see below).
        "first_config": float(sum(np.sum(x[0]) for x in jax.tree.leaves(res.params))),
        "loss_diff": max_diff(
            [r.train_loss for r in res.runs], [r.train_loss for r in reference.runs]
        ),
        "param_diff": max_diff(res.params, reference.params),
        "val_loss_diff": max(
            abs(a.final["val_loss"] - b.final["val_loss"])
            for a, b in zip(res.runs, reference.runs, strict=True)
        ),
    }
# K = 5 on 4 devices: padded to 8 (copies of the last configuration), padding dropped.
five = {n: [*v, v[-1] * 0.5] for n, v in hparams.items()}
padded = train_lib.train_grid(task, model, make_tx, five, [*seeds, 4], base)
alone = train_lib.train_grid(
    task, model, make_tx, five, [*seeds, 4], dataclasses.replace(base, shard_configs=False)
)
out["padded"] = {
    "runs": len(padded.runs),
    "param_rows": int(jax.tree.leaves(padded.params)[0].shape[0]),
    "param_diff": max_diff(padded.params, alone.params),
    "loss_diff": max_diff([r.train_loss for r in padded.runs], [r.train_loss for r in alone.runs]),
}
# 8-bit moments under apply_if_finite (skip_nonfinite), K split over the devices: the vmapped
# lax.cond around the 8-bit table lookups raised JAX's "pvary is a invariant->variant
# collective" inside shard_map with its vma checks on.
int8_tx = schedules.scheduled(
    od.adamw,
    total_steps=STEPS,
    warmup_steps=2,
    state_dtype=od.BlockwiseInt8Storage(block_size=64, min_size=0),
)
skip = dataclasses.replace(base, skip_nonfinite=True, config_chunk=None)
int8_lr = {"learning_rate": hparams["learning_rate"]}
int8_runs = {}
for name, config in (
    ("sharded", skip),
    ("one device", dataclasses.replace(skip, shard_configs=False)),
):
    try:
        int8_runs[name] = train_lib.train_grid(task, model, int8_tx, int8_lr, seeds, config)
    except Exception as e:  # reported, not raised: the other checks still print
        int8_runs[name] = f"{type(e).__name__}: {str(e)[:300]}"
if all(not isinstance(r, str) for r in int8_runs.values()):
    sharded, alone_int8 = (int8_runs[k].params for k in ("sharded", "one device"))
    n_runs = int(jax.tree.leaves(sharded)[0].shape[0])

    def run_diff(i, j):  # run i of the sharded grid against run j on one device
        return max_diff(
            jax.tree.map(lambda x: x[i], sharded), jax.tree.map(lambda x: x[j], alone_int8)
        )

    out["int8_skip"] = {
        "devices": int8_runs["sharded"].devices,
        "param_devices": len(jax.tree.leaves(sharded)[0].sharding.device_set),
        "param_diff": max_diff(sharded, alone_int8),
        # The scale of a different run: each sharded run against the other runs on one device.
        "other_run_diff": min(
            run_diff(i, j) for i in range(n_runs) for j in range(n_runs) if i != j
        ),
    }
else:
    out["int8_skip"] = {k: v for k, v in int8_runs.items() if isinstance(v, str)}
with tempfile.TemporaryDirectory() as tmp:
    full = results["sharded, chunk auto"]  # run(base), uninterrupted
    run(base, checkpoint_dir=tmp, stop_at=3)
    resumed = run(base, checkpoint_dir=tmp, resume=True)
    out["resume_start"] = resumed.start_step
    out["resume_bit_identical"] = all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params), strict=True)
    ) and all(
        np.array_equal(a.train_loss, b.train_loss) and a.final == b.final
        for a, b in zip(resumed.runs, full.runs, strict=True)
    )
    out["resumed_devices"] = resumed.devices
    out["resumed_param_devices"] = len(jax.tree.leaves(resumed.params)[0].sharding.device_set)
# XLA:CPU's collectives can deadlock (train._off_cpu_mesh): no program of the above, the
# sharded steps, evaluations, checkpoints and results included, may contain one.
COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)")
modules = sorted(pathlib.Path(DUMP).glob("*after_optimizations.txt"))
out["compiled_modules"] = len(modules)
out["step_modules"] = sum("jit_step_fn" in m.name for m in modules)
out["collective_modules"] = [m.name for m in modules if COLLECTIVE.search(m.read_text())]
shutil.rmtree(DUMP, ignore_errors=True)
print(json.dumps(out))
sys.exit(0)
