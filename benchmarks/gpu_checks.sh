#!/usr/bin/env bash
# Every check this project runs on a GPU, in one command (about 12 minutes on one H200):
#
#   1. the update-step benchmark with its bandwidth report (benchmarks/gpu.sh), ~3 minutes;
#   2. where a many-leaf step's time goes: per-call host cost vs device work
#      (benchmarks/step_overhead.py), ~1 minute;
#   3. low-precision state between the steps of one program (benchmarks/excess_precision.py),
#      and 8-bit and bf16 against fp32 AdamW state: step time and bytes (state_memory.py);
#   4. the test suite on the GPU backend (pytest-xdist when installed; the notebooks are not
#      run here), ~6 minutes on 8 workers.
#
#   pip install -e ".[cuda12,experiments,dev]"
#   bash benchmarks/gpu_checks.sh                    # logs and JSON in benchmarks/results/gpu
#   RESULTS=/tmp/gpu bash benchmarks/gpu_checks.sh
#
# Each stage has a time limit (GPU_BENCH_S, GPU_OVERHEAD_S, GPU_EXCESS_S, GPU_STATE_S,
# GPU_TESTS_S seconds) so that the whole run fits a lease; a stage that runs out is reported
# as such (rc 124) and the next one still runs; the benchmarks write their JSON after every
# group or size, so a stopped stage keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHON
RESULTS=${RESULTS:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Several processes (torch, the pytest workers) share the GPU: allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

status=0
stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND under a limit, logs to RESULTS/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc $rc in $((SECONDS - t0)) s ==="
  if [[ $rc -ne 0 ]]; then status=1; fi
}

"$PYTHON" - <<'EOF' | tee "$RESULTS/env.log"
import jax, optax, platform
print("python", platform.python_version(), "jax", jax.__version__, "optax", optax.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
if jax.default_backend() != "gpu":
    raise SystemExit("gpu_checks.sh: JAX sees no GPU")
EOF
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv \
  2>&1 | tee -a "$RESULTS/env.log" || true

stage bench "${GPU_BENCH_S:-300}" bash benchmarks/gpu.sh --group-budget "${GROUP_BUDGET:-12}" \
  --out "$RESULTS/update_step_gpu.json"
stage overhead "${GPU_OVERHEAD_S:-120}" "$PYTHON" benchmarks/step_overhead.py --sizes 1e8 \
  --leaves 1 200 --repeats 5 --out "$RESULTS/step_overhead_gpu.json"
stage excess "${GPU_EXCESS_S:-60}" "$PYTHON" benchmarks/excess_precision.py \
  --json "$RESULTS/excess_precision_gpu.json"
stage state "${GPU_STATE_S:-90}" "$PYTHON" benchmarks/state_memory.py --sizes 1e8 2e8 \
  --repeats 10 --out "$RESULTS/state_memory_gpu.json"

xdist=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then xdist=(-n "${GPU_TEST_WORKERS:-8}"); fi
stage tests "${GPU_TESTS_S:-480}" env OPTAX_DECOUPLED_SMOKE=1 OPTAX_DECOUPLED_OFFLINE=1 \
  "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --durations=10 "${xdist[@]}" --junitxml="$RESULTS/tests.xml" tests
exit $status
