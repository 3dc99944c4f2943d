"""The compiled programs that train and evaluate K configurations of one model at once.

A grid's state (:class:`TrainState`) carries a leading K axis. :func:`step_programs` maps the
single-configuration step (:func:`~optax_decoupled.experiments.training_step.train_step`) over
that axis: one ``jax.vmap``, or a ``jax.lax.map`` over chunks of vmapped configurations
(:func:`resolve_config_chunk`), inside a ``jax.shard_map`` over a 1-D mesh of local devices
(:func:`config_mesh`) when there are several. :func:`evaluate` scores the K models on a split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments import training_step
from optax_decoupled.experiments.training_step import MakeTx, PyTree


class TrainState(NamedTuple):
    """Everything a grid's step depends on; arrays other than ``step`` have a leading K axis."""

    step: jax.Array  # () int32, number of updates done
    params: PyTree
    rest: PyTree
    opt_state: optax.OptState
    data_key: jax.Array  # (K, 2) uint32, raw key data of each run's data key


@functools.lru_cache(maxsize=64)
def _constant_make_tx(tx: optax.GradientTransformation) -> MakeTx:
    # Cached by the transformation's identity, so repeated runs reuse compiled programs.
    return lambda: tx


@functools.lru_cache(maxsize=32)
def skip_nonfinite_make_tx(make_tx: MakeTx, max_consecutive_errors: int) -> MakeTx:
    """``make_tx`` wrapped in ``optax.apply_if_finite`` (``TrainConfig.skip_nonfinite``).

    Cached, so the same arguments give the same factory, which keys the program cache.
    """

    def wrapped(**hparams: Any) -> optax.GradientTransformation:
        return optax.apply_if_finite(make_tx(**hparams), max_consecutive_errors)

    return wrapped


def skipped_steps(opt_state: PyTree) -> np.ndarray:
    """``(K,)`` total skipped steps of an ``apply_if_finite`` state with a leading K axis."""
    return np.asarray(opt_state.total_notfinite, np.int64)


def as_make_tx(tx: MakeTx | optax.GradientTransformation) -> MakeTx:
    """``tx`` as a factory: a fixed transformation becomes ``lambda: tx`` (cached by its
    identity, so repeated runs reuse compiled programs); a callable is returned as is.

    Raises:
      TypeError: for anything else.
    """
    if isinstance(tx, optax.GradientTransformation):
        return _constant_make_tx(tx)
    if not callable(tx):
        raise TypeError("pass an optax.GradientTransformation or make_tx(**hparams) -> one.")
    return tx


#: Configurations per vmapped chunk on CPU for ``TrainConfig(config_chunk="auto")``.
CPU_CONFIG_CHUNK = 1

#: The mesh axis the K configurations are split over.
CONFIG_AXIS = "configs"


def resolve_config_chunk(chunk: int | str | None, platform: str | None = None) -> int | None:
    """The chunk size ``TrainConfig.config_chunk`` means on ``platform`` (default backend)."""
    if chunk != "auto":
        return chunk
    platform = platform or jax.default_backend()
    return CPU_CONFIG_CHUNK if platform == "cpu" else None


def config_mesh(k: int, shard: bool = True) -> jax.sharding.Mesh | None:
    """A 1-D mesh over ``min(k, number of local devices)`` devices, ``None`` if that is 1.

    When the mesh size does not divide ``k``,
    :func:`~optax_decoupled.experiments.train.train_grid` pads the grid with copies of
    its last configuration (computed, then dropped), so every device gets the same share.
    """
    if not shard:
        return None
    devices = jax.local_devices()
    n = min(k, len(devices))
    if n <= 1:
        return None
    return jax.sharding.Mesh(np.asarray(devices[:n]), (CONFIG_AXIS,))


def place(state: TrainState, mesh: jax.sharding.Mesh | None) -> TrainState:
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
def step_programs(
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
        return training_step.train_step(
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
def param_metrics_program(fn: Callable[[PyTree], Mapping[str, jax.Array]]):
    """``fn`` vmapped over the ``K`` configurations and jitted (cached by ``fn``)."""
    return jax.jit(jax.vmap(fn))


@functools.lru_cache(maxsize=32)
def _eval_program(graphdef: nnx.GraphDef):
    """Jitted ``(params_K, rest_K, batch) -> (K, 3)`` sums of (cross-entropy, correct, count)."""

    def eval_one(params, rest, batch):
        logits = training_step.apply_model(graphdef, params, rest, batch["inputs"])
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


def to_host(tree: PyTree) -> PyTree:
    """``tree``'s arrays as NumPy arrays."""
    return jax.tree.map(np.asarray, tree)


def is_cpu_mesh(mesh: jax.sharding.Mesh) -> bool:
    """Whether every device of ``mesh`` is a CPU device."""
    return all(d.platform == "cpu" for d in mesh.devices.flat)


def through_host(tree: PyTree) -> PyTree:
    """``tree``'s arrays copied through host memory: uncommitted arrays of the default device."""
    return jax.tree.map(lambda v: jnp.asarray(np.asarray(v)), tree)


def off_cpu_mesh(tree: PyTree) -> PyTree:
    """``tree``'s arrays, split over a mesh of CPU devices, as arrays of the default device.

    Any program over arrays split across XLA:CPU devices that needs values from more than one
    device (indexing one configuration of the K axis is a gather followed by an all-reduce)
    runs XLA:CPU's in-process collectives, and those can deadlock when several such programs
    wait on the same inputs: one device's half waits in the all-reduce for the other's, which
    never arrives, and XLA aborts the process after 40 s ("Termination timeout for `all
    reduce ...`"). CPU devices share the host's memory, so the state goes back through it,
    shard by shard, to one device, and no program runs.
    """
    return through_host(tree)
