"""Checkpoints of a training grid (orbax-checkpoint) and what a resume compares.

:func:`save_checkpoint`, :func:`restore_checkpoint` and :func:`latest_checkpoint_step` store a
pytree of arrays with a JSON ``meta`` dict. :func:`task_fingerprint` and
:func:`optimizer_fingerprint` describe a run's data and optimizer, so that
:func:`~optax_decoupled.experiments.train.train_grid` can tell a resume of the same run from
one of another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import optax_decoupled as od
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments.training_step import MakeTx, PyTree


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored (corrupt, incomplete or incompatible)."""


def _checkpoint_manager(directory: str | os.PathLike, max_to_keep: int = 2, create: bool = True):
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


def _hash_array(digest: Any, array: Any, label: str = "") -> None:
    """Adds ``label``, ``array``'s dtype and shape, and its bytes to a hashlib ``digest``."""
    value = np.asarray(array)  # (tobytes is in C order whatever the layout)
    digest.update(f"{label}{value.dtype}{value.shape}".encode() + value.tobytes())


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
    on things a version number does not show: the package's code between releases and
    ``jax_enable_x64``. A resume therefore warns on a mismatch rather than refusing.
    """
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
            "optax_decoupled": od.__version__,
        },
    }


def warn_if_other_optimizer(saved: Any, current: dict, checkpoint_dir: Any) -> None:
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
            "weight decay or the state dtype), or the package's code or "
            "jax_enable_x64 changed since. The run "
            "continues with this run's optimizer; if that is not what you meant, "
            "resume with the same make_tx or train afresh in another checkpoint_dir.",
            UserWarning,
            stacklevel=3,
        )
