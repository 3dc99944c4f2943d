"""Optimizer-state memory, measured: bytes per parameter, a compiled step, a 7B model.

* :func:`bytes_per_param_table` -- SGD+momentum, Lion, AdamW, AMSGrad × float32 / bfloat16 /
  int8 state: bytes per parameter measured (:func:`optax_decoupled.contrib.state_bytes` of
  ``tx.init``) on a large-tensor model and on the SSM, next to the theoretical value.
* :func:`l2_vs_adamw_memory` -- tests the claim "L2 regularisation makes Adam's variance
  tensor explode in memory, AdamW fixes it": state bytes and the compiled SSM training step's
  memory (XLA buffer assignment) for ``adam_l2`` vs ``adamw`` at two batch sizes.
* :func:`memory_7b` -- weights, gradients and optimizer state of a 7B-parameter
  (Llama-2-7B-shaped) model, computed with the same functions on abstract shapes.

All of it is shape arithmetic and compilation: nothing is trained and nothing big is
allocated (``jax.eval_shape``, ``jax.ShapeDtypeStruct``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments import training_step
from optax_decoupled.experiments.ssm import SSMConfig

#: The state dtypes of the memory tables.
STATE_DTYPES = ("float32", "bfloat16", "int8")


class MomentumState(NamedTuple):
    """State of :func:`sgd_momentum`'s trace: the momentum buffer."""

    trace: optax.Updates


def sgd_momentum(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    *,
    state_dtype: Any = None,
) -> optax.GradientTransformation:
    r"""Heavy-ball SGD, :math:`m_t = \beta m_{t-1} + g_t`, :math:`u_t = -\eta_t m_t`, with the
    momentum stored through the package's moment storage (:func:`optax_decoupled.resolve_storage`
    of ``state_dtype``, so ``"int8"`` works).

    The same update as ``optax.sgd(learning_rate, momentum)`` (``optax.trace``); here only to
    measure SGD's state in every storage format.
    """
    store = od.resolve_storage(state_dtype)

    def init_fn(params):
        return MomentumState(jax.tree.map(lambda p: store.init(p, signed=True), params))

    def update_fn(updates, state, params=None):
        del params

        def leaf(g, m_s):
            m = momentum * store.read(m_s, g) + g.astype(jnp.float32)
            return m.astype(g.dtype), store.write(m, g, signed=True)

        treedef = jax.tree.structure(updates)
        parts = treedef.flatten_up_to(jax.tree.map(leaf, updates, state.trace))
        trace = treedef.unflatten([p[1] for p in parts])
        return treedef.unflatten([p[0] for p in parts]), MomentumState(trace)

    trace = optax.GradientTransformation(init_fn, update_fn)
    return optax.chain(trace, optax.scale_by_learning_rate(learning_rate))


#: The optimizers of the memory tables: name -> factory(state_dtype).
OPTIMIZERS: dict[str, Callable[[Any], optax.GradientTransformation]] = {
    "sgd_momentum": lambda sd: sgd_momentum(1e-2, state_dtype=sd),
    "lion": lambda sd: od.lion(1e-4, weight_decay=0.1, state_dtype=sd),
    "adamw": lambda sd: od.adamw(1e-3, weight_decay=0.1, state_dtype=sd),
    "amsgrad": lambda sd: od.amsgrad(1e-3, weight_decay=0.1, state_dtype=sd),
}


def abstract(shapes: dict[str, Any], dtype: Any = jnp.float32) -> Any:
    """A pytree of ``ShapeDtypeStruct`` s from a nested dict of shapes."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(tuple(s), dtype),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple),
    )


def llama_7b_shapes(
    vocab: int = 32000, d: int = 4096, layers: int = 32, ffn: int = 11008
) -> dict[str, Any]:
    """Parameter shapes of a Llama-2-7B-style decoder (untied embedding and head): 6.74e9."""
    layer = {
        "attn": {n: {"kernel": (d, d)} for n in ("q", "k", "v", "o")},
        "mlp": {"gate": {"kernel": (d, ffn)}, "up": {"kernel": (d, ffn)},
                "down": {"kernel": (ffn, d)}},
        "attn_norm": {"scale": (d,)},
        "mlp_norm": {"scale": (d,)},
    }  # fmt: skip
    return {
        "embed": {"embedding": (vocab, d)},
        "layers": {str(i): layer for i in range(layers)},
        "final_norm": {"scale": (d,)},
        "lm_head": {"kernel": (d, vocab)},
    }


def large_tensor_shapes() -> dict[str, Any]:
    """A model of large matrices only (every moment is quantized): 4 × 1024×1024."""
    return {f"dense{i}": {"kernel": (1024, 1024)} for i in range(4)}


def ssm_digits_setup(d_model: int = 32, n_layers: int = 2, batch_size: int = 64):
    """``(task, model_config, params)`` of the sequential-digits SSM (by default d_model 32,
    two layers, batches of 64: larger than the comparison's ``quick`` model, so that some
    of its tensors reach the 8-bit storage's 4096-element threshold)."""
    task = tasks_lib.sequential_digits(batch_size=batch_size)
    config = SSMConfig(**task.model_kwargs(), d_model=d_model, n_layers=n_layers)
    _, params, _ = training_step.init_model(config, 0)
    return task, config, params


def bytes_per_param_table(
    models: dict[str, Any] | None = None,
    optimizers: Sequence[str] = tuple(OPTIMIZERS),
    state_dtypes: Sequence[Any] = STATE_DTYPES,
) -> list[dict[str, Any]]:
    """Optimizer-state bytes per parameter, measured, next to the theory.

    Args:
      models: ``{name: params}`` (arrays or ``ShapeDtypeStruct`` s). Default: the
        large-matrix model of :func:`large_tensor_shapes` and the SSM of
        :func:`ssm_digits_setup`.

    Returns:
      One row per optimizer and state dtype: ``optimizer``, ``state_dtype``, ``theory``
      (large tensors, step counters ignored) and ``measured:<model>`` per model, plus
      ``params:<model>``.
    """
    if models is None:
        _, _, ssm_params = ssm_digits_setup()
        models = {"large matrices": abstract(large_tensor_shapes()), "SSM digits": ssm_params}
    rows = []
    for opt in optimizers:
        for sd in state_dtypes:
            row: dict[str, Any] = {
                "optimizer": opt,
                "state_dtype": str(sd),
                "theory": od.contrib.theoretical_bytes_per_param(opt, sd),
            }
            for name, params in models.items():
                sb = od.contrib.state_bytes(
                    od.contrib.abstract_state(OPTIMIZERS[opt](sd), params), params
                )
                row[f"measured:{name}"] = sb.per_param
                row[f"params:{name}"] = sb.num_params
            rows.append(row)
    return rows


def _abstract_batch(task, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    example = task.splits["val"]
    return {
        k: jax.ShapeDtypeStruct((batch_size, *np.shape(v)[1:]), np.asarray(v).dtype)
        for k, v in example.items()
    }


def l2_vs_adamw_memory(
    batch_sizes: Sequence[int] = (4, 512),
    *,
    d_model: int = 32,
    n_layers: int = 2,
    weight_decay: float = 0.1,
    state_dtype: Any = None,
) -> list[dict[str, Any]]:
    """State bytes and compiled-step memory of ``adam_l2`` vs ``adamw`` on the SSM.

    The step is the trainer's
    :func:`~optax_decoupled.experiments.training_step.train_step` (forward, backward,
    optimizer update, apply), jitted with parameters and optimizer state donated, compiled for
    abstract inputs and read with :func:`optax_decoupled.contrib.step_memory`.

    Returns:
      One row per optimizer and batch size: ``optimizer``, ``batch_size``, ``state_bytes``,
      ``state_shapes`` (the distinct shapes of the state's leaves, to compare), and the
      :class:`~optax_decoupled.contrib.StepMemory` fields (``arguments``, ``outputs``,
      ``temporaries``, ``aliased``, ``peak``, ...).
    """
    task, config, params = ssm_digits_setup(d_model, n_layers)
    graphdef, _, rest = training_step.init_model(config, 0)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    factories = {
        "adam_l2": lambda: od.adam_l2(1e-3, weight_decay=weight_decay, state_dtype=state_dtype),
        "adamw": lambda: od.adamw(1e-3, weight_decay=weight_decay, state_dtype=state_dtype),
    }
    rows = []
    for name, make_tx in factories.items():
        state = od.contrib.abstract_state(make_tx(), abstract_params)
        sb = od.contrib.state_bytes(state, params)
        shapes = sorted({tuple(x.shape) for x in jax.tree.leaves(state)})
        for batch_size in batch_sizes:

            def step(p, s, batch, make_tx=make_tx):
                return training_step.train_step(
                    p, s, batch, {}, graphdef=graphdef, rest=rest, make_tx=make_tx
                )

            mem = od.contrib.step_memory(
                step,
                abstract_params,
                state,
                _abstract_batch(task, batch_size),
                donate_argnums=(0, 1),
            )
            rows.append(
                {
                    "optimizer": name,
                    "batch_size": batch_size,
                    "state_bytes": sb.total,
                    "state_bytes_per_param": sb.per_param,
                    "num_params": sb.num_params,
                    "state_shapes": shapes,
                    **mem.as_dict(),
                }
            )
    return rows


def memory_7b(
    shapes: dict[str, Any] | None = None,
    optimizers: Sequence[str] = ("adamw", "lion", "amsgrad", "sgd_momentum"),
    state_dtypes: Sequence[Any] = STATE_DTYPES,
    weights_dtypes: Sequence[Any] = ("float32", "bfloat16"),
) -> list[dict[str, Any]]:
    """Weights, gradients and optimizer state of a 7B model, by the package's functions.

    Every number comes from :func:`optax_decoupled.contrib.training_memory` on the abstract
    parameters of :func:`llama_7b_shapes` (biases and norms included; small tensors keep
    float32 moments under int8 storage, as in training). Gradients have the weights' dtype.

    Returns:
      One row per weights dtype, optimizer and state dtype with ``weights``, ``gradients``,
      ``optimizer_state``, ``total`` (bytes) and ``num_params``.
    """
    params = abstract(shapes or llama_7b_shapes())
    rows = []
    for wd in weights_dtypes:
        for opt in optimizers:
            for sd in state_dtypes:
                # Moments are kept in float32 for bfloat16 weights unless asked otherwise.
                m = od.contrib.training_memory(params, OPTIMIZERS[opt](sd), weights_dtype=wd)
                rows.append({"weights_dtype": str(wd), "optimizer": opt, "state_dtype": str(sd),
                             **m})  # fmt: skip
    return rows


def l2_vs_adamw_finding(rows: list[dict[str, Any]]) -> str:
    """What the ``l2_vs_adamw`` rows show, in one sentence computed from them."""
    by_batch: dict[Any, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_batch.setdefault(row["batch_size"], {})[row["optimizer"]] = row
    pairs = {b: (r["adam_l2"], r["adamw"]) for b, r in by_batch.items() if len(r) == 2}
    if not pairs:
        return "Measured: no batch size has both optimizers"
    differ = [
        f"batch {b}: {key} {l2[key]:,} vs {w[key]:,} bytes"
        for b, (l2, w) in pairs.items()
        for key in ("state_bytes", "peak")
        if l2[key] != w[key]
    ]
    if not differ:
        return (
            "Measured: the same state bytes and the same compiled step memory at every batch "
            "size; both keep μ and ν with the parameters' shapes, so what changes between "
            "them is values, not sizes"
        )
    return "Measured: they differ (adam_l2 vs adamw; " + "; ".join(differ) + ")"


def check_sgd_momentum_matches_optax() -> None:
    """:func:`sgd_momentum` with float32 state equals ``optax.sgd(lr, momentum)``."""
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    grads = {"w": jnp.ones((2, 3))}
    ours, ref = sgd_momentum(0.1, 0.9, state_dtype="float32"), optax.sgd(0.1, 0.9)
    so, sr = ours.init(params), ref.init(params)
    for _ in range(3):
        uo, so = ours.update(grads, so, params)
        ur, sr = ref.update(grads, sr, params)
        chex.assert_trees_all_close(uo, ur, rtol=1e-6)
