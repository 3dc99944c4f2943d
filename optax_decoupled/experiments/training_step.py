"""The SSM as plain arrays and one pure training step.

* :func:`init_model` / :func:`init_models` -- ``(graphdef, params, rest)`` from an
  :class:`~optax_decoupled.experiments.ssm.SSMConfig` and a seed (or a batch of keys).
  ``params`` is a plain nested dict of arrays (``nnx.to_pure_dict``), so any Optax
  transformation and any path-based decay mask sees names like ``layers/0/mixer/A_log``.
* :func:`loss_fn` -- ``(params, batch, *, graphdef, rest) -> (loss, aux)``, pure.
* :func:`train_step` -- ``(params, opt_state, batch, hparams, *, graphdef, rest, make_tx)``:
  forward, loss, gradient, ``make_tx(**hparams).update``, ``optax.apply_updates``. Pure, so it
  can be ``jax.vmap``-ed over configurations and ``jax.jit``-ed with buffer donation.

Optimizers enter as ``make_tx(**hparams) -> optax.GradientTransformation``, built *inside* the
traced step from (possibly traced) scalar hyperparameters: Optax transformations are closures,
so a learning rate that is a tracer of a ``jax.vmap`` over a grid is just another array.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments.ssm import Mamba2Model, SSMConfig

PyTree = Any
#: ``make_tx(**hparams) -> optax.GradientTransformation``, called inside the traced step.
MakeTx = Callable[..., optax.GradientTransformation]


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
    ``seed_keys(seed)[0]``, exactly as in :func:`~optax_decoupled.experiments.train.train_grid`.
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
    # compiles the vmapped random initialisers in about 1.7x the time, once per model
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
