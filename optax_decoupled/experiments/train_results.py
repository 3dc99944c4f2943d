"""What training a grid hands back and writes: per-run results and JSON-lines metrics.

:class:`RunResult` is one configuration's outcome, :class:`GridResult` the whole grid's (with
the final model and optimizer state). :func:`write_jsonl` / :func:`read_jsonl` are the metrics
file; :func:`metrics_mark` and :func:`truncate_metrics` let a resumed run cut it back to where
its checkpoint was taken.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from optax_decoupled.experiments.training_step import PyTree


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
    """Outcome of :func:`~optax_decoupled.experiments.train.train_grid`.

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
        run, can deadlock (:func:`~optax_decoupled.experiments.programs.off_cpu_mesh`). On
        accelerators they stay split over the mesh.
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


def metrics_mark(path: str | os.PathLike | None) -> dict | None:
    """Where the metrics file ends now (stored with a checkpoint)."""
    if path is None:
        return None
    path = os.path.abspath(path)
    return {"path": path, "bytes": os.path.getsize(path) if os.path.exists(path) else 0}


def truncate_metrics(path: str | os.PathLike | None, mark: dict | None) -> None:
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
