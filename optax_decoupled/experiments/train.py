"""Training K configurations of the SSM as one compiled program: :func:`train_grid`.

A grid is hyperparameters and seeds (:func:`product_grid`); the state carries a leading ``K``
axis, each configuration draws its own batches from its own data key inside the step,
evaluation is periodic, metrics go to JSON lines
(:mod:`~optax_decoupled.experiments.train_results`), progress to tqdm, and checkpoints to
orbax-checkpoint (:mod:`~optax_decoupled.experiments.checkpoints`). The step is
:func:`~optax_decoupled.experiments.training_step.train_step` mapped over the configurations
and devices (:mod:`~optax_decoupled.experiments.programs`); optimizers enter as ``make_tx``
factories (:func:`~optax_decoupled.experiments.schedules.scheduled`). A run stopped and
resumed from a checkpoint ends with parameters bit-identical to an uninterrupted run (the
step is a pure function of the checkpointed state and the step number).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from optax_decoupled.experiments import checkpoints, programs, train_results, training_step
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments.ssm import SSMConfig
from optax_decoupled.experiments.training_step import MakeTx, PyTree


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings of :func:`train_grid`.

    Attributes:
      steps: number of optimisation steps.
      eval_every: evaluate ``eval_splits`` every this many steps (and after the last step).
      eval_splits: splits evaluated periodically; ``final_splits`` are evaluated at the end.
      eval_batch_size: evaluation chunk size (splits are padded with ``mask = 0``).
      log_every: refresh the progress bar's loss every this many steps.
      checkpoint_every: save a checkpoint every this many steps (needs ``checkpoint_dir``).
      max_to_keep: checkpoints kept.
      progress: show a tqdm progress bar.
      skip_nonfinite: wrap the optimizer in ``optax.apply_if_finite``: a step whose gradients
        contain a NaN or an Inf leaves the parameters and the whole optimizer state (moments,
        step counts, hence the schedules) unchanged and is counted; training continues with
        the next batch. The counts are reported as ``RunResult.skipped_steps`` and in the
        ``"final"`` and ``"eval"`` JSON lines. A skipped step's ``grad_norm`` is not finite,
        but not every step with a non-finite ``grad_norm`` is skipped: the norm of large
        finite gradients (above about 1.8e19 in float32) overflows to inf, and such a step is
        applied (clip the gradients, ``scheduled(clip_norm=...)``, against such steps).
      max_consecutive_nonfinite: ``apply_if_finite``'s ``max_consecutive_errors``: after more
        than this many non-finite steps *in a row* the update is applied anyway (and the
        non-finite values reach the parameters), so a run that has truly diverged does not
        silently stand still.
      config_chunk: how many configurations one device computes at a time. ``None``: all of
        its configurations in one ``jax.vmap``; an int ``c``: ``jax.lax.map(..., batch_size=c)``
        -- a loop over chunks of ``c`` vmapped configurations inside the same compiled step.
        ``"auto"`` (default): all at once on accelerators, one at a time on CPU, where a wide
        vmap pushes the working set out of the L2 cache and is *slower* than a loop
        (``benchmarks/grid_vmap.py``). Results do not depend on it beyond float rounding.
      shard_configs: split the ``K`` configurations over ``min(K, local devices)`` devices
        (a 1-D mesh, ``jax.shard_map``); when that count does not divide ``K`` the grid is
        padded with copies of its last configuration, which are dropped from every result
        (``programs.config_mesh``). On a CPU host this uses several cores only if XLA exposes
        several CPU devices
        (:func:`~optax_decoupled.experiments.xla_setup.configure_cpu`, called by the CLI, the
        report and the notebooks).
    """

    steps: int = 600
    eval_every: int = 100
    eval_splits: tuple[str, ...] = ("val",)
    final_splits: tuple[str, ...] = ("val", "test")
    eval_batch_size: int = 512
    log_every: int = 25
    checkpoint_every: int | None = None
    max_to_keep: int = 2
    progress: bool = True
    skip_nonfinite: bool = False
    max_consecutive_nonfinite: int = 10
    config_chunk: int | Literal["auto"] | None = "auto"
    shard_configs: bool = True

    def __post_init__(self):
        if self.steps < 1 or self.eval_every < 1 or self.eval_batch_size < 1:
            raise ValueError("steps, eval_every and eval_batch_size must be positive.")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every!r}.")
        if self.max_to_keep < 1:  # 0 would delete every checkpoint as it is written
            raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep!r}.")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be positive or None.")
        if (
            not isinstance(self.max_consecutive_nonfinite, int)
            or self.max_consecutive_nonfinite < 0
        ):
            raise ValueError("max_consecutive_nonfinite must be an int >= 0.")
        chunk = self.config_chunk
        if not (chunk is None or chunk == "auto" or (isinstance(chunk, int) and chunk >= 1)):
            raise ValueError(f"config_chunk must be None, 'auto' or an int >= 1, got {chunk!r}.")


def product_grid(
    axes: Mapping[str, Sequence[float]], seeds: Sequence[int] = (0,)
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Cartesian product of hyperparameter axes and seeds as flat ``(K,)`` arrays.

    Returns ``(hparams, seeds)`` for :func:`train_grid`; the seed varies fastest.
    """
    names = list(axes)
    rows = list(itertools.product(*(axes[n] for n in names), seeds))
    hparams = {n: np.asarray([r[i] for r in rows], np.float64) for i, n in enumerate(names)}
    return hparams, np.asarray([r[-1] for r in rows], np.int64)


def _finite_mean(values: np.ndarray) -> float:
    """The mean of the finite entries of ``values``; NaN (without NumPy's warning) if none."""
    finite = values[np.isfinite(values)]
    return float(np.mean(finite)) if finite.size else float("nan")


def _broadcast_grid(
    hparams: Mapping[str, Any] | None, seeds: int | Sequence[int]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    # Kept in float64 on the host (reported as given); the step receives float32 copies.
    hparams = {k: np.atleast_1d(np.asarray(v, np.float64)) for k, v in (hparams or {}).items()}
    sizes = {v.shape[0] for v in hparams.values()}
    for name, v in hparams.items():
        if v.ndim != 1:
            raise ValueError(f"hparams[{name!r}] must be a scalar or a (K,) array, got {v.shape}.")
    seeds_arr = np.atleast_1d(np.asarray(seeds, np.int64))
    if seeds_arr.ndim != 1:
        raise ValueError("seeds must be an int or a 1-D sequence of ints.")
    sizes.add(seeds_arr.shape[0])
    k = max(sizes)
    if not sizes <= {1, k}:
        raise ValueError(f"hparams and seeds have inconsistent grid sizes {sorted(sizes)}.")
    hparams = {n: np.broadcast_to(v, (k,)).copy() for n, v in hparams.items()}
    return hparams, np.broadcast_to(seeds_arr, (k,)).copy()


def train_grid(
    task: tasks_lib.Task,
    model_config: SSMConfig,
    make_tx: MakeTx | optax.GradientTransformation,
    hparams: Mapping[str, Any] | None = None,
    seeds: int | Sequence[int] = 0,
    config: TrainConfig = TrainConfig(),
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    metrics_path: str | os.PathLike | None = None,
    keep_params: bool = True,
    desc: str | None = None,
    param_metrics: Callable[[PyTree], Mapping[str, jax.Array]] | None = None,
) -> train_results.GridResult:
    """Train ``K`` configurations of one model on one task as a single compiled program.

    The step maps one configuration's step over the K axis -- vmapped, in ``lax.map`` chunks
    and split over the local devices as ``config.config_chunk`` and ``config.shard_configs``
    say (:class:`TrainConfig`).

    Args:
      task: a :class:`~optax_decoupled.experiments.tasks.Task`.
      model_config: the model; its input/head fields must match ``task.model_kwargs()``.
      make_tx: ``make_tx(**hparams) -> GradientTransformation`` (called inside the traced
        step with scalar tracers), or a fixed ``GradientTransformation``.
      hparams: ``{name: (K,) array}`` (scalars broadcast), passed to ``make_tx``.
      seeds: an int (all configurations share model init and data order) or ``(K,)`` seeds.
        A seed fixes the model init and the data order (``training_step.seed_keys``).
      config: loop settings (:class:`TrainConfig`).
      checkpoint_dir: where orbax checkpoints go (every ``config.checkpoint_every`` steps, at
        ``stop_at`` and at the end).
      resume: continue from the latest checkpoint in ``checkpoint_dir``; raises
        ``FileNotFoundError`` if there is none and ``checkpoints.CheckpointError`` if it is
        unusable or was written by another run (task and its data, model, grid, seeds, steps,
        ``eval_every``/``eval_splits``: ``checkpoints.task_fingerprint``); it warns if the
        checkpoint's optimizer computes something else (``checkpoints.optimizer_fingerprint``,
        stored with the checkpoint).
        A checkpoint holds the state as trained, including any padding of the grid to a
        multiple of the device count (``TrainConfig.shard_configs``); a grid that needed
        padding resumes on the same number of devices. A resumed run equals an uninterrupted
        one bit for bit when it runs with the same layout (devices and ``config_chunk``);
        with another it continues, up to float rounding, and warns.
      stop_at: stop after this many steps (>= 1; saving a checkpoint), to emulate an
        interruption.
      metrics_path: append JSON lines here (``"eval"`` records per configuration and
        evaluation, whose ``train_loss`` is the mean training loss since the previous
        evaluation, of the finite losses only with ``skip_nonfinite``; a ``"final"`` record
        per configuration). A resume first cuts the file
        back to where it ended at the checkpoint, so no record is written twice.
      keep_params: store each configuration's final parameters in its ``RunResult``.
      desc: progress-bar label.
      param_metrics: ``params -> {name: scalar}`` (e.g. weight norms per group), evaluated
        per configuration at every evaluation and stored in its ``evals`` records.

    Returns:
      A :class:`~optax_decoupled.experiments.train_results.GridResult`, a deterministic
      function of the arguments.
    """
    for field, value in task.model_kwargs().items():
        if getattr(model_config, field) != value:
            raise ValueError(
                f"model_config.{field}={getattr(model_config, field)!r} but task {task.name!r} "
                f"needs {value!r}; build the config with SSMConfig(**task.model_kwargs(), ...)."
            )
    if (resume or stop_at is not None or config.checkpoint_every) and checkpoint_dir is None:
        raise ValueError("resume, stop_at and checkpoint_every need a checkpoint_dir.")
    if stop_at is not None and (
        isinstance(stop_at, bool) or int(stop_at) != stop_at or stop_at < 1
    ):
        raise ValueError(f"stop_at must be None or an int >= 1, got {stop_at!r}.")
    for field in ("eval_splits", "final_splits"):  # before training, not after it
        unknown = [n for n in getattr(config, field) if n not in task.splits]
        if unknown:
            raise ValueError(
                f"TrainConfig.{field} names {unknown}, which task {task.name!r} does not have "
                f"(its splits: {sorted(task.splits)})."
            )
    hp, seeds_arr = _broadcast_grid(hparams, seeds)
    k = seeds_arr.shape[0]
    steps = config.steps
    make_tx = programs.as_make_tx(make_tx)
    if config.skip_nonfinite:
        make_tx = programs.skip_nonfinite_make_tx(make_tx, config.max_consecutive_nonfinite)
    graphdef = training_step.model_graphdef(model_config)
    mesh = programs.config_mesh(k, config.shard_configs)
    devices = 1 if mesh is None else int(mesh.size)
    chunk = programs.resolve_config_chunk(config.config_chunk)
    opt_init, step_fn = programs.step_programs(graphdef, task, make_tx, chunk, mesh)
    # Padding so that the mesh divides the grid: copies of the last configuration, dropped
    # from every result (they only keep the devices' shares equal).
    k_run = k if mesh is None else -(-k // mesh.size) * mesh.size
    seeds_run = np.concatenate([seeds_arr, np.repeat(seeds_arr[-1:], k_run - k)])
    hp_dev = {
        n: jnp.asarray(np.concatenate([v, np.repeat(v[-1:], k_run - k)]), jnp.float32)
        for n, v in hp.items()
    }
    if mesh is not None:
        hp_dev = jax.device_put(
            hp_dev,
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(programs.CONFIG_AXIS)),
        )

    t_start = time.perf_counter()
    model_keys = jnp.stack([training_step.seed_keys(int(s))[0] for s in seeds_run])
    data_keys = jnp.stack(
        [jax.random.key_data(training_step.seed_keys(int(s))[1]) for s in seeds_run]
    )
    _, params, rest = training_step.init_models(model_config, model_keys)
    opt_state = opt_init(params, hp_dev)
    state = programs.TrainState(jnp.asarray(0, jnp.int32), params, rest, opt_state, data_keys)
    state = programs.place(state, mesh)
    history = {
        "loss": np.full((k, steps), np.nan, np.float32),
        "accuracy": np.full((k, steps), np.nan, np.float32),
        "grad_norm": np.full((k, steps), np.nan, np.float32),
    }
    evals: list[list[dict]] = [[] for _ in range(k)]
    meta = {
        "task": task.name,
        "model_config": dataclasses.asdict(model_config),
        "steps": steps,
        "batch_size": task.batch_size,
        "seeds": seeds_arr.tolist(),
        "hparams": {n: v.tolist() for n, v in hp.items()},
        "task_data": checkpoints.task_fingerprint(task),
        # The evaluation schedule: the evals recorded so far and the metrics file follow it.
        "evaluation": {"eval_every": config.eval_every, "eval_splits": list(config.eval_splits)},
        # How the K configurations were laid out: a resume with another layout computes the
        # same steps with other float rounding (another vmap/lax.map split).
        "layout": {"devices": devices, "config_chunk": chunk},
    }
    if checkpoint_dir is not None:  # one configuration's optimizer (see the resume check)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
        meta["optimizer"] = checkpoints.optimizer_fingerprint(make_tx, one, sorted(hp))

    start_step = 0
    if resume:
        target = {"state": state, "history": history}
        restored, saved_meta, start_step = checkpoints.restore_checkpoint(checkpoint_dir, target)
        run_keys = ("task", "model_config", "seeds", "hparams", "steps", "batch_size")
        # (older checkpoints have no task_data and evaluation: not checked on them)
        for key in (*run_keys, *(k for k in ("task_data", "evaluation") if k in saved_meta)):
            here, there = json.loads(json.dumps(meta[key])), saved_meta.get(key)
            if here != there:
                if isinstance(here, dict) and isinstance(there, dict):  # name what differs
                    names = sorted(n for n in {*here, *there} if here.get(n) != there.get(n))
                    here = {n: here.get(n) for n in names}
                    there = {n: there.get(n) for n in names}
                raise checkpoints.CheckpointError(
                    f"checkpoint in {checkpoint_dir!r} was written by a different run: {key} "
                    f"is {there!r} there and {here!r} here."
                )
        checkpoints.warn_if_other_optimizer(
            saved_meta.get("optimizer"), meta["optimizer"], checkpoint_dir
        )
        if "layout" in saved_meta and saved_meta["layout"] != meta["layout"]:
            warnings.warn(
                f"resuming from {checkpoint_dir!r} with another layout of the configurations "
                f"({saved_meta['layout']} there, {meta['layout']} here: devices of the mesh and "
                "TrainConfig.config_chunk): the run continues, but is not bit-identical to an "
                "uninterrupted one (float rounding of another vmap/lax.map split).",
                UserWarning,
                stacklevel=2,
            )
        # Through host memory, so the arrays are uncommitted like freshly initialised ones and
        # the cached step program is reused instead of recompiled for committed inputs.
        train_results.truncate_metrics(metrics_path, saved_meta.get("metrics"))
        state = programs.through_host(restored["state"])
        state = programs.place(state, mesh)
        history = {n: np.array(v) for n, v in restored["history"].items()}
        evals = saved_meta["evals"]

    def checkpoint(step: int) -> None:
        checkpoints.save_checkpoint(
            checkpoint_dir,
            step,
            {"state": state, "history": history},
            {**meta, "evals": evals, "metrics": train_results.metrics_mark(metrics_path)},
            max_to_keep=config.max_to_keep,
        )

    def run_eval(splits: Sequence[str]) -> dict[str, np.ndarray]:
        out = {}
        for name in splits:
            res = programs.evaluate(
                graphdef,
                state.params,
                state.rest,
                task.splits[name],
                batch_size=config.eval_batch_size,
            )
            out[f"{name}_loss"], out[f"{name}_accuracy"] = res["loss"], res["accuracy"]
        if param_metrics is not None:
            metrics = programs.param_metrics_program(param_metrics)(state.params)
            out.update({n: np.asarray(v) for n, v in metrics.items()})
        if config.skip_nonfinite:
            out["skipped_steps"] = programs.skipped_steps(state.opt_state)
        return out

    pending: list[tuple[int, dict]] = []

    def flush() -> None:
        for s, m in jax.device_get(pending):
            for name in history:
                history[name][:, s] = m[name][:k]
        pending.clear()

    end = steps if stop_at is None else min(stop_at, steps)
    bar = tqdm(total=steps, initial=start_step, disable=not config.progress, desc=desc or task.name)
    compile_time = eval_time = 0.0
    t_loop = t_steady = time.perf_counter()
    for s in range(start_step, end):
        state, metrics = step_fn(state, hp_dev)
        pending.append((s, metrics))
        if s == start_step:
            jax.block_until_ready(state)
            compile_time = time.perf_counter() - t_loop
            t_steady = time.perf_counter()
        done = s + 1
        bar.update(1)
        if done % config.log_every == 0:
            flush()
            bar.set_postfix(loss=f"{np.nanmean(history['loss'][:, s]):.4f}", refresh=False)
        if done % config.eval_every == 0 or done == steps:
            jax.block_until_ready(state)
            t_eval = time.perf_counter()
            flush()
            results = run_eval(config.eval_splits)
            since = (done - 1) // config.eval_every * config.eval_every  # the last eval's step
            records = []
            for i in range(k):
                window = history["loss"][i, since:done]
                # A skipped step's NaN/Inf loss moved nothing: the finite ones with skipping.
                train_loss = _finite_mean(window) if config.skip_nonfinite else np.mean(window)
                rec = {"step": done, **{n: float(v[i]) for n, v in results.items()}}
                if "skipped_steps" in results:  # a count, not a measurement
                    rec["skipped_steps"] = int(results["skipped_steps"][i])
                evals[i].append(rec)
                records.append(
                    {
                        "event": "eval",
                        "run": i,
                        "seed": int(seeds_arr[i]),
                        "hparams": {n: float(v[i]) for n, v in hp.items()},
                        "train_loss": float(train_loss),
                        **rec,
                    }
                )
            if metrics_path is not None:
                train_results.write_jsonl(metrics_path, records)
            acc = results.get(f"{config.eval_splits[0]}_accuracy") if config.eval_splits else None
            if acc is not None and config.progress:
                loss = _finite_mean(history["loss"][:, s])
                bar.set_postfix(loss=f"{loss:.4f}", acc=f"{np.max(acc):.4f}")
            eval_time += time.perf_counter() - t_eval
        if checkpoint_dir is not None and (
            (config.checkpoint_every and done % config.checkpoint_every == 0) or done == end
        ):
            jax.block_until_ready(state)
            t_ck = time.perf_counter()
            flush()
            checkpoint(done)
            eval_time += time.perf_counter() - t_ck
    jax.block_until_ready(state)
    flush()
    bar.close()
    t_end = time.perf_counter()
    n_steady = end - start_step - 1
    step_time = (t_end - t_steady - eval_time) / n_steady if n_steady > 0 else float("nan")
    tokens_per_s = k * task.batch_size * task.seq_len / step_time if n_steady > 0 else float("nan")

    final = run_eval(config.final_splits) if end == steps else {}
    final.pop("skipped_steps", None)  # reported as RunResult.skipped_steps
    skipped = programs.skipped_steps(state.opt_state) if config.skip_nonfinite else None
    wall = time.perf_counter() - t_start
    if mesh is not None and programs.is_cpu_mesh(mesh):
        state = programs.off_cpu_mesh(state)
    host_params = programs.to_host(state.params) if keep_params else None
    runs = []
    for i in range(k):
        run = train_results.RunResult(
            index=i,
            seed=int(seeds_arr[i]),
            hparams={n: float(v[i]) for n, v in hp.items()},
            train_loss=history["loss"][i],
            train_accuracy=history["accuracy"][i],
            grad_norm=history["grad_norm"][i],
            evals=list(evals[i]),
            final={n: float(v[i]) for n, v in final.items()},
            wall_time_s=wall,
            params=jax.tree.map(lambda v, i=i: v[i], host_params) if keep_params else None,
            skipped_steps=None if skipped is None else int(skipped[i]),
        )
        runs.append(run)
    if metrics_path is not None and end == steps:
        train_results.write_jsonl(metrics_path, [r.to_dict() for r in runs])
    if k_run > k:  # drop the padding
        state = jax.tree.map(lambda v: v[:k] if np.ndim(v) else v, state)
    return train_results.GridResult(
        runs=runs,
        graphdef=graphdef,
        params=state.params,
        rest=state.rest,
        opt_state=state.opt_state,
        wall_time_s=wall,
        compile_time_s=compile_time,
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        start_step=start_step,
        devices=devices,
    )


def train(
    task: tasks_lib.Task,
    model_config: SSMConfig,
    tx: MakeTx | optax.GradientTransformation,
    *,
    seed: int = 0,
    hparams: Mapping[str, float] | None = None,
    config: TrainConfig = TrainConfig(),
    **kwargs: Any,
) -> train_results.RunResult:
    """Train one configuration (a grid of size 1); keyword arguments as :func:`train_grid`."""
    hparams = {n: [v] for n, v in (hparams or {}).items()}
    return train_grid(task, model_config, tx, hparams, [seed], config, **kwargs).runs[0]
