"""Trainer for the SSM test bed: a pure, jittable, vmappable step and a grid training loop.

The functional core (what sweeps build on):

* :func:`init_model` / :func:`init_models` -- ``(graphdef, params, rest)`` from an
  :class:`~optax_decoupled.experiments.ssm.SSMConfig` and a seed (or a batch of seeds). ``params``
  is a plain nested dict of arrays (``nnx.to_pure_dict``), so any Optax transformation and any
  path-based decay mask sees names like ``layers/0/mixer/A_log``.
* :func:`loss_fn` -- ``(params, batch, *, graphdef, rest) -> (loss, aux)``, pure.
* :func:`train_step` -- ``(params, opt_state, batch, hparams, *, graphdef, rest, make_tx)``:
  forward, loss, gradient, ``make_tx(**hparams).update``, ``optax.apply_updates``. Pure, so it
  can be ``jax.vmap``-ed over configurations and ``jax.jit``-ed with buffer donation.

Optimizers enter as ``make_tx(**hparams) -> optax.GradientTransformation``. The transformation is
built *inside* the traced step from (possibly traced) scalar hyperparameters: Optax
transformations are closures, so a learning rate or a weight decay that is a tracer of a
``jax.vmap`` over a grid is just another array. :func:`scheduled` wraps any Optax-style
optimizer with a warmup + cosine schedule built from the traced peak learning rate and with
global-norm clipping.

The loop (:func:`train_grid`, and :func:`train` for one run) trains ``K`` configurations --
hyperparameters and seeds -- as one compiled program: the state carries a leading ``K`` axis,
each configuration draws its own batches from its own data key inside the step, evaluation is
periodic, metrics go to JSON lines, progress to tqdm, and checkpoints to orbax-checkpoint. A run
stopped and resumed from a checkpoint ends with parameters bit-identical to an uninterrupted run
(the step is a pure function of the checkpointed state and the step number).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from optax_decoupled._src import validation as V
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments.ssm import Mamba2Model, SSMConfig

PyTree = Any
MakeTx = Callable[..., optax.GradientTransformation]


# ---------------------------------------------------------------------------------------------
# Model state.
# ---------------------------------------------------------------------------------------------


def _as_key(seed_or_key) -> jax.Array:
    if isinstance(seed_or_key, int | np.integer):
        return jax.random.key(int(seed_or_key))
    return seed_or_key


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """The (model-init key, data key) a run with this seed uses."""
    key = jax.random.key(seed)
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


@functools.lru_cache(maxsize=64)
def model_graphdef(config: SSMConfig) -> nnx.GraphDef:
    """The static structure of :class:`Mamba2Model` for ``config`` (no arrays allocated)."""
    return nnx.graphdef(nnx.eval_shape(lambda: Mamba2Model(config, rngs=nnx.Rngs(0))))


def _init_state(config: SSMConfig, key: jax.Array) -> tuple[PyTree, PyTree]:
    model = Mamba2Model(config, rngs=nnx.Rngs(params=key))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def init_model(
    config: SSMConfig, seed_or_key: int | jax.Array
) -> tuple[nnx.GraphDef, PyTree, PyTree]:
    """``(graphdef, params, rest)`` of a freshly initialised model.

    ``params`` holds the ``nnx.Param`` variables and ``rest`` every other variable (empty for
    :class:`Mamba2Model`), both as plain nested dicts of arrays. ``nnx.merge(graphdef, params,
    rest)`` rebuilds the module. An ``int`` is a seed; the model key is then
    ``seed_keys(seed)[0]``, exactly as in :func:`train_grid`.
    """
    key = seed_keys(seed_or_key)[0] if isinstance(seed_or_key, int | np.integer) else seed_or_key
    params, rest = _init_state(config, key)
    return model_graphdef(config), params, rest


def init_models(config: SSMConfig, keys: jax.Array) -> tuple[nnx.GraphDef, PyTree, PyTree]:
    """Like :func:`init_model` for a batch of model keys ``(K,)``: arrays get a leading K axis.

    Model ``i`` is bit for bit the model ``init_model(config, keys[i])``.
    """
    params, rest = _init_program(config)(keys)
    return model_graphdef(config), params, rest


@functools.lru_cache(maxsize=64)
def _init_program(config: SSMConfig):
    # A loop over the keys, not jax.vmap: the same values (tests/test_train.py), but XLA:CPU
    # compiles the vmapped random initialisers in 1.6-1.8x the time (4.7 vs 2.9 s for the
    # 2-layer test model, 6.9 vs 4.0 s on sequential digits; AMD EPYC Zen 1), once per model
    # configuration and grid size, and initialising runs once per grid.
    return jax.jit(lambda keys: jax.lax.map(lambda k: _init_state(config, k), keys))


def apply_model(
    graphdef: nnx.GraphDef, params: PyTree, rest: PyTree, inputs: jax.Array
) -> jax.Array:
    """Logits of the model ``nnx.merge(graphdef, params, rest)`` on ``inputs``."""
    return nnx.merge(graphdef, params, rest)(inputs)


def loss_fn(
    params: PyTree, batch: tasks_lib.Batch, *, graphdef: nnx.GraphDef, rest: PyTree
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean cross-entropy and ``{"accuracy": ...}`` of one batch (pure)."""
    logits = apply_model(graphdef, params, rest, batch["inputs"])
    return tasks_lib.cross_entropy(logits, batch), {"accuracy": tasks_lib.accuracy(logits, batch)}


def train_step(
    params: PyTree,
    opt_state: optax.OptState,
    batch: tasks_lib.Batch,
    hparams: Mapping[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    rest: PyTree,
    make_tx: MakeTx,
) -> tuple[PyTree, optax.OptState, dict[str, jax.Array]]:
    """One optimisation step: loss, gradient, ``make_tx(**hparams).update``, apply (pure).

    Returns new params, new optimizer state and ``{"loss", "accuracy", "grad_norm"}`` (the
    gradient's global norm before any clipping inside the transformation).
    """
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, graphdef=graphdef, rest=rest
    )
    tx = make_tx(**hparams)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": optax.tree.norm(grads)}
    return params, opt_state, metrics


# ---------------------------------------------------------------------------------------------
# Optimizer factories.
# ---------------------------------------------------------------------------------------------


def warmup_cosine(
    peak: jax.typing.ArrayLike,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    init_fraction: float = 0.0,
    end_fraction: float = 0.0,
) -> optax.Schedule:
    """Linear warmup from ``init_fraction * peak`` to ``peak``, then cosine decay to
    ``end_fraction * peak`` at ``total_steps``: ``peak * unit_schedule(count)``.

    ``peak`` may be a tracer (a vmapped learning rate); the unit schedule is Optax's
    ``warmup_cosine_decay_schedule`` with peak 1, whose construction needs concrete values.

    Raises:
      ValueError: unless ``total_steps >= 1`` and ``0 <= warmup_steps < total_steps``.
    """
    _check_schedule_steps(total_steps, warmup_steps)
    if warmup_steps > 0:
        unit = optax.warmup_cosine_decay_schedule(
            init_fraction, 1.0, warmup_steps, total_steps, end_value=end_fraction
        )
    else:
        unit = optax.cosine_decay_schedule(1.0, total_steps, alpha=end_fraction)
    return lambda count: peak * unit(count)


def _check_schedule_steps(total_steps: Any, warmup_steps: Any) -> None:
    if not V.is_int(total_steps) or total_steps < 1:
        raise ValueError(f"`total_steps` must be an int >= 1, got {total_steps!r}.")
    if not V.is_int(warmup_steps) or not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"`warmup_steps` must be an int with 0 <= warmup_steps < total_steps "
            f"({total_steps}), got {warmup_steps!r}."
        )


def scheduled(
    optimizer: Callable[..., optax.GradientTransformation],
    *,
    total_steps: int,
    warmup_steps: int = 0,
    clip_norm: float | None = 1.0,
    end_fraction: float = 0.0,
    lr_name: str = "learning_rate",
    peak_name: str | None = None,
    **fixed: Any,
) -> MakeTx:
    """Turn ``optimizer(learning_rate, **kw)`` into a ``make_tx(learning_rate, **hparams)``.

    The returned factory builds :func:`warmup_cosine` from the (peak) ``learning_rate`` it is
    given, calls ``optimizer(schedule, **fixed, **hparams)`` and, if ``clip_norm`` is set,
    chains ``optax.clip_by_global_norm(clip_norm)`` in front. ``peak_name`` passes the peak
    learning rate under that keyword too (e.g. ``peak_learning_rate`` for
    ``optax_decoupled.adamw(..., decay_convention="schedule")``).

    Example::

        make_tx = scheduled(optax.adamw, total_steps=600, warmup_steps=50, clip_norm=1.0)
        tx = make_tx(learning_rate=3e-3, weight_decay=0.1)

    Raises:
      ValueError: for step counts :func:`warmup_cosine` refuses, or a ``clip_norm`` that is
        not ``None`` or a finite number > 0 (a negative one would turn descent into ascent).
    """
    _check_schedule_steps(total_steps, warmup_steps)
    if clip_norm is not None:
        V.check_not_schedule("clip_norm", clip_norm)
        V.check_positive("clip_norm", clip_norm)

    def make_tx(**hparams: Any) -> optax.GradientTransformation:
        if lr_name not in hparams:
            raise TypeError(f"make_tx needs the peak learning rate as {lr_name}=...")
        peak = hparams.pop(lr_name)
        schedule = warmup_cosine(
            peak, total_steps=total_steps, warmup_steps=warmup_steps, end_fraction=end_fraction
        )
        kwargs = {**fixed, **hparams}
        if peak_name is not None:
            kwargs[peak_name] = peak
        tx = optimizer(schedule, **kwargs)
        if clip_norm is not None:
            tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
        return tx

    return make_tx


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


# ---------------------------------------------------------------------------------------------
# Results and JSON lines.
# ---------------------------------------------------------------------------------------------


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
        the next batch. The counts are reported as :attr:`RunResult.skipped_steps` and in the
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
        (:func:`config_mesh`). On a CPU host this uses several cores only if XLA exposes
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


@dataclasses.dataclass
class RunResult:
    """Outcome of one configuration of a grid.

    Attributes:
      index: position in the grid.
      seed: its seed.
      hparams: its hyperparameters as floats.
      train_loss, train_accuracy, grad_norm: per-step training metrics, shape ``(steps,)``.
      evals: periodic evaluations ``{"step", "<split>_loss", "<split>_accuracy"}``.
      final: final metrics of ``final_splits`` (``"test_accuracy"`` etc.).
      wall_time_s: wall time of the whole grid (configurations train together) in this
        call: for a resumed run, since the resume.
      params: final parameters (NumPy), or ``None`` when not kept.
      skipped_steps: steps skipped for non-finite gradients (``TrainConfig.skip_nonfinite``),
        ``None`` when skipping is off.
    """

    index: int
    seed: int
    hparams: dict[str, float]
    train_loss: np.ndarray
    train_accuracy: np.ndarray
    grad_norm: np.ndarray
    evals: list[dict]
    final: dict[str, float]
    wall_time_s: float
    params: PyTree = None
    skipped_steps: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready summary (no parameters)."""
        return {
            "event": "final",
            "run": self.index,
            "seed": self.seed,
            "hparams": self.hparams,
            "final": self.final,
            "evals": self.evals,
            "train_loss": [float(v) for v in self.train_loss],
            "train_accuracy": [float(v) for v in self.train_accuracy],
            "wall_time_s": self.wall_time_s,
            "skipped_steps": self.skipped_steps,
        }


@dataclasses.dataclass
class GridResult:
    """Outcome of :func:`train_grid`.

    Attributes:
      runs: one :class:`RunResult` per configuration.
      graphdef, params, rest: the final model state, arrays with a leading ``K`` axis.
      opt_state: the final optimizer state, leading ``K`` axis (for diagnostics).
      wall_time_s: wall time of the loop (including compilation and evaluation).
      compile_time_s: time of the first step (compilation plus one step).
      step_time_s: mean time of one (vmapped) step after the first, evaluation excluded.
      tokens_per_s: ``K * batch_size * seq_len / step_time_s``.
      start_step: step the loop started from (non-zero after a resume).
      devices: how many devices the steps ran on (the mesh's size of
        ``TrainConfig.shard_configs``; 1 without one). After a run split over several CPU
        devices, ``params``, ``rest`` and ``opt_state`` are handed back on the default device,
        not split: XLA:CPU's collectives, which any program indexing a split array would
        run, can deadlock (:func:`_off_cpu_mesh`). On accelerators they stay split over the
        mesh.
    """

    runs: list[RunResult]
    graphdef: nnx.GraphDef
    params: PyTree
    rest: PyTree
    opt_state: PyTree
    wall_time_s: float
    compile_time_s: float
    step_time_s: float
    tokens_per_s: float
    start_step: int = 0
    devices: int = 1


def write_jsonl(
    path: str | os.PathLike, records: Sequence[Mapping], *, append: bool = True
) -> None:
    """Write records as JSON lines (NumPy scalars and arrays become numbers and lists)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for record in records:
            f.write(json.dumps(record, default=_json_default) + "\n")


def _metrics_mark(path: str | os.PathLike | None) -> dict | None:
    """Where the metrics file ends now (stored with a checkpoint)."""
    if path is None:
        return None
    path = os.path.abspath(path)
    return {"path": path, "bytes": os.path.getsize(path) if os.path.exists(path) else 0}


def _truncate_metrics(path: str | os.PathLike | None, mark: dict | None) -> None:
    """On resume: drop the records written after the checkpoint (by the interrupted run, or
    the "final" records of a finished one), which the resumed run writes again. Only for the
    file the checkpoint measured, and only if it has grown since."""
    if path is None or not mark or mark.get("path") != os.path.abspath(path):
        return
    if os.path.exists(path) and os.path.getsize(path) > mark["bytes"]:
        with open(path, "r+b") as f:
            f.truncate(mark["bytes"])


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file written by :func:`write_jsonl`."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _json_default(obj):
    if isinstance(obj, np.ndarray | jax.Array):
        return np.asarray(obj).tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj)}")


# ---------------------------------------------------------------------------------------------
# Checkpoints.
# ---------------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored (corrupt, incomplete or incompatible)."""


class TrainState(NamedTuple):
    """Everything a grid's step depends on; arrays other than ``step`` have a leading K axis."""

    step: jax.Array  # () int32, number of updates done
    params: PyTree
    rest: PyTree
    opt_state: optax.OptState
    data_key: jax.Array  # (K, 2) uint32, raw key data of each run's data key


def _checkpoint_manager(directory: str | os.PathLike, max_to_keep: int = 2, create: bool = True):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=create, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_names=("state", "meta")
    )


def save_checkpoint(
    directory: str | os.PathLike, step: int, tree: PyTree, meta: Mapping, *, max_to_keep: int = 2
) -> None:
    """Save a pytree of arrays and a JSON-able ``meta`` dict as checkpoint ``step``."""
    import orbax.checkpoint as ocp

    with _checkpoint_manager(directory, max_to_keep) as mngr:
        mngr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(dict(meta))
            ),
            force=True,
        )
        mngr.wait_until_finished()


def latest_checkpoint_step(directory: str | os.PathLike) -> int | None:
    """The newest checkpoint step in ``directory``, or ``None`` if there is none."""
    if not os.path.isdir(directory):
        return None
    with _checkpoint_manager(directory, create=False) as mngr:
        return mngr.latest_step()


def restore_checkpoint(
    directory: str | os.PathLike, target: PyTree, step: int | None = None
) -> tuple[PyTree, dict, int]:
    """Restore ``(tree, meta, step)``; ``target`` gives the tree's structure, shapes and dtypes.

    Raises:
      FileNotFoundError: no checkpoint (or not the requested step) in ``directory``.
      CheckpointError: the checkpoint exists but cannot be read back into ``target``.
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"no checkpoint directory {directory!r}; train without resume=True to create one."
        )
    with _checkpoint_manager(directory, create=False) as mngr:
        steps = mngr.all_steps()
        if not steps:
            raise FileNotFoundError(
                f"no checkpoint in {directory!r}; train without resume=True to create one."
            )
        step = max(steps) if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {directory!r}; have {steps}."
            )
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), target
        )
        try:
            restored = mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
                ),
            )
            tree, meta = restored["state"], restored["meta"]
            if meta is None:
                raise ValueError("metadata item is missing")
        except Exception as err:  # orbax raises many types for damaged files
            raise CheckpointError(
                f"checkpoint step {step} in {directory!r} is corrupt or incompatible with this "
                f"run ({type(err).__name__}: {err}). Delete it or pass a fresh checkpoint_dir."
            ) from err
    leaves_ok = jax.tree.structure(tree) == jax.tree.structure(abstract) and all(
        np.shape(a) == np.shape(b)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(abstract), strict=True)
    )
    if not leaves_ok:
        raise CheckpointError(
            f"checkpoint step {step} in {directory!r} does not match this run's state structure."
        )
    return tree, meta, step


# ---------------------------------------------------------------------------------------------
# The grid loop.
# ---------------------------------------------------------------------------------------------


def _hash_array(digest: Any, array: Any, label: str = "") -> None:
    """Adds ``label``, ``array``'s dtype and shape, and its bytes to a hashlib ``digest``."""
    value = np.asarray(array)  # (tobytes is in C order whatever the layout)
    digest.update(f"{label}{value.dtype}{value.shape}".encode() + value.tobytes())


def _finite_mean(values: np.ndarray) -> float:
    """The mean of the finite entries of ``values``; NaN (without NumPy's warning) if none."""
    finite = values[np.isfinite(values)]
    return float(np.mean(finite)) if finite.size else float("nan")


def task_fingerprint(task: tasks_lib.Task) -> dict[str, Any]:
    """What a resume compares of ``task`` besides its name: its shapes, batch size and
    description (``info``), and a sha256 of its evaluation splits' arrays, which are drawn
    by the same generator as the training batches, so another sequence length, token count,
    ``split_seed`` or ``num_eval`` changes them. (The training sampler is a function; it is
    compared through these.)"""
    digest = hashlib.sha256()
    for split in sorted(task.splits):
        for key in sorted(task.splits[split]):
            _hash_array(digest, task.splits[split][key], label=f"{split}/{key}:")
    return {
        "name": task.name,
        "seq_len": task.seq_len,
        "num_classes": task.num_classes,
        "head": task.head,
        "vocab_size": task.vocab_size,
        "input_dim": task.input_dim,
        "batch_size": task.batch_size,
        "info": json.loads(json.dumps(task.info, sort_keys=True, default=str)),
        "splits_sha256": digest.hexdigest(),
    }


def optimizer_fingerprint(
    make_tx: MakeTx, params: PyTree, hparam_names: Sequence[str] = ()
) -> dict[str, Any]:
    """What one configuration's optimizer computes, as a hash, to tell a resume with another
    optimizer from one with the same.

    The hash is of the jaxpr of ``make_tx(**hparams).init`` and ``.update`` on ``params``'
    shapes and dtypes (a gradient of the same shapes), with the hyperparameters named in
    ``hparam_names`` as inputs: the grid's values, compared on their own, do not enter it,
    while every fixed setting inside ``make_tx`` (a schedule's length, clipping, a fixed
    weight decay, the state's dtype, the transforms themselves) does, as constants or
    equations. Function addresses, which jaxprs print for custom derivatives, are removed.
    Array constants enter by value. The text depends on the versions of JAX, Optax and this
    package, returned with it (fingerprints of other versions are not comparable), and also
    on things a version number does not show: the package's code between releases, whether
    the compiled CPU kernels are available (a step with them traces to other equations, with
    the same values up to float32 rounding) and ``jax_enable_x64``. A resume therefore warns
    on a mismatch rather than refusing.
    """
    import optax_decoupled

    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params)
    hp = {n: jax.ShapeDtypeStruct((), jnp.float32) for n in hparam_names}

    def init_and_update(p, hparams):
        tx = make_tx(**hparams)
        return tx.update(p, tx.init(p), p)

    closed = jax.make_jaxpr(init_and_update)(specs, hp)
    digest = hashlib.sha256(re.sub(r" at 0x[0-9a-fA-F]+", "", str(closed)).encode())
    for const in closed.consts:  # array constants print as types only: hash their values
        _hash_array(digest, const)
    return {
        "sha256": digest.hexdigest(),
        "versions": {
            "jax": jax.__version__,
            "optax": optax.__version__,
            "optax_decoupled": optax_decoupled.__version__,
        },
    }


def _warn_if_other_optimizer(saved: Any, current: dict, checkpoint_dir: Any) -> None:
    """Warns where a checkpoint's :func:`optimizer_fingerprint` differs from this run's, or
    cannot be compared (other versions). Checkpoints without one (older) pass."""
    if not isinstance(saved, dict):
        return
    if saved.get("versions") != current["versions"]:
        warnings.warn(
            f"the checkpoint in {checkpoint_dir!r} was written with other versions "
            f"({saved.get('versions')}, here {current['versions']}): whether its "
            "optimizer is this run's cannot be checked.",
            UserWarning,
            stacklevel=3,
        )
    elif saved.get("sha256") != current["sha256"]:
        warnings.warn(
            f"the checkpoint in {checkpoint_dir!r} was written by an optimizer that "
            "computes something else than this run's: make_tx differs beyond the "
            "grid's hyperparameters (e.g. a schedule's length, clipping, a fixed "
            "weight decay or the state dtype), or the package's code, the compiled "
            "CPU kernels' availability or jax_enable_x64 changed since. The run "
            "continues with this run's optimizer; if that is not what you meant, "
            "resume with the same make_tx or train afresh in another checkpoint_dir.",
            UserWarning,
            stacklevel=3,
        )


@functools.lru_cache(maxsize=64)
def _constant_make_tx(tx: optax.GradientTransformation) -> MakeTx:
    # Cached by the transformation's identity, so repeated runs reuse compiled programs.
    return lambda: tx


@functools.lru_cache(maxsize=32)
def _skip_nonfinite_make_tx(make_tx: MakeTx, max_consecutive_errors: int) -> MakeTx:
    # Cached like _constant_make_tx, so the wrapped factory keys the program cache stably.
    def wrapped(**hparams: Any) -> optax.GradientTransformation:
        return optax.apply_if_finite(make_tx(**hparams), max_consecutive_errors)

    return wrapped


def _skipped_steps(opt_state: PyTree) -> np.ndarray:
    """``(K,)`` total skipped steps of an ``apply_if_finite`` state with a leading K axis."""
    return np.asarray(opt_state.total_notfinite, np.int64)


def _as_make_tx(tx: MakeTx | optax.GradientTransformation) -> MakeTx:
    if isinstance(tx, optax.GradientTransformation):
        return _constant_make_tx(tx)
    if not callable(tx):
        raise TypeError("pass an optax.GradientTransformation or make_tx(**hparams) -> one.")
    return tx


#: Configurations per vmapped chunk on CPU for ``TrainConfig(config_chunk="auto")``.
CPU_CONFIG_CHUNK = 1

CONFIG_AXIS = "configs"


def resolve_config_chunk(chunk: int | str | None, platform: str | None = None) -> int | None:
    """The chunk size ``TrainConfig.config_chunk`` means on ``platform`` (default backend)."""
    if chunk != "auto":
        return chunk
    platform = platform or jax.default_backend()
    return CPU_CONFIG_CHUNK if platform == "cpu" else None


def config_mesh(k: int, shard: bool = True) -> jax.sharding.Mesh | None:
    """A 1-D mesh over ``min(k, number of local devices)`` devices, ``None`` if that is 1.

    When the mesh size does not divide ``k``, :func:`train_grid` pads the grid with copies of
    its last configuration (computed, then dropped), so every device gets the same share.
    """
    if not shard:
        return None
    devices = jax.local_devices()
    n = min(k, len(devices))
    if n <= 1:
        return None
    return jax.sharding.Mesh(np.asarray(devices[:n]), (CONFIG_AXIS,))


def _place(state: TrainState, mesh: jax.sharding.Mesh | None) -> TrainState:
    """Puts the K axis of every state leaf on ``mesh`` (the step counter is replicated)."""
    if mesh is None:
        return state
    P = jax.sharding.PartitionSpec
    split = jax.sharding.NamedSharding(mesh, P(CONFIG_AXIS))
    replicated = jax.sharding.NamedSharding(mesh, P())
    step = jax.device_put(state.step, replicated)
    rest = jax.device_put(state._replace(step=None), split)
    return rest._replace(step=step)


@functools.lru_cache(maxsize=32)
def _programs(
    graphdef: nnx.GraphDef,
    task: tasks_lib.Task,
    make_tx: MakeTx,
    chunk: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """Jitted (opt-init, step) programs, cached so repeated runs reuse their compilations.

    The step maps the single-configuration step over the K axis: one ``jax.vmap``
    (``chunk=None``) or ``jax.lax.map`` over chunks of ``chunk`` vmapped configurations, inside
    a ``jax.shard_map`` over ``mesh``'s devices when one is given.
    """

    def opt_init(params, hparams):
        return jax.vmap(lambda p, hp: make_tx(**hp).init(p))(params, hparams)

    def one_step(params, rest, opt_state, data_key, hparams, step):
        batch = task.train_batch(jax.random.wrap_key_data(data_key), step)
        return train_step(
            params, opt_state, batch, hparams, graphdef=graphdef, rest=rest, make_tx=make_tx
        )

    def local_steps(params, rest, opt_state, data_key, hparams, step):
        per_config = (params, rest, opt_state, data_key, hparams)
        k = data_key.shape[0]
        if chunk is None or chunk >= k:
            return jax.vmap(one_step, in_axes=(0, 0, 0, 0, 0, None))(*per_config, step)
        return jax.lax.map(lambda xs: one_step(*xs, step), per_config, batch_size=chunk)

    if mesh is not None:
        P = jax.sharding.PartitionSpec
        # The configurations are independent (no collectives), so JAX's varying-manual-axes
        # checks have nothing to verify here; with them on, jax 0.10's batching of a
        # vmapped lax.cond (optax.apply_if_finite, skip_nonfinite) re-applies a pvary to
        # an operand that is already varying and raises "pvary is a invariant->variant
        # collective" when a branch gathers from a constant table (the 8-bit moments' map).
        local_steps = jax.shard_map(
            local_steps,
            mesh=mesh,
            in_specs=(P(CONFIG_AXIS),) * 5 + (P(),),
            out_specs=P(CONFIG_AXIS),
            check_vma=False,
        )

    def step_fn(state: TrainState, hparams):
        params, opt_state, metrics = local_steps(
            state.params, state.rest, state.opt_state, state.data_key, hparams, state.step
        )
        new_state = state._replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return jax.jit(opt_init), jax.jit(step_fn, donate_argnums=0)


@functools.lru_cache(maxsize=32)
def _param_metrics_program(fn: Callable[[PyTree], Mapping[str, jax.Array]]):
    """``fn`` vmapped over the ``K`` configurations and jitted (cached by ``fn``)."""
    return jax.jit(jax.vmap(fn))


@functools.lru_cache(maxsize=32)
def _eval_program(graphdef: nnx.GraphDef):
    """Jitted ``(params_K, rest_K, batch) -> (K, 3)`` sums of (cross-entropy, correct, count)."""

    def eval_one(params, rest, batch):
        logits = apply_model(graphdef, params, rest, batch["inputs"])
        ce, count = tasks_lib.cross_entropy_sum(logits, batch)
        return jnp.stack([ce, tasks_lib.correct_sum(logits, batch), count])

    return jax.jit(jax.vmap(eval_one, in_axes=(0, 0, None)))


def _eval_chunks(split: Mapping[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    n = split["targets"].shape[0]
    size = min(size, n)
    padded = math.ceil(n / size) * size

    def pad(v):
        return np.concatenate([v, np.zeros((padded - n, *v.shape[1:]), v.dtype)])

    full = {k: pad(np.asarray(v)) for k, v in split.items()}
    return [{k: v[i : i + size] for k, v in full.items()} for i in range(0, padded, size)]


def evaluate(
    graphdef: nnx.GraphDef,
    params: PyTree,
    rest: PyTree,
    split: Mapping[str, np.ndarray],
    *,
    batch_size: int = 512,
) -> dict[str, np.ndarray]:
    """Masked mean loss and accuracy of K stacked models (leading K axis) on a split.

    ``split`` is a batch dict (e.g. ``task.splits["test"]``); it is evaluated in chunks of
    ``batch_size``, padded with ``mask = 0``. Returns ``{"loss", "accuracy"}`` of shape (K,).
    """
    eval_fn = _eval_program(graphdef)
    totals = np.zeros((jax.tree.leaves(params)[0].shape[0], 3))
    for chunk in _eval_chunks(split, batch_size):
        totals = totals + np.asarray(eval_fn(params, rest, chunk), np.float64)
    count = np.maximum(totals[:, 2], 1.0)
    return {"loss": totals[:, 0] / count, "accuracy": totals[:, 1] / count}


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


def _host(tree: PyTree) -> PyTree:
    return jax.tree.map(np.asarray, tree)


def _cpu_mesh(mesh: jax.sharding.Mesh) -> bool:
    return all(d.platform == "cpu" for d in mesh.devices.flat)


def _through_host(tree: PyTree) -> PyTree:
    """``tree``'s arrays copied through host memory: uncommitted arrays of the default device."""
    return jax.tree.map(lambda v: jnp.asarray(np.asarray(v)), tree)


def _off_cpu_mesh(tree: PyTree) -> PyTree:
    """``tree``'s arrays, split over a mesh of CPU devices, as arrays of the default device.

    Any program over arrays split across XLA:CPU devices that needs values from more than one
    device (indexing one configuration of the K axis is a gather followed by an all-reduce)
    runs XLA:CPU's in-process collectives, and those can deadlock when several such programs
    wait on the same inputs (every leaf of a tree indexed at once while the last step still
    runs): one device's half waits in the all-reduce for the other's, which never arrives, and
    XLA aborts the process after 40 s ("Termination timeout for `all reduce ...`"). Seen with
    jax 0.10.2 on 2 cores under load: notebook 02 in CI on 2026-12-07, and a standalone
    script that indexes 40 split leaves right after a step, which deadlocks within seconds
    while two other processes load the cores, and just as surely with a 100 s timeout (so it
    is not a slow device). Presumably the CPU client's thread pool fills with one device's
    halves, leaving the other device's none to run on. CPU devices share the host's memory,
    so the final state goes back through it, shard by shard, to one device (no program runs).
    """
    return _through_host(tree)


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
) -> GridResult:
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
        A seed fixes the model init and the data order (:func:`seed_keys`).
      config: loop settings (:class:`TrainConfig`).
      checkpoint_dir: where orbax checkpoints go (every ``config.checkpoint_every`` steps, at
        ``stop_at`` and at the end).
      resume: continue from the latest checkpoint in ``checkpoint_dir``; raises
        ``FileNotFoundError`` if there is none and :class:`CheckpointError` if it is unusable
        or was written by another run (task and its data, model, grid, seeds, steps,
        ``eval_every``/``eval_splits``: :func:`task_fingerprint`); it warns if the
        checkpoint's optimizer computes something else (:func:`optimizer_fingerprint`, stored
        with the checkpoint).
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
      keep_params: store each configuration's final parameters in its :class:`RunResult`.
      desc: progress-bar label.
      param_metrics: ``params -> {name: scalar}`` (e.g. weight norms per group), evaluated
        per configuration at every evaluation and stored in its ``evals`` records.

    Returns:
      A :class:`GridResult`. The result is a deterministic function of the arguments.
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
    make_tx = _as_make_tx(make_tx)
    if config.skip_nonfinite:
        make_tx = _skip_nonfinite_make_tx(make_tx, config.max_consecutive_nonfinite)
    graphdef = model_graphdef(model_config)
    mesh = config_mesh(k, config.shard_configs)
    devices = 1 if mesh is None else int(mesh.size)
    chunk = resolve_config_chunk(config.config_chunk)
    opt_init, step_fn = _programs(graphdef, task, make_tx, chunk, mesh)
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
            hp_dev, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(CONFIG_AXIS))
        )

    t_start = time.perf_counter()
    model_keys = jnp.stack([seed_keys(int(s))[0] for s in seeds_run])
    data_keys = jnp.stack([jax.random.key_data(seed_keys(int(s))[1]) for s in seeds_run])
    _, params, rest = init_models(model_config, model_keys)
    opt_state = opt_init(params, hp_dev)
    state = _place(TrainState(jnp.asarray(0, jnp.int32), params, rest, opt_state, data_keys), mesh)
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
        "task_data": task_fingerprint(task),
        # The evaluation schedule: the evals recorded so far and the metrics file follow it.
        "evaluation": {"eval_every": config.eval_every, "eval_splits": list(config.eval_splits)},
        # How the K configurations were laid out: a resume with another layout computes the
        # same steps with other float rounding (another vmap/lax.map split).
        "layout": {"devices": devices, "config_chunk": chunk},
    }
    if checkpoint_dir is not None:  # one configuration's optimizer (see the resume check)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
        meta["optimizer"] = optimizer_fingerprint(make_tx, one, sorted(hp))

    start_step = 0
    if resume:
        target = {"state": state, "history": history}
        restored, saved_meta, start_step = restore_checkpoint(checkpoint_dir, target)
        run_keys = ("task", "model_config", "seeds", "hparams", "steps", "batch_size")
        # (task_data and evaluation since 2026-12-01: older checkpoints are not checked on them)
        for key in (*run_keys, *(k for k in ("task_data", "evaluation") if k in saved_meta)):
            here, there = json.loads(json.dumps(meta[key])), saved_meta.get(key)
            if here != there:
                if isinstance(here, dict) and isinstance(there, dict):  # name what differs
                    names = sorted(n for n in {*here, *there} if here.get(n) != there.get(n))
                    here = {n: here.get(n) for n in names}
                    there = {n: there.get(n) for n in names}
                raise CheckpointError(
                    f"checkpoint in {checkpoint_dir!r} was written by a different run: {key} "
                    f"is {there!r} there and {here!r} here."
                )
        _warn_if_other_optimizer(saved_meta.get("optimizer"), meta["optimizer"], checkpoint_dir)
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
        _truncate_metrics(metrics_path, saved_meta.get("metrics"))
        state = _through_host(restored["state"])
        state = _place(state, mesh)
        history = {n: np.array(v) for n, v in restored["history"].items()}
        evals = saved_meta["evals"]

    def checkpoint(step: int) -> None:
        save_checkpoint(
            checkpoint_dir,
            step,
            {"state": state, "history": history},
            {**meta, "evals": evals, "metrics": _metrics_mark(metrics_path)},
            max_to_keep=config.max_to_keep,
        )

    def run_eval(splits: Sequence[str]) -> dict[str, np.ndarray]:
        out = {}
        for name in splits:
            res = evaluate(
                graphdef,
                state.params,
                state.rest,
                task.splits[name],
                batch_size=config.eval_batch_size,
            )
            out[f"{name}_loss"], out[f"{name}_accuracy"] = res["loss"], res["accuracy"]
        if param_metrics is not None:
            metrics = _param_metrics_program(param_metrics)(state.params)
            out.update({n: np.asarray(v) for n, v in metrics.items()})
        if config.skip_nonfinite:
            out["skipped_steps"] = _skipped_steps(state.opt_state)
        return out

    pending: list[tuple[int, dict]] = []

    def flush() -> None:
        for s, m in jax.device_get(pending):
            for name in history:
                history[name][:, s] = m[name][:k]
        pending.clear()

    from tqdm.auto import tqdm

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
                write_jsonl(metrics_path, records)
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
    skipped = _skipped_steps(state.opt_state) if config.skip_nonfinite else None
    wall = time.perf_counter() - t_start
    if mesh is not None and _cpu_mesh(mesh):
        state = _off_cpu_mesh(state)
    host_params = _host(state.params) if keep_params else None
    runs = []
    for i in range(k):
        run = RunResult(
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
        write_jsonl(metrics_path, [r.to_dict() for r in runs])
    if k_run > k:  # drop the padding
        state = jax.tree.map(lambda v: v[:k] if np.ndim(v) else v, state)
    return GridResult(
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
) -> RunResult:
    """Train one configuration (a grid of size 1); keyword arguments as :func:`train_grid`."""
    hparams = {n: [v] for n, v in (hparams or {}).items()}
    return train_grid(task, model_config, tx, hparams, [seed], config, **kwargs).runs[0]
