r"""Memory of optimizer state: the tables and runs of the report's memory section and of
``notebooks/04_memory.ipynb`` (issue 6).

* :func:`bytes_per_param_table` -- SGD+momentum, Lion, AdamW, AMSGrad × float32 / bfloat16 /
  int8 state: bytes per parameter measured (:func:`optax_decoupled.memory.state_bytes` of
  ``tx.init``) on a large-tensor model and on the SSM, next to the theoretical value.
* :func:`l2_vs_adamw_memory` -- tests the claim "L2 regularisation makes Adam's variance
  tensor explode in memory, AdamW fixes it": state bytes and the compiled SSM training step's
  memory (XLA buffer assignment) for ``adam_l2`` vs ``adamw`` at two batch sizes.
* :func:`memory_7b` -- weights, gradients and optimizer state of a 7B-parameter
  (Llama-2-7B-shaped) model, computed with the same functions on abstract shapes.
* :func:`quality_comparison` -- final validation loss on the SSM sequential-digits task of
  AdamW and Lion with float32, bfloat16 and 8-bit state, several seeds.

Everything but :func:`quality_comparison` is shape arithmetic and compilation: nothing is
trained and nothing big is allocated (``jax.eval_shape``, ``jax.ShapeDtypeStruct``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_decoupled as od
from optax_decoupled._src import memory
from optax_decoupled._src import storage as storage_lib
from optax_decoupled.experiments import report
from optax_decoupled.experiments.formatting import number

STATE_DTYPES = ("float32", "bfloat16", "int8")


# ---------------------------------------------------------------------------------------------
# SGD with momentum on the same storage interface.
# ---------------------------------------------------------------------------------------------


class MomentumState(NamedTuple):
    """State of :func:`sgd_momentum`'s trace: the momentum buffer."""

    trace: optax.Updates


def sgd_momentum(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    *,
    state_dtype: storage_lib.StateDtype = None,
) -> optax.GradientTransformation:
    r"""Heavy-ball SGD, :math:`m_t = \beta m_{t-1} + g_t`, :math:`u_t = -\eta_t m_t`, with the
    momentum stored through :mod:`optax_decoupled.storage` (so ``"int8"`` works).

    The same update as ``optax.sgd(learning_rate, momentum)`` (``optax.trace``); here only to
    measure SGD's state in every storage format.
    """
    store = storage_lib.resolve_storage(state_dtype)

    def init_fn(params):
        return MomentumState(jax.tree.map(lambda p: store.init(p, signed=True), params))

    def update_fn(updates, state, params=None):
        del params

        def heavy_ball(m, g):
            return (momentum * m + g.astype(jnp.float32),)

        def leaf(g, m_s):
            (m,) = heavy_ball(store.read(m_s, g), g)
            (written,) = storage_lib.update_moments(
                store, heavy_ball, (m_s,), (g,), like=g, signed=(True,)
            )
            return m.astype(g.dtype), written

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


# ---------------------------------------------------------------------------------------------
# Abstract models.
# ---------------------------------------------------------------------------------------------


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
    from optax_decoupled.experiments import tasks as tasks_lib
    from optax_decoupled.experiments import train as train_lib
    from optax_decoupled.experiments.ssm import SSMConfig

    task = tasks_lib.sequential_digits(batch_size=batch_size)
    config = SSMConfig(**task.model_kwargs(), d_model=d_model, n_layers=n_layers)
    _, params, _ = train_lib.init_model(config, 0)
    return task, config, params


# ---------------------------------------------------------------------------------------------
# Bytes per parameter.
# ---------------------------------------------------------------------------------------------


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
                "theory": memory.theoretical_bytes_per_param(opt, sd),
            }
            for name, params in models.items():
                sb = memory.state_bytes(memory.abstract_state(OPTIMIZERS[opt](sd), params), params)
                row[f"measured:{name}"] = sb.per_param
                row[f"params:{name}"] = sb.num_params
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Coupled L2 vs AdamW: does L2 make the state bigger?
# ---------------------------------------------------------------------------------------------


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

    The step is the trainer's :func:`~optax_decoupled.experiments.train.train_step` (forward,
    backward, optimizer update, apply), jitted with parameters and optimizer state donated,
    compiled for abstract inputs and read with :func:`optax_decoupled.memory.step_memory`.

    Returns:
      One row per optimizer and batch size: ``optimizer``, ``batch_size``, ``state_bytes``,
      ``state_shapes`` (the distinct shapes of the state's leaves, to compare), and the
      :class:`~optax_decoupled.memory.StepMemory` fields (``arguments``, ``outputs``,
      ``temporaries``, ``aliased``, ``peak``, ...).
    """
    from optax_decoupled.experiments import train as train_lib

    task, config, params = ssm_digits_setup(d_model, n_layers)
    graphdef, _, rest = train_lib.init_model(config, 0)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    factories = {
        "adam_l2": lambda: od.adam_l2(1e-3, weight_decay=weight_decay, state_dtype=state_dtype),
        "adamw": lambda: od.adamw(1e-3, weight_decay=weight_decay, state_dtype=state_dtype),
    }
    rows = []
    for name, make_tx in factories.items():
        state = memory.abstract_state(make_tx(), abstract_params)
        sb = memory.state_bytes(state, params)
        shapes = sorted({tuple(x.shape) for x in jax.tree.leaves(state)})
        for batch_size in batch_sizes:

            def step(p, s, batch, make_tx=make_tx):
                return train_lib.train_step(
                    p, s, batch, {}, graphdef=graphdef, rest=rest, make_tx=make_tx
                )

            mem = memory.step_memory(
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


# ---------------------------------------------------------------------------------------------
# A 7B-parameter model.
# ---------------------------------------------------------------------------------------------


def memory_7b(
    shapes: dict[str, Any] | None = None,
    optimizers: Sequence[str] = ("adamw", "lion", "amsgrad", "sgd_momentum"),
    state_dtypes: Sequence[Any] = STATE_DTYPES,
    weights_dtypes: Sequence[Any] = ("float32", "bfloat16"),
) -> list[dict[str, Any]]:
    """Weights, gradients and optimizer state of a 7B model, by the package's functions.

    Every number comes from :func:`optax_decoupled.memory.training_memory` on the abstract
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
                m = memory.training_memory(params, OPTIMIZERS[opt](sd), weights_dtype=wd)
                rows.append({"weights_dtype": str(wd), "optimizer": opt, "state_dtype": str(sd),
                             **m})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# Quality: final validation loss with 8-bit / bf16 state.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QualityConfig:
    """Settings of :func:`quality_comparison`. The report's ``quick`` preset (:meth:`preset`),
    which the report, the notebook and docs/memory.md show, is these defaults at batch 32 and
    300 steps; the defaults themselves are measured in docs/memory.md too (about 10 minutes
    on 2 CPU cores)."""

    d_model: int = 32
    n_layers: int = 2
    batch_size: int = 64
    steps: int = 400
    warmup_steps: int = 40
    eval_every: int = 100
    seeds: tuple[int, ...] = (1, 2, 3)
    adamw_lr: float = 3e-3
    adamw_wd: float = 0.1
    lion_lr: float = 6e-4
    lion_wd: float = 0.5
    optimizers: tuple[str, ...] = ("adamw", "lion")
    state_dtypes: tuple[Any, ...] = (
        "float32",
        "bfloat16",
        "int8",
        storage_lib.BlockwiseInt8Storage(min_size=0),
    )

    @classmethod
    def preset(cls, scale: str) -> QualityConfig:
        if scale == "smoke":
            return cls(d_model=16, n_layers=1, batch_size=16, steps=3, warmup_steps=1,
                       eval_every=3, seeds=(1, 2), optimizers=("adamw",),
                       state_dtypes=("float32",
                                     storage_lib.BlockwiseInt8Storage(min_size=0)))  # fmt: skip
        if scale == "quick":
            # The defaults at batch 32 and 300 steps (about 4.5 minutes on 2 CPU cores): with
            # d_model 32 the two in_proj kernels (32 x 164) exceed the default int8 storage's
            # 4096 elements, so its row quantizes what a user's would; "all tensors" quantizes
            # every moment, the norms' and A_log's too.
            return cls(batch_size=32, steps=300, warmup_steps=30, eval_every=300)
        if scale == "full":
            return cls(d_model=64, steps=2000, warmup_steps=200, eval_every=200,
                       seeds=(1, 2, 3, 4, 5))  # fmt: skip
        raise ValueError(f"scale must be 'smoke', 'quick' or 'full', got {scale!r}.")


def state_dtype_label(sd: Any) -> str:
    """``"int8"``, ``"bfloat16"``, or ``"int8 (B=256, all tensors)"`` for a storage object."""
    if isinstance(sd, storage_lib.BlockwiseInt8Storage):
        extra = "all tensors" if sd.min_size == 0 else f">= {sd.min_size} elements"
        return f"int8 (B={sd.block_size}, {extra})"
    return str(sd)


def quality_comparison(config: QualityConfig = QualityConfig(), *, progress: bool = False):
    """Train AdamW and Lion on the SSM digits task with each state dtype and several seeds.

    Every (optimizer, state dtype) is one :func:`~optax_decoupled.experiments.train.train_grid`
    over the seeds, with the same warmup-cosine schedule, clipping and hyperparameters; only
    the storage of the moments differs.

    Returns:
      One row per optimizer and state dtype: ``optimizer``, ``state_dtype`` (label),
      ``val_loss`` (per seed), ``val_loss_mean``, ``val_accuracy_mean``,
      ``gap_vs_float32`` (relative difference of the mean validation loss to the same
      optimizer's float32 row) and ``max_seed_gap`` (largest per-seed relative difference).
    """
    from optax_decoupled.experiments import tasks as tasks_lib
    from optax_decoupled.experiments import train as train_lib
    from optax_decoupled.experiments.ssm import SSMConfig

    task = tasks_lib.sequential_digits(batch_size=config.batch_size)
    model = SSMConfig(**task.model_kwargs(), d_model=config.d_model, n_layers=config.n_layers)
    loop = train_lib.TrainConfig(
        steps=config.steps,
        eval_every=config.eval_every,
        final_splits=("val",),
        progress=progress,
    )
    hp = {
        "adamw": (od.adamw, config.adamw_lr, config.adamw_wd),
        "lion": (od.lion, config.lion_lr, config.lion_wd),
    }
    rows = []
    for opt in config.optimizers:
        factory, lr, wd = hp[opt]
        base = None
        for sd in config.state_dtypes:
            make_tx = train_lib.scheduled(
                factory, total_steps=config.steps, warmup_steps=config.warmup_steps,
                weight_decay=wd, state_dtype=sd,
            )  # fmt: skip
            result = train_lib.train_grid(
                task, model, make_tx, {"learning_rate": lr}, list(config.seeds), loop,
                keep_params=False, desc=f"{opt} {state_dtype_label(sd)}",
            )  # fmt: skip
            losses = np.array([r.final["val_loss"] for r in result.runs])
            accs = np.array([r.final["val_accuracy"] for r in result.runs])
            if base is None:
                base = losses
            rows.append(
                {
                    "optimizer": opt,
                    "state_dtype": state_dtype_label(sd),
                    "val_loss": losses.tolist(),
                    "val_loss_mean": float(losses.mean()),
                    "val_accuracy_mean": float(accs.mean()),
                    "gap_vs_float32": float(losses.mean() / base.mean() - 1.0),
                    "max_seed_gap": float(np.max(np.abs(losses / base - 1.0))),
                    "step_time_s": result.step_time_s,
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------------------


def nu_decay(
    high_steps: int = 100, low_steps: int = 2900, size: int = 4096
) -> list[dict[str, Any]]:
    r"""Whether a stored :math:`\nu` can come down: Adam (``b2 = 0.999``) on ``size`` equal
    elements, ``high_steps`` steps of :math:`g = 1` then ``low_steps`` of :math:`g = 0.01`,
    per state dtype: the final :math:`\nu` (mean over the elements, and their spread
    relative to it) and the last update's mean, next to float32's. Round-to-nearest
    bfloat16 cannot shrink :math:`\nu` by less than half an ulp per step, so it stays near
    its peak; stochastic rounding and 8-bit state follow float32 (``docs/memory.md``)."""
    storages = {
        "float32": None,
        "bfloat16": "bfloat16",
        "bfloat16, stochastic rounding": storage_lib.FloatStorage(
            jnp.bfloat16, "bfloat16", rounding="stochastic"
        ),
        "int8 (B=256, all tensors)": storage_lib.BlockwiseInt8Storage(min_size=0),
    }
    gs = jnp.concatenate([jnp.ones(high_steps), jnp.full(low_steps, 0.01)])
    params = {"w": jnp.zeros((size,))}
    rows = []
    for name, state_dtype in storages.items():
        tx = od.scale_by_adam(state_dtype=state_dtype)

        def body(state, g, tx=tx):
            u, state = tx.update({"w": jnp.full((size,), g)}, state)
            return state, u["w"]

        state, u = jax.jit(lambda s, body=body: jax.lax.scan(body, s, gs))(tx.init(params))
        nu = np.asarray(
            storage_lib.resolve_storage(state_dtype).read(state.nu["w"], params["w"]), np.float64
        )
        rows.append({
            "state_dtype": name,
            "nu_mean": float(nu.mean()),
            "nu_spread": float(nu.std() / nu.mean()),
            "update_mean": float(np.mean(np.asarray(u[-1], np.float64))),
        })  # fmt: skip
    for row in rows:
        row["nu_vs_float32"] = row["nu_mean"] / rows[0]["nu_mean"] - 1
        row["update_vs_float32"] = row["update_mean"] / rows[0]["update_mean"] - 1
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                   formats: dict[str, str] | None = None) -> str:  # fmt: skip
    """A Markdown table of ``rows`` (dicts); ``formats`` maps a column to a format spec or to
    ``"bytes"`` (:func:`optax_decoupled.memory.format_bytes`)."""
    if not rows:
        return ""
    columns = list(columns or rows[0])
    formats = formats or {}

    def cell(col, v):
        fmt = formats.get(col)
        if fmt == "bytes":
            return memory.format_bytes(v)
        if fmt and isinstance(v, int | float | np.number):
            return number(v, fmt)
        return str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(c, r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(out)


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


# ---------------------------------------------------------------------------------------------
# The report's memory part and the command line.
# ---------------------------------------------------------------------------------------------


def run(scale: str, out: Any = None, *, progress: bool = False) -> dict[str, Any]:
    """Every memory table at ``scale`` (the report's ``memory`` part); a JSON-ready dict."""
    import time

    t0 = time.perf_counter()
    doc: dict[str, Any] = {
        "bytes_per_param": bytes_per_param_table(),
        "l2_vs_adamw": [
            {k: v for k, v in row.items() if k != "state_shapes"}
            | {"state_shapes": [list(s) for s in row["state_shapes"]]}
            for row in l2_vs_adamw_memory((4, 512) if scale != "smoke" else (4, 16))
        ],
        "memory_7b": memory_7b(),
    }
    quality = QualityConfig.preset(scale)
    doc["quality_config"] = {
        f.name: getattr(quality, f.name) for f in dataclasses.fields(quality)
    } | {"state_dtypes": [state_dtype_label(x) for x in quality.state_dtypes]}
    doc["quality"] = quality_comparison(quality, progress=progress)
    doc["wall_time_s"] = time.perf_counter() - t0
    return doc


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


def markdown(doc: dict[str, Any], rel: str = "memory") -> str:
    """The report's memory section."""
    del rel
    bpp = markdown_table(
        doc["bytes_per_param"],
        ["optimizer", "state_dtype", "theory", "measured:large matrices", "measured:SSM digits"],
        {"theory": ".4f", "measured:large matrices": ".4f", "measured:SSM digits": ".4f"},
    )
    l2 = markdown_table(
        doc["l2_vs_adamw"],
        ["optimizer", "batch_size", "state_bytes", "arguments", "temporaries", "peak"],
        {"state_bytes": "bytes", "arguments": "bytes", "temporaries": "bytes", "peak": "bytes"},
    )
    big = markdown_table(
        [r for r in doc["memory_7b"] if r["weights_dtype"] == "bfloat16"],
        ["optimizer", "state_dtype", "weights", "gradients", "optimizer_state", "total"],
        {"weights": "bytes", "gradients": "bytes", "optimizer_state": "bytes", "total": "bytes"},
    )
    q = markdown_table(
        doc["quality"],
        ["optimizer", "state_dtype", "val_loss_mean", "val_accuracy_mean", "gap_vs_float32",
         "max_seed_gap"],
        {"val_loss_mean": ".4f", "val_accuracy_mean": ".4f", "gap_vs_float32": "+.2%",
         "max_seed_gap": ".2%"},
    )  # fmt: skip
    qc = doc["quality_config"]
    return (
        "## Optimizer-state memory\n\n"
        "Bytes of optimizer state per parameter (`memory.state_bytes` of `tx.init`), measured "
        "on large matrices and on the SSM, next to the theory (int8: one byte per element plus "
        "a float32 absmax per block of 256; tensors under 4096 elements stay float32, which is "
        "why the SSM, whose small tensors keep float32 moments, measures above the large "
        "matrices):\n\n"
        f"{bpp}\n\n"
        "**Does L2 make Adam's state bigger than AdamW's?** State bytes and the compiled SSM "
        "training step's memory (XLA buffer assignment, parameters and state donated) at two "
        f"batch sizes. {l2_vs_adamw_finding(doc['l2_vs_adamw'])}:\n\n"
        f"{l2}\n\n"
        "A 7B-parameter (Llama-2-7B-shaped) model with bfloat16 weights and gradients, "
        "computed by the same functions:\n\n"
        f"{big}\n\n"
        f"**Quality with low-precision state** (SSM digits, d_model {qc['d_model']}, "
        f"batch {qc['batch_size']}, {qc['steps']} steps, seeds {qc['seeds']}; final validation "
        "loss vs float32 state; *int8* quantizes tensors of 4096 elements and more, *all "
        "tensors* every moment; the last column is the largest per-seed gap):"
        f"\n\n{q}\n"
    )


#: The ``optax-decoupled memory`` subcommand (options and entry point, shared with the report).
add_arguments, run_cli = report.part_subcommand("memory", markdown)


if __name__ == "__main__":  # python -m ...experiments.memory_report: optax-decoupled memory
    import sys

    from optax_decoupled import cli

    sys.exit(cli.main(["memory", *sys.argv[1:]]))
