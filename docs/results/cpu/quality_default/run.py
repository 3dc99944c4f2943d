"""memory_report.quality_comparison at the QualityConfig() defaults (d_model 32, 2 layers,
400 steps, batch 64, seeds 1-3), a larger CPU configuration than the report's quick preset.

    .venv/bin/python docs/results/cpu/quality_default/run.py results.json   # ~10 min, 2 cores

Written up in docs/memory.md ("Does it change the result?").
"""

import dataclasses
import json
import sys
import time

from optax_decoupled.experiments import memory_report as R
from optax_decoupled.experiments import xla_setup


def main(out_path: str) -> None:
    xla_setup.configure_cpu()  # before any JAX computation: one XLA device per core
    config = R.QualityConfig()
    t0 = time.time()
    rows = R.quality_comparison(config, progress=True)
    fields = dataclasses.asdict(config)
    fields["state_dtypes"] = str(fields["state_dtypes"])
    with open(out_path, "w") as f:
        json.dump(
            {"config": fields, "rows": rows, "wall_s": time.time() - t0}, f, indent=1, default=str
        )
    cols = "optimizer state_dtype val_loss_mean val_accuracy_mean gap_vs_float32 max_seed_gap"
    fmt = {"val_loss_mean": ".4f", "val_accuracy_mean": ".4f"}
    fmt.update(gap_vs_float32="+.2%", max_seed_gap=".2%")
    print(R.markdown_table(rows, cols.split(), fmt))
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
