"""The report's memory part: every memory table at a scale, and its Markdown section.

:func:`run` gathers :mod:`~optax_decoupled.experiments.state_memory` (bytes per parameter,
L2 vs AdamW step memory, a 7B model) and :mod:`~optax_decoupled.experiments.state_precision`
(quality with low-precision state) into one JSON-ready document; :func:`markdown` renders it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from optax_decoupled.experiments.formatting import markdown_table
from optax_decoupled.experiments.state_memory import (
    bytes_per_param_table,
    l2_vs_adamw_finding,
    l2_vs_adamw_memory,
    memory_7b,
)
from optax_decoupled.experiments.state_precision import (
    QualityConfig,
    quality_comparison,
    state_dtype_label,
)


def run(scale: str, out: Any = None, *, progress: bool = False) -> dict[str, Any]:
    """Every memory table at ``scale`` (the report's ``memory`` part); a JSON-ready dict."""
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
        "Bytes of optimizer state per parameter (`contrib.state_bytes` of `tx.init`), measured "
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
