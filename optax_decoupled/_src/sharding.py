"""Optimizer state sharded like the parameters (ZeRO-style), with JAX's own SPMD.

Every moment has its parameter's shape and takes its parameter's sharding; 8-bit codes and
scales split along the leading axis where whole blocks allow.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import optax

from optax_decoupled._src import packing, storage
from optax_decoupled._src.quantization import QuantizedArray


def state_shardings(
    tx: optax.GradientTransformation,
    params: Any,
    replicated: jax.sharding.Sharding | None = None,
) -> Any:
    """The sharding of every leaf of ``tx.init(params)``: each moment takes its parameter's
    (a parameter on one device among parameters on a mesh, e.g. an uncommitted bias, or a
    NumPy array, gets moments replicated on that mesh, where ``jit`` would put it).

    Moments are found with :func:`optax.tree_utils.tree_map_params`; where it cannot pair the
    state with the parameters (``optax.masked``, ``optax.multi_transform``: moments of a part of
    the parameter tree), by key path: a state leaf whose key path ends with a parameter's and
    that has its shape takes its sharding.

    Non-parameter leaves (step counts, injected hyperparameters) get ``replicated``, by
    default a fully replicated :class:`~jax.sharding.NamedSharding` on the mesh of the first
    parameter on a mesh (else the sharding of the first parameter, or the default device
    when there are no parameters).
    """
    # NumPy arrays, Python scalars (which tx.init accepts) and uncommitted jax.Arrays go where
    # jit puts them: on the device of the committed parameters, replicated on their mesh, or
    # on the default device when none is committed.
    committed = [
        p.sharding for p in jax.tree.leaves(params) if isinstance(p, jax.Array) and p.committed
    ]
    default = next(
        (s for s in committed if isinstance(s, jax.sharding.SingleDeviceSharding)),
        jax.sharding.SingleDeviceSharding(_default_device()),
    )
    param_shardings = jax.tree.map(
        lambda p: p.sharding if isinstance(p, jax.Array) and p.committed else default, params
    )
    if replicated is None:
        leaves = jax.tree.leaves(param_shardings)
        on_mesh = [s for s in leaves if isinstance(s, jax.sharding.NamedSharding)]
        if on_mesh:
            replicated = jax.sharding.NamedSharding(on_mesh[0].mesh, jax.sharding.PartitionSpec())
        elif leaves:
            replicated = leaves[0]
        else:
            replicated = default
    if isinstance(replicated, jax.sharding.NamedSharding):
        param_shardings = jax.tree.map(
            lambda s: replicated if isinstance(s, jax.sharding.SingleDeviceSharding) else s,
            param_shardings,
        )
    shapes = jax.eval_shape(tx.init, params)
    packed = jax.tree.leaves(
        shapes, is_leaf=lambda x: isinstance(x, packing.PackedState) or x is None
    )
    if any(isinstance(x, packing.PackedState) for x in packed):
        raise ValueError(
            "state_shardings/jit_init: this optimizer is packed (optax_decoupled.packed), and "
            "its state lives in packed buffers, not per parameter; packed optimizers are for "
            "unsharded parameters. Use the unpacked optimizer for sharded parameters, or "
            "tx.init(params) for packed ones."
        )
    try:
        return optax.tree_utils.tree_map_params(
            tx,
            storage.stored_sharding,  # 8-bit moments: codes/scales split like the leading axis
            shapes,
            param_shardings,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, QuantizedArray),
        )
    except ValueError as e:
        # optax.masked and optax.multi_transform keep moments of a masked copy of the
        # parameter tree (optax.MaskedNode where another transform owns a leaf), which
        # tree_map_params cannot pair with the parameters: match by key path instead.
        found = _shardings_by_key_path(shapes, params, param_shardings, replicated)
        if found is not None:
            return found
        raise ValueError(
            "state_shardings/jit_init: cannot match this optimizer's state to the parameters: "
            "optax.tree_utils.tree_map_params, which finds the parameter-shaped parts of the "
            "state, failed, and no state leaf's key path ends with a parameter's key path "
            "with its shape. Call tx.init(params) and place the state yourself. "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e


def _shardings_by_key_path(
    shapes: Any, params: Any, param_shardings: Any, replicated: Any
) -> Any | None:
    """The shardings of a state whose moments are trees shaped like a *part* of the parameters
    (``optax.masked``, ``optax.multi_transform``): a state leaf whose key path ends with a
    parameter's key path (the longest such) and that has that parameter's shape (an 8-bit
    moment: as many blocks as the parameter needs) takes the parameter's sharding, as
    :func:`~optax_decoupled._src.storage.stored_sharding` lays it out; every other leaf gets
    ``replicated``. ``None`` when no leaf matches a parameter (there are parameters)."""
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_shardings = jax.tree.leaves(param_shardings)
    by_path = {
        tuple(path): (tuple(jax.numpy.shape(p)), sh)
        for (path, p), sh in zip(flat_params, flat_shardings, strict=True)
    }
    lengths = sorted({len(k) for k in by_path}, reverse=True)
    matched = []

    def fits(leaf: Any, shape: tuple[int, ...]) -> bool:
        if isinstance(leaf, QuantizedArray):
            n_blocks, block = leaf.codes.shape
            size = math.prod(shape)
            return n_blocks == max(1, -(-size // block))
        return tuple(leaf.shape) == shape

    def one(path: tuple[Any, ...], leaf: Any) -> Any:
        for n in lengths:
            if n > len(path):
                continue
            hit = by_path.get(tuple(path[len(path) - n :]))
            if hit is not None and fits(leaf, hit[0]):
                matched.append(path)
                return storage.stored_sharding(leaf, hit[1])
        return replicated

    out = jax.tree_util.tree_map_with_path(
        one, shapes, is_leaf=lambda x: isinstance(x, QuantizedArray)
    )
    return out if matched or not flat_params else None


def _default_device() -> jax.Device:
    """Where JAX puts an uncommitted array: ``jax.default_device``'s device, else this
    process's first device of the default backend."""
    device = jax.config.jax_default_device
    if isinstance(device, jax.Device):
        return device
    if isinstance(device, str):  # a platform name
        return jax.local_devices(backend=device)[0]
    return jax.local_devices()[0]


def jit_init(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init`` compiled with every moment placed on its parameter's sharding.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax_decoupled as od
      >>> mesh = jax.make_mesh((1,), ("fsdp",))
      >>> spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
      >>> params = {"w": jax.device_put(jnp.ones((8, 4)), spec)}
      >>> state = od.contrib.jit_init(od.adamw(1e-3), params)
      >>> tuple(od.diagnostics.find_adam_state(state).mu["w"].sharding.spec)
      ('fsdp',)
    """
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
