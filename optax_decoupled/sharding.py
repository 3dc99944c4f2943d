"""Sharding optimizer state like the parameters (ZeRO-style), with JAX's own SPMD.

Every moment of this package's transforms has its parameter's shape, so the natural layout
puts each moment on its parameter's sharding: FSDP-sharded weights get FSDP-sharded moments
(ZeRO stage 1-3 for the optimizer state), replicated weights replicated moments.

* Eagerly, ``tx.init(params)`` already does this: moments are created with
  ``jnp.zeros_like(param)``, which keeps a concrete array's sharding.
* Under ``jit`` the compiler cannot see the input shardings of a constant, so pass
  ``out_shardings=state_shardings(tx, params)`` (this module), which is what
  :func:`jit_init` does. ``update`` needs nothing: its outputs follow its inputs.

Example::

    mesh = jax.make_mesh((8,), ("fsdp",))
    params = jax.device_put(params, param_shardings)
    tx = optax_decoupled.adamw(1e-3)
    opt_state = optax_decoupled.sharding.jit_init(tx, params)
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_decoupled import packing, storage
from optax_decoupled.quantization import QuantizedArray


def state_shardings(
    tx: optax.GradientTransformation,
    params: Any,
    replicated: jax.sharding.Sharding | None = None,
) -> Any:
    """The sharding of every leaf of ``tx.init(params)``: each moment takes its parameter's
    (a parameter on one device among parameters on a mesh, e.g. an uncommitted bias, or a
    NumPy array, gets moments replicated on that mesh, where ``jit`` would put it).

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
        raise ValueError(
            "state_shardings/jit_init: cannot match this optimizer's state to the parameters. "
            "optax.tree_utils.tree_map_params, which finds the parameter-shaped parts of the "
            "state, failed; it does for optax.masked (its state has the masked tree's "
            "structure), also with optax's own optimizers. Give the decay mask to this "
            "package's transforms instead (mask=...), or call tx.init(params) and place the "
            f"state yourself. ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e


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
    """``tx.init`` compiled with every moment placed on its parameter's sharding."""
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params))(params)
