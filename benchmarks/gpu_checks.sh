#!/usr/bin/env bash
# Every check this project runs on a GPU, in one command (about 12 minutes on one H200):
#
#   1. the update-step benchmark with its bandwidth report (benchmarks/gpu.sh, issue #7's
#      target: >= 80% of peak memory bandwidth at >= 1e8 parameters), ~3 minutes;
#   2. where a many-leaf step's time goes: per-call host cost vs device work
#      (benchmarks/step_overhead.py), ~1 minute;
#   3. low-precision state between the steps of one program (benchmarks/excess_precision.py),
#      and 8-bit and bf16 against fp32 AdamW state: step time and bytes (state_memory.py);
#   4. the test suite on the GPU backend (pytest-xdist when installed; the notebooks are not
#      run here), ~6 minutes on 8 workers: the long float32 loops of test_reddi and
#      test_reliability take 1-2 minutes each on a GPU.
#
#   pip install -e ".[cuda12,experiments,dev]" pytest-xdist
#   bash benchmarks/gpu_checks.sh                    # logs and JSON in benchmarks/results/gpu
#
# Offline, on an image that already has JAX with CUDA, Flax, Optax and the test tools,
# `pip install --no-deps --no-build-isolation -e .` installs the package and builds its CPU
# kernel (it needs setuptools >= 77, wheel and jax there; 13 s on the H200 machine). Where the
# kernel is not built, its tests (tests/test_cpu_kernel*.py) are skipped with that reason
# (OPTAX_DECOUPLED_NO_KERNEL=1), instead of failing as they do in CI, where it must be built.
#   RESULTS=/tmp/gpu bash benchmarks/gpu_checks.sh
#
# Each stage has a time limit (GPU_BENCH_S, GPU_OVERHEAD_S, GPU_EXCESS_S, GPU_STATE_S,
# GPU_TESTS_S seconds) so that the whole run fits a lease; a stage that runs out is reported
# as such (rc 124) and the next one still runs; the benchmarks write their JSON after every
# group or size, with "complete": false until they finish, so a stopped stage keeps what it
# measured. Results of the last runs: docs/results/gpu/,
# docs/devices.md, docs/performance.md.
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
if ! "$PYTHON" -c "from optax_decoupled import cpu_kernel as k; raise SystemExit(not k.available())"; then
  echo "gpu_checks.sh: the CPU kernel is not built here; its tests are skipped" \
    "(OPTAX_DECOUPLED_NO_KERNEL=1)" | tee -a "$RESULTS/env.log"
  export OPTAX_DECOUPLED_NO_KERNEL=1
fi

stage bench "${GPU_BENCH_S:-300}" bash benchmarks/gpu.sh --group-budget "${GROUP_BUDGET:-12}" \
  --out "$RESULTS/update_step_gpu.json"
stage overhead "${GPU_OVERHEAD_S:-120}" "$PYTHON" benchmarks/step_overhead.py --sizes 1e8 \
  --leaves 1 200 --repeats 5 --out "$RESULTS/step_overhead_gpu.json"
stage excess "${GPU_EXCESS_S:-60}" "$PYTHON" benchmarks/excess_precision.py \
  --json "$RESULTS/excess_precision_gpu.json"
stage state "${GPU_STATE_S:-90}" "$PYTHON" benchmarks/state_memory.py --sizes 1e8 2e8 --ragged \
  --repeats 30 --json "$RESULTS/state_memory_gpu.json"

xdist=()
if "$PYTHON" -c "import xdist" 2>/dev/null; then xdist=(-n "${GPU_TEST_WORKERS:-8}"); fi
stage tests "${GPU_TESTS_S:-480}" env OPTAX_DECOUPLED_SMOKE=1 OPTAX_DECOUPLED_OFFLINE=1 \
  "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --durations=10 "${xdist[@]}" --junitxml="$RESULTS/tests.xml" tests
exit $status
