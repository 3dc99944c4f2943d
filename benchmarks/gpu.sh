#!/usr/bin/env bash
# The update-step benchmark on a GPU, reporting the fraction of peak memory bandwidth achieved.
#
#   pip install -e ".[cuda12]"            # jax with CUDA; torch with CUDA adds the torch rows
#   bash benchmarks/gpu.sh                # 1 and 200 leaves x 1e8 and 2e8 parameters, ~3 min
#   PEAK_GBPS=3350 bash benchmarks/gpu.sh # a GPU missing from update_step.PEAK_GBPS
#   SIZES="1e8" LEAVES="1" bash benchmarks/gpu.sh
#
# An AdamW step must move 28 B per fp32 parameter; the report divides 28 B x N by the median
# step time and compares it with the GPU's nominal peak bandwidth and with a copy kernel
# measured in the same run. Results: benchmarks/results/update_step_gpu.json (and printed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
SIZES=${SIZES:-"1e8 2e8"}
LEAVES=${LEAVES:-"1 200"}
# Allocate on demand: torch (if installed with CUDA) shares the GPU with JAX.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

"$PYTHON" - <<'EOF'
import jax
if jax.default_backend() != "gpu":
    raise SystemExit(f"gpu.sh: JAX sees no GPU (backend {jax.default_backend()!r}, {jax.devices()})")
print("devices:", jax.devices())
EOF
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
fi

extra=()
if [[ -n "${PEAK_GBPS:-}" ]]; then extra+=(--peak-gbps "$PEAK_GBPS"); fi
# shellcheck disable=SC2086
"$PYTHON" benchmarks/update_step.py --gpu --sizes $SIZES --leaves $LEAVES \
  --out benchmarks/results/update_step_gpu.json ${extra[@]+"${extra[@]}"} "$@"
