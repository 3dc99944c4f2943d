"""What low-precision optimizer state does to training and to the second moment.

* :func:`quality_comparison` -- final validation loss on the SSM sequential-digits task of
  AdamW and Lion with float32, bfloat16 and 8-bit state, several seeds.
* :func:`nu_decay` -- whether a stored :math:`\\nu` can come down after large gradients, per
  state dtype (round-to-nearest bfloat16 cannot shrink it by less than half an ulp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import optax_decoupled as od
from optax_decoupled.experiments import schedules
from optax_decoupled.experiments import tasks as tasks_lib
from optax_decoupled.experiments import train as train_lib
from optax_decoupled.experiments.ssm import SSMConfig


@dataclasses.dataclass(frozen=True)
class QualityConfig:
    """Settings of :func:`quality_comparison`. The report's ``quick`` preset (:meth:`preset`),
    which the report, the notebook and docs/memory.md show, is these defaults at batch 32 and
    300 steps. ``row_length`` is the digits' pixels per sequence step
    (:func:`~optax_decoupled.experiments.tasks.sequential_digits`)."""

    d_model: int = 32
    row_length: int = 8
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
        od.BlockwiseInt8Storage(min_size=0),
    )

    @classmethod
    def preset(cls, scale: str) -> QualityConfig:
        if scale == "smoke":
            return cls(d_model=16, n_layers=1, batch_size=16, steps=3, warmup_steps=1,
                       eval_every=3, seeds=(1, 2), optimizers=("adamw",),
                       state_dtypes=("float32",
                                     od.BlockwiseInt8Storage(min_size=0)))  # fmt: skip
        if scale == "quick":
            # The defaults at batch 32 and 300 steps: with
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
    if isinstance(sd, od.BlockwiseInt8Storage):
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
    task = tasks_lib.sequential_digits(batch_size=config.batch_size, row_length=config.row_length)
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
            make_tx = schedules.scheduled(
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
        "bfloat16, stochastic rounding": od.FloatStorage(
            jnp.bfloat16, "bfloat16", rounding="stochastic"
        ),
        "int8 (B=256, all tensors)": od.BlockwiseInt8Storage(min_size=0),
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
            od.resolve_storage(state_dtype).read(state.nu["w"], params["w"]), np.float64
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
